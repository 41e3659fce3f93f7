"""The :class:`Schedule` base class (the argument checks every kind shares are in :mod:`._checks`).

A kind implements :meth:`Schedule.phase_at` and :meth:`Schedule.group_names`,
and may describe its repeating pattern through two hooks, ``_tail()`` and
``_stride()``, so that :meth:`Schedule.segments`, :meth:`Schedule.next_change`
and :meth:`Schedule.describe` need no scanning of long runs. The kinds
themselves live in :mod:`hf_altparams.plan.schedules`.
"""

from __future__ import annotations

import itertools
import json
from abc import ABC, abstractmethod
from typing import Any, Iterable, Literal, Mapping, NamedTuple

from ..errors import PlanError
from ._checks import _check_int, _name_list
from ._share import TrainShare, numel_by_group, train_share, warn_if_always_dominates
from .groups import ParamGroups
from .phase import Phase

__all__ = ["Schedule", "Unit"]

#: The position a schedule counts in.
Unit = Literal["step", "epoch"]
_UNITS: tuple[str, ...] = ("step", "epoch")
_DESCRIBE_SEGMENTS = 8  # segments listed by describe() for schedules with no known pattern
_SHARE_POSITIONS = 1000  # positions trained_share() scans for schedules with no known pattern


class _Tail(NamedTuple):
    """From position `start` on, the phase repeats every `period` (None: stays constant)."""

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
    kinds also describe their repeating pattern so that :meth:`segments`,
    :meth:`next_change` and :meth:`describe` need no scanning of long runs.

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
            known = frozenset(_name_list(groups, "groups", one_str=True))
        unknown = sorted(self.group_names() - known)
        if unknown:
            raise PlanError(
                f"`{self.kind}` schedule references unknown group(s) {unknown}; "
                f"known groups: {sorted(known)}"
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
        scanned = _check_int(positions, "positions", minimum=1) if positions is not None else (
            pattern if pattern is not None else _SHARE_POSITIONS)
        phases = [phase for _, _, phase in self.segments(scanned)]
        largest = self._largest_phase(numel_by_group(groups))
        exact = largest is not None or (pattern is not None and scanned >= pattern)
        return train_share(self.kind, phases, largest, self.always_groups(), groups, positions=scanned,
                           exact=exact)

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
            >>> from hf_altparams.plan import Alternating
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
            >>> from hf_altparams.plan import Alternating, GradualUnfreeze
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
        tail = self._tail()
        return None if tail is None else tail.start + (tail.period or self._stride())

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
