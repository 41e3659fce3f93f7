"""What a phase switch did: :class:`SwitchRecord`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Union

__all__ = ["SwitchRecord"]


@dataclass(frozen=True)
class SwitchRecord:
    """What one switch did; ``as_log()`` gives flat metrics for trackers.

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

    def as_log(self, prefix: str = "altparams/") -> dict[str, Union[int, float, str]]:
        """Flat ``{name: value}`` metrics (numbers only, plus the phase name)."""
        data = asdict(self)
        data["trainable_groups"] = ",".join(self.trainable_groups)
        data["rebuilt_ddp"] = int(self.rebuilt_ddp)
        return {f"{prefix}{k}": v for k, v in data.items() if v is not None}
