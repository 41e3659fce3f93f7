"""When a switch releases memory: the ``release`` setting of :class:`~hf_altparams.engine.PhaseSwitcher`.

Releasing (a gc pass, ``torch.cuda.empty_cache``, ``malloc_trim``; see
:func:`~hf_altparams.engine.release_memory`) gives memory the old phase freed
back to the device or the OS. It pays only when the memory is not needed again
soon: on CPU ``malloc_trim`` costs 10-50 ms for tens of MiB and the next step
page-faults the same pages back; on CUDA the next step re-allocates through
``cudaMalloc`` what ``empty_cache`` returned. ``release="auto"`` (the default)
decides per switch from the schedule and the phases' expected footprints
(:func:`~hf_altparams.engine.expected_peak_bytes`, activations excluded):

* release when the coming phase's expected footprint is smaller than the one
  held so far (by at least ``1/32`` of it and 1 MiB) **and** the coming phase
  lasts at least ``min_steps`` steps (or any whole epoch), so the release is
  amortised;
* skip it otherwise: a phase as large as the last one (equal-sized groups
  alternating) reuses the freed memory at once, and a short smaller phase gives
  it back one or few steps later.

``True`` releases at every switch, ``False`` never. The decision and its reason
go into the switch's :class:`~hf_altparams.engine.SwitchRecord`
(``released``, ``release_reason``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

from ...errors import SwitchError
from ...plan.phase import Phase
from ._report import expected_peak_bytes
from .._layout import remember


__all__ = ["ReleasePolicy", "ReleaseSetting", "check_release"]

ReleaseSetting = Union[bool, str]
_MIB = 2**20


def check_release(setting: object) -> None:
    """Validate the ``release`` setting: ``"auto"``, ``True`` or ``False``."""
    if not (setting is True or setting is False or setting == "auto"):
        raise SwitchError(f"`release` is {setting!r}; accepted: 'auto', True or False")


class ReleasePolicy:
    """Decides, at each switch, whether to release the memory the old phase freed.

    Args:
        setting: ``"auto"``, ``True`` (always) or ``False`` (never).
        min_steps: with ``"auto"``, the shortest phase (in steps) worth a release.

    Example:
        >>> import torch
        >>> from hf_altparams.engine import PhaseSwitcher
        >>> from hf_altparams.plan import ParamGroups, Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        >>> switcher = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
        >>> _ = switcher.step_to(0)
        >>> record = switcher.step_to(1)
        >>> record.released, record.release_reason
        (False, 'skipped: the coming phase needs as much memory as the last (864 B vs 864 B)')
    """

    def __init__(self, setting: ReleaseSetting = "auto", min_steps: int = 8) -> None:
        check_release(setting)
        self.setting = setting
        self.min_steps = min_steps
        self._footprints: dict[tuple[Phase, frozenset[str]], int] = {}
        self._held = 0  # the largest expected footprint since the last release

    def forget_footprints(self) -> None:
        """Drop cached footprints (the wrapper changed: gradient copies differ)."""
        self._footprints.clear()

    def footprint(self, switcher: Any, phase: Phase) -> int:
        """The phase's expected device footprint, computed once per phase and set of groups trained so far.

        An idle group's optimizer state (and fp32 master) exists only once it has
        trained, so a phase's figure grows until every group has: the driver's
        ``trained_groups`` is part of the key.
        """
        key = (phase, frozenset(switcher.driver.trained_groups))
        cached = self._footprints.get(key)
        if cached is None:
            cached = remember(self._footprints, key, expected_peak_bytes(switcher, phase)[0])
        return cached

    def decide(self, switcher: Any, previous: Optional[Phase], phase: Phase,
               step: Optional[int], epoch: Optional[int]) -> tuple[bool, str]:
        """``(release now?, why)`` for a switch from ``previous`` to ``phase``."""
        if self.setting is True:
            return True, "release=True"
        if self.setting is False:
            return False, "release=False"
        coming = self.footprint(switcher, phase)
        if previous is None:
            self._held = coming
            return False, "skipped: first phase, nothing freed"
        self._held = max(self._held, self.footprint(switcher, previous))
        held = self._held
        if held - coming < max(_MIB, held // 32):
            return False, (f"skipped: the coming phase needs as much memory as the last "
                           f"({_size(coming)} vs {_size(held)})")
        lasts = self._lasts(switcher, step, epoch)
        if lasts is not None and lasts < self.min_steps:
            return False, (f"skipped: the coming phase is smaller ({_size(coming)} vs {_size(held)}) "
                           f"but lasts {lasts} step(s) < {self.min_steps}")
        self._held = coming
        return True, f"released: the coming phase needs {_size(coming)} of the {_size(held)} held"

    def _lasts(self, switcher: Any, step: Optional[int], epoch: Optional[int]) -> Optional[int]:
        """Steps the coming phase lasts (``None``: unknown or longer than the horizon, or epochs)."""
        schedule = switcher.schedule
        if schedule.unit != "step" or step is None:
            return None
        change = schedule.next_change(step, horizon=self.min_steps)
        return None if change is None else change - step


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    return f"{n} B"
