"""Schedules: which :class:`Phase` is active at each optimizer step (or epoch).

A schedule is a pure function of its position: the training loop owns the step
counter and asks ``schedule.phase_at(step, epoch)``. Equal arguments give equal
phases on every rank and in every process, so a resumed run lands in the same
phase. Positions count from 0 in the schedule's ``unit`` (``"step"``: global
optimizer steps; ``"epoch"``: epochs).

The base class, :class:`Schedule`, derives every query (:meth:`~Schedule.segments`,
:meth:`~Schedule.next_change`, :meth:`~Schedule.describe`,
:meth:`~Schedule.trained_share`, the saved :meth:`~Schedule.state_dict`) from two
methods a kind implements, :meth:`~Schedule.phase_at` and
:meth:`~Schedule.group_names`, and, so that none of them scans a long run, from
the kind's repeating :meth:`~Schedule.pattern` and its :meth:`~Schedule.stride`.
The kinds, in the order of this module: :class:`PhaseSequence` and those built on
it (:class:`Alternating`, :class:`GradualUnfreeze`, :class:`ProgressiveFreeze`,
:class:`PerTaskCycle`); :class:`RandomBlocks` and :class:`FnSchedule`, which have
no known pattern; and :class:`Chain`, which runs schedules one after another.
All are importable from here and from :mod:`hf_altparams.plan`.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import random
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Literal, Mapping, NamedTuple, Sequence, TypeVar

from ..errors import PlanError
from .checks import as_phase, check_bool, check_choice, check_disjoint, check_int, name_list, ordered_groups
from .groups import ParamGroups
from .phase import Phase
from .share import TrainShare, train_share, warn_if_always_dominates

__all__ = [
    "Alternating",
    "Chain",
    "FnSchedule",
    "FreezeOrder",
    "GradualUnfreeze",
    "Pattern",
    "PerTaskCycle",
    "PhaseSequence",
    "ProgressiveFreeze",
    "RandomBlocks",
    "Schedule",
    "Unit",
    "IdleState",
    "with_idle_state",
]

#: The position a schedule counts in.
Unit = Literal["step", "epoch"]
#: The order in which :class:`GradualUnfreeze` adds and :class:`ProgressiveFreeze` freezes groups.
FreezeOrder = Literal["last_to_first", "first_to_last"]

_UNITS: tuple[Unit, ...] = ("step", "epoch")
_ORDERS: tuple[FreezeOrder, ...] = ("last_to_first", "first_to_last")
_DESCRIBE_SEGMENTS = 8  # segments listed by describe() for schedules with no known pattern
_SHARE_POSITIONS = 1000  # positions trained_share() scans for schedules with no known pattern


ScheduleT = TypeVar("ScheduleT", bound="Schedule")
#: What a recipe assumes of an idle group's optimizer state (:attr:`Schedule.idle_state`).
IdleState = Literal["keep", "drop"]


def with_idle_state(schedule: ScheduleT, idle_state: IdleState) -> ScheduleT:
    """``schedule`` marked with the idle-state assumption of the recipe that built it (returned for chaining).

    Example:
        >>> with_idle_state(Alternating(["a", "b"]), "drop").idle_state
        'drop'
    """
    check_choice(idle_state, "idle_state", ("keep", "drop"))
    schedule.idle_state = idle_state
    return schedule


class Pattern(NamedTuple):
    """A schedule's repeating pattern: from position `start` on, the phase repeats every `period`.

    ``period=None``: from `start` on the phase stays what it is at `start`.

    Example:
        >>> Alternating({"a": 3, "b": 1}).pattern(), GradualUnfreeze(["x", "y"], every=5).pattern()
        (Pattern(start=0, period=4), Pattern(start=5, period=None))
    """

    start: int
    period: int | None


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
    kinds also describe their repeating :meth:`pattern` and :meth:`stride` so
    that :meth:`segments`, :meth:`next_change` and :meth:`describe` need no
    scanning of long runs. A kind's arguments, for :meth:`state_dict`, come
    from its ``_config()``; a kind with a seed restores it in ``_load_seed()``.

    Example:
        >>> from hf_altparams.plan import GradualUnfreeze
        >>> schedule = GradualUnfreeze(["l0", "l1", "l2"], every=2, always=["head"])
        >>> schedule.phase_at(3).name, schedule.next_change(3)
        ('head+l1+l2', 4)
        >>> [(start, end, phase.name) for start, end, phase in schedule.segments(6)]
        [(0, 2, 'head+l2'), (2, 4, 'head+l1+l2'), (4, 6, 'head+l0+l1+l2')]
    """

    unit: Unit = "step"
    allow_empty: bool = False
    seed: Any = None
    #: What the recipe assumes of an idle group's optimizer state and fp32 master: ``"keep"`` (the
    #: default: a GAN's Adam moments must persist) or ``"drop"`` (:func:`~hf_altparams.plan.lisa`,
    #: :func:`~hf_altparams.plan.badam`: their published memory figures hold state for the active
    #: blocks only). The run uses it wherever the optimizer leaves the choice open.
    idle_state: IdleState = "keep"

    @abstractmethod
    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        """The phase at global optimizer `step` (0-based) in `epoch` (0-based)."""

    @abstractmethod
    def group_names(self) -> frozenset[str]:
        """Every group the schedule references, trainable or resident."""

    def pattern(self) -> Pattern | None:
        """How the phases repeat from some position on; None if not known (random or user-defined kinds).

        A kind that knows its pattern overrides this, and :meth:`stride` too;
        the default (None) makes the queries scan positions one by one.

        Example:
            >>> PhaseSequence([("a", 2), ("b", 3)]).pattern()  # "b" from position 2 on
            Pattern(start=2, period=None)
            >>> print(RandomBlocks(["x", "y"], k=1, every=5).pattern())
            None
        """
        return None

    def stride(self) -> int:
        """The phase can change only at multiples of this position (1 unless a kind knows better).

        Example:
            >>> PhaseSequence([("a", 4), ("b", 6)]).stride(), RandomBlocks(["x", "y"], k=1, every=5).stride()
            (2, 5)
        """
        return 1

    # Hooks with safe defaults; built-in kinds override them.
    def _config(self) -> dict[str, Any]:
        return {}

    def _load_seed(self, seed: Any) -> None:
        del seed

    def _largest_phase(self, numel: Mapping[str, int]) -> Phase | None:
        """The phase training the most parameters, where scanning positions may miss it (random draws)."""
        del numel
        return None

    def always_groups(self) -> frozenset[str]:
        """The groups this schedule trains in every phase by its ``always=`` argument (none if it has none)."""
        return frozenset()

    @property
    def kind(self) -> str:
        """The schedule's kind, e.g. ``"Alternating"``."""
        return type(self).__name__

    def _position(self, step: int, epoch: int) -> int:
        check_int(step, "step", minimum=0)
        check_int(epoch, "epoch", minimum=0)
        return epoch if self.unit == "epoch" else step

    def phase_at_position(self, position: int) -> Phase:
        """The phase at `position` in the schedule's unit (step or epoch)."""
        if self.unit == "epoch":
            return self.phase_at(0, position)
        return self.phase_at(position, 0)

    def validate(self, groups: ParamGroups | Iterable[str]) -> None:
        """Check the schedule against the known groups, before training.

        Given a :class:`ParamGroups`, it also warns
        (:class:`~hf_altparams.plan.TrainShareWarning`) when the parameters
        trained in every phase (:meth:`always_groups`, and the ungrouped ones
        under ``ungrouped="trainable"``) are more than
        :data:`~hf_altparams.plan.ALWAYS_SHARE_LIMIT` of the model.

        Raises:
            PlanError: if the schedule names unknown groups, or has a phase that
                trains no group while ``allow_empty`` is False.
        """
        if isinstance(groups, ParamGroups):
            known = frozenset(groups.names)
        else:
            known = frozenset(name_list(groups, "groups", one_str=True))
        unknown = sorted(self.group_names() - known)
        if unknown:
            raise PlanError(
                f"`{self.kind}` schedule references unknown group(s) {unknown}; known groups: {sorted(known)}"
            )
        self._check_nonempty()
        if isinstance(groups, ParamGroups):
            warn_if_always_dominates(self.kind, self.always_groups(), groups)

    def trained_share(self, groups: ParamGroups, positions: int | None = None) -> TrainShare:
        """What share of the parameters each phase trains, the largest, and what trains in every phase.

        Validates the schedule against `groups` first (so it may warn as :meth:`validate` does).

        Args:
            groups: the model's groups (sizes are counted on their parameters,
                ``meta`` ones included).
            positions: positions to scan; by default :meth:`pattern_length`, or
                1000 for a random or user-defined schedule (a random one's
                largest possible draw is counted even if not met).

        Example:
            >>> from torch import nn
            >>> from hf_altparams.plan import ParamGroups, lisa
            >>> net = nn.ModuleDict({"emb": nn.Embedding(100, 8), "l0": nn.Linear(8, 8), "l1": nn.Linear(8, 8)})
            >>> groups = ParamGroups(net, {"emb": "emb.*", "l0": "l0.*", "l1": "l1.*"})
            >>> import warnings
            >>> with warnings.catch_warnings(record=True) as caught:
            ...     warnings.simplefilter("always")
            ...     share = lisa(["l0", "l1"], k=1, always=["emb"]).trained_share(groups)
            >>> type(caught[0].message).__name__  # emb is 85% of the model
            'TrainShareWarning'
            >>> round(share.always_fraction, 3), round(share.largest_fraction, 3), share.largest.phase
            (0.847, 0.924, 'emb+l0')
        """
        if not isinstance(groups, ParamGroups):
            raise PlanError(f"`groups` must be a ParamGroups (sizes are read from it), got {type(groups).__name__}")
        self.validate(groups)
        pattern = self.pattern_length()
        scanned = (
            check_int(positions, "positions", minimum=1)
            if positions is not None
            else (pattern if pattern is not None else _SHARE_POSITIONS)
        )
        phases = [phase for _, _, phase in self.segments(scanned)]
        largest = self._largest_phase({g: groups.numel(g) for g in groups.names})
        exact = largest is not None or (pattern is not None and scanned >= pattern)
        return train_share(self.kind, phases, largest, self.always_groups(), groups, positions=scanned, exact=exact)

    def _check_nonempty(self) -> None:
        tail = self.pattern()
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
            >>> from hf_altparams.plan import Alternating
            >>> [(s, e, sorted(p.trainable)) for s, e, p in Alternating({"a": 2, "b": 1}).segments(5)]
            [(0, 2, ['a']), (2, 3, ['b']), (3, 5, ['a'])]
        """
        total = check_int(total, "total", minimum=0)
        tail = self.pattern()
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
        stride = self.stride()
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
            >>> from hf_altparams.plan import Alternating, GradualUnfreeze
            >>> s = Alternating({"a": 3, "b": 1})
            >>> s.next_change(0), s.next_change(3), GradualUnfreeze(["x", "y"], every=2).next_change(5)
            (3, 4, None)
        """
        position = check_int(position, "position", minimum=0)
        horizon = check_int(horizon, "horizon", minimum=1)
        current = self.phase_at_position(position)
        limit = position + horizon
        tail = self.pattern()
        if tail is not None and position >= tail.start:
            if tail.period is None:
                return None
            limit = min(limit, position + tail.period)
        stride = self.stride()
        pos = (position // stride + 1) * stride
        while pos <= limit:
            if self.phase_at_position(pos) != current:
                return pos
            pos += stride
        return None

    def pattern_length(self) -> int | None:
        """Positions from 0 that show the schedule's whole pattern, or None if it has no known one.

        One period of a cycling schedule; for a settling one, up to its final
        phase plus the shortest span in which its phase can change. Random and
        user-defined schedules have no known pattern.

        Example:
            >>> from hf_altparams.plan import Alternating, GradualUnfreeze, RandomBlocks
            >>> Alternating({"a": 3, "b": 1}).pattern_length(), GradualUnfreeze(["x", "y"], every=5).pattern_length()
            (4, 10)
            >>> print(RandomBlocks(["x", "y"], k=1, every=5).pattern_length())
            None
        """
        tail = self.pattern()
        return None if tail is None else tail.start + (tail.period or self.stride())

    def describe(self, total: int | None = None) -> str:
        """A readable list of phases with their ranges.

        Args:
            total: list positions ``0..total-1`` only; by default one period of a
                cycling schedule, up to the final phase of a settling one, or the
                first few phases of a random or user-defined one.

        Example:
            >>> from hf_altparams.plan import Alternating
            >>> Alternating({"a": 3, "b": 1}).describe()
            'steps 0-2: trainable a | steps 3-3: trainable b (repeats every 4 steps)'
        """
        word = f"{self.unit}s"

        def span(start: int, end: int | None, phase: Phase) -> str:
            where = f"{start}+" if end is None else f"{start}-{end - 1}"
            return f"{word} {where}: {_phase_text(phase)}"

        if total is not None:
            total = check_int(total, "total", minimum=1)
            return " | ".join(span(s, e, p) for s, e, p in self.segments(total))
        tail = self.pattern()
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
            raise PlanError(f"saved schedule kind {state['kind']!r} differs from this schedule's kind {self.kind!r}")
        mine, saved = self.state_dict()["config"], _jsonable(state["config"])
        missing = object()
        diffs = [
            f"`{key}`: saved {_short(saved.get(key, missing))}, here {_short(mine.get(key, missing))}"
            for key in sorted(set(mine) | set(saved))
            if mine.get(key, missing) != saved.get(key, missing)
        ]
        if diffs:
            raise PlanError(
                f"saved `{self.kind}` schedule differs from this one in config field(s): " + "; ".join(diffs)
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
        self.unit = check_choice(unit, "unit", _UNITS)
        self.repeat = check_bool(repeat, "repeat")
        self.allow_empty = check_bool(allow_empty, "allow_empty")
        if not isinstance(phases, Sequence) or isinstance(phases, str) or not phases:
            raise PlanError(f"`phases` must be a non-empty list of (phase, duration) pairs, got {phases!r}")
        items: list[Phase] = []
        durations: list[int] = []
        for i, item in enumerate(phases):
            if not isinstance(item, (tuple, list)) or len(item) != 2:
                raise PlanError(f"`phases[{i}]` must be a (phase, duration) pair, got {item!r}")
            items.append(as_phase(item[0], f"phases[{i}]"))
            durations.append(check_int(item[1], f"phases[{i}] duration", minimum=1))
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

    def pattern(self) -> Pattern:
        if self.repeat:
            return Pattern(0, self._ends[-1])
        return Pattern(self._ends[-1] - self.durations[-1], None)

    def stride(self) -> int:
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

    def pattern(self) -> Pattern:
        return self._seq.pattern()

    def stride(self) -> int:
        return self._seq.stride()


class Alternating(_SequenceBacked):
    """Cycle through groups, training one entry at a time (plus the `always` groups).

    Args:
        ratios: a mapping entry -> duration (``{"gen": 3, "disc": 1}``: gen for
            3 positions, then disc for 1), or a list of entries that each last
            `every` positions. An entry is a group name or a tuple of names
            trained together; each group appears in one entry only.
        every: duration of each entry when `ratios` is a list (must stay 1 for a mapping).
        unit: ``"step"`` or ``"epoch"``.
        resident: groups kept on the device in every phase besides the trainable
            entry; ``None`` keeps every group resident.
        always: groups trained in every phase along with the entry ("the head
            always trains"); not in any entry. Phases are named
            ``entry+always``, e.g. ``"lo+head"``. Groups trained in every phase
            bound the memory a phase can save: see :meth:`Schedule.trained_share`.

    Raises:
        PlanError: on a group in two entries, or in an entry and in `always`;
            the message gives the call that works (e.g. with ``always=``).

    Example:
        >>> s = Alternating(["a", ("b", "c")], every=2)
        >>> [s.phase_at(i).name for i in range(5)]
        ['a', 'a', 'b+c', 'b+c', 'a']
        >>> s = Alternating({"lo": 2, "hi": 1}, always=["head"])
        >>> [s.phase_at(i).name for i in range(4)], sorted(s.phase_at(2).trainable)
        (['lo+head', 'lo+head', 'hi+head', 'lo+head'], ['head', 'hi'])
    """

    def __init__(
        self,
        ratios: Mapping[str | tuple[str, ...], int] | Sequence[str | tuple[str, ...]],
        *,
        every: int = 1,
        unit: Unit = "step",
        resident: Iterable[str] | None = None,
        always: Iterable[str] = (),
    ) -> None:
        self.unit = check_choice(unit, "unit", _UNITS)
        every = check_int(every, "every", minimum=1)
        if isinstance(ratios, Mapping):
            if every != 1:
                raise PlanError(
                    f"`every` applies only when `ratios` is a list; got every={every} with the "
                    f"mapping {ratios!r}: put the durations in the mapping"
                )
            pairs = [
                (_entry(k, f"ratios key {k!r}"), check_int(v, f"ratios[{k!r}]", minimum=1)) for k, v in ratios.items()
            ]
        elif isinstance(ratios, Sequence) and not isinstance(ratios, str):
            pairs = [(_entry(k, f"ratios[{i}]"), every) for i, k in enumerate(ratios)]
        else:
            raise PlanError(f"`ratios` must be a mapping entry -> duration or a list of entries, got {ratios!r}")
        if not pairs:
            raise PlanError(f"`ratios` must hold at least one entry, got {ratios!r}")
        self.entries: tuple[tuple[str, ...], ...] = tuple(e for e, _ in pairs)
        self.durations: tuple[int, ...] = tuple(d for _, d in pairs)
        self.always = frozenset(name_list(always, "always", one_str=True))
        as_mapping = isinstance(ratios, Mapping)
        hint = _alternating_hint(self.entries, self.durations, as_mapping=as_mapping, every=every, always=self.always)
        _check_unique_entries(self.entries, "ratios", hint=hint)
        _check_always_apart(self.entries, self.durations, as_mapping=as_mapping, every=every, always=self.always)
        self.resident = None if resident is None else frozenset(name_list(resident, "resident", one_str=True))
        extra = tuple(sorted(self.always))
        self._seq = PhaseSequence(
            [(Phase(set(e) | self.always, resident=self.resident, label="+".join(e + extra)), d) for e, d in pairs],
            repeat=True,
            unit=unit,
        )

    def always_groups(self) -> frozenset[str]:
        return self.always

    def _config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "entries": [list(e) for e in self.entries],
            "durations": list(self.durations),
            "resident": None if self.resident is None else sorted(self.resident),
            "unit": self.unit,
        }
        if self.always:  # only when given: a state_dict saved before `always` existed still loads
            config["always"] = sorted(self.always)
        return config


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
        order: FreezeOrder = "last_to_first",
        always: Iterable[str] = (),
    ) -> None:
        self.groups = ordered_groups(groups, "groups")
        self.every = check_int(every, "every", minimum=1)
        self.unit = check_choice(unit, "unit", _UNITS)
        self.order = check_choice(order, "order", _ORDERS)
        self.always = frozenset(name_list(always, "always", one_str=True))
        check_disjoint(self.always, self.groups, "always", "groups")
        ordered = self.groups[::-1] if order == "last_to_first" else self.groups
        phases = [(Phase(self.always | set(ordered[: k + 1])), self.every) for k in range(len(ordered))]
        self._seq = PhaseSequence(phases, unit=unit)

    def always_groups(self) -> frozenset[str]:
        return self.always

    def _config(self) -> dict[str, Any]:
        return {
            "groups": list(self.groups),
            "every": self.every,
            "unit": self.unit,
            "order": self.order,
            "always": sorted(self.always),
        }


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
        order: FreezeOrder = "first_to_last",
        always: Iterable[str] = (),
        allow_empty: bool = False,
    ) -> None:
        self.groups = ordered_groups(groups, "groups")
        self.every = check_int(every, "every", minimum=1)
        self.unit = check_choice(unit, "unit", _UNITS)
        self.order = check_choice(order, "order", _ORDERS)
        self.always = frozenset(name_list(always, "always", one_str=True))
        self.allow_empty = check_bool(allow_empty, "allow_empty")
        check_disjoint(self.always, self.groups, "always", "groups")
        ordered = self.groups if order == "first_to_last" else self.groups[::-1]
        count = len(ordered) + 1 if allow_empty else len(ordered)
        phases = [(Phase(self.always | set(ordered[k:])), self.every) for k in range(count)]
        self._seq = PhaseSequence(phases, unit=unit, allow_empty=allow_empty)

    def always_groups(self) -> frozenset[str]:
        return self.always

    def _config(self) -> dict[str, Any]:
        return {
            "groups": list(self.groups),
            "every": self.every,
            "unit": self.unit,
            "order": self.order,
            "always": sorted(self.always),
            "allow_empty": self.allow_empty,
        }


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
        >>> p.task, p.name  # the current task, by its group names
        ('t1a+t1b', 't1a+t1b')
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
        self.trunk = frozenset(name_list(trunk, "trunk", one_str=True))
        if not self.trunk:
            raise PlanError(
                f"`trunk` must name at least one group, got {trunk!r}; without a shared trunk "
                "use Alternating(tasks, every=..., resident=[])"
            )
        if not isinstance(tasks, Sequence) or isinstance(tasks, str) or not tasks:
            raise PlanError(f"`tasks` must be a non-empty list of task groups, got {tasks!r}")
        self.tasks: tuple[tuple[str, ...], ...] = tuple(_entry(t, f"tasks[{i}]") for i, t in enumerate(tasks))
        _check_unique_entries(self.tasks, "tasks")
        check_disjoint(self.trunk, {n for t in self.tasks for n in t}, "trunk", "tasks")
        self.every = check_int(every, "every", minimum=1)
        self.unit = check_choice(unit, "unit", _UNITS)
        self.train_trunk = check_bool(train_trunk, "train_trunk")
        trained = self.trunk if train_trunk else frozenset()
        phases = [
            (Phase(trained | set(t), resident=self.trunk | set(t), label="+".join(t), task="+".join(t)), self.every)
            for t in self.tasks
        ]
        self._seq = PhaseSequence(phases, repeat=True, unit=unit)

    def _config(self) -> dict[str, Any]:
        return {
            "trunk": sorted(self.trunk),
            "tasks": [list(t) for t in self.tasks],
            "every": self.every,
            "unit": self.unit,
            "train_trunk": self.train_trunk,
        }


