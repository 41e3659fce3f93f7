"""The one-process strategy: a plain module, nothing synchronised by a wrapper.

It is the registry's fallback: a model no other strategy recognises trains as
it is (one process; or, in a multi-rank run, a module attached without a
wrapper on purpose). A switch flips ``requires_grad`` and moves residency;
there is nothing to rebuild and no gradient to communicate.

Example:
    >>> import torch
    >>> strategy = LocalStrategy()
    >>> strategy.recognises(torch.nn.Linear(2, 2)), strategy.backend(torch.nn.Linear(2, 2)).kind
    (True, 'local')
"""

from __future__ import annotations

from torch import nn

from ..backend import Backend, LocalBackend
from .base import Capabilities, Collective, Pricing, Strategy

__all__ = ["LocalStrategy"]


class LocalStrategy(Strategy):
    """One process, no wrapper: nothing to rebuild, no gradient communicated."""

    name = "local"
    aliases = ("none",)
    label = "one process"
    capabilities = Capabilities()
    pricing = Pricing(collective=Collective.NONE)

    def recognises(self, model: nn.Module) -> bool:
        """Every module: the fallback when no other strategy recognises the model."""
        return isinstance(model, nn.Module)

    def backend(self, wrapper: nn.Module) -> Backend:
        return LocalBackend(wrapper)
