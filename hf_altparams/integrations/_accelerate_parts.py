"""Pieces of :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` that stand alone.

The prepared optimizer and scheduler wrappers (they report sync-boundary steps to
their accelerator), the configurations that are refused (:func:`check_supported`),
and the refusals ``prepare`` raises (it finds its arguments with
:mod:`._user_optimizers`). Checkpoints live in :mod:`._accelerate_checkpoints`,
switch reports in :mod:`._accelerate_reporting`.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType, DynamoBackend
from torch.optim import Optimizer

from ..errors import AltParamsError
from ._fsdp2_prepare import accelerator_refusal



class StepHooks(Protocol):
    """What the prepared optimizer calls around a sync-boundary step (a :class:`~._accelerate_run.PhasedRun`)."""

    guard: Any

    def before_step(self) -> None: ...

    def after_step(self) -> Any: ...

#: Refused distributed types (DeepSpeed and FSDP1: ``_fsdp2_prepare.fsdp_refusal``, naming FSDP2).
UNSUPPORTED = {
    DistributedType.MEGATRON_LM: "Megatron-LM builds its own optimizer and reducer",
    DistributedType.XLA: "XLA reduces gradients itself, without a DDP reducer",
}



def check_supported(acc: Accelerator, fsdp_plugin_given: Any = None) -> None:
    """Refuse, with the reason, a configuration whose reducer or trainable set the phases cannot drive."""
    reason = accelerator_refusal(acc, fsdp_plugin_given) or UNSUPPORTED.get(acc.distributed_type)
    parallelism = getattr(acc, "parallelism_config", None)
    if reason is None and parallelism is not None and (parallelism.tp_enabled or parallelism.cp_enabled):
        reason = "tensor/context parallelism shards parameters outside DDP"
    dynamo = getattr(getattr(acc.state, "dynamo_plugin", None), "backend", DynamoBackend.NO)
    if reason is None and dynamo != DynamoBackend.NO:
        reason = "torch.compile bakes DDP's bucket layout into the compiled graph"
    if reason is not None:
        raise AltParamsError(
            f"PhasedAccelerator supports DDP, FSDP2 and single-process runs, not "
            f"distributed_type={acc.distributed_type.value!r} / this configuration: {reason} "
            "(and no dynamo backend)."
        )


class PhasedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: a sync-boundary ``step()`` is checked first, then drives the schedule.

    Before the update, the run's loop checks run (:mod:`._loop_guard`; the
    phase's invariants run in the inner optimizer's own step hook); after it,
    the run's driver counts the step and switches phase when the schedule says
    so, so the next iteration, whatever its order, starts in the right phase.

    Args:
        optimizer: the optimizer that drives the schedule.
        run: the accelerator's :class:`~._accelerate_run.PhasedRun`.
        accumulation_steps: the accelerator's gradient-accumulation steps (read at each call).
    """

    def __init__(self, optimizer: Optimizer, run: StepHooks, accumulation_steps: Callable[[], int],
                 **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self._run = run
        self._accumulation_steps = accumulation_steps

    def step(self, closure: Any = None) -> None:
        at_boundary = self.gradient_state.sync_gradients
        if at_boundary:
            self._run.before_step()
        super().step(closure)
        if at_boundary:
            self._run.after_step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        guard = self._run.guard
        if self.gradient_state.sync_gradients and guard is not None:  # Accelerate skips it inside a window
            guard.zero_grad_at_boundary(self._accumulation_steps())
        super().zero_grad(set_to_none)


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
