"""What each parameter group weighs and what a switch moves: the planner's side of the memory model.

The arithmetic itself (bytes per parameter as stored, gradients, DDP buckets,
optimizer state per optimizer kind, fp32 masters; where state and masters are
under each :class:`~hf_altparams.engine.optim.StatePolicy`) is
:mod:`hf_altparams.engine.memory.model`, which
:func:`~hf_altparams.engine.memory_report` uses on the live model. Here: the
planner's arguments (optimizer spec, dtype names), the sizes of a
:class:`~hf_altparams.plan.ParamGroups` built on ``meta``, and the bytes a
switch moves between two layouts.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
from torch import nn

from ..engine.memory.model import (OPTIMIZER_STATES, UNGROUPED, Layout, Sizes, StatePolicy, Storage,
                                    state_bytes_for, tensor_sizes)
from ..errors import PlanError
from ..plan import ParamGroups

#: The state policies (``--state-policy``, ``--master-policy``): :class:`~hf_altparams.engine.optim.StatePolicy`'s values.
POLICIES: tuple[str, ...] = tuple(p.value for p in StatePolicy)
#: Host<->device bandwidth assumed for offload time estimates (GB/s; PCIe 4.0 x16, pinned memory).
DEFAULT_PCIE_GBPS = 25.0
_DEFAULT_POSITIONS = 1000  # positions listed for schedules with no repeating pattern
_UNGROUPED = UNGROUPED
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
        return (f"{optimizer.lower()} ({states:g} state(s) per parameter, in its dtype)",
                lambda name, p: state_bytes_for(states, p))
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


def _check_args(steps: Optional[int], world_size: int, pcie_gbps: float, grad_dtype: Optional[torch.dtype]) -> None:
    for value, name in ((steps, "steps"), (world_size, "world_size")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanError(f"`{name}` must be an int >= 1, got {value!r}")
    if isinstance(pcie_gbps, bool) or not isinstance(pcie_gbps, (int, float)) or not pcie_gbps > 0:
        raise PlanError(f"`pcie_gbps` must be a number > 0 (GB/s), got {pcie_gbps!r}")
    if grad_dtype is not None and not isinstance(grad_dtype, torch.dtype):
        raise PlanError(f"`grad_dtype` must be a torch.dtype or None, got {grad_dtype!r}")


def _group_sizes(groups: ParamGroups, state_fn: Callable[[str, nn.Parameter], int],
                 storage: Storage) -> dict[str, Sizes]:
    """:class:`Sizes` per group (and ``<ungrouped>``) of ``groups``' parameters, stored as ``storage`` says."""
    by_name = dict(groups.all_named_params())
    members = {g: groups.param_names(g) for g in groups.names}
    members[_UNGROUPED] = groups.ungrouped_names()
    return {key: tensor_sizes([(n, by_name[n]) for n in names], state_fn, storage)  # type: ignore[arg-type]
            for key, names in members.items()}


def _moves(before: Layout, after: Layout, size: dict[str, Sizes],
           owners: list[tuple[frozenset[Optional[str]], int]]) -> tuple[int, int]:
    """(bytes to host, bytes to device) from one layout to the next: parameters, buffers, optimizer state, masters."""
    to_host = sum(size[g].param for g in after.off - before.off)
    to_device = sum(size[g].param for g in before.off - after.off)
    for owned, n in owners:
        was, now = (None not in owned and owned <= layout.off for layout in (before, after))
        to_host += n if now and not was else 0
        to_device += n if was and not now else 0
    for placed, now_placed, kind in ((before.state, after.state, "state"), (before.masters, after.masters, "master")):
        for g, at in placed.items():
            moved = getattr(size[g], kind)
            to_host += moved if (at, now_placed.get(g)) == ("device", "host") else 0
            to_device += moved if (at, now_placed.get(g)) == ("host", "device") else 0
    return to_host, to_device
