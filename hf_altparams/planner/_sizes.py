"""What each parameter group weighs (parameters, gradients, optimizer state, fp32 masters) and
what a switch moves: the pure arithmetic under :func:`~hf_altparams.planner.plan_cost`.

The low-precision storage part (``storage_dtype``, :class:`~hf_altparams.engine.PrecisionOptimizer`)
lives in :func:`_group_sizes` (what is stored in which dtype) and in ``_Layout.masters``
(where each group's fp32 master is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import PlanError
from ..plan import ParamGroups

#: Optimizer name -> number of state tensors it keeps per parameter (each of the parameter's shape and dtype).
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}
POLICIES: tuple[str, ...] = ("keep", "offload", "drop")
#: Host<->device bandwidth assumed for offload time estimates (GB/s; PCIe 4.0 x16, pinned memory).
DEFAULT_PCIE_GBPS = 25.0
_DEFAULT_POSITIONS = 1000  # positions listed for schedules with no repeating pattern
_UNGROUPED = "<ungrouped>"
_SWITCH_LINES = 8  # kinds of switch listed by CostPlan.table()
#: The dtype names the planner accepts (its ``--*dtype`` flags, ``build_model(dtype=)``): torch's, and the
#: short ones of Accelerate's ``mixed_precision`` and the Trainer's ``bf16``/``fp16`` flags; any case, and
#: ``torch.`` in front allowed.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}

OptimizerSpec = Union[str, float, Callable[[str, nn.Parameter], int]]


def dtype_from_name(value: Union[str, torch.dtype], argument: str) -> torch.dtype:
    """The torch dtype a planner flag names: ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``, ... (:data:`DTYPE_NAMES`).

    `argument` is how the error names the flag or argument (e.g. ``"`--storage-dtype`"``).

    Example:
        >>> dtype_from_name("bf16", "`--storage-dtype`"), dtype_from_name("torch.Float16", "`dtype`")
        (torch.bfloat16, torch.float16)
        >>> dtype_from_name("int8", "`--storage-dtype`")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `--storage-dtype` must name a float dtype: bf16/bfloat16, fp16/float16/half, fp32/float32/float (any case, 'torch.' in front allowed), got 'int8'
    """
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    key = value.strip().lower() if isinstance(value, str) else None
    if key is not None and key.startswith("torch."):
        key = key[len("torch."):]
    if key in DTYPE_NAMES:
        return DTYPE_NAMES[key]
    spellings: dict[torch.dtype, list[str]] = {}
    for name, dtype in DTYPE_NAMES.items():
        spellings.setdefault(dtype, []).append(name)
    accepted = ", ".join("/".join(names) for names in spellings.values())
    raise PlanError(f"{argument} must name a float dtype: {accepted} (any case, 'torch.' in front allowed), "
                    f"got {value!r}")


def _state_bytes_fn(optimizer: OptimizerSpec) -> tuple[str, Callable[[str, nn.Parameter], int]]:
    """A label and ``(name, param) -> optimizer state bytes`` for the optimizer spec."""
    if isinstance(optimizer, str):
        states = OPTIMIZER_STATES.get(optimizer.lower())
        if states is None:
            raise PlanError(f"`optimizer` must be one of {list(OPTIMIZER_STATES)}, a number of state bytes "
                            f"per parameter, or a callable (name, param) -> bytes; got {optimizer!r}")
        return (f"{optimizer.lower()} ({states} state(s) per parameter, in its dtype)",
                lambda name, p: states * p.numel() * p.element_size())
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        if not math.isfinite(optimizer) or optimizer < 0:
            raise PlanError(f"`optimizer` as bytes per parameter must be a finite number >= 0, got {optimizer!r}")
        return f"{optimizer:g} B state per parameter", lambda name, p: math.ceil(optimizer * p.numel())
    if callable(optimizer):
        def checked(name: str, p: nn.Parameter) -> int:
            value = optimizer(name, p)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"`optimizer` callable returned {value!r} for {name!r}; expected an int >= 0")
            return value
        return f"custom ({getattr(optimizer, '__name__', type(optimizer).__name__)})", checked
    raise PlanError(f"`optimizer` must be a name from {list(OPTIMIZER_STATES)}, a number or a callable, "
                    f"got {optimizer!r}")


def _check_args(state_policy: str, steps: Optional[int], world_size: int, pcie_gbps: float,
                grad_dtype: Optional[torch.dtype]) -> None:
    if state_policy not in POLICIES:
        raise PlanError(f"`state_policy` must be one of {list(POLICIES)}, got {state_policy!r}")
    for value, name in ((steps, "steps"), (world_size, "world_size")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"`{name}` must be an int >= 1, got {value!r}")
    if isinstance(pcie_gbps, bool) or not isinstance(pcie_gbps, (int, float)) or not pcie_gbps > 0:
        raise PlanError(f"`pcie_gbps` must be a number > 0 (GB/s), got {pcie_gbps!r}")
    if grad_dtype is not None and not isinstance(grad_dtype, torch.dtype):
        raise PlanError(f"`grad_dtype` must be a torch.dtype or None, got {grad_dtype!r}")


@dataclass(frozen=True)
class _Layout:
    """Where things are in a phase: non-resident groups, each group's optimizer state, offloaded buffers."""

    off: frozenset[str]
    state: dict[str, str]  # group -> "device" | "host" (absent: no state)
    buffers_off: int
    masters: dict[str, str] = field(default_factory=dict)  # group -> "device" | "host" (absent: none)


