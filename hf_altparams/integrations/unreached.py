"""A training forward that reached no trainable parameter: a clear error instead of torch's.

When the loss of a training step depends on no parameter that requires grad,
torch's backward fails with "element 0 of tensors does not require grad and does
not have a grad_fn", which names none of the causes a phased run adds. Both
integrations catch it where they can, before the backward:

* :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` in
  ``backward(loss)``: :func:`check_loss`;
* :class:`~hf_altparams.integrations.trainer.AlternatingFreeze`, whose callback
  events never see the loss: :class:`OutputGuard`, a forward hook on the model
  that looks at the output of each training forward (model in training mode,
  grad enabled): the ``loss`` it holds, or else its floating-point tensors.

The message names the phase, its trainable groups and how many of their
parameters require grad, and lists the causes with what to do for each: the
advice of each line holds for its own cause, so no line sends a user from one
cause into another (nothing here suggests ``find_unused_parameters``, which
would only hide the first cause).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..errors import UnreachedPhaseError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase

__all__ = ["OutputGuard", "check_loss", "unreached_message"]


def unreached_message(phase: Optional[Phase], groups: Optional[ParamGroups], where: str, task_hint: str) -> str:
    """The error text: the phase, its groups, and each likely cause with its own fix.

    ``task_hint``: how the loop reads the current task (``accelerator.task``).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> print(unreached_message(Phase({"b"}), groups, "backward", "accelerator.task")[:115])
        backward: the loss does not depend on any parameter that trains in phase 'b' (groups ['b']; 2 of their 2 parameters
    """
    if phase is None:
        head = f"{where}: the loss does not depend on any parameter that requires grad (no phase applied yet)"
    else:
        names = sorted(phase.trainable)
        params = [p for g in names for p in groups.params(g)] if groups is not None else []
        grad_on = sum(1 for p in params if p.requires_grad)
        head = (
            f"{where}: the loss does not depend on any parameter that trains in phase {phase.name!r} "
            f"(groups {names}; {grad_on} of their {len(params)} parameters require grad)"
        )
        if phase.task is not None:
            head += f", task {phase.task!r}"
    causes = [
        "the forward does not run through these groups (a branch, task head or adapter this batch skips): "
        "make each step's forward use what the phase trains",
        f"another task or adapter than the phase's is active (peft's `set_adapter`, a task switch): activate "
        f"the phase's own (read it from {task_hint} at the top of each step)",
        "the loss was computed under `torch.no_grad()` / `torch.inference_mode()`, or detached "
        "(`.detach()`, `.item()`, a cached output): compute it with grad enabled from the model's output",
        "gradient checkpointing with `use_reentrant=True` while the layers before the checkpointed ones are "
        "frozen: their outputs do not require grad; use `use_reentrant=False` (Trainer: "
        "`gradient_checkpointing_kwargs={'use_reentrant': False}`) or `model.enable_input_require_grads()`",
        "`requires_grad` turned off outside the schedule (`model.requires_grad_(False)`, a freezing helper): "
        "leave `requires_grad` to the schedule",
    ]
    return head + ". Likely causes: " + "; ".join(f"({i}) {c}" for i, c in enumerate(causes, 1)) + "."


def check_loss(loss: Any, phase: Optional[Phase], groups: Optional[ParamGroups], where: str, task_hint: str) -> None:
    """Raise :class:`UnreachedPhaseError` when ``loss`` (about to be backpropagated) requires no grad."""
    if isinstance(loss, torch.Tensor) and not loss.requires_grad:
        raise UnreachedPhaseError(unreached_message(phase, groups, where, task_hint))


def _tensors(output: Any) -> list[torch.Tensor]:
    """The loss of a model output if it has one, else its floating-point tensors (one level deep)."""
    if isinstance(output, torch.Tensor):
        return [output] if output.is_floating_point() else []
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return [loss]
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]


class OutputGuard:
    """A forward hook on ``module`` raising :class:`UnreachedPhaseError` for a training forward without grad.

    A training forward is one in training mode with grad enabled (the Trainer's
    evaluation runs under ``no_grad``); it is refused when its loss (or, without
    one, every floating-point output) requires no grad: its backward would fail.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1).requires_grad_(False)
        >>> guard = OutputGuard(net, lambda: None, None)
        >>> try:
        ...     net(torch.ones(1, 2))
        ... except UnreachedPhaseError as err:
        ...     print(str(err)[:56])
        the model's forward: the loss does not depend on any par
        >>> guard.remove()
    """

    def __init__(self, module: nn.Module, phase: Any, groups: Optional[ParamGroups]) -> None:
        self._phase, self._groups = phase, groups
        self._handle: Optional[Any] = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, _inputs: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        tensors = _tensors(output)
        if tensors and not any(t.requires_grad for t in tensors):
            raise UnreachedPhaseError(
                unreached_message(self._phase(), self._groups, "the model's forward", "`callback.task`")
            )

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
