"""The FSDP2 strategy: a ``fully_shard`` model; nothing rebuilt at a switch.

FSDP2 reduce-scatters only the parameters that have a gradient and reads
``requires_grad`` at every all-gather, so a switch rebuilds nothing; its
backend (:class:`~hf_altparams.engine.fsdp2.FSDP2Backend`, the fenced state of
:mod:`hf_altparams.engine.fsdp2`) re-initialises mixed-precision dtypes and
moves shards with FSDP2's own storage. ``fully_shard`` replaces the parameter
objects, so the groups are rebound to the shards after wrapping and the first
phase is applied then. Each rank holds a shard of the parameters, gradients,
optimizer state and masters (dim 0 over the ranks, padded); it feeds the
trainable gradients, padded and unsharded, to reduce-scatter, counted by a
custom reduce-scatter.

Example:
    >>> import torch
    >>> FSDP2Strategy().recognises(torch.nn.Linear(2, 2)), FSDP2Strategy().pricing.collective.value
    (False, 'reduce-scatter')
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ..backend import Backend
from ..comm import CommCounter, register_reduce_scatter_counter
from ..fsdp2 import FSDP2Backend, is_fsdp2
from .base import Capabilities, Collective, Placement, Pricing, Strategy

__all__ = ["FSDP2Strategy"]

_SHARDED = Placement.SHARDED


class FSDP2Strategy(Strategy):
    """``fully_shard`` (FSDP2): sharded in place; the phase read at every all-gather."""

    name = "fsdp2"
    label = "FSDP2"
    capabilities = Capabilities(
        synchronises_gradients=True,
        rebinds_parameters=True,
        shards_parameters=True,
        frozen_prefix=False,
        counts_comm=True,
    )
    pricing = Pricing(
        parameters=_SHARDED,
        gradients=_SHARDED,
        optimizer_state=_SHARDED,
        masters=_SHARDED,
        buckets=False,
        collective=Collective.REDUCE_SCATTER,
        compare_with="ddp",
        unit_transient=True,
    )

    def recognises(self, model: nn.Module) -> bool:
        return is_fsdp2(model)

    def backend(self, wrapper: nn.Module) -> Backend:
        return FSDP2Backend(wrapper)

    def count_comm(self, wrapper: nn.Module, counter: Optional[CommCounter] = None) -> CommCounter:
        """A counting reduce-scatter on every ``fully_shard`` unit of ``wrapper``."""
        return register_reduce_scatter_counter(wrapper, counter=counter)