# -- the entries of Alternating and the tasks of PerTaskCycle -------------------------------------
#
# A group may appear in one entry only. A group meant to train in every phase ("the head always
# trains") is given once in `always=`; a refusal of `Alternating({("lo", "head"): 5, ("hi", "head"): 5})`
# says exactly that, with the rewritten call.


def _entry(value: Any, argument: str) -> tuple[str, ...]:
    """One alternating entry or task: a group name or a non-empty tuple/list of them."""
    if not isinstance(value, (str, tuple, list)):
        raise PlanError(f"`{argument}` must be a group name or a tuple of group names, got {value!r}")
    names = name_list(value, argument, one_str=True)
    if not names:
        raise PlanError(f"`{argument}` must name at least one group, got {value!r}")
    return names


def _alternating_call(
    entries: Sequence[tuple[str, ...]], durations: Sequence[int], *, as_mapping: bool, every: int, always: Sequence[str]
) -> str:
    """The source text of an ``Alternating(...)`` call with these entries (for error messages).

    Example:
        >>> _alternating_call([("lo",), ("hi", "x")], [5, 5], as_mapping=True, every=1, always=["head"])
        "Alternating({'lo': 5, ('hi', 'x'): 5}, always=['head'])"
        >>> _alternating_call([("lo",), ("hi",)], [2, 2], as_mapping=False, every=2, always=[])
        "Alternating(['lo', 'hi'], every=2)"
    """
    keys = [e[0] if len(e) == 1 else tuple(e) for e in entries]
    if as_mapping:
        ratios = "{" + ", ".join(f"{k!r}: {d}" for k, d in zip(keys, durations)) + "}"
    else:
        ratios = repr(keys) + ("" if every == 1 else f", every={every}")
    return f"Alternating({ratios}" + (f", always={sorted(always)!r}" if always else "") + ")"


