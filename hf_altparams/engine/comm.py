"""Counting the bytes DDP really all-reduces (a comm hook), and FSDP2 reduce-scatters.

The same hook sets the dtype buckets are all-reduced in (``CommCounter.dtype``:
a bf16 bucket all-reduced in fp32 is cast up, reduced, and cast back) and, for a
:class:`~hf_altparams.engine.PrecisionOptimizer` (``CommCounter.grads``), reduces
its fp32 accumulated sums in place of their bf16 roundings and hands it the fp32 result.
The bytes counted are those of the tensor all-reduced, in the dtype it is reduced in.

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

from ..errors import PlanError
from .ddp import comm_hook_states

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
    #: the dtype buckets are all-reduced in; None: the bucket's (the gradients') dtype
    dtype: Optional[torch.dtype] = None
    #: a PrecisionOptimizer's fp32 gradients (engine._grad32.Fp32Grads): sums in, fp32 results out
    grads: Optional[Any] = None

    def end_step(self) -> int:
        """Close the current step: return its bytes, record them, reset the counters."""
        total = self.bytes_pending
        self.history.append(total)
        self.bytes_pending = 0
        self.buckets_pending = 0
        return total


def counting_allreduce_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: count the bucket's bytes, then all-reduce it as DDP's default does.

    DDP's default divides the bucket by the world size and sums it over the ranks.
    With ``state.dtype`` the tensor reduced is a copy in that dtype (with
    ``state.grads``, fp32: each gradient's fp32 accumulated sum where it has one);
    the result is written back into the bucket (rounded to its dtype) and, when
    fp32, handed to ``state.grads``.
    """
    buffer = bucket.buffer()
    params = bucket.parameters() if state.grads is not None else []
    if state.grads is not None:
        send = state.grads.bucket_input(params, buffer, state.dtype)
    else:
        send = buffer if state.dtype in (None, buffer.dtype) else buffer.to(state.dtype)
    state.bytes_pending += send.numel() * send.element_size()
    state.buckets_pending += 1
    if send is buffer:
        return allreduce_hook(state.process_group, bucket)  # type: ignore[arg-type]
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    send.div_(dist.get_world_size(group))
    grads = state.grads

    def written_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        if grads is not None:
            grads.deliver(params, reduced)
        return buffer.copy_(reduced)

    return dist.all_reduce(send, group=group, async_op=True).get_future().then(written_back)


def register_comm_counter(
    ddp: DistributedDataParallel,
    *,
    dtype: Optional[torch.dtype] = None,
    grads: Optional[Any] = None,
    counter: Optional[CommCounter] = None,
) -> CommCounter:
    """Register :func:`counting_allreduce_hook` on ``ddp`` and return its counter.

    DDP accepts one comm hook per wrapper, so this replaces DDP's default
    all-reduce (it does the same averaging) and cannot be combined with another hook.
    If ``ddp`` already has this hook, its counter is returned (with ``dtype`` and
    ``grads`` set where given): a :class:`~hf_altparams.engine.PrecisionOptimizer`
    and ``count_comm`` share one hook, whichever registers first.
    The rebuild at a phase switch re-registers it with the same counter.

    Args:
        ddp: the wrapper.
        dtype: the dtype buckets are all-reduced in (default: the gradients' dtype).
        grads: a PrecisionOptimizer's fp32 gradients (set by ``PrecisionOptimizer.attach_ddp``).
        counter: count into this counter (several wrappers of one run, one per model, share one).

    Example:
        >>> # ddp = DistributedDataParallel(model); counter = register_comm_counter(ddp)
        >>> # loss.backward(); optimizer.step(); optimizer.zero_grad()
        >>> # counter.end_step()  -> bytes all-reduced in that optimizer step
    """
    for state in comm_hook_states(ddp):
        if isinstance(state, CommCounter):
            state.dtype = dtype if dtype is not None else state.dtype
            state.grads = grads if grads is not None else state.grads
            return state
    if counter is None:
        counter = CommCounter(process_group=ddp.process_group, dtype=dtype, grads=grads)
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    return counter


#: FSDP2's default reduce-scatter calls ``dist.reduce_scatter_single`` (torch 2.13) or
#: ``dist.reduce_scatter_tensor`` (2.11, which lacks the former); same arguments.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _CountingReduceScatter:
    """FSDP2's default reduce-scatter (``dist.reduce_scatter_single``; 2.11: ``_tensor``), counting its input bytes.

    Duck-typed to FSDP2's ``ReduceScatter`` interface (``allocate`` and
    ``__call__``), given through the public ``FSDPModule.set_custom_reduce_scatter``.
    """

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def allocate(
        self, size: Sequence[Union[int, torch.SymInt]], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.counter.bytes_pending += input_tensor.numel() * input_tensor.element_size()
        self.counter.buckets_pending += 1
        return _REDUCE_SCATTER(output=output_tensor, input=input_tensor, group=group, op=op, async_op=async_op)


def register_reduce_scatter_counter(model: torch.nn.Module, counter: Optional[CommCounter] = None) -> CommCounter:
    """Count the bytes each rank feeds to FSDP2's reduce-scatter, on every ``fully_shard`` unit of ``model``.

    The FSDP2 counterpart of :func:`register_comm_counter`: ``bytes_pending``
    grows during backward (each unit's padded gradients of the parameters that
    have one), :meth:`CommCounter.end_step` closes an optimizer step. Compare a
    step's figure with ``PhaseSwitcher.allreduce_bytes_per_step()``. ``counter``:
    count into this one (default: a new one).

    Raises:
        PlanError: when ``model`` has no ``fully_shard`` unit. (FSDP2 itself
            refuses a unit that already has a custom reduce-scatter, or holds
            several parameter groups.)

    Example:
        >>> # fully_shard(layer) for each layer; fully_shard(model)
        >>> # counter = register_reduce_scatter_counter(model)
        >>> # loss.backward(); optimizer.step(); counter.end_step()  -> bytes reduce-scattered
    """
    from torch.distributed.fsdp import FSDPModule

    counter = counter if counter is not None else CommCounter()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise PlanError(
            f"`model` ({type(model).__name__}) has no fully_shard (FSDP2) unit to count; pass the model "
            "after `fully_shard` (or `shard_by_groups`)"
        )
    for unit in units:
        unit.set_custom_reduce_scatter(_CountingReduceScatter(counter))  # type: ignore[arg-type]
    return counter
