"""Counting the bytes DDP really all-reduces (a comm hook), and FSDP2 reduce-scatters.

The hook state holds no reference to the DDP wrapper (a strong one would form a
cycle through C++ that keeps old gradient buckets alive after a rebuild).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are real types.
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

__all__ = ["CommCounter", "counting_allreduce_hook", "register_comm_counter", "register_reduce_scatter_counter"]


@dataclass
class CommCounter:
    """State of :func:`counting_allreduce_hook`: bytes and buckets all-reduced.

    ``bytes_pending`` grows during backward; :meth:`end_step` closes a step and
    appends its total to ``history``.

    Example:
        >>> counter = CommCounter()
        >>> counter.bytes_pending, counter.history
        (0, [])
    """

    process_group: Optional[dist.ProcessGroup] = None
    bytes_pending: int = 0
    buckets_pending: int = 0
    history: list[int] = field(default_factory=list)

    def end_step(self) -> int:
        """Close the current step: return its bytes, record them, reset the counters."""
        total = self.bytes_pending
        self.history.append(total)
        self.bytes_pending = 0
        self.buckets_pending = 0
        return total


def counting_allreduce_hook(
    state: CommCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: count the bucket's bytes, then all-reduce it as DDP's default does."""
    buffer = bucket.buffer()
    state.bytes_pending += buffer.numel() * buffer.element_size()
    state.buckets_pending += 1
    return allreduce_hook(state.process_group, bucket)  # type: ignore[arg-type]


def register_comm_counter(ddp: DistributedDataParallel) -> CommCounter:
    """Register :func:`counting_allreduce_hook` on ``ddp`` and return its counter.

    DDP accepts one comm hook per wrapper, so this replaces DDP's default
    all-reduce (it does the same averaging) and cannot be combined with another hook.
    The rebuild at a phase switch re-registers it with the same counter.

    Example:
        >>> # ddp = DistributedDataParallel(model); counter = register_comm_counter(ddp)
        >>> # loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> # counter.end_step()  -> bytes all-reduced in that optimizer step
    """
    counter = CommCounter(process_group=ddp.process_group)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    return counter


class _CountingReduceScatter:
    """FSDP2's default reduce-scatter (``dist.reduce_scatter_single``), counting its input bytes.

    Duck-typed to FSDP2's ``ReduceScatter`` interface (``allocate`` and
    ``__call__``), given through the public ``FSDPModule.set_custom_reduce_scatter``.
    """

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> Any:
        self.counter.bytes_pending += input_tensor.numel() * input_tensor.element_size()
        self.counter.buckets_pending += 1
        return dist.reduce_scatter_single(output=output_tensor, input=input_tensor, group=group, op=op,
                                          async_op=async_op)


def register_reduce_scatter_counter(model: torch.nn.Module) -> CommCounter:
    """Count the bytes each rank feeds to FSDP2's reduce-scatter, on every ``fully_shard`` unit of ``model``.

    The FSDP2 counterpart of :func:`register_comm_counter`: ``bytes_pending``
    grows during backward (each unit's padded gradients of the parameters that
    have one), :meth:`CommCounter.end_step` closes an optimizer step. Compare a
    step's figure with ``PhaseSwitcher.allreduce_bytes_per_step()``.

    Raises:
        ValueError: when a unit already has a custom reduce-scatter, or holds
            several parameter groups (FSDP2 then refuses a custom one).

    Example:
        >>> # fully_shard(layer) for each layer; fully_shard(model)
        >>> # counter = register_reduce_scatter_counter(model)
        >>> # loss.backward(); optimizer.step(); counter.end_step()  -> bytes reduce-scattered
    """
    from torch.distributed.fsdp import FSDPModule

    counter = CommCounter()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError(f"`model` ({type(model).__name__}) has no fully_shard (FSDP2) unit to count")
    for unit in units:
        unit.set_custom_reduce_scatter(_CountingReduceScatter(counter))  # type: ignore[arg-type]
    return counter
