"""What :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` reports about its switches.

``switch_records`` (the recent switches), ``switch_history`` (those plus the
run's running totals) and ``switch_metrics`` (what ``accelerator.log``
receives at a switch with ``log_switches=True``: the record, the totals, memory,
the FSDP2 and frozen-prefix figures). A mixin of the accelerator, whose loop
hooks stay in :mod:`.accelerate`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ..engine.memory import rss_bytes
from ..engine.records import SwitchHistory, SwitchRecord
from ._fsdp2_prepare import fsdp2_metrics

if TYPE_CHECKING:
    from .accelerate import PhasedAccelerator

__all__ = ["ReportingMixin"]


class ReportingMixin:
    """``switch_records``, ``switch_history`` and ``switch_metrics`` for :class:`PhasedAccelerator`."""

    @property
    def switch_records(self: PhasedAccelerator) -> list[SwitchRecord]:
        """The recent switches (the first phase applied at ``prepare`` included), oldest first.

        At most ``switcher.history.window`` (256 by default) records; the running
        totals of the whole run are in :attr:`switch_history`.
        """
        return [] if self.switcher is None else self.switcher.records

    @property
    def switch_history(self: PhasedAccelerator) -> Optional[SwitchHistory]:
        """Recent records plus running totals (count, seconds, bytes moved); ``None`` before ``prepare``."""
        return None if self.switcher is None else self.switcher.history

    def switch_metrics(self: PhasedAccelerator, record: SwitchRecord, prefix: str = "altparams/") -> dict[str, Any]:
        """What ``accelerator.log`` receives at a switch: the record, the run's switch totals, memory."""
        metrics: dict[str, Any] = record.as_log(prefix)
        metrics.update(fsdp2_metrics(self, record, prefix))
        if self.switcher is not None:
            metrics.update(self.switcher.history.as_log(prefix))
        if self.device.type == "cuda":
            metrics[f"{prefix}memory_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            metrics[f"{prefix}max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            metrics[f"{prefix}rss_bytes"] = rss_bytes()
        if self.frozen_prefix is not None:  # what the cache did for the prefix that just ended
            metrics.update(self.frozen_prefix.metrics(prefix))
        return metrics
