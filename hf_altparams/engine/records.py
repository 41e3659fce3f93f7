"""What a phase switch did: :class:`SwitchRecord`, and the bounded :class:`SwitchHistory`."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass
from typing import Iterator, Optional, Union

from ..errors import SwitchError

__all__ = ["SwitchHistory", "SwitchRecord", "check_history_window"]


@dataclass(frozen=True)
class SwitchRecord:
    """What one switch did; ``as_log()`` gives flat metrics for trackers.

    ``released`` says whether the switch ran the memory release (gc,
    ``empty_cache``, ``malloc_trim``) and ``release_reason`` why (the
    ``release="auto"`` decision, see :mod:`hf_altparams.engine.memory.release`).

    Example:
        >>> import torch
        >>> from hf_altparams.engine import PhaseSwitcher
        >>> from hf_altparams.plan import ParamGroups, Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> record = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"])).step_to(0)
        >>> record.phase, record.trainable_params, record.as_log()["altparams/trainable_bytes"]
        ('a', 6, 24)
    """

    step: Optional[int]
    epoch: Optional[int]
    phase: str
    trainable_groups: tuple[str, ...]
    trainable_params: int
    trainable_bytes: int
    allreduce_bytes_per_step: int
    rebuilt_ddp: bool
    seconds: float
    moved_bytes: Optional[int] = None
    offloaded_bytes: Optional[int] = None
    synced_bytes: Optional[int] = None
    buffer_broadcast_bytes: Optional[int] = None
    buffer_broadcast_saved_bytes: Optional[int] = None
    released: Optional[bool] = None
    release_reason: Optional[str] = None

    def as_log(self, prefix: str = "altparams/") -> dict[str, Union[int, float, str]]:
        """Flat ``{name: value}`` metrics (numbers only, plus the phase name)."""
        data = asdict(self)
        data.pop("release_reason")  # free text: for logs, not for trackers
        data["trainable_groups"] = ",".join(self.trainable_groups)
        data["rebuilt_ddp"] = int(self.rebuilt_ddp)
        if self.released is not None:
            data["released"] = int(self.released)
        return {f"{prefix}{k}": v for k, v in data.items() if v is not None}


def check_history_window(window: object) -> None:
    """Validate ``history_window``: an int >= 1 (records kept)."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise SwitchError(f"`history_window` is {window!r}; accepted: an int >= 1 (records kept)")


class SwitchHistory:
    """The most recent :class:`SwitchRecord` s plus running totals over every switch.

    A run that switches every step for a million steps keeps ``window`` records
    (a few hundred KB at most), not a million; the totals (how many switches,
    how long they took, how many bytes they moved) cover the whole run.

    Args:
        window: how many recent records to keep (at least 1).

    Example:
        >>> history = SwitchHistory(window=2)
        >>> for step in range(5):
        ...     history.append(SwitchRecord(step, None, "a", ("a",), 1, 4, 4, False, 0.5, moved_bytes=8))
        >>> [r.step for r in history.recent], history.count, history.seconds, history.moved_bytes
        ([3, 4], 5, 2.5, 40)
    """

    def __init__(self, window: int = 256) -> None:
        check_history_window(window)
        self.window = window
        self._recent: deque[SwitchRecord] = deque(maxlen=window)
        self.count = 0
        self.seconds = 0.0
        self.moved_bytes = 0
        self.synced_bytes = 0
        self.releases = 0

    def append(self, record: SwitchRecord) -> None:
        """Add one switch's record (the oldest one leaves the window when it is full)."""
        self._recent.append(record)
        self.count += 1
        self._add(record, +1)

    def replace_last(self, record: SwitchRecord) -> None:
        """Replace the most recent record (e.g. to fill in what a wrapper built later reduces)."""
        if not self._recent:
            raise SwitchError("no switch record to replace: the history is empty")
        self._add(self._recent[-1], -1)
        self._recent[-1] = record
        self._add(record, +1)

    def _add(self, record: SwitchRecord, sign: int) -> None:
        self.seconds += sign * record.seconds
        self.moved_bytes += sign * (record.moved_bytes or 0)
        self.synced_bytes += sign * (record.synced_bytes or 0)
        self.releases += sign * int(bool(record.released))

    @property
    def recent(self) -> list[SwitchRecord]:
        """The records in the window, oldest first (a copy)."""
        return list(self._recent)

    @property
    def last(self) -> Optional[SwitchRecord]:
        """The most recent record, or ``None`` before the first switch."""
        return self._recent[-1] if self._recent else None

    def __len__(self) -> int:
        return len(self._recent)

    def __iter__(self) -> Iterator[SwitchRecord]:
        return iter(list(self._recent))

    def totals(self) -> dict[str, Union[int, float]]:
        """Running totals over every switch of the run."""
        return {
            "switches": self.count,
            "switch_seconds": self.seconds,
            "switch_moved_bytes": self.moved_bytes,
            "switch_synced_bytes": self.synced_bytes,
            "switch_releases": self.releases,
        }

    def as_log(self, prefix: str = "altparams/") -> dict[str, Union[int, float]]:
        """The totals as flat tracker metrics."""
        return {f"{prefix}{k}": v for k, v in self.totals().items()}

    def __repr__(self) -> str:
        """How many switches, the window, the running totals and the last record, on one line.

        Example:
            >>> history = SwitchHistory(window=2)
            >>> history
            SwitchHistory(0 switches, window 2 (0 kept); no switch yet)
            >>> for step in range(3):
            ...     history.append(SwitchRecord(step, 0, "a", ("a",), 6, 24, 24, True, 0.002, moved_bytes=8))
            >>> history
            SwitchHistory(3 switches, window 2 (2 kept), 6.00 ms in all, 24 B moved, 0 B synced, 0 releases; last: step 2, epoch 0, phase 'a' (6 params, 24 B all-reduced/step), DDP rebuilt, 2.00 ms)
        """
        head = f"{self.count} switch{'' if self.count == 1 else 'es'}, window {self.window} ({len(self._recent)} kept)"
        last = self.last
        if last is None:
            return f"SwitchHistory({head}; no switch yet)"
        totals = (
            f"{1e3 * self.seconds:.2f} ms in all, {self.moved_bytes:,} B moved, {self.synced_bytes:,} B synced, "
            f"{self.releases} release{'' if self.releases == 1 else 's'}"
        )
        where = ", ".join(
            f"{name} {value}" for name, value in (("step", last.step), ("epoch", last.epoch)) if value is not None
        )
        record = (
            f"{where + ', ' if where else ''}phase {last.phase!r} ({last.trainable_params:,} params, "
            f"{last.allreduce_bytes_per_step:,} B all-reduced/step), "
            f"{'DDP rebuilt' if last.rebuilt_ddp else 'no DDP rebuild'}, {1e3 * last.seconds:.2f} ms"
        )
        return f"SwitchHistory({head}, {totals}; last: {record})"
