"""What :meth:`PhasedAccelerator.prepare` finds in its arguments: the grouped model(s) and the driving optimizer.

Every ``prepare`` form Accelerate accepts works, in any order of arguments and
over separate calls:

* the grouped model (``groups.module``), or, for several models trained by one
  schedule (``ParamGroups.of_models({"generator": g, "discriminator": d})``),
  each model, in the same call or in separate ones;
* the optimizer(s) that drive the schedule, in the same call as the model(s)
  or in a later one: one :class:`~hf_altparams.engine.GroupedOptimizer` (its
  groups are used when ``groups=`` is not given), one optimizer over every
  parameter the schedule trains, or one optimizer per group (each matched to
  its group by the parameters it holds; they are combined into one
  GroupedOptimizer and handed back as one :class:`~._user_optimizers.OptimizerHandle`
  each, in the order passed);
* anything else (schedulers, dataloaders, other models and optimizers),
  prepared by Accelerate as usual.

Refused before anything is prepared, naming the argument, the value and the
accepted forms: an optimizer over the grouped parameters before its model, a
second driving optimizer, a model prepared twice, a DDP the user built, an
optimizer that leaves out a parameter the schedule trains.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Union

from torch import nn
from torch.optim import Optimizer

from ..engine._models import model_name_in
from ..engine.ddp import is_ddp
from ..engine.optim import GroupedOptimizer
from ..engine.optim._factories import match_to_groups, uncovered_message
from ..errors import AltParamsError, PlanError
from ..plan.groups import ParamGroups
from ..plan.schedules import Schedule
from ._accelerate_parts import refuse_user_ddp, refuse_without_groups
from ._user_optimizers import GradientArrivals, OptimizerHandle, held

__all__ = ["FORMS", "Found", "checked_phases", "find_grouped"]

FORMS = (
    "Accepted next to the grouped model (or each model of ParamGroups.of_models), in the same `prepare` call or a "
    "later one: the optimizer(s) that drive the schedule: one GroupedOptimizer(groups, ...); one optimizer over "
    "every parameter the schedule trains (with `groups=` given to PhasedAccelerator); or one optimizer per group, "
    "each built on exactly that group's parameters, e.g. `model, opt1, opt2 = accelerator.prepare(model, opt1, "
    "opt2)` with opt1 = Adam(model.layer1.parameters()) and opt2 = Adam(model.layer2.parameters())."
)


def _label(index: int) -> str:
    return f"`prepare` argument #{index + 1}"


@dataclasses.dataclass
class Found:
    """What one ``prepare`` call holds of the phased run.

    ``models`` maps the index of each grouped model in ``arguments()`` to its
    name among several models (``None``: the groups' module itself).
    ``driving`` is the optimizer that drives the schedule, if this call brings it;
    ``user`` maps ``prepare`` argument indexes to group names when the user
    passed one optimizer per group (``driving`` is then the GroupedOptimizer
    built from them, prepared in the first one's place).
    """

    groups: Optional[ParamGroups] = None
    models: dict[int, Optional[str]] = dataclasses.field(default_factory=dict)
    driving: Optional[Optimizer] = None
    user: dict[int, str] = dataclasses.field(default_factory=dict)

    def arguments(self, args: tuple[Any, ...], placement: Optional[list[bool]]
                  ) -> tuple[tuple[Any, ...], Optional[list[bool]]]:
        """``prepare``'s arguments with the user's optimizers replaced by the grouped one."""
        if not self.user:
            return args, placement
        first = min(self.user)
        keep = [i for i in range(len(args)) if i == first or i not in self.user]
        return (tuple(self.driving if i == first else args[i] for i in keep),
                None if placement is None else [placement[i] for i in keep])

    def hand_back(self, args: tuple[Any, ...], items: list[Any]
                  ) -> tuple[list[Any], Optional[GradientArrivals]]:
        """What the user gets: ``items`` in the order of ``args``, a handle per optimizer passed.

        Also returns the handles' shared :class:`GradientArrivals` (``None`` without handles).
        """
        if not self.user:
            return items, None
        assert self.groups is not None
        first = min(self.user)
        prepared = items[sum(1 for i in range(first) if i not in self.user)]
        arrivals = GradientArrivals([p for g in self.groups.names for p in self.groups.params(g)], prepared)
        rest = iter(items)
        out = []
        for i, arg in enumerate(args):
            if i == first or i not in self.user:
                item = next(rest)
            if i in self.user:
                item = OptimizerHandle(arg, self.user[i], prepared, arrivals)
            out.append(item)
        return out, arrivals


def _model_part(root: nn.Module, arg: Any) -> tuple[bool, Optional[str]]:
    """Whether ``arg`` is a grouped model, and its name among several (``None``: the root itself)."""
    if arg is root:
        return True, None
    name = model_name_in(root, arg) if isinstance(arg, nn.Module) else None
    return name is not None, name


def _touches(opt: Optimizer, module: nn.Module, ids: set[int]) -> bool:
    if isinstance(opt, GroupedOptimizer):
        return opt.groups.module is module
    return any(id(p) in ids for p in held(opt))


def _check_coverage(groups: ParamGroups, schedule: Schedule, what: str, opt: Optimizer) -> None:
    """A parameter the schedule trains that the driving optimizer (``what``) does not hold."""
    missing = uncovered_message(groups, schedule.group_names(), [opt])
    if missing is None:
        return
    raise PlanError(
        f"{what} {missing}; they would never be updated. Build it over every parameter the schedule trains, "
        "whether frozen now or not "
        "(e.g. `torch.optim.AdamW(model.parameters())`, not over the trainable ones only), or pass one "
        f"optimizer per group; ungrouped parameters need a group when ungrouped='trainable'. {FORMS}"
    )


def find_grouped(args: tuple[Any, ...], groups: Optional[ParamGroups], schedule: Optional[Schedule], *,
                 prepared_models: set[Optional[str]], driving_bound: bool) -> Found:
    """Find the grouped model(s) and the optimizer(s) that drive the schedule in ``prepare``'s ``args``.

    ``groups`` are the accelerator's (``None`` when only a GroupedOptimizer can
    tell); ``prepared_models``: the grouped models prepared by earlier calls;
    ``driving_bound``: an earlier call brought the driving optimizer. Refuses,
    before anything is prepared, every form the schedule could not drive.
    """
    if schedule is None:
        return Found()
    optimizers = [(i, a) for i, a in enumerate(args)
                  if isinstance(a, Optimizer) and not getattr(a, "_is_accelerate_prepared", False)]
    grouped = [o for _, o in optimizers if isinstance(o, GroupedOptimizer)]
    if groups is None and grouped:
        groups = grouped[0].groups
    if groups is None:
        if optimizers:
            refuse_without_groups([o for _, o in optimizers])
        return Found()
    root = groups.module
    models: dict[int, Optional[str]] = {}
    for i, arg in enumerate(args):
        is_model, name = _model_part(root, arg)
        if is_model:
            models[i] = name
        elif is_ddp(arg) and (arg.module is root or _model_part(root, arg.module)[0]):
            refuse_user_ddp()
    twice = [name for name in models.values() if name in prepared_models]
    if twice or len(set(models.values())) < len(models):
        raise AltParamsError(
            f"`prepare` got the grouped model{'' if twice == [None] else ' ' + repr(twice)} a second time. "
            "Preparing the raw module again would add it to `accelerator._models` twice (two model files in "
            "save_state) and wrap its autocast forward twice; keep using the object the first `prepare` "
            "returned: switches rebuild it in place.")
    ids = {id(p) for p in root.parameters()}
    mine = [(i, o) for i, o in optimizers if _touches(o, root, ids)]
    found = Found(groups, models)
    if not mine:
        return found
    if driving_bound:
        i, opt = mine[0]
        raise AltParamsError(
            f"{_label(i)} ({type(opt).__name__}) is an optimizer of the grouped model, passed after the model was "
            f"prepared with the optimizer that drives the schedule: a second one would step outside it. {FORMS}")
    if not models and not prepared_models:
        i, opt = mine[0]
        raise AltParamsError(
            f"{_label(i)} ({type(opt).__name__}) is an optimizer of the grouped model, passed without the model "
            "(before it); prepare the model first, in the same call or an earlier one: the first phase must be "
            f"applied before DDP wraps it. {FORMS}")
    if any(isinstance(o, GroupedOptimizer) for _, o in mine) and len(mine) > 1:
        raise AltParamsError(
            f"`prepare` got a GroupedOptimizer and {len(mine) - 1} more optimizer(s) over the grouped model's "
            f"parameters ({[f'{_label(i)} ({type(o).__name__})' for i, o in mine]}); one optimizer (or one "
            f"per group) drives the schedule: a second would step outside it. {FORMS}")
    if len(mine) == 1:
        index, found.driving = mine[0]
        _check_coverage(groups, schedule, f"{_label(index)} ({type(found.driving).__name__})", found.driving)
        return found
    matched = match_to_groups(groups, [(_label(i), o) for i, o in mine], forms=FORMS)
    group_of = {id(opt): name for name, opt in matched.items()}
    found.user = {i: group_of[id(o)] for i, o in mine}
    found.driving = GroupedOptimizer(groups, matched)
    # what no group holds: ungrouped parameters under ungrouped="trainable"
    _check_coverage(groups, schedule, "the optimizers passed, one per group,", found.driving)
    call_args, _ = found.arguments(args, None)
    found.models = {j: models[i] for i in models for j, a in enumerate(call_args) if a is args[i]}
    return found


def checked_phases(schedule: Optional[Schedule], groups: Union[None, ParamGroups, Mapping[str, nn.Module]]
                    ) -> tuple[Optional[Schedule], Optional[ParamGroups]]:
    """The constructor's (or ``set_phases``') schedule and groups, checked; a mapping of models becomes groups."""
    if schedule is not None and not isinstance(schedule, Schedule):
        raise PlanError(f"`schedule` must be an hf_altparams Schedule or None, got {type(schedule).__name__}: "
                        f"{schedule!r}")
    if isinstance(groups, Mapping) and all(isinstance(m, nn.Module) for m in groups.values()):
        groups = ParamGroups.of_models(groups)
    if groups is not None and not isinstance(groups, ParamGroups):
        raise PlanError(f"`groups` must be a ParamGroups, a mapping of names to models, or None; got "
                        f"{type(groups).__name__}")
    if groups is not None and schedule is None:
        raise PlanError("`groups` was given without a `schedule`; pass both (or neither, for a plain Accelerator)")
    if groups is not None and schedule is not None:
        schedule.validate(groups)
    return schedule, groups
