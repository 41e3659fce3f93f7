"""Composed schedules: :class:`Chain` runs schedules one after another.

Re-exported by :mod:`hf_altparams.plan.schedules`; import it from there or from
:mod:`hf_altparams.plan`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..errors import PlanError
from ._checks import _check_int
from ._schedule_base import Schedule, _Tail
from .phase import Phase

if TYPE_CHECKING:
    from .groups import ParamGroups

__all__ = ["Chain"]


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

    def always_groups(self) -> frozenset[str]:
        """The groups every part trains in all its phases."""
        return frozenset.intersection(*(s.always_groups() for s in self.parts))

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
