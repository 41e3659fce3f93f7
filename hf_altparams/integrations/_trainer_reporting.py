"""What :class:`~hf_altparams.integrations.trainer.AlternatingFreeze` reports: the ``altparams/*`` log values.

:class:`TrainerReport` builds what the callback's ``on_log`` adds to the
Trainer's logs, from the switcher (the phase of the step just trained, read
from its driver; the switch history) and the comm counter, and remembers what
the previous log already reported (switch seconds, measured steps).
"""

from __future__ import annotations

from typing import Any, Optional, Union

from ..engine.comm import CommCounter
from ..engine.switch import PhaseSwitcher
from ..plan.phase import Phase

__all__ = ["TrainerReport", "describe_phase"]

Metrics = dict[str, Union[int, float, str]]


def describe_phase(switcher: PhaseSwitcher, phase: Optional[Phase]) -> dict[str, Union[int, str]]:
    """``phase``, ``trainable_params`` and ``allreduce_bytes_per_step`` of ``phase`` (as last applied)."""
    if phase is None:
        return {"phase": "", "trainable_params": 0, "allreduce_bytes_per_step": 0}
    trainable = switcher.trainable_names(phase)
    return {
        "phase": phase.name,
        "trainable_params": sum(p.numel() for n, p in switcher.groups.all_named_params() if n in trainable),
        "allreduce_bytes_per_step": switcher.reduced_bytes(phase),
    }


class TrainerReport:
    """The callback's log values, and what the previous log already covered.

    Args:
        prefix: prefix of the keys (``"altparams/"``).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.logged_seconds = 0.0  # switch seconds already reported by the previous log
        self.logged_comm = 0  # measured steps already reported by the previous log

    def reset(self) -> None:
        """A new ``train()``: nothing reported yet."""
        self.logged_seconds, self.logged_comm = 0.0, 0

    def metrics(self, switcher: PhaseSwitcher, comm: Optional[CommCounter], frozen_prefix: Any) -> Metrics:
        """The ``altparams/*`` values of the step just trained and of the switches since the last log.

        Describing the optimizer step just trained (the one whose loss is
        logged): ``phase``, ``trainable_params``, ``allreduce_bytes_per_step``
        (bytes the DDP reducer all-reduces per step; 0 without DDP); then
        ``switches`` (so far in this ``train()``, the wrapper's first
        re-bucketing included), ``switch_seconds`` (time spent switching since
        the previous log), and with a comm counter ``allreduce_bytes_measured``
        (mean bytes per step since the previous log).
        """
        prefix, history, driver = self.prefix, switcher.history, switcher.driver
        info = describe_phase(switcher, driver.trained or driver.current)
        out: Metrics = {f"{prefix}{k}": v for k, v in info.items()}
        out.update({
            f"{prefix}switches": history.count,
            f"{prefix}switch_seconds": history.seconds - self.logged_seconds,
        })
        self.logged_seconds = history.seconds
        if comm is not None:
            recent = comm.history[self.logged_comm:]
            self.logged_comm = len(comm.history)
            out[f"{prefix}allreduce_bytes_measured"] = sum(recent) / len(recent) if recent else 0
        if frozen_prefix is not None:
            out.update(frozen_prefix.metrics(prefix))
        return out
