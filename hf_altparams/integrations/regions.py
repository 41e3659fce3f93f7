"""Compiled regions: each repeated block of a model compiled on its own, in place, with phases.

Regional compilation compiles the blocks a model repeats (a ``ModuleList`` of
modules of one class: a decoder's layers) one by one, and each other child
beside them (embeddings, final norm, head) on its own, instead of one graph over
the whole model. With phases that is what makes compiling work: a compiled
graph guards on the ``requires_grad`` of the parameters it uses, so a graph
over the whole model would be recompiled at every switch that changes any
flag, and under DDP the wrapper's forward would be inside it. A region is
recompiled only when its trainable state changes (which of its parameters
train, and whether its input needs a gradient), at most once per distinct
state (dynamo keeps each compiled version; a switch back reuses it), and
DDP's wrapper stays outside every region, so its
reducer, rebuilt in place at each switch, reduces the gradients as usual.

:func:`compile_regions_in_place` compiles with ``nn.Module.compile`` (public
torch API): the modules, their names and their parameters stay what they were,
so groups, optimizers, checkpoints and the DDP wrapper built afterwards see the
same model. Accelerate's ``compile_regions`` compiles the same regions but
returns a copy of the module tree (each block wrapped in a module whose
parameter names gain ``._orig_mod``); applied to a prepared DDP wrapper, that
copy keeps the reducer the wrapper had when it was made, which is why
``PhasedAccelerator`` compiles the regions itself, before DDP wraps the model,
when ``TorchDynamoPlugin(use_regional_compilation=True)`` asks for them.

A model without repeated blocks has no regions: compiling it "by regions"
compiles it whole, which phases refuse with several ranks
(:mod:`.refusals`); :func:`compile_regions_in_place` refuses it too.

Example:
    >>> import torch
    >>> from torch import nn
    >>> net = nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.Linear(4, 4) for _ in range(3)]), nn.Linear(4, 2))
    >>> [name for name, _ in regions(net)]
    ['0', '1.0', '1.1', '1.2', '2']
    >>> compile_regions_in_place(net, backend="eager")
    ['0', '1.0', '1.1', '1.2', '2']
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..engine.strategies import strategy_for
from ..errors import PlanError

__all__ = ["compile_regions_in_place", "has_repeated_blocks", "is_repeated_blocks", "regions"]


def is_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` is a non-empty ``ModuleList`` whose modules are all of one class (a stack of blocks)."""
    if not isinstance(module, nn.ModuleList) or len(module) == 0:
        return False
    kind = type(module[0])
    return all(type(block) is kind for block in module)


def has_repeated_blocks(module: nn.Module) -> bool:
    """Whether ``module`` or any module inside it is a stack of repeated blocks."""
    return any(is_repeated_blocks(sub) for sub in module.modules())


def regions(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The regions of ``model``, by qualified name: each repeated block, and each other child beside them.

    Walking down from ``model``: a stack of repeated blocks gives each block; a
    child that holds such a stack is walked into; any other child is one
    region (whatever it holds). Without repeated blocks, the model itself is
    the one region (``""``).
    """
    if not has_repeated_blocks(model):
        return [("", model)]
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        if is_repeated_blocks(module):
            found.extend((f"{prefix}{name}", block) for name, block in module.named_children())
            return
        for name, child in module.named_children():
            if has_repeated_blocks(child):
                walk(f"{prefix}{name}.", child)
            else:
                found.append((f"{prefix}{name}", child))

    walk("", model)
    return found


def compile_regions_in_place(model: nn.Module, **compile_kwargs: Any) -> list[str]:
    """Compile each region of ``model`` (:func:`regions`) in place with ``nn.Module.compile``.

    The same regions Accelerate's ``compile_regions`` compiles, without the copy:
    ``model`` and every module and parameter in it keep their identity and names,
    so build the groups, the optimizer and the DDP wrapper as for the uncompiled
    model (before or after this call). Use it for the Trainer, or for a loop of
    your own; ``PhasedAccelerator`` calls it when its ``TorchDynamoPlugin`` has
    ``use_regional_compilation=True``.

    Args:
        model: the model (unwrapped: not a DDP or FSDP wrapper).
        **compile_kwargs: passed to ``torch.compile`` for each region (``backend``, ``mode``, ``dynamic``, ...).

    Returns:
        The names of the compiled regions.

    Raises:
        PlanError: ``model`` has no repeated blocks (compiling it would compile it whole), or is a wrapper.

    Example:
        >>> # model = AutoModelForCausalLM.from_config(config)
        >>> # compile_regions_in_place(model, backend="inductor")   # model.model.layers[i], embed_tokens, norm, lm_head
        >>> # trainer = Trainer(model=model, args=args, callbacks=[AlternatingFreeze(...)])
    """
    if strategy_for(model).capabilities.wraps_module:
        raise PlanError(
            f"`compile_regions_in_place` got a {type(model).__name__}, a wrapper around a module: compile the "
            "regions of the model before it is wrapped (before `accelerator.prepare` or the Trainer), so the "
            "wrapper's forward stays outside every compiled region"
        )
    if not has_repeated_blocks(model):
        raise PlanError(
            f"`compile_regions_in_place`: {type(model).__name__} has no repeated blocks (an nn.ModuleList of "
            "modules of one class), so it has no regions: compiling it would compile it whole, whose graph is "
            "recompiled at every phase switch (and with several ranks is refused). Train it uncompiled, or keep "
            "its blocks in an nn.ModuleList"
        )
    found = regions(model)
    for _, region in found:
        region.compile(**compile_kwargs)
    return [name for name, _ in found]
