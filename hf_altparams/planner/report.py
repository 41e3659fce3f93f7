"""What the planner reports: :class:`PhaseCost` rows, :class:`SwitchCost` and :class:`CostPlan` with its table.

:func:`~hf_altparams.planner.plan_cost` fills a :class:`CostPlan`; its
:meth:`~CostPlan.table` prints it (one layout for DDP and one process, one for
FSDP2's per-rank shards next to DDP), :meth:`~CostPlan.as_dict` gives it as
JSON-ready data. Both carry the notes that come with a plan: what trains in
every phase (with the warning a run gives when a schedule's ``always`` groups
hold most of the model) and, for a plan that computes in bf16, whether the
device the run computes on does bf16 arithmetic fast
(:func:`~hf_altparams.planner.hardware.bf16_speed`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

from ..errors import PlanError
from ..plan import TrainShare
from ..plan.groups import format_bytes
from .hardware import Bf16Speed

__all__ = ["CostPlan", "PhaseCost", "SwitchCost"]

_SWITCH_LINES = 8  # kinds of switch listed by CostPlan.table()


@dataclass
class PhaseCost:
    """The cost of one phase (bytes per rank; memory at the phase's peak)."""

    phase: str
    trainable_groups: tuple[str, ...]
    ranges: list[tuple[int, int]]  # [start, end) positions where the phase is active
    trainable_params: int
    allreduce_bytes: int  # per optimizer step: what DDP's buckets hold and all-reduce (FSDP2: reduce-scatter input)
    wire_bytes: int  # per optimizer step and rank: ring all-reduce over `world_size` ranks (FSDP2: reduce-scatter),
    # plus (N-1)/N of `gather_bytes`
    param_bytes: int  # parameters on the device (all but non-resident groups')
    buffer_bytes: int  # module buffers on the device
    grad_bytes: int
    optimizer_bytes: int  # optimizer state on the device
    bucket_bytes: int  # DDP bucket memory beyond the gradients
    host_bytes: int  # off the device: non-resident parameters and buffers, offloaded optimizer state and masters
    master_bytes: int = 0  # fp32 master weights on the device (low-precision storage, or a strategy's fp32 copies)
    gather_bytes: int = 0  # per optimizer step: parameters all-gathered, whole tensors (DeepSpeed ZeRO; else 0)

    @property
    def device_bytes(self) -> int:
        """Estimated device memory: parameters, buffers, gradients, optimizer state, masters and DDP buckets."""
        return (
            self.param_bytes
            + self.buffer_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.bucket_bytes
            + self.master_bytes
        )


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
    """The result of :func:`~hf_altparams.planner.plan_cost`: per-phase rows, the train-everything row, the switches.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from hf_altparams.plan import Alternating, ParamGroups
        >>> from hf_altparams.planner import plan_cost
        >>> with torch.device("meta"):
        ...     net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 2))
        >>> plan = plan_cost(net, ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
        >>> plan.row("b").allreduce_bytes, "train everything" in plan.table(), sorted(plan.as_dict())[:3]
        (88, True, ['allreduce_dtype', 'backend', 'bf16_speed'])
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
    allreduce_dtype: Optional[str] = None  # all-reduced in this dtype, if not the gradients'
    backend: str = "ddp"  # the strategy's name ("fsdp2": bytes per rank of fully_shard shards; "local": one process)
    strategy_label: str = "DDP"  # how the table names the strategy
    collective: str = "all-reduce"  # what carries the gradients ("reduce-scatter", "none")
    gathers: str = "none"  # parameters all-gathered per step: "updated" (after the step), "every" (for the forward)
    fp32_masters: bool = False  # the strategy keeps an fp32 master of every optimized parameter, fp32 ones too
    compared_with: Optional[str] = None  # the strategy whose device bytes are shown beside (FSDP2: "DDP")
    ddp_device_bytes: dict[str, int] = field(default_factory=dict)  # each phase's device bytes under `compared_with`
    unit_bytes: int = 0  # fsdp2: the largest group unsharded (a transient of its unit's forward/backward)
    trained: Optional[TrainShare] = None  # the share of the parameters each phase trains (Schedule.trained_share)
    bf16_speed: Optional[Bf16Speed] = None  # a plan that computes in bf16: is bf16 fast where the run computes?
    state_policy_source: str = "given"  # why that policy: "given", "the default", "the <kind> recipe's assumption"

    def share_lines(self) -> list[str]:
        """The table's lines on the share trained: the largest phase, what trains in every phase, the warning."""
        if self.trained is None:
            return []
        lines = [
            f"trains: {self.trained.headline()}"
            + ("" if self.trained.exact else f" (the largest met in {self.unit}s 0-{self.trained.positions - 1})")
        ]
        if self.trained.warning is not None:
            lines.append("WARNING: " + self.trained.warning.removeprefix("hf_altparams: "))
        return lines

    def bf16_lines(self) -> list[str]:
        """The table's line on bf16 speed: the verdict; where bf16 is slow, a warning naming the way out."""
        speed = self.bf16_speed
        if speed is None:
            return []
        warning = speed.warning()
        if warning is None:
            return [f"bf16: {speed.reason}"]
        how = (
            "leave out `--storage-dtype` (plan_cost(storage_dtype=None)) to plan fp32 weights for the same schedule"
            if self.storage_dtype == "bfloat16"
            else "plan the model in fp32 (no `--dtype bf16`)"
        )
        return [f"WARNING: {warning} Here: {how}."]

    def row(self, phase: str) -> PhaseCost:
        """The row of the phase named ``phase``."""
        for row in self.phases:
            if row.phase == phase:
                return row
        raise PlanError(f"no phase named {phase!r} in this plan; phases: {[r.phase for r in self.phases]}")

    def as_dict(self) -> dict[str, Any]:
        """Everything as JSON-ready data (device totals, the share warning and the bf16 verdict included)."""
        out = asdict(self)
        for row, data in zip([*self.phases, self.everything], [*out["phases"], out["everything"]]):
            data["device_bytes"] = row.device_bytes
        if self.trained is not None:
            out["trained"]["warning"] = self.trained.warning
        out["bf16_speed"] = None if self.bf16_speed is None else self.bf16_speed.as_dict()
        return out

    def table(self) -> str:
        """A readable report: one row per phase, the train-everything row, then the switches and the notes."""
        return self._compared_table() if self.compared_with is not None else self._ddp_table()

    def _ddp_table(self) -> str:
        host = any(r.host_bytes for r in self.phases)
        head = [
            "phase",
            f"{self.unit}s",
            "trainable params",
            "all-reduce/step",
            "sent/rank",
            "params",
            "buffers",
            "grads",
            "optimizer" if self.storage_dtype is None else "optim+master",
            "buckets",
            "device",
            "vs all",
        ] + (["host"] if host else [])
        full = self.everything.device_bytes or 1

        def cells(row: PhaseCost, where: str) -> list[str]:
            values = [
                row.phase,
                where,
                self._share_text(row),
                format_bytes(row.allreduce_bytes),
                format_bytes(row.wire_bytes),
            ]
            values += [
                format_bytes(b)
                for b in (
                    row.param_bytes,
                    row.buffer_bytes,
                    row.grad_bytes,
                    row.optimizer_bytes + row.master_bytes,
                    row.bucket_bytes,
                    row.device_bytes,
                )
            ]
            values.append(f"{100.0 * row.device_bytes / full:.0f}%")
            return values + ([format_bytes(row.host_bytes)] if host else [])

        buckets = (
            "none (no DDP)"
            if self.collective == "none"
            else "views of the gradients (gradient_as_bucket_view)"
            if self.bucket_as_view
            else "separate"
        )
        why = "" if self.state_policy_source == "given" else f" ({self.state_policy_source})"
        settings = (
            f"optimizer: {self.optimizer} | state policy: {self.state_policy}{why} | world size: "
            f"{self.world_size} | grads: {self.grad_dtype or 'param dtype'} | DDP buckets: {buckets}"
            + ("" if self.allreduce_dtype is None else f" | all-reduced in {self.allreduce_dtype}")
            + ("" if self.offload_nonresident else " | non-resident groups stay on the device")
            + (
                ""
                if self.storage_dtype is None
                else f" | storage: {self.storage_dtype}, fp32 masters "
                f"(idle: {self.master_policy}) and fp32 optimizer state"
            )
        )
        lines = [self._model_line(), settings, *self._grid(head, cells)]
        moved = sum((s.bytes_to_host + s.bytes_to_device) * s.count for s in self.switches)
        count = sum(s.count for s in self.switches)
        lines.append(
            f"switches ({self.state_policy}): {count}, moving {format_bytes(moved)} host<->device "
            f"in all (~{1e3 * sum(s.seconds * s.count for s in self.switches):.2f} ms at "
            f"{self.pcie_gbps:g} GB/s assumed)"
        )
        costly = [s for s in self.switches if s.bytes_to_host or s.bytes_to_device or s.reinit_bytes]
        for s in costly[:_SWITCH_LINES]:
            lines.append(
                f"  {s.from_phase} -> {s.to_phase} (x{s.count}): to host "
                f"{format_bytes(s.bytes_to_host)}, to device {format_bytes(s.bytes_to_device)}, "
                f"re-initialised {format_bytes(s.reinit_bytes)}, ~{1e3 * s.seconds:.2f} ms each"
            )
        lines.extend(self.share_lines())
        lines.extend(self.bf16_lines())
        lines.append(
            "state policies: "
            + " | ".join(
                f"{p}: peak {format_bytes(v['peak_device_bytes'])}, moved {format_bytes(v['moved_bytes'])}"
                for p, v in self.policies.items()
            )
        )
        lines.append(
            "bytes per rank; sent/rank: ring all-reduce estimate; not counted: activations, "
            "temporaries, Adam step counters, allocator rounding"
        )
        return "\n".join(lines)

    def _compared_table(self) -> str:
        host = any(r.host_bytes for r in self.phases)
        other = self.compared_with
        gathers = self.gathers != "none"
        masters = self.storage_dtype is not None or self.fp32_masters
        head = (
            ["phase", f"{self.unit}s", "trainable params", f"{self.collective}/step"]
            + (["all-gather/step"] if gathers else [])
            + [
                "sent/rank",
                "params",
                "buffers",
                "grads",
                "optim+master" if masters else "optimizer",
                "device",
                f"{other} device",
                f"vs {other}",
            ]
            + (["host"] if host else [])
        )

        def cells(row: PhaseCost, where: str) -> list[str]:
            ddp = self.ddp_device_bytes.get(row.phase, 0)
            values = (
                [row.phase, where, self._share_text(row), format_bytes(row.allreduce_bytes)]
                + ([format_bytes(row.gather_bytes)] if gathers else [])
                + [format_bytes(row.wire_bytes)]
            )
            values += [
                format_bytes(b)
                for b in (
                    row.param_bytes,
                    row.buffer_bytes,
                    row.grad_bytes,
                    row.optimizer_bytes + row.master_bytes,
                    row.device_bytes,
                )
            ]
            values += [format_bytes(ddp), f"{100.0 * row.device_bytes / (ddp or 1):.0f}%"]
            return values + ([format_bytes(row.host_bytes)] if host else [])

        how = "FSDP2 (fully_shard)" if self.backend == "fsdp2" else self.strategy_label
        settings = (
            f"{how} over {self.world_size} ranks | optimizer: {self.optimizer} | state "
            f"policy: {self.state_policy} | grads: {self.grad_dtype or 'param dtype'}"
            + ("" if self.offload_nonresident else " | non-resident groups stay on the device")
            + (
                ""
                if self.storage_dtype is None
                else f" | storage: {self.storage_dtype}, fp32 masters (idle: {self.master_policy})"
            )
            + (
                ""
                if not self.fp32_masters or self.storage_dtype is not None
                else f" | fp32 masters of every optimized parameter (idle: {self.master_policy})"
            )
        )
        gathered = {
            "updated": "all-gather/step: the trainable parameters, gathered after the optimizer step",
            "every": "all-gather/step: every parameter, gathered for the forward (at least once a step)",
        }
        sent = f"{self.collective}" + (" and all-gather" if gathers else " only")
        lines = [
            self._model_line(),
            settings,
            *self._grid(head, cells),
            *self.share_lines(),
            *self.bf16_lines(),
            "state policies: "
            + " | ".join(f"{p}: peak {format_bytes(v['peak_device_bytes'])}" for p, v in self.policies.items()),
            *([gathered[self.gathers]] if gathers else []),
            f"bytes per rank (rank 0's padded shards); sent/rank: {sent}; not in 'device': "
            + (
                f"one unit unsharded in forward/backward (largest: {format_bytes(self.unit_bytes)} with one "
                "unit per group, ungrouped parameters in the root's), "
                if self.unit_bytes
                else ""
            )
            + "activations, temporaries, Adam step counters",
        ]
        return "\n".join(lines)

    def _model_line(self) -> str:
        return f"model: {self.model}, {self.total_params:,} params | {self.unit}s 0-{self.positions - 1} listed"

    def _share_text(self, row: PhaseCost) -> str:
        return f"{row.trainable_params:,} ({100.0 * row.trainable_params / (self.total_params or 1):.1f}%)"

    def _grid(self, head: list[str], cells: Callable[[PhaseCost, str], list[str]]) -> list[str]:
        """The rows under ``head`` (``cells(row, positions) -> texts``), ruled: the phases, then train everything."""
        body = [cells(r, _ranges_text(r.ranges)) for r in self.phases] + [cells(self.everything, "-")]
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

        def fmt(values: list[str]) -> str:  # names left-aligned, figures right-aligned
            return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(values, widths)))

        rule = "-" * len(fmt(head))
        return [rule, fmt(head), rule, *map(fmt, body[:-1]), rule, fmt(body[-1]), rule]


def _ranges_text(ranges: Sequence[tuple[int, int]]) -> str:
    parts = [f"{s}" if e - s == 1 else f"{s}-{e - 1}" for s, e in ranges[:3]]
    if len(ranges) > 3:
        return f"{parts[0]}, {parts[1]}, ... ({len(ranges)}x)"
    return ", ".join(parts)
