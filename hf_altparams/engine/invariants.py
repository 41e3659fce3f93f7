"""Reality against the phase, before every optimizer step: nothing un-reduced ever reaches a weight.

The switch sets ``requires_grad`` for the phase and builds the DDP reducer for
exactly those parameters. Code outside the schedule can still change
``requires_grad`` (a helper calling ``model.requires_grad_(True)``, peft's
``set_adapter``, ``prepare_model_for_kbit_training``); a parameter it
unfreezes then gets a gradient computed on each rank alone, which DDP never
all-reduces, and any optimizer over it would step it: the ranks split, silently.
:func:`check_before_step` runs at every optimizer step of every entry point
(``PhasedAccelerator``'s prepared optimizer, ``AlternatingFreeze`` before the
Trainer's optimizer step, and a ``PhaseSwitcher`` given an optimizer: a step
pre-hook) and:

* refuses the step when a parameter outside the phase holds a gradient (DDP
  did not reduce it), naming the parameters, the phase and the usual causes;
* re-applies the phase's ``requires_grad`` where it was changed but no
  gradient arrived yet (the change would bite at the next forward), with one
  warning naming the parameters;
* refuses, under DDP with ``find_unused_parameters=False``, a step where some
  trainable parameters of the phase got a gradient and others none (their
  bucket was never all-reduced); the message gives the fix for each cause,
  since the library cannot tell a branch skipped on purpose from the wrong
  adapter or task. A step where none has a gradient applies nothing and passes.

The library re-applies the flags itself (it owns them) but never clears a
gradient it did not expect: a refused step changes nothing.

Wiring mistakes the switch refuses (or mends) before anything changes, for the
same reason (ranks that drift apart silently):

* a wrapper attached without ``rebuild`` that syncs other parameters than the
  current phase trains (DDP built before ``switcher.step_to(0)``; the
  backend's ``built_for_other_flags``): :meth:`PhaseSwitcher.attach` then
  warns and re-buckets it, as one collective transaction.
* :func:`unattached_error`: a switch after the first phase in a multi-rank run
  while no wrapper was ever attached (``switcher.attach(ddp)`` forgotten): the
  new phase's gradients would never be all-reduced, so the switch is refused on
  every rank, naming ``attach``.
* :func:`pending_grads_error`: a switch while gradients no optimizer step
  applied are pending (they would reach the next phase).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Iterable, Optional, Sequence

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..errors import AltParamsError, AltParamsWarning, Cause
from ..plan.phase import Phase
from .collective import is_distributed

__all__ = ["CULPRITS", "check_before_step", "check_each_step", "pending_grads_error", "unattached_error"]

#: What usually changes ``requires_grad`` behind the schedule's back.
CULPRITS = (
    "a helper that calls `model.requires_grad_(True)` (or freezes/unfreezes parameters by hand between steps)",
    "peft's `set_adapter(...)` / `enable_adapter_layers()`, which turn `requires_grad` on for the adapter they "
    "activate (let the schedule pick the adapter: hf_altparams.integrations.peft)",
    "peft's `prepare_model_for_kbit_training(model)` or `get_peft_model(...)` called after the run started",
)


def _culprits() -> str:
    return "; ".join(f"({i}) {c}" for i, c in enumerate(CULPRITS, 1))


def check_before_step(
    phase: Optional[Phase],
    trainable: Sequence[tuple[str, nn.Parameter]],
    idle: Sequence[tuple[str, nn.Parameter]],
    *,
    ddp_reduces: bool,
    find_unused: bool,
    warned: set[str],
    check_missing: bool = True,
) -> int:
    """Check the gradients and flags against ``phase`` before an optimizer step; returns flags re-applied.

    Args:
        phase: the phase the step trains (``None``: nothing applied yet; no check).
        trainable: the phase's trainable parameters (name, parameter).
        idle: every other parameter of the groups.
        ddp_reduces: a multi-rank DDP wrapper reduces the phase's gradients.
        find_unused: that wrapper searches for unused parameters.
        warned: names already warned about (updated; one warning per run and name set).
        check_missing: also refuse a trainable parameter without a gradient (the
            integrations); a bare ``PhaseSwitcher`` leaves that to its next switch,
            which refuses it with the same advice.

    Raises:
        AltParamsError: a parameter outside the phase holds a gradient under DDP, or a
            trainable one got none with ``find_unused_parameters=False``.
    """
    if phase is None:
        return 0
    stray = [name for name, p in idle if p.grad is not None]
    if stray and ddp_reduces:
        raise AltParamsError(
            f"{len(stray)} parameter(s) outside phase {phase.name!r} hold gradients (e.g. {stray[:4]}): their "
            "`requires_grad` was turned on behind the schedule's back, so each rank computed its own gradient "
            "and DDP, built for the phase's parameters, never all-reduced it; stepping would make the ranks "
            f"diverge. The step was not applied. Usual causes: {_culprits()}. Fix: let the schedule own "
            "`requires_grad` (remove that call, or make it before the run starts), or put those parameters in "
            "the groups of the phases that should train them.",
            cause=Cause.REQUIRES_GRAD_BEHIND_SCHEDULE,
        )
    flipped_on = [(n, p) for n, p in idle if p.requires_grad]
    flipped_off = [(n, p) for n, p in trainable if not p.requires_grad]
    if flipped_on or flipped_off:
        for _, param in flipped_on:
            param.requires_grad_(False)
        for _, param in flipped_off:
            param.requires_grad_(True)
        names = frozenset(n for n, _ in flipped_on + flipped_off)
        if not names <= warned:
            warned.update(names)
            examples = [n for n, _ in flipped_on[:3]] + [n for n, _ in flipped_off[:3]]
            warnings.warn(
                AltParamsWarning(
                    f"hf_altparams: `requires_grad` of {len(names)} parameter(s) (e.g. {examples}) no longer matched "
                    f"phase {phase.name!r} at this optimizer step; no gradient had reached them yet, so the phase's "
                    f"flags were put back (nothing un-reduced was applied). Usual causes: {_culprits()}.",
                    Cause.REQUIRES_GRAD_BEHIND_SCHEDULE,
                ),
                stacklevel=4,
            )
    if ddp_reduces and not find_unused and check_missing:
        missing = [name for name, p in trainable if p.grad is None]
        if missing and len(missing) < len(trainable):  # none at all: a step with nothing to apply
            raise AltParamsError(
                f"{len(missing)} trainable parameter(s) of phase {phase.name!r} got no gradient in this step "
                f"(e.g. {missing[:4]}); DDP runs with `find_unused_parameters=False`, so their bucket was not "
                "all-reduced and the ranks would diverge. The step was not applied. Which fix depends on why: "
                "if the forward skips them on purpose (a branch or a task head unused by this batch), pass "
                "`find_unused_parameters=True` (PhasedAccelerator) / `ddp_find_unused_parameters=True` "
                "(TrainingArguments); if the loop ran the wrong branch, task or adapter for this phase (read "
                "`accelerator.phase` / `.task` at the top of the iteration), fix the loop; if they should not "
                "train in this phase, move them out of its groups. Something that turns `requires_grad` off "
                f"behind the schedule's back causes it too: {_culprits()}.",
                cause=Cause.TRAINABLE_PARAM_UNUSED,
            )
    return len(flipped_on) + len(flipped_off)


def check_each_step(optimizer: Any, owner: Any) -> Any:
    """Run ``owner.check_before_step()`` before every ``step()`` of ``optimizer`` (its innermost torch optimizer).

    A step pre-hook (public torch API), so it runs however the step is called:
    by Accelerate's prepared optimizer, by the Trainer, by the user's loop. The
    hook refers to ``owner`` weakly (an optimizer must not keep a finished
    run's switcher alive). Returns the hook's handle (``None`` without an optimizer).
    """
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), Optimizer):  # Accelerate's wrapper, LOMO wrappers
        inner = inner.optimizer
    if not isinstance(inner, Optimizer):
        return None
    ref = weakref.ref(owner)

    def check(opt: Optimizer, args: Any, kwargs: Any) -> None:
        live = ref()
        if live is not None:
            live.check_before_step()

    return inner.register_step_pre_hook(check)


def unattached_error(current: Optional[Phase], attached: bool) -> Optional[str]:
    """The refusal for a switch in a multi-rank run that never attached its wrapper, or ``None``.

    ``attached``: a wrapper that synchronises gradients was attached, or the
    plain module was, on purpose.
    """
    if current is None or attached:
        return None  # the first phase comes before DDP is built; a wrapper is attached
    if not is_distributed(None):
        return None
    return (
        f"this run has {dist.get_world_size()} ranks but no DDP wrapper was attached to the switcher, "
        "so the new phase's gradients would never be all-reduced (DDP keeps the parameter set it was "
        "built with). Call `switcher.attach(ddp)` right after building the wrapper (or "
        "`switcher.attach(module)` if this run trains the module without a wrapper on purpose)"
    )


def pending_grads_error(named_params: Iterable[tuple[str, nn.Parameter]]) -> Optional[str]:
    """The refusal for a switch while parameters hold gradients no optimizer step applied, or ``None``."""
    pending = [n for n, p in named_params if p.grad is not None and _nonzero(p.grad)]
    if pending:
        return (
            f"{len(pending)} parameters hold pending gradients (e.g. {pending[:3]}): "
            "call optimizer.step() and optimizer.zero_grad(set_to_none=True) before switching"
        )
    return None


def _nonzero(grad: Any) -> bool:
    """Whether a gradient holds any non-zero value (a sparse one, e.g. from ``Embedding(sparse=True)``, too)."""
    if grad.is_sparse:
        grad = grad.coalesce().values()
    return bool(grad.ne(0).any())
