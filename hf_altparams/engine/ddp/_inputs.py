"""What a DDP reducer is built over, without walking the module tree at every switch.

DDP's ``_build_params_for_reducer``, ``_build_debug_param_to_name_mapping``
and ``_assign_modules_buffers`` each walk ``named_modules()``, and
``named_parameters(recurse=False)`` walks it again for every module: on a
12-layer BERT (228 modules) that was about half of a switch's local time.

:class:`ReducerInputs` walks the tree ONCE per wrapper and keeps the
``(name, module)`` list. Each rebuild then reads every module's own
``_parameters`` and ``_buffers`` dicts (so a parameter or buffer the user or a
residency move replaced is seen), filtered by ``requires_grad`` and the ignore
list, in DDP's order and with DDP's de-duplication:

* parameters: the first ``(module, parameter)`` pair of a shared parameter
  wins (its module says whether the gradient is sparse), while the debug name
  of that parameter is the *last* module's, as DDP's mapping has it; a module's
  direct parameter is named ``f"{module_name}.{param_name}"`` (so a root
  parameter is ``".weight"``, DDP's own quirk, and cannot be ignored there);
* buffers and the wrapper's full parameter list: ``named_buffers()`` /
  ``named_parameters()`` names (no leading dot), each tensor once.

:func:`reducer_inputs` checks these against DDP's own methods on the first rebuild of
each wrapper and uses DDP's methods for that wrapper on any difference, so a
torch whose DDP builds its inputs another way is slower, never wrong.
"""

from __future__ import annotations

from typing import AbstractSet, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

__all__ = ["InputsVerdict", "ReducerInputs", "fast_inputs", "reducer_inputs"]


def _sparse(module: nn.Module) -> bool:
    # DDP's produces_sparse_gradient, read at every rebuild (``.sparse`` is a plain attribute).
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and bool(module.sparse)


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class ReducerInputs:
    """The reducer's parameters, their names and the broadcast buffers, for one wrapped module.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> _ = net[0].requires_grad_(False)
        >>> params, sparse, names = ReducerInputs(net).parameters(ignore=set())
        >>> [p is net[1].weight for p in params], sparse, names
        ([True, False], [False, False], {0: '1.weight', 1: '1.bias'})
    """

    def __init__(self, module: nn.Module) -> None:
        #: ``named_modules()`` once: DDP assumes the module tree is fixed after wrapping.
        self.modules: list[tuple[str, nn.Module]] = list(module.named_modules())

    def parameters(self, ignore: AbstractSet[str]) -> tuple[list[nn.Parameter], list[bool], dict[int, str]]:
        """``(parameters, expect_sparse_gradient, index -> name)``, as DDP's two methods build them."""
        params: list[nn.Parameter] = []
        sparse: list[bool] = []
        names: dict[int, str] = {}
        index: dict[int, int] = {}
        for module_name, module in self.modules:
            seen: set[int] = set()  # named_parameters(recurse=False) de-duplicates within a module
            is_sparse = None
            for param_name, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                name = f"{module_name}.{param_name}"
                if not param.requires_grad or name in ignore:
                    continue
                at = index.get(id(param))
                if at is None:
                    at = index[id(param)] = len(params)
                    params.append(param)
                    if is_sparse is None:
                        is_sparse = _sparse(module)
                    sparse.append(is_sparse)
                names[at] = name  # a shared parameter keeps its last module's name
        return params, sparse, names

    def module_parameters(self, ignore: AbstractSet[str]) -> list[nn.Parameter]:
        """``[p for n, p in module.named_parameters() if n not in ignore]`` (DDP's ``_module_parameters``)."""
        return [
            tensor
            for name, tensor in self._named("_parameters")
            if name not in ignore and isinstance(tensor, nn.Parameter)
        ]

    def buffers(self, ignore: AbstractSet[str]) -> dict[str, torch.Tensor]:
        """``named_buffers()`` not in ``ignore``, in order (DDP's ``named_module_buffers``)."""
        return {name: tensor for name, tensor in self._named("_buffers") if name not in ignore}

    def same_as(
        self,
        ignore: AbstractSet[str],
        parameters: Sequence[torch.Tensor],
        sparse: Sequence[bool],
        names: Mapping[int, str],
        named_buffers: Mapping[str, torch.Tensor],
        buffers: Sequence[torch.Tensor],
    ) -> bool:
        """Whether this builds exactly what DDP's own methods built (same tensors, flags, names, order)."""
        ours, our_sparse, our_names = self.parameters(ignore)
        our_buffers = self.buffers(ignore)
        return (
            _same(ours, parameters)
            and our_sparse == list(sparse)
            and our_names == dict(names)
            and list(our_buffers) == list(named_buffers)
            and _same(list(our_buffers.values()), list(named_buffers.values()))
            and _same(list(our_buffers.values()), buffers)
        )

    def clear_grads(self) -> None:
        """``p.grad = None`` for every parameter of the module."""
        for _, module in self.modules:
            for param in module._parameters.values():
                if param is not None:
                    param.grad = None

    def _named(self, kind: str) -> list[tuple[str, torch.Tensor]]:
        seen: set[int] = set()  # named_parameters() / named_buffers(): each tensor once, first name
        out = []
        for module_name, module in self.modules:
            prefix = module_name + "." if module_name else ""
            for attr, tensor in getattr(module, kind).items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                out.append((prefix + attr, tensor))
        return out