def _group_sizes(groups: ParamGroups, state_fn: Callable[[str, nn.Parameter], int],
                 grad_dtype: Optional[torch.dtype],
                 storage_dtype: Optional[torch.dtype] = None,
                 allreduce_dtype: Optional[torch.dtype] = None) -> dict[str, dict[str, int]]:
    """Per group (and ``<ungrouped>``): elements, parameter, gradient, optimizer state and master bytes.

    With ``storage_dtype``, floating parameters are counted in it, their gradients too
    (unless ``grad_dtype``), their optimizer state in fp32 (it lives on the masters)
    and each has a 4-byte master.
    """
    by_name = dict(groups.all_named_params())
    members = {g: groups.param_names(g) for g in groups.names}
    members[_UNGROUPED] = groups.ungrouped_names()
    size = {}
    for key, names in members.items():
        params = [(n, by_name[n]) for n in names]
        if storage_dtype is not None:
            stored = [(n, _as_dtype(p, storage_dtype)) for n, p in params]
            fp32 = [(n, _as_dtype(p, torch.float32)) for n, p in params]
            masters = sum(p.numel() * 4 for _, p in params if p.is_floating_point() and storage_dtype != torch.float32)
        else:
            stored, fp32, masters = params, params, 0
        fp32_grads = {n for n, p in params if storage_dtype is not None and p.is_floating_point()}
        size[key] = {
            "numel": sum(p.numel() for _, p in params),
            "param": sum(p.numel() * p.element_size() for _, p in stored),
            "bucket": sum(p.numel() * (grad_dtype.itemsize if grad_dtype else p.element_size()) for _, p in stored),
            # what is all-reduced: the bucket, or a copy of it in `allreduce_dtype` (PrecisionOptimizer)
            "reduced": sum(p.numel() * (allreduce_dtype.itemsize if allreduce_dtype else
                                        (grad_dtype.itemsize if grad_dtype else p.element_size()))
                           for _, p in stored),
            # storage mode: the step casts each gradient to fp32 on its master and frees it
            "grad": sum(p.numel() * (4 if n in fp32_grads else
                                     (grad_dtype.itemsize if grad_dtype else p.element_size()))
                        for n, p in stored),
            "state": sum(state_fn(n, p) for n, p in fp32),
            "master": masters,
        }
    return size


def _as_dtype(param: nn.Parameter, dtype: torch.dtype) -> Any:
    """A stand-in of ``param``'s shape in ``dtype`` on ``meta`` (no memory), for floating parameters."""
    if not param.is_floating_point() or param.dtype == dtype:
        return param
    return nn.Parameter(torch.empty(param.shape, dtype=dtype, device="meta"), requires_grad=False)


def _buffer_owners(groups: ParamGroups) -> list[tuple[frozenset[Optional[str]], int]]:
    """Per module with buffers: the groups of its own parameters (None: ungrouped or none) and the bytes.

    As the engine does, a module's buffers leave the device only with its own
    parameters, when all of them are in non-resident groups.
    """
    out = []
    for mname, module in groups.module.named_modules():
        held = sum(b.numel() * b.element_size() for b in module.buffers(recurse=False) if b is not None)
        if held:
            own = [groups.group_of(f"{mname}.{n}" if mname else n) for n, _ in module.named_parameters(recurse=False)]
            out.append((frozenset(own or [None]), held))
    return out


def _moves(before: _Layout, after: _Layout, size: dict[str, dict[str, int]],
           owners: list[tuple[frozenset[Optional[str]], int]]) -> tuple[int, int]:
    """(bytes to host, bytes to device) from one layout to the next: parameters, buffers, optimizer state."""
    to_host = sum(size[g]["param"] for g in after.off - before.off)
    to_device = sum(size[g]["param"] for g in before.off - after.off)
    for owned, n in owners:
        was, now = (None not in owned and owned <= layout.off for layout in (before, after))
        to_host += n if now and not was else 0
        to_device += n if was and not now else 0
    for g, at in before.state.items():
        now_at = after.state.get(g)
        to_host += size[g]["state"] if (at, now_at) == ("device", "host") else 0
        to_device += size[g]["state"] if (at, now_at) == ("host", "device") else 0
    for g, at in before.masters.items():
        now_at = after.masters.get(g)
        to_host += size[g]["master"] if (at, now_at) == ("device", "host") else 0
        to_device += size[g]["master"] if (at, now_at) == ("host", "device") else 0
    return to_host, to_device
