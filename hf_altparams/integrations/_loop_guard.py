"""Loop mistakes that :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` catches at ``step()``.

Both would train without any error while the ranks drift apart or a group never
trains; both are checked at a gradient-sync boundary, before the optimizer
applies the step:

* **the training forward bypassed the DDP wrapper** (e.g.
  ``accelerator.unwrap_model(model)(x)``): the trainable parameters hold
  gradients, but no forward of the wrapper that would all-reduce them
  (gradients enabled, outside ``no_sync``) ran since the previous step, so the
  reducer never saw them. A forward pre-hook on the wrapper counts those
  forwards. Raised on every rank (each rank runs the same loop).
* **an epoch-unit schedule whose epoch is never set**: more optimizer steps
  than one pass over the longest prepared dataloader went by since the last
  ``accelerator.set_epoch(...)`` (or the start) and the schedule's phase for
  the epoch the loop must be in differs from the current one. Raised when
  ``set_epoch`` was never called; a warning (once) when it was called before
  (an "epoch" longer than a pass is legitimate, if unusual).

Also at that boundary, with ``find_unused_parameters=False``:
**a trainable parameter of the phase got no gradient**
(:func:`check_trainable_gradients`): its bucket was never all-reduced.

And one refusal raised where the switch would happen: ``set_epoch`` called
inside a gradient-accumulation window when the new epoch switches phase
(:func:`mid_window_switch_error`). One warning (once): a sync-boundary
``zero_grad()`` that drops gradients no ``step()`` applied, the mark of
``zero_grad()`` called first inside ``accumulate()`` (it wipes the window's
earlier micro-batches there, with or without this library).
"""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..errors import AltParamsError

if TYPE_CHECKING:
    from .accelerate import PhasedAccelerator

__all__ = ["LoopGuard", "check_trainable_gradients", "mid_window_switch_error"]


class LoopGuard:
    """Per-run state of the two checks; :meth:`check` runs at every sync-boundary ``step()``."""

    def __init__(self) -> None:
        self.syncing_forwards = 0
        self.epoch_set_at: int = 0
        self.epoch_calls = 0
        self.warned_epoch = False
        self.warned_zero_grad = False
        self._handle: Optional[Any] = None

    # ------------------------------------------------------------ wiring
    def watch(self, ddp: nn.Module) -> None:
        """Count ``ddp``'s forwards that will all-reduce their gradients."""
        self.close()
        self._handle = ddp.register_forward_pre_hook(self._seen)

    def _seen(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True):
            self.syncing_forwards += 1

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def zero_grad_at_boundary(self, acc: PhasedAccelerator) -> None:
        """A sync-boundary ``zero_grad()``: warn (once) if it drops gradients no step applied."""
        if acc._backward_since_step and not self.warned_zero_grad and int(acc.gradient_accumulation_steps) > 1:
            self.warned_zero_grad = True
            warnings.warn(
                "hf_altparams: `optimizer.zero_grad()` ran at a gradient-sync boundary after a backward whose "
                "gradients no `optimizer.step()` applied yet: they are dropped. Inside `accelerator.accumulate()` "
                "this is `zero_grad()` called at the top of the iteration, which wipes the window's earlier "
                "micro-batches (plain Accelerate does the same); call it after `optimizer.step()` there. If you "
                "skipped the step on purpose (e.g. a non-finite loss), ignore this.", stacklevel=3)
        acc._backward_since_step = False  # nothing is pending any more

    def epoch_set(self, schedule_step: int) -> None:
        self.epoch_set_at = schedule_step
        self.epoch_calls += 1

    # ------------------------------------------------------------ checks
    def check(self, acc: PhasedAccelerator) -> None:
        """Raise (or warn) before the optimizer applies a step the loop got wrong."""
        try:
            self._check_forward(acc)
            self._check_epoch(acc)
        finally:
            self.syncing_forwards = 0

    def _check_forward(self, acc: PhasedAccelerator) -> None:
        if self._handle is None:
            return
        with_grad = [name for name, p in acc._trainable if p.grad is not None]
        if with_grad and self.syncing_forwards == 0:
            raise AltParamsError(
                f"{len(with_grad)} trainable parameter(s) (e.g. {with_grad[:3]}) hold gradients, but no "
                "forward of the prepared DDP model ran since the last optimizer step, so DDP never "
                "all-reduced them and each rank would apply its own gradients (the ranks would diverge). "
                "Run the training forward through the object `accelerator.prepare` returned "
                "(`model(x)`), not `accelerator.unwrap_model(model)(x)` or the original module; use the "
                "unwrapped model only under `torch.no_grad()` (evaluation)."
            )

    def _check_epoch(self, acc: PhasedAccelerator) -> None:
        switcher = acc.switcher
        if acc.schedule.unit != "epoch" or switcher is None or switcher.current is None:
            return
        per_epoch = steps_per_epoch(acc)
        if not per_epoch:
            return
        passed = (acc.schedule_step - self.epoch_set_at) // per_epoch
        if passed < 1:
            return
        implied = acc.schedule_epoch + passed
        due = acc.schedule.phase_at(acc.schedule_step, implied)
        if due == switcher.current:
            return
        what = (f"{acc.schedule_step - self.epoch_set_at} optimizer steps went by since "
                f"{'the last `accelerator.set_epoch(...)`' if self.epoch_calls else 'the start'}, more "
                f"than one pass over the prepared dataloader ({per_epoch} steps), but the epoch-unit "
                f"schedule is still at epoch {acc.schedule_epoch} (phase {switcher.current.name!r}); at "
                f"epoch {implied} it trains {due.name!r}.")
        fix = "Call `accelerator.set_epoch(epoch)` at the top of every epoch, on every rank."
        if self.epoch_calls == 0:
            raise AltParamsError(f"{what} {fix}")
        if not self.warned_epoch:
            self.warned_epoch = True
            warnings.warn(f"hf_altparams: {what} If an epoch is meant to span several passes, ignore "
                          f"this; otherwise: {fix}", stacklevel=4)