#: ``False`` makes every rebuild use DDP's own methods (``benchmarks/switch_profile.py
#: --compare-inputs`` times both ways in one run; a way out if the fast path is suspected).
fast_inputs = True


class InputsVerdict:
    """Per wrapper: its :class:`ReducerInputs` once checked against DDP's own methods.

    ``checked`` is False until the first rebuild with something to train;
    ``inputs`` is then the fast path, or ``None`` where the two differed (DDP's
    own methods are used for that wrapper from then on). Held by the backend.
    """

    def __init__(self) -> None:
        self.checked = False
        self.inputs: Optional[ReducerInputs] = None


def reducer_inputs(
    ddp: DistributedDataParallel, verdict: Optional[InputsVerdict] = None
) -> tuple[list[nn.Parameter], list[bool], dict[int, str]]:
    """What a new reducer is built over, for the current flags and ignore list; assigns the buffers.

    Returns what ``ddp._build_params_for_reducer()`` and
    ``ddp._build_debug_param_to_name_mapping`` would (the parameters, whether
    each expects a sparse gradient, index -> name), and sets the buffers DDP
    broadcasts (``modules_buffers``, ``named_module_buffers``) as
    ``_assign_modules_buffers`` would, without walking the module tree
    (:mod:`._inputs`). With a ``verdict``, the first call uses DDP's own
    methods and keeps the fast path for later calls only if both agree exactly;
    without one (or with ``fast_inputs`` off), DDP's methods every time.
    """
    known = verdict.inputs if verdict is not None and fast_inputs else None
    if known is not None:
        ignore = ddp.parameters_to_ignore
        buffers = known.buffers(ignore)
        ddp.modules_buffers = list(buffers.values())
        ddp.named_module_buffers = buffers
        return known.parameters(ignore)
    parameters, sparse = ddp._build_params_for_reducer()  # assigns the buffers too
    names = ddp._build_debug_param_to_name_mapping(parameters)
    if verdict is not None and fast_inputs and not verdict.checked and parameters:  # nothing trains: no verdict
        ours = ReducerInputs(ddp.module)
        same = ours.same_as(
            ddp.parameters_to_ignore, parameters, list(sparse), names, ddp.named_module_buffers, ddp.modules_buffers
        )
        verdict.checked, verdict.inputs = True, (ours if same else None)
    return parameters, sparse, names
