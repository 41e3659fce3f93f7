"""Schedules: which :class:`Phase` is active at each optimizer step (or epoch).

A schedule is a pure function of its position: the training loop owns the step
counter and asks ``schedule.phase_at(step, epoch)``. Equal arguments give equal
phases on every rank and in every process, so a resumed run lands in the same
phase. Positions count from 0 in the schedule's ``unit`` (``"step"``: global
optimizer steps; ``"epoch"``: epochs).

Kinds: :class:`PhaseSequence`, :class:`Alternating`, :class:`GradualUnfreeze`,
:class:`ProgressiveFreeze`, :class:`PerTaskCycle`, :class:`RandomBlocks`,
:class:`FnSchedule`, and :class:`Chain` to run schedules one after another.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Literal, Mapping, NamedTuple, Sequence

from ..errors import PlanError
from .groups import ParamGroups
from .phase import Phase

__all__ = [
    "Alternating",
    "Chain",
    "FnSchedule",
    "GradualUnfreeze",
    "PerTaskCycle",
    "PhaseSequence",
    "ProgressiveFreeze",
    "RandomBlocks",
    "Schedule",
    "Unit",
]

#: The position a schedule counts in.
Unit = Literal["step", "epoch"]
_UNITS: tuple[str, ...] = ("step", "epoch")
_ORDERS: tuple[str, ...] = ("last_to_first", "first_to_last")
_DESCRIBE_SEGMENTS = 8  # segments listed by describe() for schedules with no known pattern


class _Tail(NamedTuple):
    """From position `start` on, the phase repeats every `period` (None: stays constant)."""

    start: int
    period: int | None


# -- argument checks ----------------------------------------------------------------------------


def _check_int(value: Any, argument: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"`{argument}` must be an int >= {minimum}, got {value!r}")
    return value


def _check_bool(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"`{argument}` must be True or False, got {value!r}")
    return value


def _check_choice(value: Any, argument: str, choices: Sequence[str]) -> Any:
    if value not in choices:
        raise PlanError(f"`{argument}` must be one of {list(choices)}, got {value!r}")
    return value


def _name_list(value: Any, argument: str, *, one_str: bool) -> tuple[str, ...]:
    """Group names from a str (if `one_str`) or an iterable of non-empty str; no duplicates."""
    if isinstance(value, str) and one_str:
        value = [value]
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        accepted = "a group name or " if one_str else ""
        raise PlanError(f"`{argument}` must be {accepted}a list of group names, got {value!r}")
    names = tuple(value)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise PlanError(f"`{argument}` must hold non-empty str group names, got {bad[0]!r} in {value!r}")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise PlanError(f"`{argument}` lists group(s) {dups} more than once: {value!r}")
    return names


def _ordered_groups(value: Any, argument: str) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PlanError(f"`{argument}` must be a list of group names (in order), got {value!r}")
    names = _name_list(value, argument, one_str=False)
    if not names:
        raise PlanError(f"`{argument}` must name at least one group, got {value!r}")
    return names


def _check_disjoint(a: Iterable[str], b: Iterable[str], a_arg: str, b_arg: str) -> None:
    both = sorted(set(a) & set(b))
    if both:
        raise PlanError(f"group(s) {both} appear in both `{a_arg}` and `{b_arg}`; use each group once")


def _as_phase(value: Any, argument: str) -> Phase:
    if isinstance(value, Phase):
        _name_list(sorted(value.trainable | (value.resident or frozenset()), key=str), argument, one_str=False)
        return value
    try:
        return Phase(trainable=_name_list(value, argument, one_str=True))
    except PlanError:
        raise PlanError(
            f"`{argument}` must be a Phase, a group name or a list of group names, got {value!r}"
        ) from None


def _phase_text(phase: Phase) -> str:
    text = "trainable " + ("+".join(sorted(phase.trainable)) or "<none>")
    if phase.resident is not None and phase.resident != phase.trainable:
        text += " (resident " + "+".join(sorted(phase.resident)) + ")"
    return text


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- the base class -----------------------------------------------------------------------------


class Schedule(ABC):
    """Maps a position (step or epoch) to a :class:`Phase`; stateless and deterministic.

    Subclasses implement :meth:`phase_at` and :meth:`group_names`; built-in
    kinds also describe their repeating pattern so that :meth:`segments`,
    :meth:`next_change` and :meth:`describe` need no scanning of long runs.
    """

    unit: Unit = "step"
    allow_empty: bool = False
    seed: Any = None

    @abstractmethod
    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        """The phase at global optimizer `step` (0-based) in `epoch` (0-based)."""

    @abstractmethod
    def group_names(self) -> frozenset[str]:
        """Every group the schedule references, trainable or resident."""

    # Hooks with safe defaults; built-in kinds override them.
    def _config(self) -> dict[str, Any]:
        return {}

    def _tail(self) -> _Tail | None:
        return None

    def _stride(self) -> int:
        """The phase can change only at multiples of this position."""
        return 1

    def _load_seed(self, seed: Any) -> None:
        del seed

    @property
    def kind(self) -> str:
        """The schedule's kind, e.g. ``"Alternating"``."""
        return type(self).__name__

    def _position(self, step: int, epoch: int) -> int:
        _check_int(step, "step", minimum=0)
        _check_int(epoch, "epoch", minimum=0)
        return epoch if self.unit == "epoch" else step

    def phase_at_position(self, position: int) -> Phase:
        """The phase at `position` in the schedule's unit (step or epoch)."""
        if self.unit == "epoch":
            return self.phase_at(0, position)
        return self.phase_at(position, 0)

    def validate(self, groups: ParamGroups | Iterable[str]) -> None:
        """Check the schedule against the known groups, before training.

        Raises:
            PlanError: if the schedule names unknown groups, or has a phase that
                trains no group while ``allow_empty`` is False.
        """
        if isinstance(groups, ParamGroups):
            known = frozenset(groups.names)
        else:
            known = frozenset(_name_list(groups, "groups", one_str=True))
        unknown = sorted(self.group_names() - known)
        if unknown:
            raise PlanError(
                f"`{self.kind}` schedule references unknown group(s) {unknown}; "
                f"known groups: {sorted(known)}"
            )
        self._check_nonempty()

    def _check_nonempty(self) -> None:
        tail = self._tail()
        if tail is None or self.allow_empty:
            return
        for start, end, phase in self.segments(tail.start + (tail.period or 1)):
            if not phase.trainable:
                raise PlanError(
                    f"`{self.kind}` schedule trains no group at {self.unit}s {start}-{end - 1}; "
                    "pass `allow_empty=True` to allow phases that train nothing"
                )

    def segments(self, total: int) -> list[tuple[int, int, Phase]]:
        """Consecutive ``[start, end)`` ranges of equal phase covering positions ``0..total-1``.

        Example:
            >>> [(s, e, sorted(p.trainable)) for s, e, p in Alternating({"a": 2, "b": 1}).segments(5)]
            [(0, 2, ['a']), (2, 3, ['b']), (3, 5, ['a'])]
        """
        total = _check_int(total, "total", minimum=0)
        tail = self._tail()
        head_end = 0 if tail is None else tail.start + (tail.period or 1)
        if tail is None or total <= head_end:
            return self._scan(0, total)
        if tail.period is None:
            segs = self._scan(0, head_end)
            start, _, phase = segs[-1]
            segs[-1] = (start, total, phase)
            return segs
        segs = self._scan(0, tail.start)
        cycle = self._scan(tail.start, head_end)
        for shift in itertools.count(0, tail.period):
            for start, end, phase in cycle:
                start, end = start + shift, min(end + shift, total)
                if start >= total:
                    return segs
                if segs and segs[-1][2] == phase and segs[-1][1] == start:
                    segs[-1] = (segs[-1][0], end, phase)
                else:
                    segs.append((start, end, phase))
        raise AssertionError("unreachable: itertools.count never ends")

    def _scan(self, start: int, stop: int) -> list[tuple[int, int, Phase]]:
        segs: list[tuple[int, int, Phase]] = []
        stride = self._stride()
        pos = start
        while pos < stop:
            phase = self.phase_at_position(pos)
            nxt = min(stop, (pos // stride + 1) * stride)
            if segs and segs[-1][2] == phase:
                segs[-1] = (segs[-1][0], nxt, phase)
            else:
                segs.append((pos, nxt, phase))
            pos = nxt
        return segs

    def next_change(self, position: int, horizon: int = 10_000) -> int | None:
        """The first position after `position` whose phase differs, or None within `horizon`.

        Example:
            >>> s = Alternating({"a": 3, "b": 1})
            >>> s.next_change(0), s.next_change(3), GradualUnfreeze(["x", "y"], every=2).next_change(5)
            (3, 4, None)
        """
        position = _check_int(position, "position", minimum=0)
        horizon = _check_int(horizon, "horizon", minimum=1)
        current = self.phase_at_position(position)
        limit = position + horizon
        tail = self._tail()
        if tail is not None and position >= tail.start:
            if tail.period is None:
                return None
            limit = min(limit, position + tail.period)
        stride = self._stride()
        pos = (position // stride + 1) * stride
        while pos <= limit:
            if self.phase_at_position(pos) != current:
                return pos
            pos += stride
        return None

    def describe(self, total: int | None = None) -> str:
        """A readable list of phases with their ranges.

        Args:
            total: list positions ``0..total-1`` only; by default one period of a
                cycling schedule, up to the final phase of a settling one, or the
                first few phases of a random or user-defined one.

        Example:
            >>> Alternating({"a": 3, "b": 1}).describe()
            'steps 0-2: trainable a | steps 3-3: trainable b (repeats every 4 steps)'
        """
        word = f"{self.unit}s"

        def span(start: int, end: int | None, phase: Phase) -> str:
            where = f"{start}+" if end is None else f"{start}-{end - 1}"
            return f"{word} {where}: {_phase_text(phase)}"

        if total is not None:
            total = _check_int(total, "total", minimum=1)
            return " | ".join(span(s, e, p) for s, e, p in self.segments(total))
        tail = self._tail()
        if tail is None:
            parts, pos = [], 0
            for _ in range(_DESCRIBE_SEGMENTS):
                nxt = self.next_change(pos)
                parts.append(span(pos, nxt, self.phase_at_position(pos)))
                if nxt is None:
                    parts[-1] += f" (no change within {10_000} {word})"
                    break
                pos = nxt
            else:
                parts.append("...")
            return " | ".join(parts)
        if tail.period is None:
            segs = self.segments(tail.start + 1)
            *head, (last_start, _, last) = segs
            return " | ".join([span(*seg) for seg in head] + [span(last_start, None, last)])
        text = " | ".join(span(*seg) for seg in self.segments(tail.start + tail.period))
        if tail.start == 0:
            return f"{text} (repeats every {tail.period} {word})"
        return f"{text} (repeats every {tail.period} {word} from {self.unit} {tail.start})"

    def state_dict(self) -> dict[str, Any]:
        """``{"kind", "config", "seed"}``: enough to check that a resumed run uses this schedule."""
        return {"kind": self.kind, "config": _jsonable(self._config()), "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check a saved :meth:`state_dict` matches this schedule, and restore its seed.

        Raises:
            PlanError: if the kind or any config field differs (each is named).
        """
        if not isinstance(state, Mapping) or "kind" not in state or "config" not in state:
            raise PlanError(
                f"`state` must be a mapping with 'kind', 'config' and 'seed' as returned by "
                f"`Schedule.state_dict()`, got {_short(state)}"
            )
        if state["kind"] != self.kind:
            raise PlanError(
                f"saved schedule kind {state['kind']!r} differs from this schedule's kind {self.kind!r}"
            )
        mine, saved = self.state_dict()["config"], _jsonable(state["config"])
        missing = object()
        diffs = [
            f"`{key}`: saved {_short(saved.get(key, missing))}, here {_short(mine.get(key, missing))}"
            for key in sorted(set(mine) | set(saved))
            if mine.get(key, missing) != saved.get(key, missing)
        ]
        if diffs:
            raise PlanError(
                f"saved `{self.kind}` schedule differs from this one in config field(s): "
                + "; ".join(diffs)
            )
        self._load_seed(state.get("seed"))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{self.kind}({args})"


# -- fixed sequences and the kinds built on them ------------------------------------------------


class PhaseSequence(Schedule):
    """Fixed phases, each for a number of positions.

    After the last phase ends, it persists, or the whole sequence starts over
    when ``repeat=True``.

    Args:
        phases: ``(phase, duration)`` pairs; a phase is a :class:`Phase`, a group
            name, or a list of group names (all trainable, every group resident).
        repeat: cycle through the phases forever.
        unit: ``"step"`` or ``"epoch"``.
        allow_empty: allow phases that train no group.

    Example:
        >>> s = PhaseSequence([("head", 2), (["head", "body"], 3)])
        >>> sorted(s.phase_at(1).trainable), sorted(s.phase_at(100).trainable)
        (['head'], ['body', 'head'])
    """

    def __init__(
        self,
        phases: Sequence[tuple[Phase | Iterable[str] | str, int]],
        *,
        repeat: bool = False,
        unit: Unit = "step",
        allow_empty: bool = False,
    ) -> None:
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.repeat = _check_bool(repeat, "repeat")
        self.allow_empty = _check_bool(allow_empty, "allow_empty")
        if not isinstance(phases, Sequence) or isinstance(phases, str) or not phases:
            raise PlanError(f"`phases` must be a non-empty list of (phase, duration) pairs, got {phases!r}")
        items: list[Phase] = []
        durations: list[int] = []
        for i, item in enumerate(phases):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise PlanError(f"`phases[{i}]` must be a (phase, duration) pair, got {item!r}")
            items.append(_as_phase(item[0], f"phases[{i}]"))
            durations.append(_check_int(item[1], f"phases[{i}] duration", minimum=1))
        self.phases: tuple[Phase, ...] = tuple(items)
        self.durations: tuple[int, ...] = tuple(durations)
        self._ends = list(itertools.accumulate(durations))
        self._check_nonempty()

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        pos, total = self._position(step, epoch), self._ends[-1]
        if pos >= total:
            if not self.repeat:
                return self.phases[-1]
            pos %= total
        return self.phases[bisect.bisect_right(self._ends, pos)]

    def group_names(self) -> frozenset[str]:
        return frozenset().union(*(p.trainable | (p.resident or frozenset()) for p in self.phases))

    def _tail(self) -> _Tail:
        if self.repeat:
            return _Tail(0, self._ends[-1])
        return _Tail(self._ends[-1] - self.durations[-1], None)

    def _stride(self) -> int:
        return math.gcd(*self.durations)

    def _config(self) -> dict[str, Any]:
        return {
            "phases": [
                {
                    "trainable": sorted(p.trainable),
                    "resident": None if p.resident is None else sorted(p.resident),
                    "duration": d,
                }
                for p, d in zip(self.phases, self.durations)
            ],
            "repeat": self.repeat,
            "unit": self.unit,
            "allow_empty": self.allow_empty,
        }


class _SequenceBacked(Schedule):
    """A kind that compiles its arguments into a :class:`PhaseSequence` and delegates to it."""

    _seq: PhaseSequence

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        return self._seq.phase_at(step, epoch)

    def group_names(self) -> frozenset[str]:
        return self._seq.group_names()

    def _tail(self) -> _Tail:
        return self._seq._tail()

    def _stride(self) -> int:
        return self._seq._stride()


def _entry(value: Any, argument: str) -> tuple[str, ...]:
    """One alternating entry or task: a group name or a non-empty tuple/list of them."""
    if not isinstance(value, (str, tuple, list)):
        raise PlanError(f"`{argument}` must be a group name or a tuple of group names, got {value!r}")
    names = _name_list(value, argument, one_str=True)
    if not names:
        raise PlanError(f"`{argument}` must name at least one group, got {value!r}")
    return names


def _check_unique_entries(entries: Sequence[tuple[str, ...]], argument: str) -> None:
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        for name in entry:
            if name in seen:
                raise PlanError(
                    f"group {name!r} appears in `{argument}` entries {seen[name]} and {i} "
                    f"({list(entries[seen[name]])} and {list(entry)}); each group may appear once"
                )
            seen[name] = i


class Alternating(_SequenceBacked):
    """Cycle through groups, training one entry at a time.

    Args:
        ratios: a mapping entry -> duration (``{"gen": 3, "disc": 1}``: gen for
            3 positions, then disc for 1), or a list of entries that each last
            `every` positions. An entry is a group name or a tuple of names
            trained together.
        every: duration of each entry when `ratios` is a list (must stay 1 for a mapping).
        unit: ``"step"`` or ``"epoch"``.
        resident: groups kept on the device in every phase besides the trainable
            entry; ``None`` keeps every group resident.

    Example:
        >>> s = Alternating(["a", ("b", "c")], every=2)
        >>> [s.phase_at(i).name for i in range(5)]
        ['a', 'a', 'b+c', 'b+c', 'a']
    """

    def __init__(
        self,
        ratios: Mapping[str | tuple[str, ...], int] | Sequence[str | tuple[str, ...]],
        *,
        every: int = 1,
        unit: Unit = "step",
        resident: Iterable[str] | None = None,
    ) -> None:
        self.unit = _check_choice(unit, "unit", _UNITS)
        every = _check_int(every, "every", minimum=1)
        if isinstance(ratios, Mapping):
            if every != 1:
                raise PlanError(
                    f"`every` applies only when `ratios` is a list; got every={every} with the "
                    f"mapping {ratios!r}: put the durations in the mapping"
                )
            pairs = [(_entry(k, f"ratios key {k!r}"), _check_int(v, f"ratios[{k!r}]", minimum=1))
                     for k, v in ratios.items()]
        elif isinstance(ratios, Sequence) and not isinstance(ratios, str):
            pairs = [(_entry(k, f"ratios[{i}]"), every) for i, k in enumerate(ratios)]
        else:
            raise PlanError(
                f"`ratios` must be a mapping entry -> duration or a list of entries, got {ratios!r}"
            )
        if not pairs:
            raise PlanError(f"`ratios` must hold at least one entry, got {ratios!r}")
        self.entries: tuple[tuple[str, ...], ...] = tuple(e for e, _ in pairs)
        self.durations: tuple[int, ...] = tuple(d for _, d in pairs)
        _check_unique_entries(self.entries, "ratios")
        self.resident = None if resident is None else frozenset(_name_list(resident, "resident", one_str=True))
        self._seq = PhaseSequence(
            [(Phase(e, resident=self.resident, label="+".join(e)), d) for e, d in pairs],
            repeat=True,
            unit=unit,
        )

    def _config(self) -> dict[str, Any]:
        return {
            "entries": [list(e) for e in self.entries],
            "durations": list(self.durations),
            "resident": None if self.resident is None else sorted(self.resident),
            "unit": self.unit,
        }


class GradualUnfreeze(_SequenceBacked):
    """Add one group to the trainable set every `every` positions (ULMFiT).

    Phase ``k`` trains `always` plus the first ``k + 1`` groups in `order`
    (by default the last group of `groups` first); once all are added, all train.

    Example:
        >>> s = GradualUnfreeze(["emb", "body", "head"], every=10)
        >>> [s.phase_at(i).name for i in (0, 10, 25)]
        ['head', 'body+head', 'body+emb+head']
    """

    def __init__(
        self,
        groups: Sequence[str],
        *,
        every: int,
        unit: Unit = "step",
        order: Literal["last_to_first", "first_to_last"] = "last_to_first",
        always: Iterable[str] = (),
    ) -> None:
        self.groups = _ordered_groups(groups, "groups")
        self.every = _check_int(every, "every", minimum=1)
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.order = _check_choice(order, "order", _ORDERS)
        self.always = frozenset(_name_list(always, "always", one_str=True))
        _check_disjoint(self.always, self.groups, "always", "groups")
        ordered = self.groups[::-1] if order == "last_to_first" else self.groups
        phases = [(Phase(self.always | set(ordered[: k + 1])), self.every) for k in range(len(ordered))]
        self._seq = PhaseSequence(phases, unit=unit)

    def _config(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "every": self.every, "unit": self.unit,
                "order": self.order, "always": sorted(self.always)}


class ProgressiveFreeze(_SequenceBacked):
    """Start with every group trainable and freeze one every `every` positions (FreezeOut).

    Groups are frozen in `order` (by default the first group first). The last
    group is never frozen unless ``allow_empty=True``, in which case the final
    phase trains only `always` (nothing if `always` is empty).

    Example:
        >>> s = ProgressiveFreeze(["l0", "l1", "l2"], every=5)
        >>> [s.phase_at(i).name for i in (0, 5, 10, 99)]
        ['l0+l1+l2', 'l1+l2', 'l2', 'l2']
    """

    def __init__(
        self,
        groups: Sequence[str],
        *,
        every: int,
        unit: Unit = "step",
        order: Literal["last_to_first", "first_to_last"] = "first_to_last",
        always: Iterable[str] = (),
        allow_empty: bool = False,
    ) -> None:
        self.groups = _ordered_groups(groups, "groups")
        self.every = _check_int(every, "every", minimum=1)
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.order = _check_choice(order, "order", _ORDERS)
        self.always = frozenset(_name_list(always, "always", one_str=True))
        self.allow_empty = _check_bool(allow_empty, "allow_empty")
        _check_disjoint(self.always, self.groups, "always", "groups")
        ordered = self.groups if order == "first_to_last" else self.groups[::-1]
        count = len(ordered) + 1 if allow_empty else len(ordered)
        phases = [(Phase(self.always | set(ordered[k:])), self.every) for k in range(count)]
        self._seq = PhaseSequence(phases, unit=unit, allow_empty=allow_empty)

    def _config(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "every": self.every, "unit": self.unit,
                "order": self.order, "always": sorted(self.always), "allow_empty": self.allow_empty}


class PerTaskCycle(_SequenceBacked):
    """A shared trunk plus per-task groups; one task at a time, cycling.

    The phase of task ``t`` trains the trunk (if `train_trunk`) and task
    ``t``'s groups; only those are resident, the other tasks' groups are not.

    Args:
        trunk: the shared groups.
        tasks: one entry per task: a group name or a list of group names.
        every: positions per task before moving to the next.
        unit: ``"step"`` or ``"epoch"``.
        train_trunk: train the trunk along with each task (False: keep it resident, frozen).

    Example:
        >>> s = PerTaskCycle(["trunk"], ["t0", ["t1a", "t1b"]], every=2)
        >>> p = s.phase_at(2)
        >>> sorted(p.trainable), sorted(p.resident)
        (['t1a', 't1b', 'trunk'], ['t1a', 't1b', 'trunk'])
    """

    def __init__(
        self,
        trunk: Iterable[str],
        tasks: Sequence[str | Sequence[str]],
        *,
        every: int,
        unit: Unit = "step",
        train_trunk: bool = True,
    ) -> None:
        self.trunk = frozenset(_name_list(trunk, "trunk", one_str=True))
        if not self.trunk:
            raise PlanError(
                f"`trunk` must name at least one group, got {trunk!r}; without a shared trunk "
                "use Alternating(tasks, every=..., resident=[])"
            )
        if not isinstance(tasks, Sequence) or isinstance(tasks, str) or not tasks:
            raise PlanError(f"`tasks` must be a non-empty list of task groups, got {tasks!r}")
        self.tasks: tuple[tuple[str, ...], ...] = tuple(
            _entry(t, f"tasks[{i}]") for i, t in enumerate(tasks)
        )
        _check_unique_entries(self.tasks, "tasks")
        _check_disjoint(self.trunk, {n for t in self.tasks for n in t}, "trunk", "tasks")
        self.every = _check_int(every, "every", minimum=1)
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.train_trunk = _check_bool(train_trunk, "train_trunk")
        trained = self.trunk if train_trunk else frozenset()
        phases = [
            (Phase(trained | set(t), resident=self.trunk | set(t), label=f"task{i}"), self.every)
            for i, t in enumerate(self.tasks)
        ]
        self._seq = PhaseSequence(phases, repeat=True, unit=unit)

    def _config(self) -> dict[str, Any]:
        return {"trunk": sorted(self.trunk), "tasks": [list(t) for t in self.tasks],
                "every": self.every, "unit": self.unit, "train_trunk": self.train_trunk}


# -- random, user-defined and composed schedules ------------------------------------------------


class RandomBlocks(Schedule):
    """Every `every` positions, train `k` of the groups drawn at random (LISA, BAdam).

    The draw for block ``b = position // every`` is seeded by ``f"{seed}:{b}"``
    alone: equal on every rank, in every process, and after a resume.

    Example:
        >>> s = RandomBlocks(["l0", "l1", "l2", "l3"], k=2, every=10, seed=1, always=["head"])
        >>> s.phase_at(3) == s.phase_at(9), len(s.phase_at(3).trainable)
        (True, 3)
    """

    def __init__(
        self,
        groups: Sequence[str],
        *,
        k: int,
        every: int,
        seed: int = 0,
        always: Iterable[str] = (),
        unit: Unit = "step",
    ) -> None:
        self.groups = _ordered_groups(groups, "groups")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(self.groups):
            raise PlanError(f"`k` must be an int in [1, {len(self.groups)}] (the number of groups), got {k!r}")
        self.k = k
        self.every = _check_int(every, "every", minimum=1)
        self.seed = self._checked_seed(seed)
        self.always = frozenset(_name_list(always, "always", one_str=True))
        _check_disjoint(self.always, self.groups, "always", "groups")
        self.unit = _check_choice(unit, "unit", _UNITS)

    @staticmethod
    def _checked_seed(seed: Any) -> int:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise PlanError(f"`seed` must be an int, got {seed!r}")
        return seed

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        block = self._position(step, epoch) // self.every
        chosen = random.Random(f"{self.seed}:{block}").sample(self.groups, self.k)
        return Phase(self.always | set(chosen))

    def group_names(self) -> frozenset[str]:
        return self.always | set(self.groups)

    def _stride(self) -> int:
        return self.every

    def _load_seed(self, seed: Any) -> None:
        self.seed = self._checked_seed(seed)

    def _config(self) -> dict[str, Any]:
        return {"groups": list(self.groups), "k": self.k, "every": self.every,
                "always": sorted(self.always), "unit": self.unit}

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, seed={self.seed!r})"


class FnSchedule(Schedule):
    """A user function ``fn(step, epoch)`` returning a :class:`Phase` or the trainable group names.

    The function must be pure (same arguments, same answer, on every rank).
    Its answer is checked at each call against the declared `groups`. Only
    `name` goes into :meth:`state_dict`, so give each distinct function its own name.

    Example:
        >>> s = FnSchedule(lambda step, epoch: ["a"] if step < 10 else ["a", "b"], groups=["a", "b"])
        >>> s.phase_at(3).name, s.phase_at(10).name, s.next_change(0)
        ('a', 'a+b', 10)
    """

    def __init__(
        self,
        fn: Callable[[int, int], Phase | Iterable[str]],
        *,
        groups: Iterable[str],
        unit: Unit = "step",
        allow_empty: bool = False,
        name: str = "fn",
    ) -> None:
        if not callable(fn):
            raise PlanError(f"`fn` must be a callable fn(step, epoch) -> Phase | list of group names, got {fn!r}")
        self.fn = fn
        self.groups = frozenset(_name_list(groups, "groups", one_str=True))
        if not self.groups:
            raise PlanError(f"`groups` must declare at least one group name, got {groups!r}")
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.allow_empty = _check_bool(allow_empty, "allow_empty")
        if not isinstance(name, str) or not name:
            raise PlanError(f"`name` must be a non-empty str, got {name!r}")
        self.name = name

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        self._position(step, epoch)
        value = self.fn(step, epoch)
        where = f"`FnSchedule` {self.name!r} at step {step}, epoch {epoch} returned {_short(value)}"
        try:
            phase = _as_phase(value, "fn result")
        except PlanError:
            raise PlanError(f"{where}; expected a Phase or a list of names from {sorted(self.groups)}") from None
        unknown = sorted((phase.trainable | (phase.resident or frozenset())) - self.groups)
        if unknown:
            raise PlanError(f"{where}, naming undeclared group(s) {unknown}; declared `groups`: {sorted(self.groups)}")
        if not phase.trainable and not self.allow_empty:
            raise PlanError(f"{where}, which trains no group; pass `allow_empty=True` to allow it")
        return phase

    def group_names(self) -> frozenset[str]:
        return self.groups

    def _config(self) -> dict[str, Any]:
        return {"name": self.name}


class Chain(Schedule):
    """Run schedules one after another; each part sees local positions from 0.

    Args:
        parts: ``(schedule, duration)`` pairs; only the last duration may be
            ``None`` (run forever). If the last part has a duration, its final
            phase persists after it ends. All parts must share one unit.

    Example:
        >>> warmup = PhaseSequence([("head", 1)])
        >>> s = Chain([(warmup, 2), (Alternating(["head", "body"]), None)])
        >>> [s.phase_at(i).name for i in range(5)]
        ['head', 'head', 'head', 'body', 'head']
    """

    def __init__(self, parts: Sequence[tuple[Schedule, int | None]]) -> None:
        if not isinstance(parts, Sequence) or isinstance(parts, str) or not parts:
            raise PlanError(f"`parts` must be a non-empty list of (schedule, duration) pairs, got {parts!r}")
        schedules: list[Schedule] = []
        durations: list[int | None] = []
        for i, item in enumerate(parts):
            if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], Schedule):
                raise PlanError(f"`parts[{i}]` must be a (Schedule, duration) pair, got {item!r}")
            last = i == len(parts) - 1
            if item[1] is None and not last:
                raise PlanError(
                    f"`parts[{i}]` duration is None but only the last part may run forever; "
                    "give it an int duration >= 1"
                )
            durations.append(None if item[1] is None else _check_int(item[1], f"parts[{i}] duration", minimum=1))
            schedules.append(item[0])
        units = sorted({s.unit for s in schedules})
        if len(units) > 1:
            found = [f"{s.kind}: {s.unit}" for s in schedules]
            raise PlanError(f"all `parts` of a Chain must share one unit, got {found}")
        self.parts: tuple[Schedule, ...] = tuple(schedules)
        self.durations: tuple[int | None, ...] = tuple(durations)
        self.unit = schedules[0].unit
        self.allow_empty = any(s.allow_empty for s in schedules)
        self._starts = [0, *itertools.accumulate(d for d in durations[:-1] if d is not None)]

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        pos = self._position(step, epoch)
        i = bisect.bisect_right(self._starts, pos) - 1
        local, duration = pos - self._starts[i], self.durations[i]
        if duration is not None and local >= duration:
            local = duration - 1  # past the end of a finite chain: the last phase persists
        if self.unit == "epoch":
            return self.parts[i].phase_at(step, local)
        return self.parts[i].phase_at(local, epoch)

    def group_names(self) -> frozenset[str]:
        return frozenset().union(*(s.group_names() for s in self.parts))

    def validate(self, groups: ParamGroups | Iterable[str]) -> None:
        for i, part in enumerate(self.parts):
            try:
                part.validate(groups)
            except PlanError as err:
                raise PlanError(f"in `Chain` part {i} ({part.kind}): {err}") from err

    def _tail(self) -> _Tail | None:
        start, duration = self._starts[-1], self.durations[-1]
        if duration is not None:
            return _Tail(start + duration - 1, None)
        sub = self.parts[-1]._tail()
        return None if sub is None else _Tail(start + sub.start, sub.period)

    def _stride(self) -> int:
        finite = [d for d in self.durations if d is not None]
        return math.gcd(*finite, *(s._stride() for s in self.parts))

    @property  # type: ignore[override]
    def seed(self) -> list[Any]:
        return [s.seed for s in self.parts]

    def _load_seed(self, seed: Any) -> None:
        if not isinstance(seed, list) or len(seed) != len(self.parts):
            raise PlanError(f"saved `Chain` seed must be a list of {len(self.parts)} part seeds, got {seed!r}")
        for part, part_seed in zip(self.parts, seed):
            part._load_seed(part_seed)

    def _config(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "parts": [
                {"kind": s.kind, "config": s.state_dict()["config"], "duration": d}
                for s, d in zip(self.parts, self.durations)
            ],
        }
