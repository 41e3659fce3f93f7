"""The FSDP2 (``fully_shard``) backend: the one place touching FSDP2's and DTensor's private state.

FSDP2 reduce-scatters only parameters that have a gradient and reads
``requires_grad`` again at every all-gather, so a phase switch needs no rewrap.
What does need doing:

* Mixed precision: a unit whose parameters were all frozen at its first
  forward has its mixed-precision dtypes unset, and with a bf16
  ``MixedPrecisionPolicy`` its first backward after unfreezing fails
  ("attempting to assign a gradient with dtype BFloat16 to a tensor with
  grad_dtype Float"). :meth:`FSDP2Backend.apply` re-runs each unit's dtype
  initialisation (private ``FSDPParamGroup._init_mp_dtypes``).
* Moving a parameter's shard (per-task residency): the sharded parameter is a
  ``DTensor`` whose local tensor is a view of FSDP2's padded storage
  (``FSDPParam._sharded_param_data``), which is what the all-gather reads.
  Assigning ``param.data`` swaps neither (the DTensor keeps its
  ``_local_tensor``), so :meth:`FSDP2Backend.place_data` replaces the padded
  storage, the DTensor's local view and the parameter's data together: the
  memory is freed and the next all-gather reads the moved values.
* DTensor optimizer state (:func:`dtensor_with_local`): moved by copying its
  local shard and rewrapping it with the same spec, as FSDP2's own CPU offload
  does (a DTensor may hold a host shard on a CUDA mesh).

Every private name is listed in :data:`PRIVATE_FSDP2_ATTRIBUTES` and checked by
:func:`check_fsdp2_supported` together with the torch version (the range and
the opt-in environment variable are the DDP fence's), before anything changes.
Two layouts of the per-module state are accepted: ``_fsdp_param_groups`` (a
list, torch 2.13) and ``_fsdp_param_group`` (one group, older releases).
Verified on gloo CPU ranks with torch 2.13.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..._compat import ALLOW_UNTESTED_ENV, TESTED_TORCH, torch_version
from ...errors import SwitchError
from ...plan.groups import ParamGroups
from ..backend import Backend, Residency
from ._dtensor import _param_groups, dtensor_with_local, fsdp2_units, is_fsdp2, local_tensor, set_data
from ._units import check_groups_fit_units, install_unit_guards

__all__ = ["FSDP2Backend", "MP_REINIT_METHOD", "PRIVATE_FSDP2_ATTRIBUTES", "check_fsdp2_supported"]

#: Private names the backend relies on, by owner (present in torch 2.11-2.13).
PRIVATE_FSDP2_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "FSDPModule": ("_get_fsdp_state",),
    "FSDPParamGroup": ("fsdp_params", "mesh_info", "mp_policy"),
    "FSDPParam": ("sharded_param", "padded_sharded_param_size", "_sharded_param_data"),
    "DTensor": ("_local_tensor", "_spec"),
}

#: The ``FSDPParamGroup`` method re-run at a switch (needed only under a casting ``MixedPrecisionPolicy``).
MP_REINIT_METHOD = "_init_mp_dtypes"


def _uses_mixed_precision(group: Any) -> bool:
    policy = group.mp_policy
    dtypes = {fp.sharded_param.dtype for fp in group.fsdp_params}
    return any(d is not None and d not in dtypes for d in (policy.param_dtype, policy.reduce_dtype))


def _check_version() -> None:
    version = torch_version()
    low, high = TESTED_TORCH
    if low <= version <= high:
        return
    found, tested = f"{version[0]}.{version[1]}", f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
    if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise SwitchError(
            f"phase switches on fully_shard (FSDP2) models use private FSDP2 state tested on torch "
            f"{tested}; found torch {found}. Install a tested torch, or set {ALLOW_UNTESTED_ENV}=1 to "
            "try anyway (tests/engine/test_fsdp2_fence.py checks it)."
        )
    warnings.warn(
        f"hf_altparams: torch {found} is outside the tested range {tested}; "
        f"{ALLOW_UNTESTED_ENV}=1 is set, trying the FSDP2 backend anyway.",
        stacklevel=3,
    )


def _missing(obj: Any, owner: str) -> list[str]:
    return [f"{owner}.{n}" for n in PRIVATE_FSDP2_ATTRIBUTES[owner] if not hasattr(obj, n)]


def check_fsdp2_supported(model: nn.Module) -> None:
    """Raise :class:`SwitchError` if the FSDP2 internals the switch needs are missing.

    Checked before anything changes: the torch version is in the tested range
    (or ``HF_ALTPARAMS_ALLOW_UNTESTED_TORCH=1`` is set), and every private name
    in :data:`PRIVATE_FSDP2_ATTRIBUTES` exists on the model's units. Without
    :data:`MP_REINIT_METHOD` a unit that uses no mixed precision still works (the
    re-initialisation is only needed for a ``MixedPrecisionPolicy`` that casts);
    one that does is refused, naming the unit.
    """
    _check_version()
    missing: list[str] = []
    for name, unit in model.named_modules():
        if not is_fsdp2(unit):
            continue
        missing += _missing(unit, "FSDPModule")
        if missing:
            break
        state = unit._get_fsdp_state()
        if not hasattr(state, "_fsdp_param_groups") and not hasattr(state, "_fsdp_param_group"):
            missing.append("FSDPState._fsdp_param_groups")
            break
        for group in _param_groups(unit):
            missing += _missing(group, "FSDPParamGroup")
            if not hasattr(group, MP_REINIT_METHOD) and not missing and _uses_mixed_precision(group):
                raise SwitchError(
                    f"fully_shard unit {name or '<root>'!r} uses a casting MixedPrecisionPolicy, and this torch "
                    f"({torch.__version__}) lacks `FSDPParamGroup.{MP_REINIT_METHOD}`, which hf_altparams re-runs "
                    "at a switch so that a unit frozen at its first forward can train later. Use a torch from "
                    f"the tested range {TESTED_TORCH[0]}..{TESTED_TORCH[1]}, or drop `mp_policy` (use autocast)."
                )
            for fp in getattr(group, "fsdp_params", ()):
                missing += _missing(fp, "FSDPParam")
                missing += _missing(getattr(fp, "sharded_param", None), "DTensor")
                break
    if missing:
        raise SwitchError(
            f"this torch ({torch.__version__}) lacks {sorted(set(missing))}, which the FSDP2 backend needs; "
            f"use a torch from the tested range {TESTED_TORCH[0]}..{TESTED_TORCH[1]}."
        )


class FSDP2Backend(Backend):
    """The switch's FSDP2 backend: nothing to rebuild, mixed-precision dtypes re-initialised.

    Example:
        >>> # backend = FSDP2Backend(model)  # model after fully_shard(...)
    """

    kind = "fsdp2"

    def __init__(self, model: nn.Module) -> None:
        check_fsdp2_supported(model)
        self.wrapper = self.model = model
        self.units = fsdp2_units(model)
        self._moves_residency = False
        # fully_shard([m1, m2]) makes both modules units of ONE state: each group once
        groups = {id(g): g for unit in self.units for g in _param_groups(unit)}
        self.param_groups: list[Any] = list(groups.values())
        self._fsdp_param_of = {id(fp.sharded_param): fp for group in self.param_groups for fp in group.fsdp_params}

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        for group in self.param_groups:
            return group.mesh_info.shard_process_group
        return None

    def bind(self, groups: ParamGroups, residency: Residency) -> None:
        """Check the groups against the units and route residency moves through here."""
        check_groups_fit_units(self.model, groups)
        residency.set_data_placer(self.place_data)
        install_unit_guards(self.model, groups, residency)
        for fp in self._fsdp_param_of.values():  # moved before the attach, around FSDP2's storage
            local, storage = local_tensor(fp.sharded_param), fp._sharded_param_data
            if local.numel() and local.untyped_storage().data_ptr() != storage.untyped_storage().data_ptr():
                self.place_data(fp.sharded_param, fp.sharded_param.data)
        self._moves_residency = residency.offload_device is not None

    def apply(self, ignore: set[str]) -> None:
        if ignore and self._moves_residency:
            from ._units import check_residency_fits_units

            check_residency_fits_units(self.model, ignore)
        for group in self.param_groups:
            reinit = getattr(group, MP_REINIT_METHOD, None)
            if reinit is not None:  # absent only without casting (fenced)
                reinit()

    def restore(self, snapshot: object) -> None:
        self.apply(set())

    def place_data(self, param: torch.Tensor, data: torch.Tensor) -> None:
        """Make ``data`` (a moved copy of ``param.data``) the parameter's data, FSDP2's storage included.

        For a parameter FSDP2 manages, its padded storage (what the all-gather
        reads) becomes ``data``'s shard (padded again where this rank's shard
        is short), the DTensor's local view points into it, and the old
        storage is released. Other tensors go through :func:`set_data`.
        """
        fp = self._fsdp_param_of.get(id(param))
        if fp is None:
            set_data(param, data)
            return
        local = local_tensor(data)
        padded_size = fp.padded_sharded_param_size
        dim = getattr(getattr(fp, "fsdp_placement", None), "dim", 0)
        if local.size() != padded_size:  # this rank's shard is short: pad it, as FSDP2 stores it
            if local.device.type == "cpu" and param.device.type == "cuda":
                torch.cuda.current_stream(param.device).synchronize()  # the copy to host may be in flight
            padded = torch.zeros(
                padded_size,
                dtype=local.dtype,
                device=local.device,
                pin_memory=local.device.type == "cpu" and local.is_pinned(),
            )
            padded.narrow(dim, 0, local.size(dim)).copy_(local)
            local = padded.narrow(dim, 0, local.size(dim))
        else:
            padded = local
        fp._sharded_param_data = padded.view(-1)
        set_data(param, dtensor_with_local(param, local))

    def reduced_bytes_per_step(self) -> int:
        """Bytes of the trainable parameters' (padded) gradients each rank feeds to reduce-scatter."""
        total = 0
        for group in self.param_groups:
            policy = group.mp_policy
            for fp in group.fsdp_params:
                if fp.sharded_param.requires_grad:
                    dtype = (
                        getattr(group, "_reduce_dtype", None)
                        or policy.reduce_dtype
                        or policy.param_dtype
                        or fp.sharded_param.dtype
                    )
                    size = torch.empty((), dtype=dtype).element_size()
                    total += fp.padded_sharded_param_size.numel() * group.mesh_info.shard_mesh_size * size
        return total
