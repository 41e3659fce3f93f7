"""fp32 gradients of low-precision parameters, between the backward passes and the optimizer step.

:class:`Fp32Grads` belongs to a :class:`~hf_altparams.engine.PrecisionOptimizer`.
It holds, per stored (bf16/fp16) parameter of a group that trains:

* ``accumulated``: the fp32 sum of the local gradients of the micro-steps of
  a gradient-accumulation window so far. Before each forward pass with grad
  enabled (a forward pre-hook on the grouped module), a gradient left in
  ``param.grad`` by the previous micro-step is added to it in fp32 and
  ``param.grad`` is released, so the next backward starts a fresh gradient in
  the storage dtype instead of adding to it there. Cost: 4 bytes per trainable
  parameter from the second micro-step of a window to the step (none with
  accumulation 1).
* ``reduced``: under DDP, the all-reduced gradient in fp32 when the buckets
  are all-reduced in fp32 (``allreduce_dtype=torch.float32``), delivered by
  the comm hook, so the masters get it without rounding to the storage dtype.

Under DDP the sums must reach the all-reduce: the comm hook
(:func:`~hf_altparams.engine.comm.counting_allreduce_hook` with this object as
``grads``) adds each bucket's accumulated fp32 sums to the bucket's own
(last micro-step's) gradients before reducing. That hook is registered by
:meth:`PrecisionOptimizer.attach_ddp` (``PhaseSwitcher.attach`` calls it); a
rank of a multi-process run that has not attached it keeps accumulating in the
storage dtype inside ``param.grad`` (never a local-only fp32 sum DDP would not see).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Fp32Grads"]


def _multi_process() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Fp32Grads:
    """The fp32 gradients of a :class:`PrecisionOptimizer`'s stored parameters (see the module docstring).

    Example:
        >>> net = nn.Linear(2, 1).to(torch.bfloat16)
        >>> grads = Fp32Grads(lambda: list(net.parameters()))
        >>> for _ in range(2):  # two micro-steps
        ...     grads.before_forward()
        ...     net(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
        >>> grads.take(net.bias), net.bias.grad
        (tensor([2.]), None)
    """

    def __init__(self, params: Callable[[], Sequence[nn.Parameter]]) -> None:
        self._params = params  # the stored parameters of the active groups that have masters
        self.accumulated: dict[int, torch.Tensor] = {}
        self.reduced: dict[int, torch.Tensor] = {}
        self.ddp_attached = False

    def enabled(self) -> bool:
        """Whether micro-steps accumulate here: one process, or a DDP run whose comm hook adds the sums."""
        return self.ddp_attached or not _multi_process()

    def before_forward(self) -> None:
        """Move each gradient the last micro-step left in ``param.grad`` into its fp32 sum."""
        if not torch.is_grad_enabled() or not self.enabled():
            return
        with torch.no_grad():
            for param in self._params():
                grad = param.grad
                if grad is None:
                    continue
                total = self.accumulated.get(id(param))
                self.accumulated[id(param)] = grad.float() if total is None else total.add_(grad)
                param.grad = None

    def bucket_input(self, params: Sequence[torch.Tensor], buffer: torch.Tensor,
                     dtype: Optional[torch.dtype]) -> torch.Tensor:
        """What a DDP bucket all-reduces: its gradients plus their fp32 sums, in ``dtype``.

        Returns ``buffer`` itself when there is nothing to add and no cast to do.
        """
        dtype = dtype or buffer.dtype
        sums = [self.accumulated.pop(id(p), None) for p in params]
        if all(s is None for s in sums):
            return buffer if dtype == buffer.dtype else buffer.to(dtype)
        flat = buffer.to(torch.float32, copy=True)
        offset = 0
        for param, total in zip(params, sums):
            if total is not None:
                flat[offset:offset + param.numel()].add_(total.view(-1))
            offset += param.numel()
        return flat if dtype == torch.float32 else flat.to(dtype)

    def deliver(self, params: Sequence[torch.Tensor], reduced: torch.Tensor) -> None:
        """Keep an fp32 all-reduced bucket's slices as its parameters' gradients for the step."""
        if reduced.dtype != torch.float32:
            return  # the storage-dtype result reaches the step through param.grad
        managed = {id(p) for p in self._params()}
        offset = 0
        for param in params:
            if id(param) in managed:
                self.reduced[id(param)] = reduced[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()

    def take(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """``param``'s fp32 gradient for the step (``None`` if it has none); ``param.grad`` is released."""
        reduced = self.reduced.pop(id(param), None)
        grad, total = param.grad, self.accumulated.pop(id(param), None)
        param.grad = None
        if reduced is not None:
            return reduced
        if grad is None:
            return total
        return grad.float() if total is None else total.add_(grad)

    def pending(self) -> int:
        """Bytes held for gradients not yet consumed by a step."""
        return sum(t.nbytes for t in (*self.accumulated.values(), *self.reduced.values()))

    def clear(self) -> None:
        """Drop every pending fp32 gradient (``zero_grad``)."""
        self.accumulated.clear()
        self.reduced.clear()
