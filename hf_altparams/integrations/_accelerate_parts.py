"""Pieces of :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` that stand alone.

The prepared optimizer and scheduler wrappers (they report sync-boundary steps to
their accelerator), the distributed types that are refused, and the refusals
``prepare`` raises. Checkpoints live in :mod:`._accelerate_checkpoints`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch.optim import Optimizer

from ..engine import _ddp
from ..engine.optim import GroupedOptimizer
from ..errors import AltParamsError
from ..plan.groups import ParamGroups

if TYPE_CHECKING:
    from .accelerate import PhasedAccelerator

#: Refused distributed types (DeepSpeed and FSDP1: ``_fsdp2_prepare.fsdp_refusal``, naming FSDP2).
UNSUPPORTED = {
    DistributedType.MEGATRON_LM: "Megatron-LM builds its own optimizer and reducer",
    DistributedType.XLA: "XLA reduces gradients itself, without a DDP reducer",
}


class PhasedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: reports sync-boundary steps and zero_grads to its accelerator."""

    def __init__(self, optimizer: Optimizer, owner: PhasedAccelerator, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self._owner = owner

    def step(self, closure: Any = None) -> None:
        at_boundary = self.gradient_state.sync_gradients
        if at_boundary:
            self._owner._check_gradients()
        super().step(closure)
        if at_boundary:
            self._owner._count_step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none)
        if self.gradient_state.sync_gradients:
            self._owner._switch_if_due()


class PreparedGroupedLRScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper for a GroupedLRScheduler (which has no ``_step_count``)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.step_with_optimizer and not self.gradient_state.sync_gradients:
            return  # inside an accumulation window: the optimizer did not step
        super().step(*args, **kwargs)


def refuse_without_groups(optimizers: list[Optimizer]) -> None:
    """`prepare` got optimizers but no groups are known: the schedule could never apply."""
    raise AltParamsError(
        f"`prepare` got {[type(o).__name__ for o in optimizers]} but PhasedAccelerator does not know "
        "the parameter groups, so its schedule would never apply (everything would train, "
        "`phase` None); pass `groups=ParamGroups(model, ...)` to PhasedAccelerator, or use a "
        "GroupedOptimizer(groups, ...)"
    )


def refuse_user_ddp() -> None:
    """`prepare` got a DistributedDataParallel the user built around the grouped model."""
    raise AltParamsError(
        "`prepare` got a DistributedDataParallel you built around the grouped model; pass the model itself "
        "(`groups.module`): PhasedAccelerator applies the first phase before it builds DDP, and rebuilds "
        "DDP's reducer at each switch, which a wrapper built earlier (over every parameter) would miss"
    )


def find_grouped(
    args: tuple[Any, ...], groups: Optional[ParamGroups], *, started: bool
) -> tuple[Optional[ParamGroups], Optional[int], Optional[Optimizer]]:
    """The grouped model's groups, its index in ``prepare``'s ``args`` and the optimizer driving the schedule.

    ``groups`` are the accelerator's (``None`` when only a GroupedOptimizer can tell);
    ``started``: a grouped model was prepared already. Refuses, before anything is
    prepared, the forms the schedule could not drive.
    """
    optimizers = [a for a in args if isinstance(a, Optimizer)]
    grouped = [o for o in optimizers if isinstance(o, GroupedOptimizer)]
    if groups is None and grouped:
        groups = grouped[0].groups
    if groups is None:
        if not started and optimizers:
            refuse_without_groups(optimizers)
        return None, None, None
    model_index = next((i for i, a in enumerate(args) if a is groups.module), None)
    if model_index is None and any(_ddp.is_ddp(a) and a.module is groups.module for a in args):
        refuse_user_ddp()
    if model_index is None:
        if not started and grouped:
            raise AltParamsError(
                "`prepare` got a GroupedOptimizer without its model; pass the model and the optimizer that "
                "drives the schedule to the same `prepare` call (the first phase must be applied before "
                "DDP wraps the model)"
            )
        return groups, None, None
    if started:
        raise AltParamsError(
            "`prepare` got the grouped model a second time. Preparing the raw module again would add it "
            "to `accelerator._models` twice (two model files in save_state) and wrap its autocast forward "
            "twice; keep using the object the first `prepare` returned: switches rebuild it in place."
        )
    mine = [o for o in grouped if o.groups.module is groups.module]
    driving = mine[0] if len(mine) == 1 else (optimizers[0] if not mine and len(optimizers) == 1 else None)
    if driving is None:
        raise AltParamsError(
            f"`prepare` got the grouped model with {len(optimizers)} optimizer(s) "
            f"({[type(o).__name__ for o in optimizers]}); pass exactly one optimizer for it in the same "
            "call: a GroupedOptimizer over its groups (one optimizer for all groups, which also keeps "
            "fp16 loss scaling to one unscale per step), or a single plain optimizer with `groups=` given"
        )
    return groups, model_index, driving
