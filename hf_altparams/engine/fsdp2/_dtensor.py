"""What FSDP2 builds, read from the outside: its units, their sharded parameters, DTensors.

Small helpers shared by the FSDP2 backend (:mod:`._backend`), the unit checks
(:mod:`._units`) and the memory moves (:mod:`hf_altparams.engine.memory.transfer`),
which must handle a DTensor parameter or optimizer state like a plain tensor.
``_param_groups`` reads FSDP2's per-module state (a private attribute fenced by
:func:`._backend.check_fsdp2_supported`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

__all__ = ["dtensor_with_local", "fsdp2_units", "is_dtensor", "is_fsdp2", "local_tensor", "set_data", "unit_params"]


def is_fsdp2(model: nn.Module) -> bool:
    """True when ``model`` was passed to ``fully_shard`` (an ``FSDPModule``)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def is_dtensor(tensor: object) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (an FSDP2 parameter, its state, its grad)."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise); no copy, no autograd."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def dtensor_with_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``like``'s spec (mesh, placements, global shape) around ``local``.

    Unlike ``DTensor.from_local`` this keeps ``local`` where it is (a host shard
    of a CUDA-mesh DTensor, as FSDP2's CPU offload holds it) and runs no check.
    """
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)  # type: ignore[attr-defined]


def set_data(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """``tensor.data = data``, also for a DTensor (whose local shard ``.data`` alone leaves in place).

    Example:
        >>> import torch
        >>> t = torch.zeros(2); set_data(t, torch.ones(2)); t.tolist()
        [1.0, 1.0]
    """
    tensor.data = data
    if is_dtensor(tensor):
        tensor._local_tensor = data._local_tensor  # type: ignore[attr-defined]


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """Every ``fully_shard`` unit inside ``model`` (itself included)."""
    return [m for m in model.modules() if is_fsdp2(m)]


def _param_groups(unit: nn.Module) -> list[Any]:
    state = unit._get_fsdp_state()  # type: ignore[operator]
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.13: a list
    if groups is None:  # older releases: one optional group
        group = getattr(state, "_fsdp_param_group", None)
        return [] if group is None else [group]
    return list(groups)


def unit_params(unit: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters ``unit`` manages itself (not those of units inside it)."""
    return [fp.sharded_param for group in _param_groups(unit) for fp in group.fsdp_params]