def _sequence_call(entries: Sequence[tuple[str, ...]], durations: Sequence[int], always: Sequence[str]) -> str:
    phases = ", ".join(f"({[*e, *sorted(always)]!r}, {d})" for e, d in zip(entries, durations))
    return f"PhaseSequence([{phases}], repeat=True)"


def _check_unique_entries(entries: Sequence[tuple[str, ...]], argument: str, *, hint: str = "") -> None:
    """Refuse a group named in two entries; the message names both and ends with `hint`."""
    seen: dict[str, int] = {}
    for i, names in enumerate(entries):
        for name in names:
            if name in seen:
                raise PlanError(
                    f"group {name!r} appears in `{argument}` entries {seen[name]} and {i} "
                    f"({list(entries[seen[name]])} and {list(names)}); each group may appear once"
                    + (f". {hint}" if hint else "")
                )
            seen[name] = i


def _alternating_hint(
    entries: Sequence[tuple[str, ...]],
    durations: Sequence[int],
    *,
    as_mapping: bool,
    every: int,
    always: frozenset[str],
) -> str:
    """What to write instead of entries that share groups (``Alternating``'s refusal ends with it)."""
    shared = frozenset.intersection(*map(frozenset, entries)) if len(entries) > 1 else frozenset()
    rest = [tuple(n for n in e if n not in shared) for e in entries]
    flat = [n for e in rest for n in e]
    if shared and all(rest) and len(flat) == len(set(flat)):
        call = _alternating_call(rest, durations, as_mapping=as_mapping, every=every, always=sorted(shared | always))
        one = len(shared) == 1
        return (
            f"{' and '.join(map(repr, sorted(shared)))} {'is' if one else 'are'} in every entry: to train "
            f"{'it' if one else 'them'} in every phase, name {'it' if one else 'them'} once in `always=`: {call}"
        )
    return (
        "A group that trains in every phase goes in `always=` (named once); for phases that share "
        f"groups otherwise, list them as a PhaseSequence: {_sequence_call(entries, durations, sorted(always))}"
    )


