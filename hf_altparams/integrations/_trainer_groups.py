"""The groups of :class:`~hf_altparams.integrations.trainer.AlternatingFreeze` on the Trainer's model.

Building the groups from the callback's ``groups`` / ``layers`` arguments on the
model the Trainer holds (checked against the schedule), the parameters the
schedule will ever train (made trainable at ``Trainer(...)`` so the default
optimizer covers them), and the check, at ``train()``, that the optimizer does
cover them. Plain functions of the callback's arguments; its events stay in :mod:`.trainer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from torch import nn
from torch.optim import Optimizer

from ..engine.optim._factories import uncovered_message
from ..errors import PlanError
from ..plan.groups import ParamGroups, UngroupedPolicy
from ..plan.schedules import Schedule

__all__ = ["GroupsSpec", "check_optimizer_covers", "make_scheduled_trainable", "resolve_groups",
           "scheduled_param_names"]


@dataclass(frozen=True)
class GroupsSpec:
    """How :class:`~hf_altparams.integrations.trainer.AlternatingFreeze` was told to build its groups.

    ``groups`` (a mapping, a function or ParamGroups), or ``layers`` with ``per``,
    ``prefix`` and ``extra``; ``ungrouped`` is the policy for the rest.
    """

    groups: Any = None
    layers: Optional[str] = None
    per: int = 1
    prefix: str = "layer"
    extra: Mapping[str, Any] = field(default_factory=dict)
    ungrouped: UngroupedPolicy = "frozen"


def resolve_groups(spec: GroupsSpec, schedule: Schedule, model: nn.Module) -> ParamGroups:
    """Build the groups of ``spec`` on ``model`` and validate ``schedule`` against them."""
    arg = spec.groups
    try:
        if isinstance(arg, ParamGroups):
            groups = arg if arg.module is model else arg.rebind(model)
        elif isinstance(arg, Mapping):
            groups = ParamGroups(model, arg, ungrouped=spec.ungrouped)
        elif arg is not None:
            groups = arg(model)
            if not isinstance(groups, ParamGroups):
                raise PlanError(
                    f"the `groups` function returned {type(groups).__name__}; it must return "
                    "ParamGroups built on the model it is given"
                )
        else:
            assert spec.layers is not None
            groups = ParamGroups.from_layers(model, spec.layers, per=spec.per, prefix=spec.prefix,
                                             extra=dict(spec.extra), ungrouped=spec.ungrouped)
    except PlanError as err:
        raise PlanError(f"AlternatingFreeze: cannot build the groups on {type(model).__name__}: {err}") from err
    if groups.module is not model:
        raise PlanError(
            "AlternatingFreeze: the groups were built on another module than the Trainer's "
            f"model ({type(groups.module).__name__} vs {type(model).__name__}); build them on "
            "the model you pass to Trainer"
        )
    schedule.validate(groups)
    return groups


def scheduled_param_names(groups: ParamGroups, schedule: Schedule) -> frozenset[str]:
    """Canonical names of every parameter some phase of ``schedule`` may train."""
    names = [g for g in groups.names if g in schedule.group_names()]
    return groups.trainable_param_names(names)


def make_scheduled_trainable(groups: ParamGroups, schedule: Schedule, only: bool = False) -> None:
    """``requires_grad=True`` on every parameter the schedule may train (``only``: the rest frozen too)."""
    wanted = scheduled_param_names(groups, schedule)
    for name, param in groups.all_named_params():
        if name in wanted or only:  # FSDP2: the rest frozen too (a resume loads no state for them)
            param.requires_grad_(name in wanted)


def check_optimizer_covers(groups: ParamGroups, schedule: Schedule, optimizer: Optional[Optimizer]) -> None:
    """Refuse an optimizer that leaves out a parameter the schedule trains (it would never be updated)."""
    if optimizer is None:
        return
    missing = uncovered_message(groups, schedule.group_names(), [optimizer])
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
