"""Schedules: which :class:`Phase` is active at each optimizer step (or epoch).

A schedule is a pure function of its position: the training loop owns the step
counter and asks ``schedule.phase_at(step, epoch)``. Equal arguments give equal
phases on every rank and in every process, so a resumed run lands in the same
phase. Positions count from 0 in the schedule's ``unit`` (``"step"``: global
optimizer steps; ``"epoch"``: epochs).

Kinds: :class:`PhaseSequence`, :class:`Alternating`, :class:`GradualUnfreeze`,
:class:`ProgressiveFreeze`, :class:`PerTaskCycle`, :class:`RandomBlocks`,
:class:`FnSchedule`, and :class:`Chain` to run schedules one after another.
Their base class, :class:`Schedule`, is in :mod:`hf_altparams.plan._schedule_base`;
:class:`RandomBlocks` and :class:`FnSchedule` are in :mod:`hf_altparams.plan._random_fn`,
:class:`Chain` in :mod:`hf_altparams.plan._chain`.
All are importable from here and from :mod:`hf_altparams.plan`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import Any, Iterable, Literal, Mapping, Sequence

from ..errors import PlanError
from ._chain import Chain
from ._entries import alternating_hint, check_always_apart, check_unique_entries, entry
from ._checks import _as_phase, _check_bool, _check_choice, _check_disjoint, _check_int, _name_list, _ordered_groups
from ._random_fn import FnSchedule, RandomBlocks
from ._schedule_base import _UNITS, Schedule, Unit, _Tail
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

_ORDERS: tuple[str, ...] = ("last_to_first", "first_to_last")


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
        self.unit = _check_choice(unit, "unit", _UNITS)
        every = _check_int(every, "every", minimum=1)
        if isinstance(ratios, Mapping):
            if every != 1:
                raise PlanError(
                    f"`every` applies only when `ratios` is a list; got every={every} with the "
                    f"mapping {ratios!r}: put the durations in the mapping"
                )
            pairs = [(entry(k, f"ratios key {k!r}"), _check_int(v, f"ratios[{k!r}]", minimum=1))
                     for k, v in ratios.items()]
        elif isinstance(ratios, Sequence) and not isinstance(ratios, str):
            pairs = [(entry(k, f"ratios[{i}]"), every) for i, k in enumerate(ratios)]
        else:
            raise PlanError(
                f"`ratios` must be a mapping entry -> duration or a list of entries, got {ratios!r}"
            )
        if not pairs:
            raise PlanError(f"`ratios` must hold at least one entry, got {ratios!r}")
        self.entries: tuple[tuple[str, ...], ...] = tuple(e for e, _ in pairs)
        self.durations: tuple[int, ...] = tuple(d for _, d in pairs)
        self.always = frozenset(_name_list(always, "always", one_str=True))
        as_mapping = isinstance(ratios, Mapping)
        hint = alternating_hint(self.entries, self.durations, as_mapping=as_mapping, every=every, always=self.always)
        check_unique_entries(self.entries, "ratios", hint=hint)
        check_always_apart(self.entries, self.durations, as_mapping=as_mapping, every=every, always=self.always)
        self.resident = None if resident is None else frozenset(_name_list(resident, "resident", one_str=True))
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

    def always_groups(self) -> frozenset[str]:
        return self.always

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

    def always_groups(self) -> frozenset[str]:
        return self.always

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
        self.trunk = frozenset(_name_list(trunk, "trunk", one_str=True))
        if not self.trunk:
            raise PlanError(
                f"`trunk` must name at least one group, got {trunk!r}; without a shared trunk "
                "use Alternating(tasks, every=..., resident=[])"
            )
        if not isinstance(tasks, Sequence) or isinstance(tasks, str) or not tasks:
            raise PlanError(f"`tasks` must be a non-empty list of task groups, got {tasks!r}")
        self.tasks: tuple[tuple[str, ...], ...] = tuple(
            entry(t, f"tasks[{i}]") for i, t in enumerate(tasks)
        )
        check_unique_entries(self.tasks, "tasks")
        _check_disjoint(self.trunk, {n for t in self.tasks for n in t}, "trunk", "tasks")
        self.every = _check_int(every, "every", minimum=1)
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.train_trunk = _check_bool(train_trunk, "train_trunk")
        trained = self.trunk if train_trunk else frozenset()
        phases = [
            (Phase(trained | set(t), resident=self.trunk | set(t), label="+".join(t), task="+".join(t)),
             self.every)
            for t in self.tasks
        ]
        self._seq = PhaseSequence(phases, repeat=True, unit=unit)

    def _config(self) -> dict[str, Any]:
        return {"trunk": sorted(self.trunk), "tasks": [list(t) for t in self.tasks],
                "every": self.every, "unit": self.unit, "train_trunk": self.train_trunk}