def _check_always_apart(
    entries: Sequence[tuple[str, ...]],
    durations: Sequence[int],
    *,
    as_mapping: bool,
    every: int,
    always: frozenset[str],
) -> None:
    """Refuse `always` groups that also appear in an entry, with the call that works."""
    both = sorted({n for e in entries for n in e} & always)
    if not both:
        return
    where = [i for i, e in enumerate(entries) if set(e) & always]
    rest = [tuple(n for n in e if n not in always) for e in entries]
    if all(rest):
        fix = "they train in every phase already, so leave them out of the entries: " + _alternating_call(
            rest, durations, as_mapping=as_mapping, every=every, always=sorted(always)
        )
    else:
        fix = "an entry would be left with no group of its own: take them out of `always` or out of `ratios`"
    raise PlanError(f"group(s) {both} are in `always` and in `ratios` entries {where}; {fix}")


# -- kinds with no known pattern ----------------------------------------------------------------


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
        self.groups = ordered_groups(groups, "groups")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(self.groups):
            raise PlanError(f"`k` must be an int in [1, {len(self.groups)}] (the number of groups), got {k!r}")
        self.k = k
        self.every = check_int(every, "every", minimum=1)
        self.seed = check_int(seed, "seed")
        self.always = frozenset(name_list(always, "always", one_str=True))
        check_disjoint(self.always, self.groups, "always", "groups")
        self.unit = check_choice(unit, "unit", _UNITS)

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        block = self._position(step, epoch) // self.every
        chosen = random.Random(f"{self.seed}:{block}").sample(self.groups, self.k)
        return Phase(self.always | set(chosen))

    def group_names(self) -> frozenset[str]:
        return self.always | set(self.groups)

    def always_groups(self) -> frozenset[str]:
        return self.always

    def _largest_phase(self, numel: Mapping[str, int]) -> Phase:
        """`always` plus the `k` largest groups: the largest draw there can be."""
        largest = sorted(self.groups, key=lambda g: numel.get(g, 0), reverse=True)[: self.k]
        return Phase(self.always | set(largest))

    def stride(self) -> int:
        return self.every

    def _load_seed(self, seed: Any) -> None:
        self.seed = check_int(seed, "seed")

    def _config(self) -> dict[str, Any]:
        return {
            "groups": list(self.groups),
            "k": self.k,
            "every": self.every,
            "always": sorted(self.always),
            "unit": self.unit,
        }

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, seed={self.seed!r})"


