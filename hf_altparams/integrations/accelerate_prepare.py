"""What :meth:`PhasedAccelerator.prepare` accepts: the grouped model(s), the optimizer(s) that drive the schedule.

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
  GroupedOptimizer and handed back as one :class:`OptimizerHandle` each, in
  the order passed; see below);
* anything else (schedulers, dataloaders, other models and optimizers),
  prepared by Accelerate as usual.

Refused before anything is prepared, naming the argument, the value and the
accepted forms: an optimizer over the grouped parameters before its model, a
second driving optimizer, a model prepared twice, a DDP the user built, an
optimizer that leaves out a parameter the schedule trains.

The user's own optimizers, one per group: each is matched to a group by the
parameters it holds (exactly that group's). One GroupedOptimizer is built from
them (its state policy the run's: ``"drop"`` under lisa and badam, ``"keep"`` otherwise) and prepared as the one optimizer Accelerate
knows (one loss-scaler unscale and step per iteration under fp16, one optimizer
in ``save_state``); the user gets back one :class:`OptimizerHandle` per
optimizer. :class:`GradientArrivals` tells the handles whether a backward put
gradients on the groups since the last grouped step, and :func:`unscale_once`
keeps Accelerate from unscaling the grouped optimizer twice.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import extract_model_from_parallel, has_compiled_regions, is_compiled_module
from torch import nn
from torch.optim import Optimizer

from ..engine.backend import model_name_in
from ..engine.optim import GroupedOptimizer, frozen_ungrouped, grouped_in, match_to_groups, uncovered_message
from ..engine.strategies import strategy_for
from ..errors import AltParamsError, Cause, PlanError
from ..plan.groups import ParamGroups
from ..plan.schedules import Schedule
from .accelerate_internals import is_prepared, mark_prepared
from .refusals import ACCELERATE, Configuration, check

__all__ = [
    "FORMS",
    "Found",
    "GradientArrivals",
    "OptimizerHandle",
    "checked_phases",
    "find_grouped",
    "held",
    "unscale_once",
]

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

    def arguments(
        self, args: tuple[Any, ...], placement: Optional[Sequence[Optional[bool]]]
    ) -> tuple[tuple[Any, ...], Optional[Sequence[Optional[bool]]]]:
        """``prepare``'s arguments with the user's optimizers replaced by the grouped one."""
        if not self.user:
            return args, placement
        first = min(self.user)
        keep = [i for i in range(len(args)) if i == first or i not in self.user]
        return (
            tuple(self.driving if i == first else args[i] for i in keep),
            None if placement is None else [placement[i] for i in keep],
        )

    def hand_back(self, args: tuple[Any, ...], items: list[Any]) -> tuple[list[Any], Optional[GradientArrivals]]:
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
    if isinstance(arg, nn.Module) and is_compiled_module(arg):  # torch.compile(model): one process only
        arg = extract_model_from_parallel(arg, keep_torch_compile=False)
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
        f"optimizer per group; ungrouped parameters need a group when ungrouped='trainable'. {FORMS}",
        cause=Cause.OPTIMIZER_MISSES_PARAMETERS,
    )


def find_grouped(
    args: tuple[Any, ...],
    groups: Optional[ParamGroups],
    schedule: Optional[Schedule],
    *,
    prepared_models: set[Optional[str]],
    driving_bound: bool,
    multi_process: bool = False,
) -> Found:
    """Find the grouped model(s) and the optimizer(s) that drive the schedule in ``prepare``'s ``args``.

    ``groups`` are the accelerator's (``None`` when only a GroupedOptimizer can
    tell); ``prepared_models``: the grouped models prepared by earlier calls;
    ``driving_bound``: an earlier call brought the driving optimizer;
    ``multi_process``: the run has several processes (DDP or FSDP2). Refuses,
    before anything is prepared, every form the schedule could not drive.

    ``groups={"a": net.layer1, "b": net.layer2}`` with ``prepare(net, ...)``
    means groups of ``net``: they are rebuilt on it (``ParamGroups(net, {...})``).
    A model compiled with ``torch.compile`` before ``prepare`` trains in one
    process (its groups named either way); with several processes it is refused.
    """
    if schedule is None:
        return Found()
    optimizers = [(i, a) for i, a in enumerate(args) if isinstance(a, Optimizer) and not is_prepared(a)]
    grouped = [o for _, o in optimizers if isinstance(o, GroupedOptimizer)]
    if groups is None and grouped:
        groups = grouped[0].groups
    if groups is None:
        if optimizers:
            _refuse_without_groups([o for _, o in optimizers])
        return Found()
    groups = _groups_of_one_model(groups, args, schedule)
    root = groups.module
    _check_compiled(args, root, multi_process)
    models: dict[int, Optional[str]] = {}
    for i, arg in enumerate(args):
        is_model, name = _model_part(root, arg)
        if is_model:
            models[i] = name
        elif isinstance(arg, nn.Module):
            strategy = strategy_for(arg)
            inner = strategy.wrapped_module(arg)
            if strategy.capabilities.wraps_module and (inner is root or _model_part(root, inner)[0]):
                _refuse_user_wrapper(arg)
    twice = [name for name in models.values() if name in prepared_models]
    if twice or len(set(models.values())) < len(models):
        raise AltParamsError(
            f"`prepare` got the grouped model{'' if twice == [None] else ' ' + repr(twice)} a second time. "
            "Preparing the raw module again would add it to `accelerator._models` twice (two model files in "
            "save_state) and wrap its autocast forward twice; keep using the object the first `prepare` "
            "returned: switches rebuild it in place."
        )
    ids = {id(p) for p in root.parameters()}
    mine = [(i, o) for i, o in optimizers if _touches(o, root, ids)]
    found = Found(groups, models)
    if not mine:
        return found
    if driving_bound:
        i, opt = mine[0]
        raise AltParamsError(
            f"{_label(i)} ({type(opt).__name__}) is an optimizer of the grouped model, passed after the model was "
            f"prepared with the optimizer that drives the schedule: a second one would step outside it. {FORMS}"
        )
    if not models and not prepared_models:
        i, opt = mine[0]
        others = [f"{_label(j)} ({type(a).__name__})" for j, a in enumerate(args) if isinstance(a, nn.Module)]
        copies = [
            j
            for j, a in enumerate(args)
            if isinstance(a, nn.Module)
            and has_compiled_regions(a)
            and extract_model_from_parallel(a, keep_torch_compile=False) is root
        ]
        if copies:
            raise AltParamsError(
                f"{_label(copies[0])} is `accelerate.utils.compile_regions(model)` of the grouped model: a copy of "
                "its module tree (each block wrapped, its parameter names gaining `._orig_mod`), while the groups "
                "(and the optimizer's) were built on the model itself. Build the groups on the model "
                "`compile_regions` returned (`ParamGroups(compiled, ...)`; patterns such as 'model.layers.0.*' "
                "match either way), or compile in place so nothing is copied: "
                f"`hf_altparams.compile_regions_in_place(model)`. {FORMS}"
            )
        if others:
            raise AltParamsError(
                f"{_label(i)} ({type(opt).__name__}) is an optimizer of the grouped model, but no argument of this "
                f"`prepare` is that model: the groups were built on a {type(root).__name__}, and {others} is not it "
                "(nor one of the models of `ParamGroups.of_models`). Build the groups on the model you pass to "
                f"`prepare` (`ParamGroups(model, ...)`). {FORMS}"
            )
        raise AltParamsError(
            f"{_label(i)} ({type(opt).__name__}) is an optimizer of the grouped model, passed without the model "
            "(before it); prepare the model first, in the same call or an earlier one: the first phase must be "
            f"applied before DDP wraps it. {FORMS}"
        )
    if any(isinstance(o, GroupedOptimizer) for _, o in mine) and len(mine) > 1:
        raise AltParamsError(
            f"`prepare` got a GroupedOptimizer and {len(mine) - 1} more optimizer(s) over the grouped model's "
            f"parameters ({[f'{_label(i)} ({type(o).__name__})' for i, o in mine]}); one optimizer (or one "
            f"per group) drives the schedule: a second would step outside it. {FORMS}"
        )
    if len(mine) == 1:
        index, found.driving = mine[0]
        _check_coverage(groups, schedule, f"{_label(index)} ({type(found.driving).__name__})", found.driving)
        _warn_frozen_ungrouped(groups, found.driving)
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


def _groups_of_one_model(groups: ParamGroups, args: tuple[Any, ...], schedule: Schedule) -> ParamGroups:
    """``groups`` of several models (``{"a": net.layer1, ...}``) rebuilt on ``net`` when ``net`` is passed.

    A mapping of names to modules means several models trained by one schedule,
    each prepared (and wrapped) on its own (a GAN); when the modules are all
    parts of one model passed to ``prepare`` instead, the user meant groups of
    that model, and gets them.
    """
    root = groups.module
    if not isinstance(root, nn.ModuleDict) or any(arg is root or model_name_in(root, arg) for arg in args):
        return groups
    parts = dict(root.items())
    if set(groups.names) != set(parts):
        return groups
    for arg in args:
        if isinstance(arg, nn.Module) and not strategy_for(arg).capabilities.wraps_module:
            inside = {id(m) for m in arg.modules() if m is not arg}
            if all(id(part) in inside for part in parts.values()):
                rebuilt = ParamGroups(arg, {name: part for name, part in parts.items()}, ungrouped=groups.ungrouped)
                schedule.validate(rebuilt)
                return rebuilt
    return groups


def _check_compiled(args: tuple[Any, ...], root: nn.Module, multi_process: bool) -> None:
    """Refuse a model compiled before ``prepare`` in a run of several processes (the way out named)."""
    if not multi_process:
        return
    for i, arg in enumerate(args):
        if isinstance(arg, nn.Module) and is_compiled_module(arg):
            inner = extract_model_from_parallel(arg, keep_torch_compile=False)
            if arg is root or inner is root or model_name_in(root, arg) or model_name_in(root, inner):
                check(Configuration(ACCELERATE, compiled_model=_label(i)))


def _warn_frozen_ungrouped(groups: ParamGroups, optimizer: Optimizer) -> None:
    """Warn, naming them, about parameters ``optimizer`` holds that no group names (``ungrouped="frozen"``)."""
    frozen = frozen_ungrouped(groups, [optimizer])
    if frozen:
        warnings.warn(
            f"hf_altparams: the optimizer holds {len(frozen)} parameter(s) that no group names (e.g. "
            f"{frozen[:4]}); with ungrouped='frozen' (the default) they stay frozen for the whole run and are "
            "never updated. Put them in a group of the schedule, or pass `ungrouped='trainable'` to ParamGroups "
            "to train them in every phase.",
            stacklevel=4,
        )


def checked_phases(
    schedule: Optional[Schedule], groups: Union[None, ParamGroups, Mapping[str, nn.Module]]
) -> tuple[Optional[Schedule], Optional[ParamGroups]]:
    """The constructor's (or ``set_phases``') schedule and groups, checked; a mapping of models becomes groups."""
    if schedule is not None and not isinstance(schedule, Schedule):
        raise PlanError(
            f"`schedule` must be an hf_altparams Schedule or None, got {type(schedule).__name__}: {schedule!r}"
        )
    if isinstance(groups, Mapping) and all(isinstance(m, nn.Module) for m in groups.values()):
        groups = ParamGroups.of_models(groups)
    if groups is not None and not isinstance(groups, ParamGroups):
        raise PlanError(
            f"`groups` must be a ParamGroups, a mapping of names to models, or None; got {type(groups).__name__}"
        )
    if groups is not None and schedule is None:
        raise PlanError("`groups` was given without a `schedule`; pass both (or neither, for a plain Accelerator)")
    if groups is not None and schedule is not None:
        schedule.validate(groups)
    return schedule, groups


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
    unscaled it since its last step (:func:`unscale_once`).
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

    def __init__(
        self, optimizer: Optimizer, group: str, driving: AcceleratedOptimizer, arrivals: GradientArrivals
    ) -> None:
        super().__init__(optimizer, device_placement=False, scaler=None)
        self.group = group
        self.driving = driving
        self._arrivals = arrivals
        mark_prepared(self)  # a later `prepare(handle)` returns it as is

    def __repr__(self) -> str:
        return f"OptimizerHandle(group={self.group!r}, optimizer={type(self.optimizer).__name__})"

    # no loss returned, closure or not, as Accelerate's own step (torch's returns the closure's loss)
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
        grouped = grouped_in(self.driving)
        assert grouped is not None
        grouped.refresh_param_groups()  # torch's load replaced the inner optimizer's param_group dicts
        grouped.reapply_policy()

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
    listed = (
        list(prepared)
        if optimizer is None
        else list(optimizer)
        if isinstance(optimizer, (list, tuple))
        else [optimizer]
    )
    chosen: list[Any] = []
    for opt in listed:
        opt = opt.driving if isinstance(opt, OptimizerHandle) else opt
        if opt is arrivals.driving:
            if arrivals.unscaled:
                continue
            arrivals.unscaled = True
        chosen.append(opt)
    return chosen


def _refuse_without_groups(optimizers: list[Optimizer]) -> None:
    """`prepare` got optimizers but no groups are known: the schedule could never apply."""
    raise AltParamsError(
        f"`prepare` got {[type(o).__name__ for o in optimizers]} but PhasedAccelerator does not know "
        "the parameter groups, so its schedule would never apply (everything would train, "
        "`phase` None); pass `groups=ParamGroups(model, ...)` to PhasedAccelerator, or use a "
        "GroupedOptimizer(groups, ...)"
    )


def _refuse_user_wrapper(wrapper: nn.Module) -> None:
    """`prepare` got a wrapper (a registered strategy's: DDP, ...) the user built around the grouped model."""
    raise AltParamsError(
        f"`prepare` got a {type(wrapper).__name__} you built around the grouped model; pass the model itself "
        "(`groups.module`): PhasedAccelerator applies the first phase before Accelerate builds the wrapper, and "
        "adapts that wrapper at each switch (DDP's reducer is rebuilt), which a wrapper built earlier (over every "
        "parameter) would miss"
    )
