"""The FSDP2 (``fully_shard``) backend: the one place touching FSDP2's private state.

FSDP2 reduce-scatters only parameters that have a gradient and reads
``requires_grad`` again at every all-gather, so a phase switch needs no rewrap.
One thing does need doing: a unit whose parameters were all frozen at its first
forward has its mixed-precision dtypes unset, and with a bf16
``MixedPrecisionPolicy`` its first backward after unfreezing fails ("attempting
to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float").
:meth:`FSDP2Backend.apply` re-runs each unit's dtype initialisation (private:
``FSDPModule._get_fsdp_state()._fsdp_param_groups[i]._init_mp_dtypes()``,
checked by :func:`check_fsdp2_supported`). Verified on 2 gloo CPU ranks, torch 2.13.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..errors import SwitchError
from .backend import Backend

__all__ = ["FSDP2Backend", "check_fsdp2_supported", "fsdp2_units", "is_fsdp2"]


def is_fsdp2(model: nn.Module) -> bool:
    """True when ``model`` was passed to ``fully_shard`` (an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """Every ``fully_shard`` unit inside ``model`` (itself included)."""
    return [m for m in model.modules() if is_fsdp2(m)]


def _param_groups(unit: nn.Module) -> list:
    return list(unit._get_fsdp_state()._fsdp_param_groups)  # type: ignore[operator]


def check_fsdp2_supported(model: nn.Module) -> None:
    """Raise :class:`SwitchError` if the FSDP2 internals the switch needs are missing."""
    for unit in fsdp2_units(model):
        state = getattr(unit, "_get_fsdp_state", None)
        if state is None or not all(hasattr(g, "_init_mp_dtypes") for g in _param_groups(unit)):
            raise SwitchError(
                f"this torch ({torch.__version__}) lacks the FSDP2 internals hf_altparams re-initialises "
                "at a switch (`_fsdp_param_groups[i]._init_mp_dtypes`); tested with torch 2.13"
            )


class FSDP2Backend(Backend):
    """The switch's FSDP2 backend: nothing to rebuild, mixed-precision dtypes re-initialised.

    Example:
        >>> # backend = FSDP2Backend(model)  # model after fully_shard(...)
    """

    kind = "fsdp2"

    def __init__(self, model: nn.Module) -> None:
        check_fsdp2_supported(model)
        self.wrapper = model
        self.units = fsdp2_units(model)

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        for unit in self.units:
            for group in _param_groups(unit):
                return group.mesh_info.shard_process_group
        return None

    def apply(self, ignore: set[str]) -> None:
        for unit in self.units:
            for group in _param_groups(unit):
                group._init_mp_dtypes()

    def restore(self, snapshot: object) -> None:
        self.apply(set())

    def reduced_bytes_per_step(self) -> int:
        """Bytes of the trainable parameters' (padded) gradients each rank feeds to reduce-scatter."""
        total = 0
        for unit in self.units:
            for group in _param_groups(unit):
                for fp in group.fsdp_params:
                    if fp.sharded_param.requires_grad:
                        dtype = group._reduce_dtype or fp.sharded_param.dtype
                        size = torch.empty((), dtype=dtype).element_size()
                        total += fp.padded_sharded_param_size.numel() * group.mesh_info.shard_mesh_size * size
        return total
