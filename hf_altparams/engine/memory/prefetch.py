"""Prefetch: during the last step of a phase, start copying the next phase's offloaded tensors back.

The ``prefetch`` setting of :class:`~hf_altparams.engine.PhaseSwitcher`. The
switcher asks :class:`PhasePrefetch` for the budget (how much device memory the
overlap may cost) and starts the copies (residency's and the optimizer's,
through their :class:`~hf_altparams.engine.memory.transfer.TensorMover`); they
run on a CUDA side stream and start nothing off CUDA.
"""

from __future__ import annotations

from typing import Optional, Union

from ...errors import SwitchError

__all__ = ["PhasePrefetch", "PrefetchSetting", "check_prefetch"]

PrefetchSetting = Union[bool, int, str]


def check_prefetch(setting: object) -> None:
    """Validate the ``prefetch`` setting: ``False``, ``True``, ``"auto"`` or a byte budget."""
    if not (
        setting in (True, False, "auto")
        or (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0)
    ):
        raise SwitchError(f"`prefetch` is {setting!r}; accepted: False, True, 'auto' or a byte budget (int >= 0)")


class PhasePrefetch:
    """The prefetch setting of a switcher, and the largest expected peak it has seen (for ``"auto"``).

    Args:
        setting: ``False`` (never), ``True`` (everything), an ``int`` byte
            budget, or ``"auto"`` (the headroom below the largest expected peak).

    Example:
        >>> prefetch = PhasePrefetch("auto")
        >>> prefetch.note_peak(1000)
        >>> prefetch.budget(current_peak=600, upcoming_peak=800)  # the headroom below the 1000 seen
        400
        >>> PhasePrefetch(256).budget(600, 800), PhasePrefetch(True).budget(600, 800)
        (256, None)
    """

    def __init__(self, setting: PrefetchSetting) -> None:
        check_prefetch(setting)
        self.setting = setting
        self._peak_seen = 0

    @property
    def enabled(self) -> bool:
        return bool(self.setting)

    def note_peak(self, peak: int) -> None:
        """A phase just applied expects ``peak`` device bytes (the ``"auto"`` budget's ceiling)."""
        self._peak_seen = max(self._peak_seen, peak)

    def budget(self, current_peak: int, upcoming_peak: int) -> Optional[int]:
        """Device bytes the prefetch may take now (``None``: no limit)."""
        if self.setting == "auto":
            return max(0, max(self._peak_seen, upcoming_peak) - current_peak)
        if self.setting is True:
            return None
        return int(self.setting)
