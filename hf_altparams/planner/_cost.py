"""The cost model: :func:`plan_cost` walks a schedule's phases and switches under each state policy."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..errors import PlanError
from ..plan import ParamGroups, Phase, Schedule
from ..engine.memory.model import (Footprint, Layout, Sizes, StatePolicy, Storage, buffer_owners,
                                    everything_layout, footprint, layout)
from ._fsdp2 import finish_fsdp2, fsdp2_sizes
from ._results import CostPlan, PhaseCost, SwitchCost
from ._sizes import (_DEFAULT_POSITIONS, _UNGROUPED, DEFAULT_PCIE_GBPS, OptimizerSpec, _check_args, _group_sizes,
                     _moves, _state_bytes_fn)

__all__ = ["plan_cost"]


def plan_cost(
    model: nn.Module,
    groups: ParamGroups,
    schedule: Schedule,
    *,
    optimizer: OptimizerSpec = "adamw",
    state_policy: Union[StatePolicy, str] = "keep",
    steps: Optional[int] = None,
    world_size: int = 2,
    grad_dtype: Optional[torch.dtype] = None,
    bucket_as_view: bool = False,
    offload_nonresident: bool = True,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    storage_dtype: Optional[torch.dtype] = None,
    master_policy: Union[StatePolicy, str] = "offload",
    allreduce_dtype: Optional[torch.dtype] = None,
    backend: str = "ddp",
) -> CostPlan:
    """Cost every phase of ``schedule`` over the first ``steps`` positions (see the module docstring).

    Args:
        model: the model ``groups`` was built on (plain, DDP-wrapped, or on ``meta``).
        groups: its parameter groups. Ungrouped parameters under ``ungrouped="trainable"``
            train in every phase and get optimizer state (as with a plain torch optimizer).
        schedule: the schedule; validated against ``groups`` (which warns, as before a
            run, when its ``always`` groups hold most of the parameters); the plan's
            ``trained`` is its :meth:`~hf_altparams.plan.Schedule.trained_share`.
        optimizer: ``"adam"``/``"adamw"`` (2 states per parameter), ``"sgd"`` (0),
            ``"sgd-momentum"`` (1), states in the parameter's dtype; or a number of
            state bytes per parameter (e.g. ``2`` for 8-bit Adam); or a callable
            ``(name, param) -> bytes``.
        state_policy: ``"keep"``, ``"offload"`` or ``"drop"`` (a
            :class:`~hf_altparams.engine.optim.StatePolicy`, as in ``GroupedOptimizer``).
        steps: positions (steps, or epochs for an epoch schedule) to list; default: one
            period of a cycling schedule, into the final phase of a settling one (as long
            as its shortest phase), or 1000 for a random or user-defined one.
        world_size: ranks, for the ring all-reduce traffic per rank, ``2 (N-1)/N`` x bytes.
        grad_dtype: gradient dtype if not the parameters' dtype.
        bucket_as_view: DDP's ``gradient_as_bucket_view``.
        offload_nonresident: groups a phase does not keep resident (``Phase.resident``,
            e.g. the other tasks of ``PerTaskCycle``) live on the host, parameters,
            buffers and optimizer state, as ``PhaseSwitcher(offload_device="cpu")`` (its
            default) does; ``False`` for ``offload_device=None``.
        pcie_gbps: host<->device bandwidth assumed for offload times, in GB/s.
        storage_dtype: ``torch.bfloat16`` / ``torch.float16``: the model is stored in
            that dtype with a :class:`~hf_altparams.engine.PrecisionOptimizer`:
            parameters and gradients in it, fp32 optimizer state, and an fp32
            master (4 B per parameter) for each group that has trained, placed by
            ``master_policy`` when idle (``"keep"``: device, ``"offload"``: host,
            ``"drop"``: nowhere). Gradients at the step: fp32 on the masters (4 B;
            the storage-dtype gradients are freed as they are cast) plus DDP's bucket
            in the storage dtype. The train-everything row keeps masters for all.
        allreduce_dtype: the dtype the gradients are all-reduced in, if not theirs
            (``PrecisionOptimizer(allreduce_dtype=torch.float32)``): the all-reduce
            figures count it; the memory figures do not change.
        backend: ``"ddp"`` (replicated parameters, DDP buckets) or ``"fsdp2"``: every
            figure per rank for a ``fully_shard`` model over ``world_size`` ranks
            (parameters, gradients and optimizer state sharded; reduce-scatter
            bytes per step), next to DDP's device bytes (:mod:`hf_altparams.planner._fsdp2`);
            or ``"local"``: one process without DDP (no buckets, nothing all-reduced).

    Example:
        >>> from torch import nn
        >>> from hf_altparams.plan import Alternating, ParamGroups
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Linear(1000, 1000), nn.Linear(1000, 10))
        >>> groups = ParamGroups(net, {"body": "0.*", "head": "1.*"})
        >>> plan = plan_cost(net, groups, Alternating({"body": 3, "head": 1}))
        >>> plan.row("head").allreduce_bytes, plan.everything.allreduce_bytes
        (40040, 4044040)
    """
    if groups.module is not (model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model):
        raise PlanError("`groups` was built on another module than `model`; build ParamGroups on `model`")
    _check_args(steps, world_size, pcie_gbps, grad_dtype)
    policy = StatePolicy.parse(state_policy, "`state_policy`")
    masters_policy = StatePolicy.parse(master_policy, "`master_policy` (--master-policy)")
    if storage_dtype is not None and storage_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise PlanError(f"`storage_dtype` (--storage-dtype) must be bfloat16, float16, float32 or None, "
                        f"got {storage_dtype!r}")
    if allreduce_dtype is not None and allreduce_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise PlanError(f"`allreduce_dtype` (--allreduce-dtype) must be bfloat16, float16, float32 or None, "
                        f"got {allreduce_dtype!r}")
    if backend not in ("ddp", "fsdp2", "local"):
        raise PlanError(f"`backend` (--fsdp2) must be 'ddp', 'fsdp2' or 'local', got {backend!r}")
    if steps is None:
        pattern = schedule.pattern_length()
        steps = _DEFAULT_POSITIONS if pattern is None else pattern
    trained = schedule.trained_share(groups, positions=steps)  # validates; warns if `always` groups dominate
    label, state_fn = _state_bytes_fn(optimizer)
    segments = schedule.segments(steps)
    storage = Storage(storage_dtype, masters=storage_dtype is not None, grad_dtype=grad_dtype,
                      allreduce_dtype=allreduce_dtype)
    size = _group_sizes(groups, state_fn, storage)
    full = size
    if backend == "fsdp2":
        size = fsdp2_sizes(size, _group_sizes, groups, world_size, state_fn, storage)
    owners = buffer_owners(groups.module, groups.group_of, storage)
    always = {_UNGROUPED} if groups.ungrouped == "trainable" and size[_UNGROUPED].numel else set()
    masters_by_group = dict.fromkeys(size, masters_policy)

    def place(phase: Phase, active: set[str], stepped: set[str], idle: StatePolicy) -> Layout:
        off = frozenset(groups.names) - phase.resident if phase.resident is not None and offload_nonresident \
            else frozenset()
        return layout(active, off, stepped, dict.fromkeys(size, idle), masters_by_group)

    def cost(name: str, active: set[str], where: Layout) -> PhaseCost:
        return _phase_cost(name, active, footprint(size, where, owners, ddp=backend == "ddp",
                                                   bucket_view=bucket_as_view), size, world_size, backend)

    def walk(idle: StatePolicy) -> tuple[list[PhaseCost], list[SwitchCost]]:
        rows: dict[Phase, PhaseCost] = {}
        switches: dict[tuple[str, str, int, int, int], SwitchCost] = {}
        stepped: set[str] = set()
        previous: Optional[tuple[Phase, set[str], Layout]] = None
        for start, end, phase in segments:
            active = set(phase.trainable) | always
            if previous is not None:  # the switch: from the last layout of `previous` to this one
                out, back = _moves(previous[2], place(phase, active, stepped, idle), size, owners)
                reinit = sum(size[g].state for g in (active - previous[1]) & stepped) \
                    if idle is StatePolicy.DROP else 0
                key = (previous[0].name, phase.name, out, back, reinit)
                if key not in switches:
                    switches[key] = SwitchCost(previous[0].name, phase.name, 0, out, back, reinit,
                                               (out + back) / (pcie_gbps * 1e9))
                switches[key].count += 1
            stepped |= active
            where = place(phase, active, stepped, idle)
            row = cost(phase.name, active, where)
            best = rows.setdefault(phase, row)
            if (row.device_bytes, row.host_bytes) > (best.device_bytes, best.host_bytes):
                row.ranges, rows[phase] = best.ranges, row
            rows[phase].ranges.append((start, end))
            previous = (phase, active, where)
        return list(rows.values()), list(switches.values())

    results = {p.value: walk(p) for p in StatePolicy}
    rows, switches = results[policy.value]
    everything = cost("train everything", set(size), everything_layout(size))
    everything.trainable_groups = tuple(groups.names)
    plan = CostPlan(
        model=type(model).__name__, total_params=sum(s.numel for s in size.values()), unit=schedule.unit,
        positions=steps, optimizer=label, state_policy=policy.value, world_size=world_size,
        grad_dtype=None if grad_dtype is None else str(grad_dtype).replace("torch.", ""),
        bucket_as_view=bucket_as_view, offload_nonresident=offload_nonresident, pcie_gbps=float(pcie_gbps),
        phases=rows, everything=everything, switches=switches,
        policies={p: {"peak_device_bytes": max((r.device_bytes for r in res[0]), default=0),
                      "moved_bytes": sum((s.bytes_to_host + s.bytes_to_device) * s.count for s in res[1])}
                  for p, res in results.items()},
        storage_dtype=None if storage_dtype is None else str(storage_dtype).replace("torch.", ""),
        master_policy=None if storage_dtype is None else masters_policy.value,
        allreduce_dtype=None if allreduce_dtype is None else str(allreduce_dtype).replace("torch.", ""),
        trained=trained, backend=backend,
    )
    if backend == "fsdp2":
        ddp = plan_cost(model, groups, schedule, optimizer=optimizer, state_policy=policy, steps=steps,
                        world_size=world_size, grad_dtype=grad_dtype, bucket_as_view=bucket_as_view,
                        offload_nonresident=offload_nonresident, pcie_gbps=pcie_gbps,
                        storage_dtype=storage_dtype, master_policy=masters_policy,
                        allreduce_dtype=allreduce_dtype)
        finish_fsdp2(plan, ddp, full, world_size)
    return plan


def _phase_cost(name: str, active: set[str], where: Footprint, size: dict[str, Sizes], world_size: int,
                backend: str) -> PhaseCost:
    """A :class:`PhaseCost` row from the model's :class:`Footprint` of the phase."""
    reduced = 0 if backend == "local" else where.allreduced
    return PhaseCost(
        phase=name, trainable_groups=tuple(sorted(active - {_UNGROUPED})), ranges=[],
        trainable_params=sum(size[k].numel for k in active), allreduce_bytes=reduced,
        wire_bytes=(2 * (world_size - 1) * reduced) // world_size,
        param_bytes=where.params, buffer_bytes=where.buffers, grad_bytes=where.grads,
        optimizer_bytes=where.optimizer, bucket_bytes=where.buckets, host_bytes=where.host,
        master_bytes=where.masters)