class FnSchedule(Schedule):
    """A user function ``fn(step, epoch)`` returning a :class:`Phase` or the trainable group names.

    The function must be pure (same arguments, same answer, on every rank).
    Its answer is checked at each call against the declared `groups`, and
    :meth:`validate` (run before training) already calls it on the first
    `probe` positions of its unit (steps at epoch 0, or epochs at step 0), so
    an undeclared or unknown group there fails before any step. Only `name`
    goes into :meth:`state_dict` (and `always`, when given), so give each
    distinct function its own name.

    `always` declares groups trained in every phase: they are added to each
    phase `fn` returns (a :class:`Phase`'s label is kept), reported by
    :meth:`always_groups` and counted by :meth:`validate`'s share warning.

    Example:
        >>> s = FnSchedule(lambda step, epoch: ["a"] if step < 10 else ["a", "b"], groups=["a", "b"])
        >>> s.phase_at(3).name, s.phase_at(10).name, s.next_change(0)
        ('a', 'a+b', 10)
        >>> FnSchedule(lambda step, epoch: ["a"], groups=["a"], always=["head"]).phase_at(0).name
        'a+head'
    """

    def __init__(
        self,
        fn: Callable[[int, int], Phase | Iterable[str]],
        *,
        groups: Iterable[str],
        unit: Unit = "step",
        allow_empty: bool = False,
        name: str = "fn",
        probe: int = 1000,
        always: Iterable[str] = (),
    ) -> None:
        if not callable(fn):
            raise PlanError(f"`fn` must be a callable fn(step, epoch) -> Phase | list of group names, got {fn!r}")
        self.fn = fn
        self.groups = frozenset(name_list(groups, "groups", one_str=True))
        if not self.groups:
            raise PlanError(f"`groups` must declare at least one group name, got {groups!r}")
        self.unit = check_choice(unit, "unit", _UNITS)
        self.allow_empty = check_bool(allow_empty, "allow_empty")
        if not isinstance(name, str) or not name:
            raise PlanError(f"`name` must be a non-empty str, got {name!r}")
        self.name = name
        if isinstance(probe, bool) or not isinstance(probe, int) or probe < 0:
            raise PlanError(f"`probe` must be an int >= 0 (positions validate() checks), got {probe!r}")
        self.probe = probe
        self.always = frozenset(name_list(always, "always", one_str=True))

    def validate(self, groups: ParamGroups | Iterable[str]) -> None:
        """Check the declared groups, then call `fn` on the first `probe` positions.

        Example:
            >>> FnSchedule(lambda step, epoch: ["a"] if step < 5 else ["c"], groups=["a", "b"]).validate(["a", "b"])
            Traceback (most recent call last):
            ...
            hf_altparams.errors.PlanError: `FnSchedule` 'fn' at step 5, epoch 0 returned ['c'], naming undeclared group(s) ['c']; declared `groups`: ['a', 'b'] (found by validate(), which calls `fn` on steps 0..999 before training; `probe=` sets how many)
        """
        super().validate(groups)
        for position in range(self.probe):
            step, epoch = (0, position) if self.unit == "epoch" else (position, 0)
            try:
                self.phase_at(step, epoch)
            except PlanError as exc:
                raise PlanError(
                    f"{exc} (found by validate(), which calls `fn` on {self.unit}s "
                    f"0..{self.probe - 1} before training; `probe=` sets how many)"
                ) from None

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        self._position(step, epoch)
        value = self.fn(step, epoch)
        where = f"`FnSchedule` {self.name!r} at step {step}, epoch {epoch} returned {_short(value)}"
        try:
            phase = as_phase(value, "fn result")
        except PlanError:
            raise PlanError(f"{where}; expected a Phase or a list of names from {sorted(self.groups)}") from None
        unknown = sorted((phase.trainable | (phase.resident or frozenset())) - self.group_names())
        if unknown:
            raise PlanError(f"{where}, naming undeclared group(s) {unknown}; declared `groups`: {sorted(self.groups)}")
        if self.always and not self.always <= phase.trainable:
            resident = None if phase.resident is None else phase.resident | self.always
            phase = Phase(phase.trainable | self.always, resident=resident, label=phase.label, task=phase.task)
        if not phase.trainable and not self.allow_empty:
            raise PlanError(f"{where}, which trains no group; pass `allow_empty=True` to allow it")
        return phase

    def group_names(self) -> frozenset[str]:
        return self.groups | self.always

    def always_groups(self) -> frozenset[str]:
        return self.always

    def _config(self) -> dict[str, Any]:
        # `always` only when given: a state_dict saved before it existed still loads
        return {"name": self.name, **({"always": sorted(self.always)} if self.always else {})}


