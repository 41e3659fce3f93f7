"""Schedules with no fixed pattern: :class:`RandomBlocks` and :class:`FnSchedule`.

Both are re-exported by :mod:`hf_altparams.plan.schedules`; import them from
there or from :mod:`hf_altparams.plan`.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from ..errors import PlanError
from ._checks import _as_phase, _check_bool, _check_choice, _check_disjoint, _check_int, _name_list, _ordered_groups
from ._schedule_base import _UNITS, Schedule, Unit, _short
from .phase import Phase

if TYPE_CHECKING:
    from .groups import ParamGroups

__all__ = ["FnSchedule", "RandomBlocks"]


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

    def always_groups(self) -> frozenset[str]:
        return self.always

    def _largest_phase(self, numel: Mapping[str, int]) -> Phase:
        """`always` plus the `k` largest groups: the largest draw there can be."""
        largest = sorted(self.groups, key=lambda g: numel.get(g, 0), reverse=True)[: self.k]
        return Phase(self.always | set(largest))

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
        self.groups = frozenset(_name_list(groups, "groups", one_str=True))
        if not self.groups:
            raise PlanError(f"`groups` must declare at least one group name, got {groups!r}")
        self.unit = _check_choice(unit, "unit", _UNITS)
        self.allow_empty = _check_bool(allow_empty, "allow_empty")
        if not isinstance(name, str) or not name:
            raise PlanError(f"`name` must be a non-empty str, got {name!r}")
        self.name = name
        if isinstance(probe, bool) or not isinstance(probe, int) or probe < 0:
            raise PlanError(f"`probe` must be an int >= 0 (positions validate() checks), got {probe!r}")
        self.probe = probe
        self.always = frozenset(_name_list(always, "always", one_str=True))

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
                raise PlanError(f"{exc} (found by validate(), which calls `fn` on {self.unit}s "
                                f"0..{self.probe - 1} before training; `probe=` sets how many)") from None

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        self._position(step, epoch)
        value = self.fn(step, epoch)
        where = f"`FnSchedule` {self.name!r} at step {step}, epoch {epoch} returned {_short(value)}"
        try:
            phase = _as_phase(value, "fn result")
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
