"""Counting the bytes DDP really all-reduces, with a comm hook.

The hook state holds no reference to the DDP wrapper (a strong one would form a
cycle through C++ that keeps old gradient buckets alive after a rebuild).
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations are real types.
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

__all__ = ["CommCounter", "counting_allreduce_hook", "register_comm_counter"]


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
