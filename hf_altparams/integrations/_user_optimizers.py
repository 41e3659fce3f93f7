"""What :meth:`PhasedAccelerator.prepare` does with the optimizers it is given.

Three forms drive the schedule, each passed in the same ``prepare`` call as the
grouped model (``groups.module``):

* one :class:`~hf_altparams.engine.GroupedOptimizer` (its groups are used when
  ``groups=`` is not given);
* one optimizer over every parameter the schedule trains, with ``groups=``;
* the user's own optimizers, one per group, with ``groups=``:
  ``model, opt1, opt2 = accelerator.prepare(model, opt1, opt2)``. Each is matched
  to a group by the parameters it holds (exactly that group's). One
  GroupedOptimizer is built from them (its state policy ``"keep"``) and prepared
  as the one optimizer Accelerate knows (one loss-scaler unscale and step per
  iteration under fp16, one optimizer in ``save_state``); the user gets back one
  :class:`OptimizerHandle` per optimizer, in the order passed.

Every other form is refused by :func:`find_grouped` before anything is prepared,
naming the argument, the value and the accepted forms; so is an optimizer that
leaves out a parameter the schedule trains (it would never be updated).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from torch.optim import Optimizer

from ..engine.optim import reapply_state_policy
from ..errors import PlanError


__all__ = ["GradientArrivals", "OptimizerHandle", "held", "unscale_once"]



def held(opt: Optimizer) -> list[nn.Parameter]:
    """Every parameter ``opt`` holds, in its param groups' order."""
    return [p for g in opt.param_groups for p in g["params"]]


class GradientArrivals:
    """What the handles share: did a backward put gradients on the groups since the last grouped step?

    ``fresh`` is set by a post-accumulate-grad hook on every parameter of the
    groups (public torch API; it fires however the backward was called, inside
    DDP's ``no_sync`` too). Torch registers such a hook only on a tensor that
    requires grad, so frozen parameters are unfrozen for the registration and
    frozen again at once; the hook stays through later switches. ``driving`` is
    the prepared grouped optimizer; ``unscaled`` notes that the loss scaler
    unscaled it since its last step (:class:`HandleUnscaleMixin`).
    """

    def __init__(self, params: list[nn.Parameter], driving: AcceleratedOptimizer) -> None:
        self.fresh = False
        self.unscaled = False
        self.driving = driving
        self._handles: list[Any] = []
        for param in params:
            frozen = not param.requires_grad
            if frozen:
                param.requires_grad_(True)
            try:
                self._handles.append(param.register_post_accumulate_grad_hook(self._arrived))
            finally:
                if frozen:
                    param.requires_grad_(False)

    def _arrived(self, param: nn.Parameter) -> None:
        self.fresh = True

    def close(self) -> None:
        """Remove the hooks (``free_memory``)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


class OptimizerHandle(AcceleratedOptimizer):
    """One of the user's optimizers after ``prepare(model, opt1, opt2)``.

    Every handle drives the same grouped step, so a loop written for the user's
    optimizers works unchanged whether it steps all of them every iteration or only
    the one of the group that trains now:

    * ``step()`` at a gradient-sync boundary runs the accelerator's one optimizer
      step: the optimizers of the groups active in this phase step (an idle group's
      optimizer does not; its state stays where it is), one loss-scaler step under
      fp16, and the schedule counts one step. The first handle stepped after a
      backward does it; the other handles' ``step()`` do nothing until the next
      backward. Inside an accumulation window ``step()`` does nothing, as in
      Accelerate.
    * ``zero_grad()`` clears the gradients of every group (calling it on every handle
      is harmless). The phase switches at the end of that one sync-boundary step,
      when the schedule says so, as with the other forms.
    * ``optimizer``, ``param_groups``, ``state_dict()`` are the user's optimizer's
      own (an LR scheduler built on it acts on its group only). ``save_state`` saves
      the grouped optimizer, keyed by group and parameter name.

    Example:
        >>> # accelerator = PhasedAccelerator(Alternating(["layer1", "layer2"]), groups=groups)
        >>> # model, opt1, opt2 = accelerator.prepare(model, opt1, opt2)
        >>> # accelerator.backward(loss); opt1.step(); opt2.step(); opt1.zero_grad(); opt2.zero_grad()
    """

    def __init__(self, optimizer: Optimizer, group: str, driving: AcceleratedOptimizer,
                 arrivals: GradientArrivals) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.group = group
        self.driving = driving
        self._arrivals = arrivals
        self._is_accelerate_prepared = True  # a later `prepare(handle)` returns it as is

    def __repr__(self) -> str:
        return f"OptimizerHandle(group={self.group!r}, optimizer={type(self.optimizer).__name__})"

    def step(self, closure: Optional[Callable[[], Any]] = None) -> None:  # type: ignore[override]
        if not self.gradient_state.sync_gradients or not self._arrivals.fresh:
            return
        self.driving.step(closure)
        self._arrivals.fresh = self._arrivals.unscaled = False

    def zero_grad(self, set_to_none: Optional[bool] = None) -> None:
        self.driving.zero_grad(set_to_none)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the last grouped step was skipped (fp16 overflow)."""
        return bool(self.driving.step_was_skipped)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the user's optimizer's state; the grouped optimizer sees the new param groups."""
        self.optimizer.load_state_dict(state_dict)
        grouped = self.driving.optimizer
        grouped.param_groups = [g for opt in grouped.inner.values() for g in opt.param_groups]
        reapply_state_policy(grouped)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise PlanError(
            f"OptimizerHandle.add_param_group: the optimizer of group {self.group!r} holds exactly that group's "
            "parameters; define a new group in ParamGroups (and its optimizer) before `prepare` instead"
        )


def unscale_once(optimizer: Any, prepared: list[Any], arrivals: Optional[GradientArrivals]) -> Any:
    """What ``accelerator.unscale_gradients(optimizer)`` should unscale: the grouped optimizer once per step.

    Accelerate unwraps ``unscale_gradients(optimizer=opt1)`` to the user's own
    ``opt1`` and unscales its gradients; the grouped step would then unscale
    them a second time (an update about ``scale`` times too small). Here a
    handle stands for the grouped optimizer it drives, and a grouped optimizer
    already unscaled since its last step (by a handle, or by
    ``clip_grad_norm_``) is left out, so ``unscale_gradients(opt1)``,
    ``unscale_gradients(opt2)`` and ``clip_grad_norm_`` may all run in one
    iteration. Returns the argument to pass on to Accelerate.
    """
    if arrivals is None:
        return optimizer
    listed = (list(prepared) if optimizer is None
              else list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer])
    chosen: list[Any] = []
    for opt in listed:
        opt = opt.driving if isinstance(opt, OptimizerHandle) else opt
        if opt is arrivals.driving:
            if arrivals.unscaled:
                continue
            arrivals.unscaled = True
        chosen.append(opt)
    return chosen
