"""What a schedule will cost, before spending GPU hours on it.

:func:`plan_cost` needs only the shapes and dtypes of the parameters, so it
works on a model built on the ``meta`` device (no memory at all). Per phase it
reports the trainable parameters, the bytes DDP all-reduces per optimizer step
(exactly the trainable gradients' bytes, what the reducer's buckets hold) and
an estimate of device memory per rank, at the phase's peak (just after an
optimizer step, gradients still set), next to training everything:

* parameters and buffers: all of them, except those of groups the phase does
  not keep resident (``Phase.resident``, e.g. the other tasks of
  ``PerTaskCycle``), which the engine moves to the host with their optimizer
  state (a module's buffers go with its own parameters);
* gradients: the trainable parameters', in the gradient dtype;
* optimizer state on the device, by state policy: ``keep``: every resident group
  that has trained so far (torch creates state at a group's first step);
  ``offload`` / ``drop``: the trainable groups only (the others' is on the host / gone);
* DDP buckets: the trainable gradients' bytes once more, or nothing extra with
  ``gradient_as_bucket_view=True`` (gradients are then views into the buckets).

A switch moves host<->device the state of groups going idle or coming back
(``offload``) and the parameters, buffers and state of groups leaving or
regaining residency; its time is estimated at a stated bandwidth.

Not counted: activations, temporaries of the forward, backward and optimizer
step, Adam's 0-d ``step`` counters (4 B per tensor, on the host unless the
optimizer is fused or capturable), and allocator rounding.

``python -m hf_altparams plan`` (:func:`main`, in :mod:`hf_altparams._planner_cli`)
builds the model on ``meta`` from a transformers config JSON, a checkpoint folder,
or ``pkg.module:factory``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence, Union

import torch
from torch import nn

from .errors import PlanError
from .plan import ParamGroups, Phase, Schedule
from .plan.groups import _format_bytes

if TYPE_CHECKING:
    from ._planner_cli import SCHEDULES, build_from_argv, build_parser, main, plan_from_argv  # noqa: F401

__all__ = ["CostPlan", "PhaseCost", "SwitchCost", "build_from_argv", "build_model", "main", "plan_cost",
           "plan_from_argv"]

#: Optimizer name -> number of state tensors it keeps per parameter (each of the parameter's shape and dtype).
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1}
POLICIES: tuple[str, ...] = ("keep", "offload", "drop")
#: Host<->device bandwidth assumed for offload time estimates (GB/s; PCIe 4.0 x16, pinned memory).
DEFAULT_PCIE_GBPS = 25.0
_DEFAULT_POSITIONS = 1000  # positions listed for schedules with no repeating pattern
_UNGROUPED = "<ungrouped>"
_SWITCH_LINES = 8  # kinds of switch listed by CostPlan.table()
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

OptimizerSpec = Union[str, float, Callable[[str, nn.Parameter], int]]


@dataclass
class PhaseCost:
    """The cost of one phase (bytes per rank; memory at the phase's peak)."""

    phase: str
    trainable_groups: tuple[str, ...]
    ranges: list[tuple[int, int]]  # [start, end) positions where the phase is active
    trainable_params: int
    allreduce_bytes: int  # per optimizer step: what DDP's buckets hold and all-reduce
    wire_bytes: int  # per optimizer step and rank, for a ring all-reduce over `world_size` ranks
    param_bytes: int  # parameters on the device (all but non-resident groups')
    buffer_bytes: int  # module buffers on the device
    grad_bytes: int
    optimizer_bytes: int  # optimizer state on the device
    bucket_bytes: int  # DDP bucket memory beyond the gradients
    host_bytes: int  # off the device: non-resident parameters and buffers, offloaded optimizer state and masters
    master_bytes: int = 0  # fp32 master weights on the device (low-precision storage only)

    @property
    def device_bytes(self) -> int:
        """Estimated device memory: parameters, buffers, gradients, optimizer state, masters and DDP buckets."""
        return (self.param_bytes + self.buffer_bytes + self.grad_bytes + self.optimizer_bytes + self.bucket_bytes
                + self.master_bytes)


@dataclass
class SwitchCost:
    """One kind of switch (``from -> to``, same bytes), how often it happens and what it moves."""

    from_phase: str
    to_phase: str
    count: int
    bytes_to_host: int
    bytes_to_device: int
    reinit_bytes: int  # dropped state that restarts from zero when its group trains again
    seconds: float  # per switch, at the stated bandwidth


@dataclass
class CostPlan:
    """The result of :func:`plan_cost`: per-phase rows, the train-everything row and the switches.

    Example:
        >>> # plan = plan_cost(model, groups, Alternating(["a", "b"]), optimizer="adamw")
        >>> # print(plan.table()); plan.row("a").allreduce_bytes; plan.as_dict()
    """

    model: str
    total_params: int
    unit: str
    positions: int
    optimizer: str
    state_policy: str
    world_size: int
    grad_dtype: Optional[str]
    bucket_as_view: bool
    offload_nonresident: bool
    pcie_gbps: float
    phases: list[PhaseCost]
    everything: PhaseCost
    switches: list[SwitchCost]
    policies: dict[str, dict[str, int]] = field(default_factory=dict)  # policy -> peak / moved bytes
    storage_dtype: Optional[str] = None  # low-precision storage (PrecisionOptimizer), else None
    master_policy: Optional[str] = None
    backend: str = "ddp"  # "fsdp2": bytes per rank of fully_shard shards (_planner_fsdp2)
    ddp_device_bytes: dict[str, int] = field(default_factory=dict)  # fsdp2: each phase's device bytes under DDP
    unit_bytes: int = 0  # fsdp2: the largest group unsharded (a transient of its unit's forward/backward)

    def row(self, phase: str) -> PhaseCost:
        """The row of the phase named ``phase``."""
        for row in self.phases:
            if row.phase == phase:
                return row
        raise PlanError(f"no phase named {phase!r} in this plan; phases: {[r.phase for r in self.phases]}")

    def as_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready data (device totals included)."""
        out = asdict(self)
        for row, data in zip([*self.phases, self.everything], [*out["phases"], out["everything"]]):
            data["device_bytes"] = row.device_bytes
        return out

    def table(self) -> str:
        """A readable report: one row per phase, the train-everything row, then the switch cost."""
        if self.backend == "fsdp2":
            from ._planner_fsdp2 import fsdp2_table

            return fsdp2_table(self)
        host = any(r.host_bytes for r in self.phases)
        head = ["phase", f"{self.unit}s", "trainable params", "all-reduce/step", "sent/rank", "params", "buffers",
                "grads", "optimizer" if self.storage_dtype is None else "optim+master", "buckets", "device", "vs all"] + (["host"] if host else [])
        full = self.everything.device_bytes or 1

        def cells(row: PhaseCost, where: str) -> list[str]:
            share = 100.0 * row.trainable_params / (self.total_params or 1)
            values = [row.phase, where, f"{row.trainable_params:,} ({share:.1f}%)",
                      _format_bytes(row.allreduce_bytes), _format_bytes(row.wire_bytes)]
            values += [_format_bytes(b) for b in (row.param_bytes, row.buffer_bytes, row.grad_bytes,
                                                  row.optimizer_bytes + row.master_bytes, row.bucket_bytes,
                                                  row.device_bytes)]
            values.append(f"{100.0 * row.device_bytes / full:.0f}%")
            return values + ([_format_bytes(row.host_bytes)] if host else [])

        body = [cells(r, _ranges_text(r.ranges)) for r in self.phases]
        body.append(cells(self.everything, "-"))
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

        def fmt(cells: list[str]) -> str:  # names left-aligned, figures right-aligned
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

        rule = "-" * len(fmt(head))
        buckets = "views of the gradients (gradient_as_bucket_view)" if self.bucket_as_view else "separate"
        lines = [
            f"model: {self.model}, {self.total_params:,} params | {self.unit}s 0-{self.positions - 1} listed",
            f"optimizer: {self.optimizer} | state policy: {self.state_policy} | world size: "
            f"{self.world_size} | grads: {self.grad_dtype or 'param dtype'} | DDP buckets: {buckets}"
            + ("" if self.offload_nonresident else " | non-resident groups stay on the device")
            + ("" if self.storage_dtype is None else f" | storage: {self.storage_dtype}, fp32 masters "
               f"(idle: {self.master_policy}) and fp32 optimizer state"),
            rule, fmt(head), rule, *map(fmt, body[:-1]), rule, fmt(body[-1]), rule,
        ]
        moved = sum((s.bytes_to_host + s.bytes_to_device) * s.count for s in self.switches)
        count = sum(s.count for s in self.switches)
        lines.append(f"switches ({self.state_policy}): {count}, moving {_format_bytes(moved)} host<->device "
                     f"in all (~{1e3 * sum(s.seconds * s.count for s in self.switches):.2f} ms at "
                     f"{self.pcie_gbps:g} GB/s assumed)")
        costly = [s for s in self.switches if s.bytes_to_host or s.bytes_to_device or s.reinit_bytes]
        for s in costly[:_SWITCH_LINES]:
            lines.append(f"  {s.from_phase} -> {s.to_phase} (x{s.count}): to host "
                             f"{_format_bytes(s.bytes_to_host)}, to device {_format_bytes(s.bytes_to_device)}, "
                             f"re-initialised {_format_bytes(s.reinit_bytes)}, ~{1e3 * s.seconds:.2f} ms each")
        lines.append("state policies: " + " | ".join(
            f"{p}: peak {_format_bytes(v['peak_device_bytes'])}, moved {_format_bytes(v['moved_bytes'])}"
            for p, v in self.policies.items()))
        lines.append("bytes per rank; sent/rank: ring all-reduce estimate; not counted: activations, "
                     "temporaries, Adam step counters, allocator rounding")
        return "\n".join(lines)


def _ranges_text(ranges: Sequence[tuple[int, int]]) -> str:
    parts = [f"{s}" if e - s == 1 else f"{s}-{e - 1}" for s, e in ranges[:3]]
    if len(ranges) > 3:
        return f"{parts[0]}, {parts[1]}, ... ({len(ranges)}x)"
    return ", ".join(parts)


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


def plan_cost(
    model: nn.Module,
    groups: ParamGroups,
    schedule: Schedule,
    *,
    optimizer: OptimizerSpec = "adamw",
    state_policy: str = "keep",
    steps: Optional[int] = None,
    world_size: int = 2,
    grad_dtype: Optional[torch.dtype] = None,
    bucket_as_view: bool = False,
    offload_nonresident: bool = True,
    pcie_gbps: float = DEFAULT_PCIE_GBPS,
    storage_dtype: Optional[torch.dtype] = None,
    master_policy: str = "offload",
    backend: str = "ddp",
) -> CostPlan:
    """Cost every phase of ``schedule`` over the first ``steps`` positions (see the module docstring).

    Args:
        model: the model ``groups`` was built on (plain, DDP-wrapped, or on ``meta``).
        groups: its parameter groups. Ungrouped parameters under ``ungrouped="trainable"``
            train in every phase and get optimizer state (as with a plain torch optimizer).
        schedule: the schedule; validated against ``groups``.
        optimizer: ``"adam"``/``"adamw"`` (2 states per parameter), ``"sgd"`` (0),
            ``"sgd-momentum"`` (1), states in the parameter's dtype; or a number of
            state bytes per parameter (e.g. ``2`` for 8-bit Adam); or a callable
            ``(name, param) -> bytes``.
        state_policy: ``"keep"``, ``"offload"`` or ``"drop"`` (as in ``GroupedOptimizer``).
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
        backend: ``"ddp"`` (replicated parameters, DDP buckets) or ``"fsdp2"``: every
            figure per rank for a ``fully_shard`` model over ``world_size`` ranks
            (parameters, gradients and optimizer state sharded; reduce-scatter
            bytes per step), next to DDP's device bytes (:mod:`hf_altparams._planner_fsdp2`).

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
    _check_args(state_policy, steps, world_size, pcie_gbps, grad_dtype)
    if storage_dtype is not None and storage_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise PlanError(f"`storage_dtype` (--storage-dtype) must be bfloat16, float16, float32 or None, "
                        f"got {storage_dtype!r}")
    if backend not in ("ddp", "fsdp2"):
        raise PlanError(f"`backend` (--fsdp2) must be 'ddp' or 'fsdp2', got {backend!r}")
    if master_policy not in POLICIES:
        raise PlanError(f"`master_policy` (--master-policy) must be one of {list(POLICIES)}, got {master_policy!r}")
    schedule.validate(groups)
    label, state_fn = _state_bytes_fn(optimizer)
    if steps is None:
        pattern = schedule.pattern_length()
        steps = _DEFAULT_POSITIONS if pattern is None else pattern
    segments = schedule.segments(steps)
    size = _group_sizes(groups, state_fn, grad_dtype, storage_dtype)
    if backend == "fsdp2":
        from ._planner_fsdp2 import fsdp2_sizes

        full, size = size, fsdp2_sizes(size, _group_sizes, groups, world_size, state_fn, grad_dtype, storage_dtype)
    owners = _buffer_owners(groups)
    always = {_UNGROUPED} if groups.ungrouped == "trainable" and size[_UNGROUPED]["numel"] else set()

    def total(keys: Iterable[str], what: str) -> int:
        return sum(size[k][what] for k in keys)

    def layout(phase: Phase, active: set[str], stepped: set[str], policy: str) -> _Layout:
        off = frozenset(groups.names) - phase.resident if phase.resident is not None and offload_nonresident \
            else frozenset()
        state = {}
        for g in stepped:  # torch creates a group's state at its first step
            if g in active or (policy == "keep" and g not in off):
                state[g] = "device"
            elif policy != "drop":
                state[g] = "host"
        buffers_off = sum(n for owned, n in owners if None not in owned and owned <= off)
        masters = {}
        for g in stepped:  # masters: created when a group first trains, then placed by master_policy
            if g in active or master_policy == "keep":
                masters[g] = "device"
            elif master_policy == "offload":
                masters[g] = "host"
        return _Layout(off, state, buffers_off, masters)

    def cost(name: str, active: set[str], where: _Layout) -> PhaseCost:
        grads, reduced = total(active, "grad"), total(active, "bucket")
        return PhaseCost(
            phase=name, trainable_groups=tuple(sorted(active - {_UNGROUPED})), ranges=[],
            trainable_params=total(active, "numel"), allreduce_bytes=reduced,
            wire_bytes=(2 * (world_size - 1) * reduced) // world_size,
            param_bytes=total(set(size) - where.off, "param"),
            buffer_bytes=sum(n for _, n in owners) - where.buffers_off, grad_bytes=grads,
            optimizer_bytes=total([g for g, at in where.state.items() if at == "device"], "state"),
            # with storage_dtype the bucket outlives the cast gradients even as their view
            bucket_bytes=reduced if backend == "ddp" and (storage_dtype is not None or not bucket_as_view) else 0,
            host_bytes=total(where.off, "param") + where.buffers_off
            + total([g for g, at in where.state.items() if at == "host"], "state")
            + total([g for g, at in where.masters.items() if at == "host"], "master"),
            master_bytes=total([g for g, at in where.masters.items() if at == "device"], "master"))

    def walk(policy: str) -> tuple[list[PhaseCost], list[SwitchCost]]:
        rows: dict[Phase, PhaseCost] = {}
        switches: dict[tuple[str, str, int, int, int], SwitchCost] = {}
        stepped: set[str] = set()
        previous: Optional[tuple[Phase, set[str], _Layout]] = None
        for start, end, phase in segments:
            active = set(phase.trainable) | always
            if previous is not None:  # the switch: from the last layout of `previous` to this one
                out, back = _moves(previous[2], layout(phase, active, stepped, policy), size, owners)
                reinit = total((active - previous[1]) & stepped, "state") if policy == "drop" else 0
                key = (previous[0].name, phase.name, out, back, reinit)
                if key not in switches:
                    switches[key] = SwitchCost(previous[0].name, phase.name, 0, out, back, reinit,
                                               (out + back) / (pcie_gbps * 1e9))
                switches[key].count += 1
            stepped |= active
            where = layout(phase, active, stepped, policy)
            row = cost(phase.name, active, where)
            best = rows.setdefault(phase, row)
            if (row.device_bytes, row.host_bytes) > (best.device_bytes, best.host_bytes):
                row.ranges, rows[phase] = best.ranges, row
            rows[phase].ranges.append((start, end))
            previous = (phase, active, where)
        return list(rows.values()), list(switches.values())

    results = {p: walk(p) for p in POLICIES}
    rows, switches = results[state_policy]
    everything = cost("train everything", set(size),
                      _Layout(frozenset(), dict.fromkeys(size, "device"), 0, dict.fromkeys(size, "device")))
    everything.trainable_groups = tuple(groups.names)
    plan = CostPlan(
        model=type(model).__name__, total_params=total(size, "numel"), unit=schedule.unit, positions=steps,
        optimizer=label, state_policy=state_policy, world_size=world_size,
        grad_dtype=None if grad_dtype is None else str(grad_dtype).replace("torch.", ""),
        bucket_as_view=bucket_as_view, offload_nonresident=offload_nonresident, pcie_gbps=float(pcie_gbps),
        phases=rows, everything=everything, switches=switches,
        policies={p: {"peak_device_bytes": max((r.device_bytes for r in res[0]), default=0),
                      "moved_bytes": sum((s.bytes_to_host + s.bytes_to_device) * s.count for s in res[1])}
                  for p, res in results.items()},
        storage_dtype=None if storage_dtype is None else str(storage_dtype).replace("torch.", ""),
        master_policy=None if storage_dtype is None else master_policy,
    )
    if backend == "fsdp2":
        from ._planner_fsdp2 import finish_fsdp2

        ddp = plan_cost(model, groups, schedule, optimizer=optimizer, state_policy=state_policy, steps=steps,
                        world_size=world_size, grad_dtype=grad_dtype, bucket_as_view=bucket_as_view,
                        offload_nonresident=offload_nonresident, pcie_gbps=pcie_gbps,
                        storage_dtype=storage_dtype, master_policy=master_policy)
        finish_fsdp2(plan, ddp, full, world_size)
    return plan


@dataclass(frozen=True)
class _Layout:
    """Where things are in a phase: non-resident groups, each group's optimizer state, offloaded buffers."""

    off: frozenset[str]
    state: dict[str, str]  # group -> "device" | "host" (absent: no state)
    buffers_off: int
    masters: dict[str, str] = field(default_factory=dict)  # group -> "device" | "host" (absent: none)


def _group_sizes(groups: ParamGroups, state_fn: Callable[[str, nn.Parameter], int],
                 grad_dtype: Optional[torch.dtype],
                 storage_dtype: Optional[torch.dtype] = None) -> dict[str, dict[str, int]]:
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


# -- building a model on meta -------------------------------------------------------------------


def build_model(model: str, *, model_class: str = "AutoModel", dtype: Optional[str] = None,
                device: str = "meta") -> nn.Module:
    """Build a model on ``device`` (``meta``: no memory) from a config, checkpoint folder or factory.

    Args:
        model: a transformers config JSON file, a checkpoint folder holding
            ``config.json`` (read locally, never from a hub; weights are not
            loaded), or an import path ``"pkg.module:factory"`` whose factory
            takes no arguments and returns an ``nn.Module``.
        model_class: the transformers class for a config, e.g. ``"AutoModel"``
            or ``"AutoModelForSequenceClassification"``.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` to cast to; ``None`` keeps it.
        device: where to build (``"meta"``; ``"cpu"`` for a real model).

    Example:
        >>> net = build_model("torch.nn:Identity")
        >>> type(net).__name__
        'Identity'
    """
    if dtype is not None and dtype not in _DTYPES:
        raise PlanError(f"`dtype` (--dtype) must be one of {list(_DTYPES)}, got {dtype!r}")
    path = Path(model)
    if path.exists():
        built = _from_config(path, model_class, device)
    elif ":" in model:
        built = _from_factory(model, device)
    else:
        raise PlanError(f"`model` (--model) {model!r} is neither an existing config JSON or checkpoint "
                        "folder nor an import path 'pkg.module:factory' (hub names are not fetched: "
                        "save the config locally first)")
    return built.to(_DTYPES[dtype]) if dtype else built


def _from_config(path: Path, model_class: str, device: str) -> nn.Module:
    import transformers

    if path.is_dir() and not (path / "config.json").is_file():
        raise PlanError(f"`model` (--model) folder {str(path)!r} holds no config.json")
    cls = getattr(transformers, model_class, None)
    if not hasattr(cls, "from_config"):
        raise PlanError(f"`model_class` (--model-class) {model_class!r} is not a transformers class with "
                        "`from_config`; use e.g. AutoModel, AutoModelForSequenceClassification, AutoModelForCausalLM")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise PlanError(f"cannot read a transformers config from `model` (--model) {str(path)!r}: {err}") from err
    with torch.device(device):
        return cls.from_config(config)


def _from_factory(spec: str, device: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise PlanError(f"`model` (--model) import path {spec!r} cannot be resolved: {err}") from err
    if not callable(target):
        raise PlanError(f"`model` (--model) {spec!r} is a {type(target).__name__}, not a callable factory")
    with torch.device(device):
        built = target()
    if not isinstance(built, nn.Module):
        raise PlanError(f"`model` (--model) factory {spec!r} returned {type(built).__name__}, not an nn.Module")
    return built


# -- the command line: hf_altparams._planner_cli, loaded on first use ----------------------------

_CLI_NAMES = ("SCHEDULES", "build_from_argv", "build_parser", "main", "plan_from_argv")


def __getattr__(name: str) -> Any:
    # Lazy, because _planner_cli imports this module: an eager import at either end
    # would fail when the other module is the one imported first.
    if name in _CLI_NAMES:
        from . import _planner_cli

        return getattr(_planner_cli, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
