"""The groups of :class:`~hf_altparams.integrations.trainer.AlternatingFreeze` on the Trainer's model.

Building the groups from the callback's ``groups`` / ``layers`` arguments on the
model the Trainer holds (checked against the schedule), the parameters the
schedule will ever train (made trainable at ``Trainer(...)`` so the default
optimizer covers them), and the check, at ``train()``, that the optimizer does
cover them. A mixin of the callback, whose events stay in :mod:`.trainer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Optional

from torch import nn
from torch.optim import Optimizer

from ..engine.optim._factories import uncovered_message
from ..errors import PlanError
from ..plan.groups import ParamGroups

if TYPE_CHECKING:
    from .trainer import AlternatingFreeze

__all__ = ["GroupsMixin"]


class GroupsMixin:
    """Group resolution and optimizer coverage for :class:`~hf_altparams.integrations.trainer.AlternatingFreeze`."""

    def resolve(self: AlternatingFreeze, model: nn.Module) -> ParamGroups:
        """Build the groups on ``model`` and validate the schedule against them."""
        arg = self._groups_arg
        try:
            if isinstance(arg, ParamGroups):
                groups = arg if arg.module is model else arg.rebind(model)
            elif isinstance(arg, Mapping):
                groups = ParamGroups(model, arg, ungrouped=self.ungrouped)
            elif arg is not None:
                groups = arg(model)
                if not isinstance(groups, ParamGroups):
                    raise PlanError(
                        f"the `groups` function returned {type(groups).__name__}; it must return "
                        "ParamGroups built on the model it is given"
                    )
            else:
                layers, per, prefix, extra = self._layers
                assert layers is not None
                groups = ParamGroups.from_layers(
                    model, layers, per=per, prefix=prefix, extra=extra, ungrouped=self.ungrouped
                )
        except PlanError as err:
            raise PlanError(f"AlternatingFreeze: cannot build the groups on {type(model).__name__}: {err}") from err
        if groups.module is not model:
            raise PlanError(
                "AlternatingFreeze: the groups were built on another module than the Trainer's "
                f"model ({type(groups.module).__name__} vs {type(model).__name__}); build them on "
                "the model you pass to Trainer"
            )
        self.schedule.validate(groups)
        return groups

    def scheduled_param_names(self: AlternatingFreeze) -> frozenset[str]:
        """Canonical names of every parameter some phase of the schedule may train."""
        assert self.groups is not None
        names = [g for g in self.groups.names if g in self.schedule.group_names()]
        return self.groups.trainable_param_names(names)

    def _make_scheduled_trainable(self: AlternatingFreeze, only: bool = False) -> None:
        assert self.groups is not None
        wanted = self.scheduled_param_names()
        for name, param in self.groups.all_named_params():
            if name in wanted or only:  # FSDP2: the rest frozen too (a resume loads no state for them)
                param.requires_grad_(name in wanted)

    def _check_optimizer(self: AlternatingFreeze, optimizer: Optional[Optimizer]) -> None:
        if optimizer is None:
            return
        assert self.groups is not None
        missing = uncovered_message(self.groups, self.schedule.group_names(), [optimizer])
        if missing is None:
            return
        raise PlanError(
            f"AlternatingFreeze: the optimizer {missing}; they would never be updated. The Trainer's default "
            "optimizer covers them when AlternatingFreeze is in `callbacks` of `Trainer(...)`. If you "
            "pass `optimizers=(optimizer, scheduler)` or build the optimizer yourself, build it over "
            "every parameter the schedule trains, whether frozen now or not (e.g. "
            "`torch.optim.AdamW(model.parameters())`, or `grouped_optimizer(groups, ...)` from "
            "hf_altparams.integrations.trainer), not over `filter(lambda p: p.requires_grad, ...)`."
        )
