"""Loop mistakes that :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` catches at ``step()``.

Both would train without any error while the ranks drift apart or a group never
trains; both are checked at a gradient-sync boundary, before the optimizer
applies the step:

* **the training forward bypassed the DDP wrapper** (e.g.
  ``accelerator.unwrap_model(model)(x)``): the trainable parameters hold
  gradients, but no forward of the wrapper that would all-reduce them
  (gradients enabled, outside ``no_sync``) ran since the previous step, so the
  reducer never saw them. A forward pre-hook on the wrapper counts those
  forwards (in the driver's loop facts). Raised on every rank (each rank runs
  the same loop).
* **an epoch-unit schedule whose epoch is never set**: more optimizer steps
  than one pass over the longest prepared dataloader went by since the last
  ``accelerator.set_epoch(...)`` (or the start) and the schedule's phase for
  the epoch the loop must be in differs from the current one. Raised when
  ``set_epoch`` was never called; a warning (once) when it was called before
  (an "epoch" longer than a pass is legitimate, if unusual).

One warning (once): a sync-boundary ``zero_grad()`` that drops gradients no
``step()`` applied, the mark of ``zero_grad()`` called first inside
``accumulate()`` (it wipes the window's earlier micro-batches there, with or
without this library).

The facts checked (forwards seen, when the epoch was last set, a backward
waiting for its step) are the :class:`~hf_altparams.engine.driver.PhaseDriver`'s;
this guard keeps only its hook and its warned-once flags.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..engine.driver import PhaseDriver
from ..errors import AltParamsError

__all__ = ["LoopGuard"]


class LoopGuard:
    """The two checks of :mod:`._loop_guard` for one run; :meth:`check` runs at every sync-boundary ``step()``.

    Args:
        driver: the run's driver (its loop facts are read and reset here).
        steps_per_epoch: optimizer steps in one pass over the longest prepared
            dataloader (0: unknown).
    """

    def __init__(self, driver: PhaseDriver, steps_per_epoch: Callable[[], int]) -> None:
        self.driver = driver
        self.steps_per_epoch = steps_per_epoch
        self.warned_epoch = False
        self.warned_zero_grad = False
        self._handles: list[Any] = []

    # ------------------------------------------------------------ wiring
    def watch(self, ddp: nn.Module) -> None:
        """Count ``ddp``'s forwards that will all-reduce their gradients."""
        self.watch_many([ddp])

    def watch_many(self, wrappers: Sequence[nn.Module]) -> None:
        """Count the forwards of every wrapper in ``wrappers`` (one per model) that will all-reduce."""
        self.close()
        self._handles = [w.register_forward_pre_hook(self._seen) for w in wrappers]

    def _seen(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True):
            self.driver.loop.syncing_forwards += 1

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def zero_grad_at_boundary(self, accumulation_steps: int) -> None:
        """A sync-boundary ``zero_grad()``: warn (once) if it drops gradients no step applied."""
        loop = self.driver.loop
        if loop.backward_pending and not self.warned_zero_grad and accumulation_steps > 1:
            self.warned_zero_grad = True
            warnings.warn(
                "hf_altparams: `optimizer.zero_grad()` ran at a gradient-sync boundary after a backward whose "
                "gradients no `optimizer.step()` applied yet: they are dropped. Inside `accelerator.accumulate()` "
                "this is `zero_grad()` called at the top of the iteration, which wipes the window's earlier "
                "micro-batches (plain Accelerate does the same); call it after `optimizer.step()` there. If you "
                "skipped the step on purpose (e.g. a non-finite loss), ignore this.", stacklevel=4)
        loop.backward_pending = False  # nothing is pending any more

    # ------------------------------------------------------------ checks
    def check(self, trainable: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Raise (or warn) before the optimizer applies a step the loop got wrong."""
        try:
            self._check_forward(trainable)
            self._check_epoch()
        finally:
            self.driver.loop.syncing_forwards = 0

    def _check_forward(self, trainable: Sequence[tuple[str, nn.Parameter]]) -> None:
        if not self._handles:
            return
        with_grad = [name for name, p in trainable if p.grad is not None]
        if with_grad and self.driver.loop.syncing_forwards == 0:
            raise AltParamsError(
                f"{len(with_grad)} trainable parameter(s) (e.g. {with_grad[:3]}) hold gradients, but no "
                "forward of the prepared DDP model ran since the last optimizer step, so DDP never "
                "all-reduced them and each rank would apply its own gradients (the ranks would diverge). "
                "Run the training forward through the object `accelerator.prepare` returned "
                "(`model(x)`), not `accelerator.unwrap_model(model)(x)` or the original module; use the "
                "unwrapped model only under `torch.no_grad()` (evaluation)."
            )

    def _check_epoch(self) -> None:
        driver = self.driver
        if driver.schedule.unit != "epoch" or driver.current is None:
            return
        per_epoch = self.steps_per_epoch()
        if not per_epoch:
            return
        loop = driver.loop
        passed = (driver.step - loop.epoch_set_at) // per_epoch
        if passed < 1:
            return
        implied = driver.epoch + passed
        due = driver.phase_at(driver.step, implied)
        if due == driver.current:
            return
        what = (f"{driver.step - loop.epoch_set_at} optimizer steps went by since "
                f"{'the last `accelerator.set_epoch(...)`' if loop.epoch_calls else 'the start'}, more "
                f"than one pass over the prepared dataloader ({per_epoch} steps), but the epoch-unit "
                f"schedule is still at epoch {driver.epoch} (phase {driver.current.name!r}); at "
                f"epoch {implied} it trains {due.name!r}.")
        fix = "Call `accelerator.set_epoch(epoch)` at the top of every epoch, on every rank."
        if loop.epoch_calls == 0:
            raise AltParamsError(f"{what} {fix}")
        if not self.warned_epoch:
            self.warned_epoch = True
            warnings.warn(f"hf_altparams: {what} If an epoch is meant to span several passes, ignore "
                          f"this; otherwise: {fix}", stacklevel=5)
