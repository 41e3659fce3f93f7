"""The DeepSpeed ZeRO strategies: ``zero1``, ``zero2`` (driven) and ``zero3`` (priced, refused).

One registered strategy per ZeRO stage, because each stage holds and
communicates different things (their :class:`~.base.Pricing`), and the stage
is what a run's configuration names (``zero_optimization.stage``). Each
recognises a ``DeepSpeedEngine`` of its stage; the module inside is the
engine's ``.module``.

How phases run on ZeRO-1/2 (``docs/deepspeed.md``; the private names in the
fence :mod:`hf_altparams.engine.deepspeed`): the optimizer given to
``deepspeed.initialize`` has one param group per library group, tagged with
its name (:meth:`ZeroStrategy.before_wrap` splits it; under the Trainer the
callback has the Trainer build it so), and every parameter the schedule trains
is trainable at ``initialize``. From then on ``requires_grad`` follows the
phase (an idle parameter gets no gradient: nothing of it is reduced), the
inner torch optimizer skips the idle groups' partitions, the post-step
all-gather leaves them out, and the run's idle-state policy keeps or drops
their fp32 partitions and optimizer state (:class:`~hf_altparams.engine.deepspeed.ZeroStateOwner`).
DeepSpeed applies the update inside the engine's backward at a sync boundary
under Accelerate (``step_boundary`` ``backward``); the Trainer's
``on_step_end`` comes right after it.

ZeRO-3 is registered so that the planner prices it; the refusal table
(:mod:`hf_altparams.integrations.refusals`) refuses it for training with the
measured reason (``capabilities.trains`` is false).

Example:
    >>> import torch
    >>> ZeroStrategy(2).name, ZeroStrategy(2).recognises(torch.nn.Linear(2, 2))
    ('zero2', False)
    >>> [p.value for p in (ZeroStrategy(1).pricing.gradients, ZeroStrategy(2).pricing.gradients)]
    ['replicated', 'sharded']
"""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn
from torch.optim import Optimizer

from ...errors import AltParamsError, Cause
from ...plan.groups import ParamGroups
from ..backend import Backend
from ..comm import CommCounter
from ..deepspeed import (
    ZeroBackend,
    count_zero_comm,
    engine_stage,
    is_deepspeed_engine,
    optimizer_chain,
    split_param_groups,
)
from ..optim import StateOwner
from .base import Capabilities, Collective, Gather, Placement, Pricing, StepBoundary, Strategy

__all__ = ["ZERO_STAGES", "ZeroStrategy"]

_SHARDED, _REPLICATED = Placement.SHARDED, Placement.REPLICATED

#: The stages the library trains with (ZeRO-3 is priced only; see the module docstring).
ZERO_STAGES: tuple[int, ...] = (1, 2)


def _pricing(stage: int) -> Pricing:
    """ZeRO-1 shards optimizer state and fp32 masters, ZeRO-2 the gradients too, ZeRO-3 the parameters too.

    ZeRO-1/2 all-reduce the trainable gradients (what each rank feeds the
    collective; the post-step all-gather of the updated partitions moves as
    much again: ``Gather.UPDATED``); ZeRO-3 reduce-scatters them, and
    all-gathers every weight for the forward (``Gather.EVERY``). Every stage
    keeps fp32 partitions of the optimized weights, fp32 weights included.
    From ZeRO-2 on, the gradients are reduced into their partitions at every
    micro-batch of an accumulation window (ZeRO-1 reduces at the boundary).
    """
    return Pricing(
        parameters=_SHARDED if stage >= 3 else _REPLICATED,
        gradients=_SHARDED if stage >= 2 else _REPLICATED,
        optimizer_state=_SHARDED,
        masters=_SHARDED,
        buckets=False,
        collective=Collective.REDUCE_SCATTER if stage >= 3 else Collective.ALL_REDUCE,
        compare_with="ddp",
        unit_transient=stage >= 3,
        gathers=Gather.EVERY if stage >= 3 else Gather.UPDATED,
        fp32_masters=True,
        reduces_per_micro_batch=stage >= 2,
    )


class ZeroStrategy(Strategy):
    """A ``DeepSpeedEngine`` at ZeRO stage ``stage``: the phase's groups stepped, reduced and gathered."""

    def __init__(self, stage: int) -> None:
        self.stage = int(stage)
        self.name = f"zero{self.stage}"
        self.aliases = (f"deepspeed-zero{self.stage}",)
        self.label = f"DeepSpeed ZeRO-{self.stage}"
        self.capabilities = Capabilities(
            wraps_module=True,
            synchronises_gradients=True,
            owns_optimizer_state=True,
            shards_parameters=self.stage >= 3,
            per_task_residency=False,
            frozen_prefix=False,
            counts_comm=True,
            step_boundary=StepBoundary.BACKWARD,
            builds_with_every_group=True,
            trains=self.stage in ZERO_STAGES,
        )
        self.pricing = _pricing(self.stage)
        self._backends: weakref.WeakValueDictionary[int, ZeroBackend] = weakref.WeakValueDictionary()

    def recognises(self, model: nn.Module) -> bool:
        return is_deepspeed_engine(model) and engine_stage(model) == self.stage

    def wrapped_module(self, wrapper: nn.Module) -> nn.Module:
        module = wrapper.module
        assert isinstance(module, nn.Module), type(module).__name__
        return module

    def backend(self, wrapper: nn.Module) -> Backend:
        """The engine's :class:`~hf_altparams.engine.deepspeed.ZeroBackend` (its optimizer checked first)."""
        if not self.capabilities.trains:
            raise AltParamsError(
                f"{self.label} is priced by the planner but not driven: see the refusal table "
                "(hf_altparams.integrations.refusals)",
                cause=Cause.STRATEGY_REFUSED,
            )
        backend = ZeroBackend(wrapper)
        for obj in backend.optimizers:  # the state owner is asked for by any of them (state_owner below)
            self._backends[id(obj)] = backend
        return backend

    def before_wrap(self, groups: ParamGroups, optimizer: Optional[Optimizer]) -> None:
        """Split ``optimizer``'s param groups per library group, tagged, before ``deepspeed.initialize``."""
        if optimizer is not None:
            split_param_groups(optimizer, groups)

    def attached(self, wrapper: nn.Module, optimizer: Optional[Optimizer]) -> None:
        """The engine follows the ``requires_grad`` flags the switcher set (the phase applied before it)."""
        backend = self._backends.get(id(_zero_optimizer(wrapper)))
        if backend is not None:
            backend.follow_flags()

    def count_comm(self, wrapper: nn.Module, counter: Optional[CommCounter] = None) -> CommCounter:
        """Count every collective DeepSpeed runs for the engine's optimizer (gradient reduction, all-gather)."""
        return count_zero_comm(counter)

    def state_owner(self, optimizer: Optional[Optimizer], groups: ParamGroups) -> Optional[StateOwner]:
        """The ZeRO optimizer's own owner (fp32 partitions and their state, per group), found through any
        optimizer of the chain DeepSpeed built around the one given (``None``: no engine attached for it)."""
        for obj in optimizer_chain(optimizer):
            backend = self._backends.get(id(obj))
            if backend is not None:
                return backend.state_owner(groups)
        return None


def _zero_optimizer(engine: nn.Module) -> object:
    return getattr(engine, "optimizer", None)
