"""The DDP strategy: ``DistributedDataParallel`` re-bucketed in place at every switch.

DDP fixes the parameters it all-reduces in its constructor, so the run
assembly applies the first phase before the wrapper is built, and every switch
rebuilds the same wrapper's reducer for the new trainable set
(:class:`~hf_altparams.engine.ddp.DDPBackend`, the fenced surgery of
:mod:`hf_altparams.engine.ddp`). Replicated parameters, gradients, optimizer
state and DDP's gradient buckets on every rank; the trainable gradients
all-reduced, counted by a comm hook. Several models trained by one schedule
may each have their own wrapper; idle phases' reducers may be kept.

Example:
    >>> import torch
    >>> DDPStrategy().recognises(torch.nn.Linear(2, 2)), DDPStrategy().pricing.buckets
    (False, True)
"""

from __future__ import annotations

from typing import Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..backend import Backend
from ..comm import CommCounter, register_comm_counter
from ..ddp import DDPBackend, is_ddp
from ..optim import grouped_in
from ..shutdown import install_exit_hook
from .base import Capabilities, Collective, Pricing, Strategy

__all__ = ["DDPStrategy"]


def _ddp(wrapper: nn.Module) -> DistributedDataParallel:
    assert isinstance(wrapper, DistributedDataParallel), type(wrapper).__name__
    return wrapper


class DDPStrategy(Strategy):
    """``DistributedDataParallel``: the reducer rebuilt in place for each phase's parameters."""

    name = "ddp"
    label = "DDP"
    capabilities = Capabilities(
        wraps_module=True,
        wrapper_per_model=True,
        synchronises_gradients=True,
        rebuckets_at_switch=True,
        kept_reducers=True,
        counts_comm=True,
    )
    pricing = Pricing(buckets=True, collective=Collective.ALL_REDUCE)

    def recognises(self, model: nn.Module) -> bool:
        return is_ddp(model)

    def wrapped_module(self, wrapper: nn.Module) -> nn.Module:
        return _ddp(wrapper).module

    def backend(self, wrapper: nn.Module) -> Backend:
        install_exit_hook()  # a wrapper's last all-reduce must not race interpreter exit
        return DDPBackend(_ddp(wrapper))

    def attached(self, wrapper: nn.Module, optimizer: Optional[Optimizer]) -> None:
        """A :class:`~hf_altparams.engine.PrecisionOptimizer` with ``allreduce_dtype`` registers its comm hook."""
        grouped = grouped_in(optimizer)
        if grouped is not None:
            grouped.attach_ddp(_ddp(wrapper))

    def count_comm(self, wrapper: nn.Module, counter: Optional[CommCounter] = None) -> CommCounter:
        """A counting all-reduce comm hook on ``wrapper`` (DDP takes one hook per wrapper)."""
        return register_comm_counter(_ddp(wrapper), counter=counter)