# -- composition --------------------------------------------------------------------------------


class Chain(Schedule):
    """Run schedules one after another; each part sees local positions from 0.

    Args:
        parts: ``(schedule, duration)`` pairs; only the last duration may be
            ``None`` (run forever). If the last part has a duration, its final
            phase persists after it ends. All parts must share one unit.

    Example:
        >>> from hf_altparams.plan import Alternating, PhaseSequence
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
            durations.append(None if item[1] is None else check_int(item[1], f"parts[{i}] duration", minimum=1))
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

    def always_groups(self) -> frozenset[str]:
        """The groups every part trains in all its phases."""
        return frozenset.intersection(*(s.always_groups() for s in self.parts))

    def validate(self, groups: ParamGroups | Iterable[str]) -> None:
        for i, part in enumerate(self.parts):
            try:
                part.validate(groups)
            except PlanError as err:
                raise PlanError(f"in `Chain` part {i} ({part.kind}): {err}") from err

    def pattern(self) -> Pattern | None:
        start, duration = self._starts[-1], self.durations[-1]
        if duration is not None:
            return Pattern(start + duration - 1, None)
        sub = self.parts[-1].pattern()
        return None if sub is None else Pattern(start + sub.start, sub.period)

    def stride(self) -> int:
        finite = [d for d in self.durations if d is not None]
        return math.gcd(*finite, *(s.stride() for s in self.parts))

    @property
    def seed(self) -> list[Any]:
        return [s.seed for s in self.parts]

    def _load_seed(self, seed: Any) -> None:
        if not isinstance(seed, list) or len(seed) != len(self.parts):
            raise PlanError(f"saved `Chain` seed must be a list of {len(self.parts)} part seeds, got {seed!r}")
        for part, part_seed in zip(self.parts, seed):
            # Each part's config was compared with the saved one above (it is in the Chain's config).
            part.load_state_dict({**part.state_dict(), "seed": part_seed})

    def _config(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "parts": [
                {"kind": s.kind, "config": s.state_dict()["config"], "duration": d}
                for s, d in zip(self.parts, self.durations)
            ],
        }
