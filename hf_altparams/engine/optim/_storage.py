"""Low-precision storage: the model cast to the storage dtype, and the fp32 masters swapped in for a step.

Both serve :class:`~hf_altparams.engine.PrecisionOptimizer`: :func:`store_model`
casts the whole model once, when the optimizer is built; :func:`masters_in_place`
lets the inner torch optimizers step the fp32 masters in place of the stored
parameters, by identity, for the duration of the step only.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import nn
from torch.optim import Optimizer

__all__ = ["masters_in_place", "store_model"]


def store_model(module: nn.Module, dtype: torch.dtype) -> list[str]:
    """Store ``module`` in ``dtype``: cast its floating parameters and their modules' floating buffers in place.

    Every floating-point parameter is cast, in a group or not: a model runs in
    one dtype (an fp32 parameter left among bf16 ones fails in the first matmul
    that mixes them), and the planner counts it so. A module's floating buffers
    follow its own parameters (BatchNorm's running statistics must match its
    weight); buffers of modules without parameters of their own (rotary
    frequencies, fixed masks) keep the dtype the model gave them. Tensors keep
    their identity (only ``.data`` changes). Returns the names of the tensors cast.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.BatchNorm1d(2))
        >>> store_model(net, torch.bfloat16)
        ['0.weight', '1.weight', '1.bias', '1.running_mean', '1.running_var']
    """
    cast: list[str] = []
    for mname, sub in module.named_modules():
        own = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.is_floating_point()]
        if not own:
            continue
        buffers = [(n, b) for n, b in sub.named_buffers(recurse=False) if b is not None and b.is_floating_point()]
        for name, tensor in [*own, *buffers]:
            if tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
                cast.append(f"{mname}.{name}" if mname else name)
    return cast


@contextlib.contextmanager
def masters_in_place(optimizers: Iterable[Optimizer], pairs: list[tuple[nn.Parameter, torch.Tensor]]) -> Iterator[None]:
    """Within the block, each master replaces its parameter in the optimizers' ``param_groups`` and ``state``.

    Python lists and dicts only: the stored parameters are never touched, so
    DDP's autograd hooks on them stay valid.

    Example:
        >>> p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16)); master = p.detach().float()
        >>> opt = torch.optim.SGD([p], lr=1.0); master.grad = torch.ones(2)
        >>> with masters_in_place([opt], [(p, master)]):
        ...     opt.step()
        >>> master, opt.param_groups[0]["params"][0] is p
        (tensor([0., 0.]), True)
    """
    optimizers = list(optimizers)
    master_of = {id(p): m for p, m in pairs}
    param_of = {id(m): p for p, m in pairs}

    def swap(lookup: dict[int, torch.Tensor]) -> None:
        for opt in optimizers:
            for group in opt.param_groups:
                group["params"] = [lookup.get(id(t), t) for t in group["params"]]
            for old in [t for t in opt.state if id(t) in lookup]:
                opt.state[lookup[id(old)]] = opt.state.pop(old)

    swap(master_of)
    try:
        yield
    finally:
        swap(param_of)  # type: ignore[arg-type]
