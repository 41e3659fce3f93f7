"""fp32 gradients of low-precision parameters, between the backward passes and the optimizer step.

:class:`Fp32Grads` belongs to a :class:`~hf_altparams.engine.PrecisionOptimizer`.
It holds, per stored (bf16/fp16) parameter of a group that trains:

* ``accumulated``: with gradient accumulation, the fp32 sum of the local
  gradients of the window's micro-steps. Before each forward pass with grad
  enabled (a forward pre-hook on the grouped module) the gradient left in
  ``param.grad`` moves into the fp32 sum and ``param.grad`` is released, so the
  next backward starts a fresh storage-dtype gradient; after that backward
  (a post-accumulate-grad hook, which runs before DDP's own hook) the new
  gradient is added to the sum and ``param.grad`` is overwritten with the sum
  rounded to the storage dtype. So ``param.grad`` always holds the whole
  window's gradient, as without this class (what DDP buckets and all-reduces,
  what gradient clipping sees), and the step uses the fp32 sum itself as long as
  ``param.grad`` still equals its rounding. Nothing happens at accumulation 1.
  Cost: 4 bytes per trainable parameter from the second micro-step to the step.
* ``reduced``: the all-reduced gradient in fp32 when DDP's buckets are
  all-reduced in fp32 (``allreduce_dtype=torch.float32``), delivered by the
  comm hook (:func:`~hf_altparams.engine.comm.counting_allreduce_hook`, which
  also replaces each bucket slice by its fp32 sum before reducing).

The step takes the fp32 value only while ``param.grad`` still equals its
rounding: a gradient changed in between (clipped, unscaled) is taken from
``param.grad``. In a multi-process run a local fp32 sum that no fp32 all-reduce
consumed is never used: DDP (or the user) reduced ``param.grad``, which then holds the truth.
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
        >>> net.bias.grad, grads.take(net.bias), net.bias.grad
        (tensor([2.], dtype=torch.bfloat16), tensor([2.]), None)
    """

    def __init__(self, params: Callable[[], Sequence[nn.Parameter]]) -> None:
        self._params = params  # the stored parameters of the active groups that have masters
        self.accumulated: dict[int, torch.Tensor] = {}
        self.reduced: dict[int, torch.Tensor] = {}
        self._hooked: set[int] = set()
        self._added: set[int] = set()  # parameters whose gradient of this micro-step is in `accumulated`

    def before_forward(self) -> None:
        """Move each gradient the last micro-step left in ``param.grad`` into its fp32 sum."""
        if not torch.is_grad_enabled():
            return
        self._added.clear()
        with torch.no_grad():
            for param in self._params():
                if id(param) not in self._hooked and param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._after_accumulate)
                    self._hooked.add(id(param))
                grad = param.grad
                if grad is None:
                    continue
                total = self.accumulated.get(id(param))
                if total is None:
                    self.accumulated[id(param)] = grad.float()
                elif not torch.equal(grad, total.to(grad.dtype)):  # changed since: take it as it is now
                    total.copy_(grad)
                param.grad = None

    def _after_accumulate(self, param: torch.Tensor) -> None:
        total, grad = self.accumulated.get(id(param)), param.grad
        if total is None or grad is None:
            return  # the window's first micro-step: param.grad is its whole gradient
        with torch.no_grad():
            if id(param) in self._added:  # a second accumulation in one backward (reentrant checkpointing)
                total.add_(grad.float() - total.to(grad.dtype).float())
            else:
                total.add_(grad)
                self._added.add(id(param))
            grad.copy_(total)  # rounded: the window's gradient, for DDP and anyone reading param.grad

    def bucket_input(self, params: Sequence[torch.Tensor], buffer: torch.Tensor,
                     dtype: Optional[torch.dtype]) -> torch.Tensor:
        """What a DDP bucket all-reduces in ``dtype``: its gradients, the fp32 sums where there are some."""
        dtype = dtype or buffer.dtype
        if dtype != torch.float32:
            return buffer if dtype == buffer.dtype else buffer.to(dtype)
        flat = buffer.to(torch.float32, copy=True)
        offset = 0
        for param in params:
            total = self.accumulated.pop(id(param), None)
            if total is not None:
                flat[offset:offset + param.numel()].copy_(total.view(-1))
            offset += param.numel()
        return flat

    def deliver(self, params: Sequence[torch.Tensor], reduced: torch.Tensor) -> None:
        """Keep an fp32 all-reduced bucket's slices as its parameters' gradients for the step."""
        if reduced.dtype != torch.float32:
            return
        managed = {id(p) for p in self._params()}
        offset = 0
        for param in params:
            if id(param) in managed:
                self.reduced[id(param)] = reduced[offset:offset + param.numel()].view(param.shape)
            offset += param.numel()

    def take(self, param: nn.Parameter) -> Optional[torch.Tensor]:
        """``param``'s fp32 gradient for the step (``None`` if it has none); ``param.grad`` is released."""
        grad, param.grad = param.grad, None
        reduced = self.reduced.pop(id(param), None)
        total = self.accumulated.pop(id(param), None)
        if total is not None and _multi_process():
            total = None  # a local sum: param.grad was all-reduced, the fp32 sum was not
        exact = reduced if reduced is not None else total
        if grad is None:
            return exact
        if exact is not None and torch.equal(grad, exact.to(grad.dtype)):
            return exact
        return grad.float()

    def pending(self) -> int:
        """Bytes held for gradients not yet consumed by a step."""
        return sum(t.nbytes for t in (*self.accumulated.values(), *self.reduced.values()))

    def clear(self) -> None:
        """Drop every pending fp32 gradient (``zero_grad``)."""
        self.accumulated.clear()
        self.reduced.clear()
