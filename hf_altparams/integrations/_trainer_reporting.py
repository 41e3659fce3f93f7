"""What :class:`~hf_altparams.integrations.trainer.AlternatingFreeze` reports: switch records and log metrics.

``records`` (the recent switches of the current ``train()``), ``metrics`` (the
``altparams/*`` values the callback's ``on_log`` adds to the Trainer's logs) and
the description of the current phase they are built from. A mixin of the
callback, whose events stay in :mod:`.trainer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from ..engine.records import SwitchRecord

if TYPE_CHECKING:
    from .trainer import AlternatingFreeze

__all__ = ["ReportingMixin"]


class ReportingMixin:
    """``records`` and ``metrics`` for :class:`~hf_altparams.integrations.trainer.AlternatingFreeze`."""

    _logged_seconds: float  # switch seconds already reported by the previous log
    _logged_comm: int  # measured steps already reported by the previous log

    @property
    def records(self: AlternatingFreeze) -> list[SwitchRecord]:
        """What the recent switches of the current ``train()`` did (the first may be the wrapper's re-bucketing).

        At most ``switcher.history.window`` records, oldest first; the totals of
        the whole run are in ``switcher.history``.
        """
        return [] if self.switcher is None else self.switcher.records

    def metrics(self: AlternatingFreeze) -> dict[str, Union[int, float, str]]:
        """The ``altparams/*`` values :meth:`on_log` adds to the Trainer's logs.

        Describing the optimizer step just trained (the one whose loss is
        logged): ``phase``, ``trainable_params``, ``allreduce_bytes_per_step``
        (bytes the DDP reducer all-reduces per step; 0 without DDP); then
        ``switches`` (so far in this ``train()``, the wrapper's first
        re-bucketing included), ``switch_seconds`` (time spent switching since
        the previous log), and with ``count_comm=True``
        ``allreduce_bytes_measured`` (mean bytes per step since the previous log).
        """
        assert self.switcher is not None
        prefix, history = self.log_prefix, self.switcher.history
        info = self._trained_info or self._phase_info
        out: dict[str, Union[int, float, str]] = {f"{prefix}{k}": v for k, v in info.items()}
        out.update({
            f"{prefix}switches": history.count,
            f"{prefix}switch_seconds": history.seconds - self._logged_seconds,
        })
        self._logged_seconds = history.seconds
        if self.comm is not None:
            recent = self.comm.history[self._logged_comm:]
            self._logged_comm = len(self.comm.history)
            out[f"{prefix}allreduce_bytes_measured"] = sum(recent) / len(recent) if recent else 0
        if self.frozen_prefix is not None:
            out.update(self.frozen_prefix.metrics(prefix))
        return out

    def _describe_phase(self: AlternatingFreeze) -> dict[str, Union[int, str]]:
        assert self.switcher is not None
        phase = self.switcher.current
        trainable = self.switcher.trainable_names(phase) if phase is not None else frozenset()
        return {
            "phase": phase.name if phase is not None else "",
            "trainable_params": sum(p.numel() for n, p in self.switcher.groups.all_named_params() if n in trainable),
            "allreduce_bytes_per_step": self.switcher.allreduce_bytes_per_step(),
        }
