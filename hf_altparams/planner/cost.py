"""The cost model: :func:`plan_cost` walks a schedule's phases and switches under each state policy.

The arithmetic (bytes per parameter as stored, gradients, DDP buckets,
optimizer state per optimizer kind, fp32 masters; where state and masters are
under each :class:`~hf_altparams.engine.optim.StatePolicy`) is the engine's
memory model, :mod:`hf_altparams.engine.memory.model`, which
:func:`~hf_altparams.engine.memory_report` runs on the live model. Here: the
planner's arguments (the optimizer spec, the state policies), the sizes of the
groups of a :class:`~hf_altparams.plan.ParamGroups` (built on ``meta``), the
walk over the schedule's phases, the bytes a switch moves between two layouts,
and the FSDP2 mode.

**Strategies.** ``plan_cost(..., backend=NAME)`` (``--strategy NAME``) prices
the phases under a registered strategy (:mod:`hf_altparams.engine.strategies`)
from its :class:`~hf_altparams.engine.strategies.Pricing`: what one rank holds
per category and what it communicates. A *replicated* category is whole on
every rank; a *sharded* one is split the way ``fully_shard`` and ZeRO split
it: dim 0 over ``world_size`` ranks, padded to a multiple of it, so a rank holds
``ceil(rows / world_size)`` rows of each parameter (:func:`shard_rows`; the
figures are rank 0's, the largest). Where gradients are sharded, what a rank
feeds the collective per step is the trainable gradients padded and unsharded
(the engine's ``SwitchRecord.allreduce_bytes_per_step``); gradient buckets are
counted only for a strategy that holds them (DDP); sent/rank follows the
collective (a ring all-reduce ``2 (N-1)/N``, a reduce-scatter ``(N-1)/N``, none
for one process). A strategy that all-gathers parameters every step
(``Pricing.gathers``: the trainable ones after the step, or every weight for the
forward; DeepSpeed ZeRO) gets those bytes as ``gather_bytes`` and ``(N-1)/N`` of
them in sent/rank; one that keeps fp32 masters of fp32 weights
(``Pricing.fp32_masters``: DeepSpeed's fp32 partitions) gets a 4-byte master per
element for every optimized group from the first step, placed with the
optimizer state's policy unless ``master_policy`` is given. A strategy that
names another in ``compare_with`` (FSDP2, ZeRO: DDP) gets that strategy's
device bytes of the same phases beside its own.

**FSDP2** (``backend="fsdp2"``, ``--strategy fsdp2`` or ``--fsdp2``) shards
parameters, gradients, optimizer state and masters: per phase and rank, the
resident parameters' shards (non-resident groups' on the host), the trainable
parameters' sharded gradients only (FSDP2 reduce-scatters only parameters that
have a gradient), the shards of the state the policy keeps on the device; no
DDP buckets. Not in the device total (transients, like activations): one
unit's unsharded parameters during its forward and backward (with one unit per
group, the largest group: ``CostPlan.unit_bytes``) and its reduce-scatter input.

**bf16 speed.** A plan whose run computes in bf16 (``storage_dtype=torch.bfloat16``,
or a model stored in bf16) carries the verdict of
:func:`~hf_altparams.planner.hardware.bf16_speed` on the device the run computes
on (``bf16_check``): where bf16 arithmetic is slow (most CPUs without AVX-512
bf16 or AMX), its table warns, naming the figures and the way out.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Mapping, Optional, Union

import torch
from torch import nn

from ..engine.memory.model import (
    OPTIMIZER_STATES,
    UNGROUPED,
    Footprint,
    Layout,
    Sizes,
    StatePolicy,
    Storage,
    buffer_owners,
    everything_layout,
    footprint,
    layout,
    run_idle_policies,
    state_bytes_for,
    tensor_sizes,
)
from ..engine.strategies import Placement, Pricing, Strategy, registered, strategy_named
from ..errors import PlanError
from ..plan import ParamGroups, Phase, Schedule
from ..plan.checks import check_int
from .hardware import Bf16Speed, bf16_speed
from .report import CostPlan, PhaseCost, SwitchCost

__all__ = ["DEFAULT_PCIE_GBPS", "OPTIMIZER_STATES", "POLICIES", "OptimizerSpec", "backends", "plan_cost", "shard_rows"]

#: The state policies (``--state-policy``, ``--master-policy``): the values of
#: :class:`~hf_altparams.engine.optim.StatePolicy`.
POLICIES: tuple[str, ...] = tuple(p.value for p in StatePolicy)
#: Host<->device bandwidth assumed for offload time estimates (GB/s; PCIe 4.0 x16, pinned memory).
DEFAULT_PCIE_GBPS = 25.0
_DEFAULT_POSITIONS = 1000  # positions listed for schedules with no repeating pattern
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

#: What ``plan_cost(optimizer=)`` takes: a name from :data:`OPTIMIZER_STATES`, state bytes per
#: parameter, or a callable ``(name, param) -> bytes``.
OptimizerSpec = Union[str, float, Callable[[str, nn.Parameter], int]]
StateBytes = Callable[[str, nn.Parameter], int]
Owners = list[tuple[frozenset[Optional[str]], int]]


def backends() -> tuple[str, ...]:
    """What ``plan_cost(backend=)`` and ``--strategy`` accept: the registered strategies' names.

    Example:
        >>> backends()
        ('fsdp2', 'ddp', 'zero1', 'zero2', 'zero3', 'local')
    """
    return tuple(s.name for s in registered())


def plan_cost(
    model: nn.Module,
    groups: ParamGroups,
    schedule: Schedule,
    *,
    optimizer: OptimizerSpec = "adamw",
    state_policy: Union[StatePolicy, str, None] = None,
    steps: Optional[int] = None,
    world_size: int = 2,
    grad_dtype: Optional[torch.dtype] = None,
    bucket_as_view: bool = False,
    offload_nonresident: bool = True,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    storage_dtype: Optional[torch.dtype] = None,
    master_policy: Union[StatePolicy, str, None] = None,
    allreduce_dtype: Optional[torch.dtype] = None,
    backend: str = "ddp",
    bf16_check: Union[str, torch.device, Bf16Speed, None] = "auto",
) -> CostPlan:
    """Cost every phase of ``schedule`` over the first ``steps`` positions (see :mod:`hf_altparams.planner`).

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
            :class:`~hf_altparams.engine.optim.StatePolicy`, as in ``GroupedOptimizer``);
            ``None`` (default): what the run does by default, the schedule's recipe
            (``"drop"`` for :func:`~hf_altparams.plan.lisa` and :func:`~hf_altparams.plan.badam`),
            else ``"keep"``. The plan's ``state_policy_source`` says which.
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
            ``"drop"``: nowhere; ``None``: the run's default, ``"drop"`` for lisa
            and badam, else ``"offload"``). Gradients at the step: fp32 on the masters (4 B;
            the storage-dtype gradients are freed as they are cast) plus DDP's bucket
            in the storage dtype. The train-everything row keeps masters for all.
        allreduce_dtype: the dtype the gradients are all-reduced in, if not theirs
            (``PrecisionOptimizer(allreduce_dtype=torch.float32)``): the all-reduce
            figures count it; the memory figures do not change.
        backend: the strategy, by its registered name (:func:`backends`) or an
            alias: ``"ddp"`` (replicated parameters, DDP buckets), ``"fsdp2"``:
            every figure per rank for a ``fully_shard`` model over ``world_size``
            ranks (parameters, gradients and optimizer state sharded;
            reduce-scatter bytes per step), next to DDP's device bytes (see the
            module docstring); ``"local"``: one process without DDP (no buckets,
            nothing all-reduced); any other registered strategy by its pricing.
        bf16_check: where the run computes, for a plan that computes in bf16
            (``storage_dtype=torch.bfloat16``, or bf16 parameters): ``"auto"`` (a
            visible GPU, else this CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``, a
            :class:`~hf_altparams.planner.hardware.Bf16Speed` measured on the
            training machine, or ``None`` (no check). The plan's ``bf16_speed`` holds
            the verdict, and its table warns where bf16 arithmetic is slow.

    Raises:
        PlanError: on an invalid argument (the message names it and what it accepts).

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
    _check_args(steps, world_size, pcie_gbps, grad_dtype, storage_dtype, allreduce_dtype)
    strategy = strategy_named(backend, argument="`backend` (--strategy)")
    pricing = strategy.pricing
    run_state, run_master, why = run_idle_policies(schedule.idle_state, schedule.kind)
    policy = run_state if state_policy is None else StatePolicy.parse(state_policy, "`state_policy`")
    masters_given = (
        None if master_policy is None else StatePolicy.parse(master_policy, "`master_policy` (--master-policy)")
    )
    source = why if state_policy is None else "given"
    if steps is None:
        pattern = schedule.pattern_length()
        steps = _DEFAULT_POSITIONS if pattern is None else pattern
    trained = schedule.trained_share(groups, positions=steps)  # validates; warns if `always` groups dominate
    speed = _bf16_verdict(bf16_check, groups, storage_dtype)
    label, state_fn = _state_bytes_fn(optimizer)
    storage = Storage(
        storage_dtype, masters=storage_dtype is not None, grad_dtype=grad_dtype, allreduce_dtype=allreduce_dtype
    )
    params = dict(groups.all_named_params())
    full = _group_sizes(params, groups, state_fn, storage)
    shard_params = _shard_params(params, world_size)
    shards = _shard_sizes(full, shard_params, groups, world_size, state_fn, storage) if _shards_any(strategy) else full

    def masters_of(priced: Strategy) -> StatePolicy:
        """Idle masters' policy: given, else the state's for a strategy whose masters go with it, else the run's."""
        if masters_given is not None:
            return masters_given
        return policy if priced.pricing.fp32_masters else run_master

    def walk_of(priced: Strategy) -> _Walk:
        fp32 = priced.pricing.fp32_masters
        sizes = _priced_sizes(
            _fp32_masters(full, params, groups) if fp32 else full,
            _fp32_masters(shards, shard_params, groups) if fp32 else shards,
            priced.pricing,
        )
        return _Walk(
            groups,
            schedule,
            steps,
            sizes,
            storage,
            pricing=priced.pricing,
            world_size=world_size,
            bucket_as_view=bucket_as_view,
            offload_nonresident=offload_nonresident,
            pcie_gbps=pcie_gbps,
            masters_policy=masters_of(priced),
            gathered={k: v.param for k, v in full.items()},
        )

    walk = walk_of(strategy)
    size = walk.size
    results = {p.value: walk.run(p) for p in StatePolicy}
    rows, switches = results[policy.value]
    everything = walk.cost("train everything", set(size), everything_layout(size))
    everything.trainable_groups = tuple(groups.names)
    ddp_device_bytes: dict[str, int] = {}
    compared = None if pricing.compare_with is None else strategy_named(pricing.compare_with)
    if compared is not None:  # the same phases under the compared strategy (the same policy), side by side
        other = walk_of(compared)
        other_rows = [
            *other.run(policy)[0],
            other.cost("train everything", set(other.size), everything_layout(other.size)),
        ]
        ddp_device_bytes = {row.phase: row.device_bytes for row in other_rows}
    return CostPlan(
        model=type(model).__name__,
        total_params=sum(s.numel for s in size.values()),
        unit=schedule.unit,
        positions=steps,
        optimizer=label,
        state_policy=policy.value,
        state_policy_source=source,
        world_size=world_size,
        grad_dtype=_dtype_text(grad_dtype),
        bucket_as_view=bucket_as_view,
        offload_nonresident=offload_nonresident,
        pcie_gbps=float(pcie_gbps),
        phases=rows,
        everything=everything,
        switches=switches,
        policies={
            p: {
                "peak_device_bytes": max((r.device_bytes for r in res[0]), default=0),
                "moved_bytes": sum((s.bytes_to_host + s.bytes_to_device) * s.count for s in res[1]),
            }
            for p, res in results.items()
        },
        storage_dtype=_dtype_text(storage_dtype),
        master_policy=None if storage_dtype is None and not pricing.fp32_masters else masters_of(strategy).value,
        allreduce_dtype=_dtype_text(allreduce_dtype),
        backend=strategy.name,
        strategy_label=strategy.label,
        collective=pricing.collective.value,
        gathers=pricing.gathers.value,
        fp32_masters=pricing.fp32_masters,
        compared_with=None if compared is None else compared.label,
        ddp_device_bytes=ddp_device_bytes,
        # a transient of FSDP2's forward/backward: the largest group (or the ungrouped) unsharded
        unit_bytes=max((entry.param for entry in full.values()), default=0) if pricing.unit_transient else 0,
        trained=trained,
        bf16_speed=speed,
    )


def shard_rows(shape: Union[torch.Size, tuple[int, ...]], world_size: int) -> tuple[int, ...]:
    """The padded shape of one rank's shard of a parameter of ``shape`` (dim 0 over ``world_size``).

    Example:
        >>> shard_rows((10, 4), 4), shard_rows((3,), 4), shard_rows((), 4)
        ((3, 4), (1,), ())
    """
    if not shape:
        return tuple(shape)
    return (math.ceil(shape[0] / world_size), *shape[1:])


class _Walk:
    """The walk over a schedule's segments under one idle-state policy: a row per phase, a cost per switch."""

    def __init__(
        self,
        groups: ParamGroups,
        schedule: Schedule,
        steps: int,
        size: dict[str, Sizes],
        storage: Storage,
        *,
        pricing: Pricing,
        world_size: int,
        bucket_as_view: bool,
        offload_nonresident: bool,
        pcie_gbps: float,
        masters_policy: StatePolicy,
        gathered: dict[str, int],
    ) -> None:
        self.groups, self.size, self.pricing, self.world_size = groups, size, pricing, world_size
        self.bucket_as_view, self.offload_nonresident, self.pcie_gbps = bucket_as_view, offload_nonresident, pcie_gbps
        self.segments = schedule.segments(steps)
        self.owners: Owners = buffer_owners(groups.module, groups.group_of, storage)
        self.always = {UNGROUPED} if groups.ungrouped == "trainable" and size[UNGROUPED].numel else set()
        self.masters = dict.fromkeys(size, masters_policy)
        self.gathered = gathered  # per group: its parameters' bytes, whole (what an all-gather of them outputs)
        # a strategy that makes fp32 masters when the wrapper is built has them for every optimized group from then
        self.mastered = set(groups.names) | self.always if pricing.fp32_masters else None

    def place(self, phase: Phase, active: set[str], stepped: set[str], idle: StatePolicy) -> Layout:
        """Where everything is in ``phase`` (the groups it keeps resident; state and masters by policy)."""
        off = (
            frozenset(self.groups.names) - phase.resident
            if phase.resident is not None and self.offload_nonresident
            else frozenset()
        )
        where = layout(active, off, stepped, dict.fromkeys(self.size, idle), self.masters)
        if self.mastered is None:
            return where
        return replace(
            where, masters=layout(active, off, self.mastered, dict.fromkeys(self.size, idle), self.masters).masters
        )

    def cost(self, name: str, active: set[str], where: Layout) -> PhaseCost:
        """The row of a phase training ``active`` with everything placed as ``where`` says."""
        used = footprint(self.size, where, self.owners, ddp=self.pricing.buckets, bucket_view=self.bucket_as_view)
        gathered = self.pricing.gathers.gathered_bytes(
            trainable=sum(self.gathered[k] for k in active),
            every=sum(self.gathered[k] for k in set(self.size) - where.off),
        )
        return _phase_cost(name, active, used, self.size, self.world_size, self.pricing, gathered)

    def run(self, idle: StatePolicy) -> tuple[list[PhaseCost], list[SwitchCost]]:
        """Rows (each phase's largest occurrence, with every range it is active in) and switches, under ``idle``."""
        rows: dict[Phase, PhaseCost] = {}
        switches: dict[tuple[str, str, int, int, int], SwitchCost] = {}
        stepped: set[str] = set()
        previous: Optional[tuple[Phase, set[str], Layout]] = None
        for start, end, phase in self.segments:
            active = set(phase.trainable) | self.always
            if previous is not None:  # the switch: from the last layout of `previous` to this one
                out, back = _moves(previous[2], self.place(phase, active, stepped, idle), self.size, self.owners)
                reinit = (
                    sum(self.size[g].state for g in (active - previous[1]) & stepped) if idle is StatePolicy.DROP else 0
                )
                key = (previous[0].name, phase.name, out, back, reinit)
                if key not in switches:
                    switches[key] = SwitchCost(
                        previous[0].name, phase.name, 0, out, back, reinit, (out + back) / (self.pcie_gbps * 1e9)
                    )
                switches[key].count += 1
            stepped |= active
            where = self.place(phase, active, stepped, idle)
            row = self.cost(phase.name, active, where)
            best = rows.setdefault(phase, row)
            if (row.device_bytes, row.host_bytes) > (best.device_bytes, best.host_bytes):
                row.ranges, rows[phase] = best.ranges, row
            rows[phase].ranges.append((start, end))
            previous = (phase, active, where)
        return list(rows.values()), list(switches.values())


def _check_args(
    steps: Optional[int],
    world_size: int,
    pcie_gbps: float,
    grad_dtype: Optional[torch.dtype],
    storage_dtype: Optional[torch.dtype],
    allreduce_dtype: Optional[torch.dtype],
) -> None:
    for value, name in ((steps, "steps"), (world_size, "world_size")):
        if value is not None:
            check_int(value, name, minimum=1)
    if isinstance(pcie_gbps, bool) or not isinstance(pcie_gbps, (int, float)) or not pcie_gbps > 0:
        raise PlanError(f"`pcie_gbps` must be a number > 0 (GB/s), got {pcie_gbps!r}")
    if grad_dtype is not None and not isinstance(grad_dtype, torch.dtype):
        raise PlanError(f"`grad_dtype` must be a torch.dtype or None, got {grad_dtype!r}")
    for dtype, name in (
        (storage_dtype, "`storage_dtype` (--storage-dtype)"),
        (allreduce_dtype, "`allreduce_dtype` (--allreduce-dtype)"),
    ):
        if dtype is not None and dtype not in _FLOAT_DTYPES:
            raise PlanError(f"{name} must be bfloat16, float16, float32 or None, got {dtype!r}")


def _bf16_verdict(
    check: Union[str, torch.device, Bf16Speed, None], groups: ParamGroups, storage_dtype: Optional[torch.dtype]
) -> Optional[Bf16Speed]:
    """The bf16 speed verdict for a run that computes in bf16 (``None`` for one that does not, or no check)."""
    if isinstance(check, Bf16Speed) or check is None:
        return check if _computes_in_bf16(groups, storage_dtype) else None
    if not isinstance(check, (str, torch.device)):
        raise PlanError(
            f"`bf16_check` must be 'auto', a device ('cpu', 'cuda', 'cuda:N'), a Bf16Speed or None, got {check!r}"
        )
    if not _computes_in_bf16(groups, storage_dtype):
        return None
    if check == "auto":
        check = "cuda" if torch.cuda.is_available() else "cpu"
    return bf16_speed(check)


def _computes_in_bf16(groups: ParamGroups, storage_dtype: Optional[torch.dtype]) -> bool:
    if storage_dtype is not None:
        return storage_dtype == torch.bfloat16
    return any(p.dtype == torch.bfloat16 for _, p in groups.all_named_params())


def _state_bytes_fn(optimizer: OptimizerSpec) -> tuple[str, StateBytes]:
    """A label and ``(name, param) -> optimizer state bytes`` for the optimizer spec."""
    if isinstance(optimizer, str):
        states = OPTIMIZER_STATES.get(optimizer.lower())
        if states is None:
            raise PlanError(
                f"`optimizer` must be one of {list(OPTIMIZER_STATES)}, a number of state bytes "
                f"per parameter, or a callable (name, param) -> bytes; got {optimizer!r}"
            )
        return (
            f"{optimizer.lower()} ({states:g} state(s) per parameter, in its dtype)",
            lambda name, p: state_bytes_for(states, p),
        )
    if isinstance(optimizer, (int, float)) and not isinstance(optimizer, bool):
        per_param = float(optimizer)
        if not math.isfinite(per_param) or per_param < 0:
            raise PlanError(f"`optimizer` as bytes per parameter must be a finite number >= 0, got {optimizer!r}")
        return f"{per_param:g} B state per parameter", lambda name, p: math.ceil(per_param * p.numel())
    if callable(optimizer):
        user_fn = optimizer

        def checked(name: str, p: nn.Parameter) -> int:
            value = user_fn(name, p)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlanError(f"`optimizer` callable returned {value!r} for {name!r}; expected an int >= 0")
            return value

        return f"custom ({getattr(optimizer, '__name__', type(optimizer).__name__)})", checked
    raise PlanError(
        f"`optimizer` must be a name from {list(OPTIMIZER_STATES)}, a number or a callable, got {optimizer!r}"
    )


def _group_sizes(
    params: Mapping[str, nn.Parameter], groups: ParamGroups, state_fn: StateBytes, storage: Storage
) -> dict[str, Sizes]:
    """:class:`Sizes` per group (and ``<ungrouped>``) of ``groups``, with ``params`` standing for its parameters."""
    members = {g: groups.param_names(g) for g in groups.names}
    members[UNGROUPED] = groups.ungrouped_names()
    return {
        key: tensor_sizes([(n, params[n]) for n in names], state_fn, storage)  # type: ignore[arg-type]
        for key, names in members.items()
    }


def _shards_any(strategy: Strategy) -> bool:
    """Whether ``strategy`` or the one it is compared with shards anything (the shard sizes are needed)."""
    compared = strategy.pricing.compare_with
    return strategy.pricing.sharded or (compared is not None and strategy_named(compared).pricing.sharded)


def _priced_sizes(full: dict[str, Sizes], shards: dict[str, Sizes], pricing: Pricing) -> dict[str, Sizes]:
    """Per group: what one rank holds under ``pricing``, each category from ``full`` or from ``shards``.

    Where gradients are sharded, ``bucket``, ``bucket_kept`` and ``reduced`` are what a rank feeds to
    the collective (:func:`_shard_sizes`: its padded shard times the world size).
    """
    if not pricing.sharded:
        return full

    def pick(placement: Placement, key: str, kind: str) -> int:
        return int(getattr(shards[key] if placement is Placement.SHARDED else full[key], kind))

    out = {}
    for key in full:
        grads = pricing.gradients
        out[key] = Sizes(
            numel=full[key].numel,
            param=pick(pricing.parameters, key, "param"),
            grad=pick(grads, key, "grad"),
            bucket=pick(grads, key, "bucket"),
            bucket_kept=pick(grads, key, "bucket_kept"),
            reduced=pick(grads, key, "reduced"),
            state=pick(pricing.optimizer_state, key, "state"),
            master=pick(pricing.masters, key, "master"),
        )
    return out


def _shard_params(params: Mapping[str, nn.Parameter], world_size: int) -> dict[str, nn.Parameter]:
    """One rank's shard of each parameter, on ``meta`` (see the module docstring)."""
    return {
        name: nn.Parameter(
            torch.empty(shard_rows(p.shape, world_size), dtype=p.dtype, device="meta"), requires_grad=False
        )
        for name, p in params.items()
    }


def _fp32_masters(size: dict[str, Sizes], params: Mapping[str, nn.Parameter], groups: ParamGroups) -> dict[str, Sizes]:
    """``size`` with an fp32 master (4 bytes per element) for every floating parameter, whatever its dtype.

    For a strategy declaring ``fp32_masters`` (DeepSpeed's fp32 partitions); ``params`` are the tensors ``size``
    was computed from (whole or one rank's shards).
    """

    def floating(key: str) -> int:
        return sum(params[n].numel() for n in _member_names(groups, key) if params[n].is_floating_point())

    return {key: replace(entry, master=4 * floating(key)) for key, entry in size.items()}


def _member_names(groups: ParamGroups, key: str) -> tuple[str, ...]:
    return groups.ungrouped_names() if key == UNGROUPED else groups.param_names(key)


def _shard_sizes(
    full: dict[str, Sizes],
    shards: Mapping[str, nn.Parameter],
    groups: ParamGroups,
    world_size: int,
    state_fn: StateBytes,
    storage: Storage,
) -> dict[str, Sizes]:
    """Per group: the :class:`Sizes` of one rank's shards of its parameters (``shards``, :func:`_shard_params`).

    Element counts stay the full ones (``full``); ``bucket`` and ``reduced`` become
    the bytes a rank feeds to a reduce-scatter (its padded shard times ``world_size``;
    ``reduced`` in the all-reduce dtype if one is set).
    """
    size = _group_sizes(shards, groups, state_fn, storage)
    return {
        key: replace(
            entry,
            numel=full[key].numel,
            bucket=entry.bucket * world_size,
            bucket_kept=entry.bucket_kept * world_size,
            reduced=entry.reduced * world_size,
        )
        for key, entry in size.items()
    }


def _moves(before: Layout, after: Layout, size: dict[str, Sizes], owners: Owners) -> tuple[int, int]:
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


def _phase_cost(
    name: str,
    active: set[str],
    where: Footprint,
    size: dict[str, Sizes],
    world_size: int,
    pricing: Pricing,
    gathered: int,
) -> PhaseCost:
    """A :class:`PhaseCost` row from the model's :class:`Footprint` of the phase and the bytes it all-gathers."""
    reduced = 0 if pricing.collective.value == "none" else where.allreduced
    # an all-gather sends (N-1)/N of its output per rank, as a reduce-scatter of its input does
    sent = pricing.collective.sent_per_rank(reduced, world_size) + (world_size - 1) * gathered // world_size
    return PhaseCost(
        phase=name,
        trainable_groups=tuple(sorted(active - {UNGROUPED})),
        ranges=[],
        trainable_params=sum(size[k].numel for k in active),
        allreduce_bytes=reduced,
        wire_bytes=sent,
        param_bytes=where.params,
        buffer_bytes=where.buffers,
        grad_bytes=where.grads,
        optimizer_bytes=where.optimizer,
        bucket_bytes=where.buckets,
        host_bytes=where.host,
        master_bytes=where.masters,
        gather_bytes=gathered,
    )


def _dtype_text(dtype: Optional[torch.dtype]) -> Optional[str]:
    return None if dtype is None else str(dtype).replace("torch.", "")
