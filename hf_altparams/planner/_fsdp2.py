"""The planner's FSDP2 mode: bytes per rank when the model is sharded with ``fully_shard``.

``plan_cost(..., backend="fsdp2")`` (``--fsdp2`` on the command line) costs the
same phases with every parameter sharded the way FSDP2 shards it: dim 0 split
over ``world_size`` ranks and padded to a multiple of it, so a rank holds
``ceil(rows / world_size)`` rows of each parameter (the figures are those of
rank 0, the largest). Per phase and rank:

* parameters: the resident parameters' shards (non-resident groups' shards on
  the host, as the engine moves them);
* gradients: the trainable parameters' sharded gradients only (FSDP2
  reduce-scatters only parameters that have a gradient);
* optimizer state: the shards of the state the policy keeps on the device;
* no DDP buckets; the "reduce-scatter/step" column is what each rank feeds to
  reduce-scatter per step (the trainable gradients, padded, unsharded), which is
  the engine's ``SwitchRecord.allreduce_bytes_per_step`` for FSDP2; sent/rank is
  ``(N-1)/N`` of it (all-gathers not counted);
* next to it, the device bytes of the same phase under DDP.

Not in the device total (transients, like activations): one unit's unsharded
parameters during its forward and backward (with one unit per group, the
largest group; printed under the table) and its reduce-scatter input.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..engine.memory.model import Sizes
from ..plan import ParamGroups
from ..plan.groups import format_bytes

__all__ = ["fsdp2_sizes", "fsdp2_table", "finish_fsdp2", "shard_rows"]


def shard_rows(shape: torch.Size | tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """The padded shape of one rank's shard of a parameter of ``shape`` (dim 0 over ``world_size``).

    Example:
        >>> shard_rows((10, 4), 4), shard_rows((3,), 4), shard_rows((), 4)
        ((3, 4), (1,), ())
    """
    if not shape:
        return tuple(shape)
    return (math.ceil(shape[0] / world_size), *shape[1:])


class _ShardView:
    """What the planner's size function reads from ParamGroups, with shard-shaped parameters (on meta)."""

    def __init__(self, groups: ParamGroups, world_size: int) -> None:
        self._groups = groups
        self.names = groups.names
        self._shards = [(n, nn.Parameter(torch.empty(shard_rows(p.shape, world_size), dtype=p.dtype,
                                                     device="meta"), requires_grad=False))
                        for n, p in groups.all_named_params()]

    def all_named_params(self) -> list[tuple[str, nn.Parameter]]:
        return list(self._shards)

    def param_names(self, group: str) -> tuple[str, ...]:
        return self._groups.param_names(group)

    def ungrouped_names(self) -> tuple[str, ...]:
        return self._groups.ungrouped_names()


def fsdp2_sizes(full: dict[str, Sizes], group_sizes: Callable[..., dict[str, Sizes]],
                groups: ParamGroups, world_size: int, *args: Any) -> dict[str, Sizes]:
    """Per group: the :class:`Sizes` ``group_sizes(groups, *args)`` gives, for one rank's shards.

    Element counts stay the full ones (``full``); ``bucket`` and ``reduced`` become
    the bytes a rank feeds to reduce-scatter (its padded shard times ``world_size``;
    ``reduced`` in the all-reduce dtype if one is set).
    """
    size = group_sizes(_ShardView(groups, world_size), *args)
    return {key: replace(entry, numel=full[key].numel, bucket=entry.bucket * world_size,
                         bucket_kept=entry.bucket_kept * world_size, reduced=entry.reduced * world_size)
            for key, entry in size.items()}


def finish_fsdp2(plan: Any, ddp: Any, full: dict[str, Sizes], world_size: int) -> Any:
    """Fill the FSDP2-only fields of ``plan``: reduce-scatter traffic, DDP's device bytes, the unit transient."""
    for row in [*plan.phases, plan.everything]:
        row.wire_bytes = (world_size - 1) * row.allreduce_bytes // world_size
    plan.backend = "fsdp2"
    plan.ddp_device_bytes = {row.phase: row.device_bytes for row in [*ddp.phases, ddp.everything]}
    plan.unit_bytes = max((entry.param for entry in full.values()), default=0)  # groups and <ungrouped>
    return plan


def fsdp2_table(plan: Any) -> str:
    """The readable report of an FSDP2 plan (``CostPlan.table`` calls it)."""
    host = any(r.host_bytes for r in plan.phases)
    head = ["phase", f"{plan.unit}s", "trainable params", "reduce-scatter/step", "sent/rank", "params",
            "buffers", "grads", "optimizer" if plan.storage_dtype is None else "optim+master", "device",
            "DDP device", "vs DDP"] + (["host"] if host else [])

    def cells(row: Any, where: str) -> list[str]:
        share = 100.0 * row.trainable_params / (plan.total_params or 1)
        ddp: Optional[int] = plan.ddp_device_bytes.get(row.phase)
        values = [row.phase, where, f"{row.trainable_params:,} ({share:.1f}%)",
                  format_bytes(row.allreduce_bytes), format_bytes(row.wire_bytes)]
        values += [format_bytes(b) for b in (row.param_bytes, row.buffer_bytes, row.grad_bytes,
                                              row.optimizer_bytes + row.master_bytes, row.device_bytes)]
        values += [format_bytes(ddp or 0), f"{100.0 * row.device_bytes / (ddp or 1):.0f}%"]
        return values + ([format_bytes(row.host_bytes)] if host else [])

    ranges = [", ".join(f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in r.ranges[:3])
              + (", ..." if len(r.ranges) > 3 else "") for r in plan.phases]
    body = [cells(r, where) for r, where in zip(plan.phases, ranges)] + [cells(plan.everything, "-")]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def fmt(values: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(values, widths)))

    rule = "-" * len(fmt(head))
    lines = [
        f"model: {plan.model}, {plan.total_params:,} params | {plan.unit}s 0-{plan.positions - 1} listed",
        f"FSDP2 (fully_shard) over {plan.world_size} ranks | optimizer: {plan.optimizer} | state policy: "
        f"{plan.state_policy} | grads: {plan.grad_dtype or 'param dtype'}"
        + ("" if plan.offload_nonresident else " | non-resident groups stay on the device")
        + ("" if plan.storage_dtype is None else f" | storage: {plan.storage_dtype}, fp32 masters "
           f"(idle: {plan.master_policy})"),
        rule, fmt(head), rule, *map(fmt, body[:-1]), rule, fmt(body[-1]), rule, *plan.share_lines(),
        "state policies: " + " | ".join(f"{p}: peak {format_bytes(v['peak_device_bytes'])}"
                                        for p, v in plan.policies.items()),
        f"bytes per rank (rank 0's padded shards); sent/rank: reduce-scatter only; not in 'device': one unit "
        f"unsharded in forward/backward (largest: {format_bytes(plan.unit_bytes)} with one unit per group, "
        "ungrouped parameters in the root's), activations, temporaries, Adam step counters",
    ]
    return "\n".join(lines)
