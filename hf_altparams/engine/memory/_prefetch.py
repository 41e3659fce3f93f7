"""Prefetch: during the last step of a phase, start copying the next phase's offloaded tensors back.

Used by :class:`~hf_altparams.engine.PhaseSwitcher` (its ``prefetch`` setting).
The copies run on a CUDA side stream (:mod:`._transfer`); off CUDA they start
nothing. The budget decides how much device memory the overlap may cost.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from ...errors import SwitchError
from ...plan.phase import Phase
from ._report import expected_peak_bytes
from ._transfer import optimizer_of
from ..optim._grouped import GroupedOptimizer


__all__ = ["PhasePrefetch", "PrefetchSetting", "check_prefetch"]

PrefetchSetting = Union[bool, int, str]


def _expected_peak(switcher: Any, phase: Phase) -> int:
    return expected_peak_bytes(switcher, phase)[0]


def check_prefetch(setting: object) -> None:
    """Validate the ``prefetch`` setting: ``False``, ``True``, ``"auto"`` or a byte budget."""
    if not (setting in (True, False, "auto") or
            (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 0)):
        raise SwitchError(f"`prefetch` is {setting!r}; accepted: False, True, 'auto' or a byte budget (int >= 0)")


class PhasePrefetch:
    """The prefetch setting of a switcher and what it has started.

    Args:
        setting: ``False`` (never), ``True`` (everything), an ``int`` byte
            budget, or ``"auto"`` (the headroom below the largest expected peak).

    Example:
        >>> PhasePrefetch("auto").setting
        'auto'
    """

    def __init__(self, setting: PrefetchSetting) -> None:
        check_prefetch(setting)
        self.setting = setting
        self._started_for: Optional[int] = None
        self._peak_seen = 0

    def switched(self, switcher: Any, phase: Phase) -> None:
        """Note the expected peak of a phase just applied (for the ``"auto"`` budget)."""
        if self.setting:
            self._peak_seen = max(self._peak_seen, _expected_peak(switcher, phase))

    def maybe_start(self, switcher: Any) -> int:
        """Start the next phase's copies if the driver's step is the current phase's last; return the bytes."""
        driver = switcher.driver
        if not self.setting:
            return 0
        upcoming = driver.upcoming()  # None: same phase next step, epoch unit, or nothing applied yet
        if upcoming is None or self._started_for == driver.step + 1:
            return 0
        self._started_for = driver.step + 1  # the copies now in flight are for that step
        budget: Optional[int]
        if self.setting == "auto":
            upcoming_peak = _expected_peak(switcher, upcoming)
            budget = max(0, max(self._peak_seen, upcoming_peak) - _expected_peak(switcher, driver.current))
        elif self.setting is True:
            budget = None
        else:
            budget = int(self.setting)
        residency = switcher.residency
        started = residency.prefetch(residency.offloaded - residency.non_resident(upcoming), budget)
        opt = optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None
        if isinstance(opt, GroupedOptimizer):
            for group in sorted(upcoming.trainable - opt.active):
                if group in opt.inner and (budget is None or started < budget):
                    started += opt.prefetch(group, None if budget is None else budget - started)
        return started
