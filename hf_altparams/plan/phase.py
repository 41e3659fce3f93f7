"""The :class:`Phase`: which groups train and which stay resident on the device."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

__all__ = ["Phase"]


def _as_names(value: Iterable[str] | str | None) -> Optional[frozenset[str]]:
    if value is None:
        return None
    if isinstance(value, str):
        return frozenset([value])
    return frozenset(value)


@dataclass(frozen=True)
class Phase:
    """One phase of a schedule.

    Args:
        trainable: names of the groups whose parameters train in this phase.
        resident: names of the groups that must stay on the device. ``None``
            means every group (the default); trainable groups are always resident.
        label: a short human-readable name used in logs ("" = derived).
        task: for a per-task schedule, the name of the task this phase trains
            (``PerTaskCycle`` sets it to the task's group names joined by ``+``);
            ``None`` otherwise. Not part of equality.

    Example:
        >>> p = Phase(trainable={"head"})
        >>> sorted(p.trainable), p.resident is None
        (['head'], True)
        >>> Phase(trainable=["a"], resident=["trunk"]).resident == frozenset({"a", "trunk"})
        True
    """

    trainable: frozenset[str]
    resident: Optional[frozenset[str]] = None
    label: str = field(default="", compare=False)
    task: Optional[str] = field(default=None, compare=False)

    def __init__(
        self,
        trainable: Iterable[str] | str,
        resident: Iterable[str] | str | None = None,
        label: str = "",
        task: Optional[str] = None,
    ) -> None:
        t = _as_names(trainable)
        r = _as_names(resident)
        assert t is not None
        if r is not None:
            r = r | t
        object.__setattr__(self, "trainable", t)
        object.__setattr__(self, "resident", r)
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "task", task)

    @property
    def name(self) -> str:
        """The label, or ``"+".join(sorted(trainable))`` (``"<none>"`` if empty)."""
        if self.label:
            return self.label
        return "+".join(sorted(self.trainable)) or "<none>"

    def digest(self) -> str:
        """A stable hash of (trainable, resident): equal on every rank for equal phases."""
        text = "T:" + ",".join(sorted(self.trainable))
        text += "|R:" + ("*" if self.resident is None else ",".join(sorted(self.resident)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        # Written as the frozensets the fields are, members sorted so every rank prints the same text.
        res = "all" if self.resident is None else _frozenset_repr(self.resident)
        return f"Phase(trainable={_frozenset_repr(self.trainable)}, resident={res})"


def _frozenset_repr(names: frozenset[str]) -> str:
    """``frozenset({'a', 'b'})`` with sorted members (``frozenset()`` when empty).

    Example:
        >>> Phase(["b", "a"], resident=["t"])
        Phase(trainable=frozenset({'a', 'b'}), resident=frozenset({'a', 'b', 't'}))
        >>> eval(repr(Phase(["b", "a"]).trainable)) == eval(_frozenset_repr(frozenset({"a", "b"})))
        True
    """
    if not names:
        return "frozenset()"
    return "frozenset({" + ", ".join(repr(n) for n in sorted(names)) + "})"