def steps_per_epoch(acc: PhasedAccelerator) -> int:
    """Optimizer steps in one pass over the longest prepared dataloader (0: unknown)."""
    lengths = []
    for loader in getattr(acc, "_dataloaders", []):
        try:
            lengths.append(len(loader))
        except TypeError:  # an iterable dataset has no length
            continue
    if not lengths:
        return 0
    return math.ceil(max(lengths) / max(1, int(acc.gradient_accumulation_steps)))


def check_trainable_gradients(acc: PhasedAccelerator) -> None:
    """Refuse a sync-boundary step where a trainable parameter of the phase got no gradient (DDP, no unused search)."""
    ddp = None if acc.switcher is None else acc.switcher.ddp
    if ddp is None or ddp.find_unused_parameters:
        return
    missing = [n for n, p in acc._trainable if p.grad is None]
    if missing:
        phase = acc.phase.name if acc.phase else "?"
        raise AltParamsError(
            f"{len(missing)} trainable parameter(s) of phase {phase!r} got no gradient in this step"
            f" (e.g. {missing[:3]}); DDP runs with `find_unused_parameters=False`, so "
            "their bucket was not all-reduced and the ranks would diverge. If the forward skips them on "
            "purpose (a branch or task head unused by this batch), pass `find_unused_parameters=True` to "
            "PhasedAccelerator; otherwise move them out of the phase's groups."
        )


def mid_window_switch_error(phase: str, step: int, epoch: int) -> AltParamsError:
    """A switch is due while a backward's gradients still wait for ``optimizer.step()``."""
    return AltParamsError(
        f"the schedule switches to phase {phase!r} now (step {step}, epoch {epoch}), but gradients of a "
        "backward still wait for `optimizer.step()` (a gradient-accumulation window is open); switching "
        "would drop them. Call `accelerator.set_epoch(epoch)` at the top of the epoch, before its first forward."
    )
