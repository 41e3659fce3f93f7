"""The schedule kinds every command line knows, registered once in :data:`SCHEDULES`.

Each option (``--every``, ``--k``, ``--always``, ...) is declared here with its
reader, which takes the command line's text (``"emb,head"``) or the Python
value (``["emb", "head"]``) and refuses anything else naming the flag; each
kind with its options, defaults and builder. ``python -m hf_altparams plan``
and ``python -m hf_altparams check`` build their schedule flags and their
schedules from :data:`SCHEDULES` (:class:`~hf_altparams.plan.registry.ScheduleRegistry`),
``check`` with its own declared defaults (``hf_altparams.check.workload.CHECK_DEFAULTS``).

A kind of one's own is one :meth:`~hf_altparams.plan.registry.ScheduleRegistry.register`
call away from both command lines.

Example:
    >>> from torch import nn
    >>> net = nn.ModuleDict({n: nn.Linear(2, 2) for n in ("l0", "l1", "l2", "head")})
    >>> groups = ParamGroups(net, {n: f"{n}.*" for n in net})
    >>> schedule = SCHEDULES.build("gradual", groups, {"every": "2", "always": "head"})
    >>> [schedule.phase_at(i).name for i in (0, 2, 4)]
    ['head+l2', 'head+l1+l2', 'head+l0+l1+l2']
    >>> SCHEDULES.build("lisa", groups, {"every": "2"})
    Traceback (most recent call last):
    ...
    hf_altparams.errors.PlanError: `--k` (groups drawn per block) is required for `--schedule lisa`
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Literal, Mapping, Sequence, Union

from ..errors import PlanError
from .checks import check_bool, name_list
from .groups import ParamGroups
from .recipes import badam, lisa
from .registry import Derived, Option, ScheduleArgs, ScheduleKind, ScheduleRegistry
from .schedules import (
    Alternating,
    GradualUnfreeze,
    PerTaskCycle,
    PhaseSequence,
    ProgressiveFreeze,
    RandomBlocks,
    Schedule,
)

__all__ = ["SCHEDULES"]

#: An alternating entry or a task: one group, or several trained together.
Entry = Union[str, tuple[str, ...]]

_FREEZE_ORDERS = ("last_to_first", "first_to_last")
_BADAM_ORDERS = ("ascending", "descending", "random")


# -- readers: the command line's text or a Python value -> the value, checked ----------------------
def _positive_int(value: Any, flag: str) -> int:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str) and text.lstrip("+").isdigit():
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, int) or text < 1:
        raise PlanError(f"`{flag}` must be a positive integer, got {value!r}")
    return text


def _integer(value: Any, flag: str) -> int:
    text = value.strip() if isinstance(value, str) else value
    if isinstance(text, str):
        try:
            text = int(text)
        except ValueError:
            pass
    if isinstance(text, bool) or not isinstance(text, int):
        raise PlanError(f"`{flag}` must be an integer, got {value!r}")
    return text


def _names(value: Any, flag: str) -> tuple[str, ...]:
    """A comma list of group names (``"emb,head"``; ``""`` for none) or a list of names."""
    if isinstance(value, str):
        value = [n.strip() for n in value.split(",") if n.strip()]
    return name_list(value, flag, one_str=False)


def _some_names(value: Any, flag: str) -> tuple[str, ...]:
    names = _names(value, flag)
    if not names:
        raise PlanError(f"`{flag}` must name at least one group, got {value!r}")
    return names


def _entry(value: Any, flag: str) -> Entry:
    """``"a"`` or ``"a+b"`` (text), or a name or a list of names."""
    if isinstance(value, str):
        parts = [p.strip() for p in value.split("+")]
        names = name_list(parts, flag, one_str=False)
    elif isinstance(value, (tuple, list)):
        names = name_list(value, flag, one_str=False)
    else:
        raise PlanError(f"`{flag}` entries must be a group name or GROUP+GROUP, got {value!r}")
    if not names:
        raise PlanError(f"`{flag}` has an empty entry, got {value!r}")
    return names[0] if len(names) == 1 else names


def _entries(value: Any, flag: str) -> tuple[Entry, ...]:
    """``"t0,t1a+t1b"`` or a list of entries."""
    if isinstance(value, str):
        value = [item for item in value.split(",") if item.strip()]
    if not isinstance(value, (tuple, list)) or not value:
        raise PlanError(f"`{flag}` must name at least one entry (GROUP or GROUP+GROUP, comma-separated), got {value!r}")
    return tuple(_entry(item, flag) for item in value)


def _ratios(value: Any, flag: str) -> Union[dict[Entry, int], tuple[Entry, ...]]:
    """``"a=3,b+c=1"`` (durations) or ``"a,b+c"`` (each ``--every`` long); a mapping or a list."""
    if isinstance(value, Mapping):
        return {_entry(k, flag): _positive_int(v, f"{flag} entry {k!r}") for k, v in value.items()}
    if not isinstance(value, str):
        return _entries(value, flag)
    items = [i.strip() for i in value.split(",") if i.strip()]
    if not items:
        raise PlanError(f"`{flag}` must name at least one entry, got {value!r}")
    if not any("=" in i for i in items):
        return _entries(items, flag)
    if not all("=" in i for i in items):
        raise PlanError(f"`{flag}` mixes a=N and plain entries: {value!r}; use one form")
    ratios: dict[Entry, int] = {}
    for item in items:
        name, _, count = item.partition("=")
        if not count.strip().isdigit() or int(count) < 1:
            raise PlanError(f"`{flag}` entry {item!r} must be GROUP[+GROUP]=INT")
        ratios[_entry(name, flag)] = int(count)
    return ratios


def _phases(value: Any, flag: str) -> tuple[tuple[tuple[str, ...], int], ...]:
    """``["a+b:10", ...]`` (one text per ``--phase``) or ``[(names, duration), ...]``."""
    if isinstance(value, str) or not isinstance(value, (tuple, list)) or not value:
        raise PlanError(f"`{flag}` must be given at least once, as GROUP[+GROUP...]:DURATION, got {value!r}")
    phases = []
    for item in value:
        if isinstance(item, str):
            names, _, count = item.rpartition(":")
            if not names or not count.strip().isdigit() or int(count) < 1:
                raise PlanError(f"`{flag}` must look like GROUP[+GROUP...]:DURATION, got {item!r}")
            phases.append((name_list([n.strip() for n in names.split("+")], flag, one_str=False), int(count)))
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            names_value = (item[0],) if isinstance(item[0], str) else item[0]
            phases.append((name_list(names_value, flag, one_str=False), _positive_int(item[1], flag)))
        else:
            raise PlanError(f"`{flag}` must look like GROUP[+GROUP...]:DURATION (or (groups, duration)), got {item!r}")
    return tuple(phases)


def _choice(choices: Sequence[str]) -> Callable[[Any, str], str]:
    def read(value: Any, flag: str) -> str:
        text = value.strip() if isinstance(value, str) else value
        if text not in choices:
            raise PlanError(f"`{flag}` must be one of {list(choices)}, got {value!r}")
        return str(text)

    return read


def _switch(value: Any, flag: str) -> bool:
    return check_bool(value, flag)


def _entry_text(entry: Entry) -> str:
    return entry if isinstance(entry, str) else "+".join(entry)


def _flat(entries: Iterable[Entry]) -> list[str]:
    return [n for e in entries for n in ((e,) if isinstance(e, str) else e)]


def _not_always(groups: ParamGroups, values: Mapping[str, Any]) -> tuple[str, ...]:
    always = set(values.get("always") or ())
    return tuple(g for g in groups.names if g not in always)


def _not_trunk(groups: ParamGroups, values: Mapping[str, Any]) -> tuple[str, ...]:
    trunk = set(values.get("trunk") or ())
    return tuple(g for g in groups.names if g not in trunk)


_OPTIONS = (
    Option(
        "every",
        "positions (optimizer steps; epochs with --unit epoch) per phase: per entry, draw, block or "
        "task; for gradual and progressive, between two unfreezes or freezes",
        _positive_int,
        metavar="N",
    ),
    Option("k", "groups drawn per block", _positive_int, metavar="K", what="groups drawn per block"),
    Option("seed", "seeds the random draws (the same on every rank and after a resume)", _integer, metavar="SEED"),
    Option(
        "always",
        "groups trained in every phase, besides the scheduled ones (comma list; '' for none)",
        _names,
        metavar="GROUP[,GROUP...]",
        names_in=lambda v: v,
    ),
    Option(
        "blocks",
        "the groups scheduled in turn, in order (comma list)",
        _some_names,
        metavar="GROUP[,GROUP...]",
        names_in=lambda v: v,
    ),
    Option(
        "order",
        "the order the blocks go in",
        _choice(_FREEZE_ORDERS + _BADAM_ORDERS),
        metavar="{" + ",".join(_FREEZE_ORDERS + _BADAM_ORDERS) + "}",
    ),
    Option(
        "ratios",
        "the entries cycled: a=3,b+c=1 (durations) or a,b+c (each --every long)",
        _ratios,
        metavar="ENTRY[=N][,ENTRY[=N]...]",
        names_in=lambda v: _flat(v),
    ),
    Option(
        "trunk",
        "the shared groups, trained with every task (comma list)",
        _some_names,
        metavar="GROUP[,GROUP...]",
        what="the shared groups",
        names_in=lambda v: v,
    ),
    Option(
        "tasks",
        "the tasks, one at a time; a+b for a task of several groups (comma list)",
        _entries,
        metavar="TASK[,TASK...]",
        names_in=lambda v: _flat(v),
    ),
    Option(
        "phase",
        "one phase: the groups it trains and how many positions it lasts (repeatable)",
        _phases,
        metavar="GROUP[+GROUP...]:DURATION",
        repeatable=True,
        names_in=lambda v: [n for p in v for n in p[0]],
    ),
    Option("repeat", "start the phases over after the last (else the last persists)", _switch, switch=True),
    Option(
        "unit", "what a position is: an optimizer step or an epoch", _choice(("step", "epoch")), metavar="{step,epoch}"
    ),
)

_BLOCKS = Derived("every group not in --always", _not_always)
_NO_ALWAYS = "the trunk trains in every phase: --trunk"


# -- builders: the groups and the options -> the schedule ------------------------------------------
def _alternating(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    ratios = args["ratios"]
    if isinstance(ratios, Mapping):
        if "every" in args.given:
            given = ",".join(f"{_entry_text(e)}={n}" for e, n in ratios.items())
            raise PlanError(
                f"`--every` {args['every']} does not apply with durations in `--ratios` ({given}): "
                "give each entry's duration there, or list the entries plainly with --every"
            )
        return Alternating(ratios, unit=args["unit"], always=args["always"])
    return Alternating(list(ratios), every=args["every"], unit=args["unit"], always=args["always"])


def _drawn(args: ScheduleArgs) -> tuple[list[str], int]:
    blocks, k = list(args["blocks"]), args["k"]
    if not 1 <= k <= len(blocks):
        raise PlanError(
            f"`--k` must be an integer from 1 to {len(blocks)} (the groups in `--blocks`: "
            f"{', '.join(blocks)}), got {k!r}"
        )
    return blocks, k


def _gradual(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    return GradualUnfreeze(
        list(args["blocks"]), every=args["every"], unit=args["unit"], order=args["order"], always=args["always"]
    )


def _progressive(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    return ProgressiveFreeze(
        list(args["blocks"]), every=args["every"], unit=args["unit"], order=args["order"], always=args["always"]
    )


def _random_blocks(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    blocks, k = _drawn(args)
    return RandomBlocks(blocks, k=k, every=args["every"], seed=args["seed"], always=args["always"], unit=args["unit"])


def _lisa(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    blocks, k = _drawn(args)
    return lisa(blocks, k=k, every=args["every"], always=args["always"], seed=args["seed"])


def _badam(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    orders: dict[str, Literal["ascending", "descending", "random"]] = {
        "ascending": "ascending",
        "descending": "descending",
        "random": "random",
    }
    return badam(
        list(args["blocks"]),
        steps_per_block=args["every"],
        order=orders[args["order"]],
        always=args["always"],
        seed=args["seed"],
    )


def _per_task(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    return PerTaskCycle(args["trunk"], list(args["tasks"]), every=args["every"], unit=args["unit"])


def _sequence(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    return PhaseSequence(
        [(list(names), duration) for names, duration in args["phase"]], repeat=bool(args["repeat"]), unit=args["unit"]
    )


_DRAWN = ("always", "blocks", "k", "every", "seed")

_KINDS = (
    ScheduleKind(
        "alternating",
        "each entry of --ratios in turn, plus --always; optimizer state kept",
        _alternating,
        options=("always", "ratios", "every", "unit"),
        defaults={
            "always": (),
            "ratios": Derived("every group not in --always, each --every long", _not_always),
            "every": 1,
            "unit": "step",
        },
    ),
    ScheduleKind(
        "gradual",
        "one more of --blocks unfrozen every --every positions (ULMFiT)",
        _gradual,
        options=("always", "blocks", "every", "order", "unit"),
        required=("every",),
        defaults={"always": (), "blocks": _BLOCKS, "order": "last_to_first", "unit": "step"},
        choices={"order": _FREEZE_ORDERS},
        aliases=("gradual-unfreeze",),
    ),
    ScheduleKind(
        "progressive",
        "all of --blocks at first, one more frozen every --every positions (FreezeOut)",
        _progressive,
        options=("always", "blocks", "every", "order", "unit"),
        required=("every",),
        defaults={"always": (), "blocks": _BLOCKS, "order": "first_to_last", "unit": "step"},
        choices={"order": _FREEZE_ORDERS},
        aliases=("progressive-freeze",),
    ),
    ScheduleKind(
        "random-blocks",
        "--k of --blocks drawn at random every --every positions",
        _random_blocks,
        options=(*_DRAWN, "unit"),
        required=("k", "every"),
        defaults={"always": (), "blocks": _BLOCKS, "seed": 0, "unit": "step"},
    ),
    ScheduleKind(
        "lisa",
        "random-blocks in steps, idle optimizer state dropped (LISA)",
        _lisa,
        options=_DRAWN,
        required=("k", "every"),
        defaults={"always": (), "blocks": _BLOCKS, "seed": 0},
    ),
    ScheduleKind(
        "badam",
        "one of --blocks at a time for --every steps, in --order; idle state dropped (BAdam)",
        _badam,
        options=("always", "blocks", "every", "order", "seed"),
        required=("every",),
        defaults={"always": (), "blocks": _BLOCKS, "order": "ascending", "seed": 0},
        choices={"order": _BADAM_ORDERS},
    ),
    ScheduleKind(
        "per-task",
        "--trunk with one task at a time, the other tasks off the device",
        _per_task,
        options=("trunk", "tasks", "every", "unit"),
        required=("trunk", "every"),
        defaults={"tasks": Derived("every group not in --trunk", _not_trunk), "unit": "step"},
        aliases=("per-task-cycle",),
        instead={"always": _NO_ALWAYS},
    ),
    ScheduleKind(
        "sequence",
        "the --phase phases in order, once (the last persists) or with --repeat",
        _sequence,
        options=("phase", "repeat", "unit"),
        required=("phase",),
        defaults={"repeat": False, "unit": "step"},
        aliases=("phase-sequence",),
        instead={"always": "add them to each --phase"},
    ),
)

#: The one schedule registry: the built-in kinds; ``plan`` and ``check`` read their flags from it.
SCHEDULES = ScheduleRegistry(_OPTIONS)
for _kind in _KINDS:
    SCHEDULES.register(_kind)
