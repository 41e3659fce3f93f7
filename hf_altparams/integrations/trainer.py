"""The 🤗 Trainer integration: phased training from one callback.

Add :class:`AlternatingFreeze` to ``callbacks`` and change nothing else::

    trainer = Trainer(
        model=model, args=args, train_dataset=train,
        callbacks=[AlternatingFreeze(
            layers="bert.encoder.layer", extra={"head": ["classifier.*", "bert.pooler.*"]},
            schedule=GradualUnfreeze(["layer4", "layer5"], every=50, always=["head"]),
        )],
    )

How the callback meets the Trainer, event by event (``on_init_end``: groups and
the optimizer's coverage; ``on_train_begin``: the phase of ``state.global_step``
and the DDP wrapper caught at its first call; each optimizer step: the phase's
invariants; ``on_step_end``: the switch; ``on_log``, ``on_save``): ``docs/trainer.md``.

The engine (a :class:`~hf_altparams.engine.PhaseSwitcher` and its driver) does
every switch, and the run assembly both integrations share
(:class:`~.assembly.PhaseRun`) builds and attaches it; this module holds the
callback, with what is the Trainer's own: its groups on the Trainer's model
(:func:`resolve_groups`), how its arguments map to the refusal table
(:func:`configuration`, :mod:`.refusals`), the one-shot hook that finds the
Trainer's wrapper at its first call (:class:`FirstCallCatcher`) and the log
values (:class:`TrainerReport`).
Saves and resumes are in :mod:`.trainer_checkpoints`; the optimizer helpers in
:mod:`.trainer_optim`; the Trainer internals it reads in
:mod:`.transformers_internals`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim import Optimizer
from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..engine.collective import is_distributed
from ..engine.comm import CommCounter
from ..engine.config import SwitchConfig
from ..engine.deepspeed import optimizer_chain, split_optimizer_class
from ..engine.driver import PhaseDriver
from ..engine.memory import optimizer_of
from ..engine.optim import uncovered_message
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache, as_frozen_prefix
from ..engine.records import SwitchRecord
from ..engine.strategies import local_strategy, strategy_for
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError, Cause, PlanError
from ..plan.groups import ParamGroups, Spec, UngroupedPolicy
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from .accelerate_internals import shared_accelerator_state
from .assembly import PhaseRun, RunOptions
from .fsdp2 import fsdp2_not_running, shard_trainer_groups, trainer_fsdp_version, uses_fsdp2
from .refusals import TRAINER, Configuration, check, message
from .trainer_checkpoints import (
    STATE_KEY,
    check_callback_state,
    check_resumed,
    last_complete_checkpoint,
    mark_complete,
    prepare_save,
    resumed_checkpoint,
    save_callback_state,
    saved_driver_state,
)
from .trainer_optim import grouped_optimizer
from .transformers_internals import caller_frame, move_before_reporters, trainer_from_stack
from .unreached import OutputGuard

__all__ = [
    "FIND_UNUSED_WARNING",
    "STATE_KEY",
    "AlternatingFreeze",
    "FirstCallCatcher",
    "GroupsSpec",
    "TrainerReport",
    "grouped_optimizer",
    "last_complete_checkpoint",
    "resolve_groups",
    "unsupported_backend",
]

logger = logging.getLogger(__name__)

#: Groups given to :class:`AlternatingFreeze`: a mapping group -> spec, a
#: function model -> ParamGroups, or ParamGroups built on the Trainer's model.
GroupsArg = Union[Mapping[str, Spec], Callable[[nn.Module], ParamGroups], ParamGroups]

Metrics = dict[str, Union[int, float, str]]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def configuration(args: TrainingArguments, *, unwrapped: bool = False) -> Configuration:
    """The Trainer's run as the refusal table reads it (:mod:`.refusals`), from ``args`` and Accelerate's state.

    ``unwrapped``: the model trains without a wrapper (seen at its first training forward).
    """
    shared = shared_accelerator_state()  # the Trainer's accelerator exists by on_init_end
    kind = str(getattr(shared.get("distributed_type"), "value", shared.get("distributed_type")))
    deepspeed = (
        kind == "DEEPSPEED"
        or bool(getattr(args, "deepspeed", None))
        or getattr(args, "deepspeed_plugin", None) is not None
        or shared.get("deepspeed_plugin") is not None
        or shared.get("deepspeed_plugins") is not None
        or _env_true("ACCELERATE_USE_DEEPSPEED")
    )
    fsdp = (
        kind == "FSDP"
        or bool(getattr(args, "fsdp", None))
        or getattr(args, "fsdp_plugin_args", None) is not None
        or shared.get("fsdp_plugin") is not None
        or _env_true("ACCELERATE_USE_FSDP")
    )
    version = trainer_fsdp_version(args, shared.get("fsdp_plugin")) if fsdp else None
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    ranks = max(int(getattr(args, "world_size", 1) or 1), world)
    compiled = (
        "`torch_compile=True` in a multi-process run"
        if (getattr(args, "torch_compile", False) and getattr(args, "world_size", 1) > 1)
        else None
    )
    return Configuration(
        TRAINER,
        deepspeed=deepspeed,
        fsdp_version=(version or 1) if fsdp else None,
        compiled=compiled,
        world_size=ranks,
        processes=ranks,
        unwrapped=unwrapped,
        distributed_type=kind,
        deepspeed_config=deepspeed_config(args, shared.get("deepspeed_plugin")) if deepspeed else {},
    )


def deepspeed_config(args: TrainingArguments, plugin: Any = None) -> Mapping[str, Any]:
    """DeepSpeed's configuration as the Trainer resolved it (``args.hf_deepspeed_config``), else as given.

    ``deepspeed=`` a dict, or a JSON file's path; an Accelerate DeepSpeed plugin's
    config when that is how it was asked for; empty when none can be read.
    """
    resolved = getattr(getattr(args, "hf_deepspeed_config", None), "config", None)
    if isinstance(resolved, Mapping):
        return resolved
    given = getattr(args, "deepspeed", None)
    if isinstance(given, Mapping):
        return given
    if isinstance(given, (str, os.PathLike)) and os.path.isfile(given):
        with open(given, encoding="utf-8") as handle:
            loaded = json.load(handle)
        return loaded if isinstance(loaded, Mapping) else {}
    config = getattr(plugin, "deepspeed_config", None)
    return config if isinstance(config, Mapping) else {}


def unsupported_backend(args: TrainingArguments) -> Optional[str]:
    """The refusal message for ``args`` (DeepSpeed, FSDP1, compiled DDP, ...: :mod:`.refusals`), or None."""
    return message(configuration(args))


class FirstCallCatcher:
    """A one-shot *global* forward pre-hook that finds the wrapper the Trainer built.

    The Trainer keeps its wrapper (``DistributedDataParallel``, or that of any
    registered strategy that wraps the module) in a local variable and hands
    callbacks the bare model. A global pre-hook sees every module call, the
    wrapper's own included, *before* its ``forward`` runs (a pre-hook on the
    inner module would run after ``DDP._pre_forward`` has already prepared the
    old reducer for this iteration). The registry says whether a caller is a
    wrapper around the model (:func:`~hf_altparams.engine.strategies.strategy_for`).
    It removes itself at the first call of either the wrapper or, when there is
    none, the bare model in training.
    """

    def __init__(
        self,
        module: nn.Module,
        on_wrapper: Callable[[nn.Module], None],
        on_plain: Callable[[], None],
    ) -> None:
        self._module = weakref.ref(module)  # a global hook must not keep the model alive
        self.on_wrapper = on_wrapper
        self.on_plain = on_plain
        self._handle: Optional[Any] = register_module_forward_pre_hook(self._hook)

    def _hook(self, called: nn.Module, _inputs: Any) -> None:
        module = self._module()
        if module is None:
            self.remove()
        elif called is module:
            if called.training and torch.is_grad_enabled():
                self.remove()
                self.on_plain()
        elif any(child is module for child in called.children()):
            strategy = strategy_for(called)
            if strategy.capabilities.wraps_module and strategy.wrapped_module(called) is module:
                self.remove()
                self.on_wrapper(called)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


#: Logged when the Trainer's DDP searches for unused parameters (its default without gradient checkpointing).
FIND_UNUSED_WARNING = (
    "AlternatingFreeze: DDP runs with find_unused_parameters=True (the Trainer's default without gradient "
    "checkpointing), which walks the autograd graph and all-reduces a used-parameter map on every step. "
    "AlternatingFreeze re-buckets DDP for exactly the phase's parameters, so pass "
    "`ddp_find_unused_parameters=False` to TrainingArguments unless your forward skips some trainable parameters."
)


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
            groups = ParamGroups.from_layers(
                model, spec.layers, per=spec.per, prefix=spec.prefix, extra=dict(spec.extra), ungrouped=spec.ungrouped
            )
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


def split_trainer_optimizer(
    trainer: Optional[Trainer], args: TrainingArguments, model: nn.Module, groups: ParamGroups
) -> None:
    """Under DeepSpeed: have ``trainer`` build its optimizer with one param group per library group.

    ZeRO partitions each param group of the optimizer it is given; the Trainer
    builds that optimizer inside ``train()`` (so ``optimizers=`` is ignored
    under DeepSpeed) from ``optimizer_cls_and_kwargs``, its public attribute,
    or else its ``optim`` arguments. The class becomes a stand-in that builds
    the same optimizer split per group (its decay / no-decay split kept).

    Raises:
        AltParamsError: no Trainer under construction (the callback was not in
            ``Trainer(callbacks=...)``), ``optimizers=`` given, or an optimizer
            the Trainer builds another way (a factory, or its own parameter list).
    """
    if trainer is None:
        raise AltParamsError(
            "AlternatingFreeze under DeepSpeed must be in `Trainer(callbacks=[...])`: it has the Trainer build its "
            "optimizer with one param group per group (DeepSpeed partitions each param group), which it can only "
            "do while the Trainer is being built",
            cause=Cause.STRATEGY_REFUSED,
        )
    if trainer.optimizer is not None:
        raise AltParamsError(
            "`Trainer(optimizers=(optimizer, ...))` with DeepSpeed: the Trainer ignores that optimizer (DeepSpeed's is "
            "built inside `train()`), so the phases would drive another one. Pass `optimizer_cls_and_kwargs=(cls, "
            "kwargs)` instead, or nothing (the Trainer's `optim` arguments)",
            cause=Cause.STRATEGY_REFUSED,
        )
    given = trainer.optimizer_cls_and_kwargs
    default = Trainer.get_optimizer_cls_and_kwargs
    cls, kwargs = given if given is not None else default(args, model)  # type: ignore[arg-type]
    own = sorted({"params", "model", "optimizer_dict"} & set(kwargs))
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)) or own:
        raise AltParamsError(
            f"the Trainer's optimizer ({getattr(cls, '__name__', cls)!r}{f', with its own {own}' if own else ''}) is "
            "not built from the Trainer's param groups, so it cannot be split per group for DeepSpeed; use a torch "
            "optimizer class (`optim='adamw_torch'`, or `optimizer_cls_and_kwargs=(torch.optim.AdamW, {...})`)",
            cause=Cause.STRATEGY_REFUSED,
        )
    trainer.optimizer_cls_and_kwargs = (split_optimizer_class(cls, groups), dict(kwargs))


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
        "hf_altparams.integrations.trainer), not over `filter(lambda p: p.requires_grad, ...)`.",
        cause=Cause.OPTIMIZER_MISSES_PARAMETERS,
    )


def describe_phase(switcher: PhaseSwitcher, phase: Optional[Phase]) -> dict[str, Union[int, str]]:
    """``phase``, ``trainable_params`` and ``allreduce_bytes_per_step`` of ``phase`` (as last applied)."""
    if phase is None:
        return {"phase": "", "trainable_params": 0, "allreduce_bytes_per_step": 0}
    trainable = switcher.trainable_names(phase)
    return {
        "phase": phase.name,
        "trainable_params": sum(p.numel() for n, p in switcher.groups.all_named_params() if n in trainable),
        "allreduce_bytes_per_step": switcher.reduced_bytes(phase),
    }


class TrainerReport:
    """The callback's log values, and what the previous log already covered.

    Args:
        prefix: prefix of the keys (``"altparams/"``).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.logged_seconds = 0.0  # switch seconds already reported by the previous log
        self.logged_comm = 0  # measured steps already reported by the previous log

    def reset(self) -> None:
        """A new ``train()``: nothing reported yet."""
        self.logged_seconds, self.logged_comm = 0.0, 0

    def metrics(self, switcher: PhaseSwitcher, comm: Optional[CommCounter], frozen_prefix: Any) -> Metrics:
        """The ``altparams/*`` values of the step just trained and of the switches since the last log.

        Describing the optimizer step just trained (the one whose loss is
        logged): ``phase``, ``trainable_params``, ``allreduce_bytes_per_step``
        (bytes the DDP reducer all-reduces per step; 0 without DDP); then
        ``switches`` (so far in this ``train()``, the wrapper's first
        re-bucketing included), ``switch_seconds`` (time spent switching since
        the previous log), and with a comm counter ``allreduce_bytes_measured``
        (mean bytes per step since the previous log).
        """
        prefix, history, driver = self.prefix, switcher.history, switcher.driver
        info = describe_phase(switcher, driver.trained or driver.current)
        out: Metrics = {f"{prefix}{k}": v for k, v in info.items()}
        out.update(
            {
                f"{prefix}switches": history.count,
                f"{prefix}switch_seconds": history.seconds - self.logged_seconds,
            }
        )
        self.logged_seconds = history.seconds
        if comm is not None:
            recent = comm.history[self.logged_comm :]
            self.logged_comm = len(comm.history)
            out[f"{prefix}allreduce_bytes_measured"] = sum(recent) / len(recent) if recent else 0
        if frozen_prefix is not None:
            out.update(frozen_prefix.metrics(prefix))
        return out


class AlternatingFreeze(TrainerCallback):
    """Phased training for the 🤗 Trainer: one callback, nothing else changed.

    Args:
        groups: the parameter groups, resolved on the model the Trainer gets:
            a mapping ``{group: spec}`` (specs as in
            :class:`~hf_altparams.plan.ParamGroups`: globs, ``"re:"`` regexes,
            lists), a function ``model -> ParamGroups``, or a ``ParamGroups``
            already built on that model. Leave it out to use ``layers``.
        schedule: the :class:`~hf_altparams.plan.Schedule`; ``unit="step"``
            schedules count the Trainer's global optimizer steps, ``unit="epoch"``
            ones its epochs.
        layers: instead of ``groups``: dotted path of the model's layer
            ``ModuleList`` (e.g. ``"bert.encoder.layer"``), one group per
            ``per`` layers named ``f"{prefix}{i}"``, plus ``extra`` groups
            (see :meth:`ParamGroups.from_layers`).
        per, prefix, extra: see ``layers``.
        ungrouped: policy for parameters in no group (``"frozen"``,
            ``"trainable"`` or ``"error"``).
        count_comm: register a counting comm hook on the Trainer's DDP and log
            the bytes really all-reduced per step (``altparams/allreduce_bytes_measured``).
            It replaces DDP's default all-reduce with the same averaging, and
            cannot be combined with another comm hook.
        release: when a switch frees memory back to the OS / device (gc,
            ``empty_cache``, ``malloc_trim``): ``"auto"`` (default, decided from
            the schedule), ``True`` (every switch) or ``False`` (never); see
            :class:`~hf_altparams.engine.PhaseSwitcher`.
        check_resume: on resume, refuse a checkpoint saved with a different
            schedule or groups.
        log_prefix: prefix of the keys added to the Trainer's logs.
        switcher_options: the switch's other settings: a
            :class:`~hf_altparams.engine.config.SwitchConfig` or a mapping of its
            names (e.g. ``{"buffer_sync": "auto", "frozen_norms": "eval"}``), checked here.
        frozen_prefix: ``True`` or a :class:`~hf_altparams.engine.prefix.FrozenPrefix`:
            the frozen leading layers run in eval mode and, cached per sample,
            not at all. The dataset needs an index column (``sample_index`` by
            default; the model's forward signature shows it so the Trainer keeps
            it); ``blocks`` defaults to ``layers``. Logs carry ``altparams/prefix_*``.
        on_start: called with the run's switcher at the start of every
            ``train()``, before the first phase is applied; e.g.
            ``hf_altparams.integrations.peft.follow_phases`` so that peft's active
            adapter follows the phase (docs/peft.md).

    ``phase``, ``task`` (the current ``PerTaskCycle`` task) and
    ``visiting(groups)`` (evaluate a non-resident group) answer from
    ``trainer.train()`` on.

    Side effects: at ``Trainer(...)`` time the parameters the schedule trains
    get ``requires_grad=True`` (so the default optimizer covers them); from
    ``trainer.train()`` on, ``requires_grad`` follows the schedule, and after
    training the model is left in the last phase. The Trainer's DDP wrapper is
    re-bucketed in place at every switch.

    Raises:
        PlanError: bad arguments (here), unknown groups in the schedule, or an
            optimizer that leaves out parameters the schedule trains (at
            ``train()``, before the first step).
        AltParamsError: DeepSpeed, FSDP1 or a compiled multi-process model (FSDP2 is supported).

    Example:
        >>> from hf_altparams.plan import GradualUnfreeze
        >>> cb = AlternatingFreeze(
        ...     layers="bert.encoder.layer", extra={"head": ["classifier.*", "bert.pooler.*"]},
        ...     schedule=GradualUnfreeze(["layer0", "layer1"], every=10, always=["head"]))
        >>> # Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb]).train()
    """

    def __init__(
        self,
        groups: Optional[GroupsArg] = None,
        schedule: Optional[Schedule] = None,
        *,
        layers: Optional[str] = None,
        per: int = 1,
        prefix: str = "layer",
        extra: Optional[Mapping[str, Spec]] = None,
        ungrouped: UngroupedPolicy = "frozen",
        count_comm: bool = False,
        release: Any = "auto",
        check_resume: bool = True,
        log_prefix: str = "altparams/",
        switcher_options: Union[None, SwitchConfig, Mapping[str, Any]] = None,
        frozen_prefix: Union[None, bool, FrozenPrefix] = None,
        on_start: Optional[Callable[[PhaseSwitcher], Any]] = None,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise PlanError(
                f"`schedule` must be an hf_altparams Schedule (e.g. GradualUnfreeze, Alternating), got {schedule!r}"
            )
        if (groups is None) == (layers is None):
            raise PlanError(
                "give exactly one of `groups` (a mapping group -> patterns, a function model -> "
                f"ParamGroups, or ParamGroups) and `layers` (e.g. 'bert.encoder.layer'); got "
                f"groups={groups!r}, layers={layers!r}"
            )
        if groups is not None and not (isinstance(groups, (Mapping, ParamGroups)) or callable(groups)):
            raise PlanError(
                f"`groups` must be a mapping group -> spec, a function model -> ParamGroups, or "
                f"ParamGroups; got {type(groups).__name__}: {groups!r}"
            )
        if layers is not None and not isinstance(layers, str):
            raise PlanError(f"`layers` must be the dotted path of a ModuleList (str), got {layers!r}")
        if extra is not None and layers is None:
            raise PlanError("`extra` only goes with `layers`; put those groups in `groups` instead")
        if isinstance(groups, Mapping):
            schedule.validate(list(groups))  # unknown group names fail here, before any model
        if isinstance(switcher_options, Mapping):
            clash = sorted({"optimizer", "model", "release"} & set(switcher_options))
            if clash:
                raise PlanError(f"`switcher_options` may not set {clash}: AlternatingFreeze sets them")
        #: the switch's settings, checked here (before any model is built)
        self.config = SwitchConfig.build(switcher_options, release=release)
        self.schedule = schedule
        self.spec = GroupsSpec(groups, layers, per, prefix, dict(extra or {}), ungrouped)
        self.count_comm = bool(count_comm)
        self.check_resume = bool(check_resume)
        self.log_prefix = log_prefix
        self.report = TrainerReport(log_prefix)
        if on_start is not None and not callable(on_start):
            raise PlanError(f"`on_start` must be a callable taking the switcher, got {on_start!r}")
        self._on_start = on_start

        prefix_option = as_frozen_prefix(frozen_prefix)
        if prefix_option is not None and prefix_option.blocks is None and layers is not None:
            prefix_option = dataclasses.replace(prefix_option, blocks=layers)
        #: the run assembly (:class:`~.assembly.PhaseRun`): the strategy, the switcher, the wrapper, the comm
        #: counter, the frozen-prefix cache; a new driver at every ``train()``
        self.run = PhaseRun(schedule, RunOptions(self.config, self.count_comm, prefix_option), on_built=self._started)
        self.groups: Optional[ParamGroups] = None
        self.find_unused_parameters: Optional[bool] = None
        self._catcher: Optional[FirstCallCatcher] = None
        self._is_main = True
        self._save_prepared_at: Optional[int] = None  # the step whose save `_prepare_save` checked
        self._output_guard: Optional[OutputGuard] = None  # a training forward without grad: a clear error

    @property
    def switcher(self) -> Optional[PhaseSwitcher]:
        """The engine's switcher of the current ``train()`` (``None`` before it)."""
        return self.run.switcher

    @property
    def comm(self) -> Optional[CommCounter]:
        """The comm counter (``count_comm=True``, once the wrapper is attached)."""
        return self.run.comm_counter

    @property
    def frozen_prefix(self) -> Optional[FrozenPrefixCache]:
        """The frozen-prefix cache (``frozen_prefix=...``), attached at ``Trainer(...)`` time."""
        return self.run.frozen_prefix

    @property
    def driver(self) -> Optional[PhaseDriver]:
        """The schedule position and current phase of the current ``train()`` (``None`` before it)."""
        return None if self.switcher is None else self.switcher.driver

    @property
    def phase(self) -> Optional[Phase]:
        """The phase that trains now (``None`` before ``trainer.train()``); switches happen at ``on_step_end``."""
        return None if self.switcher is None else self.switcher.phase

    @property
    def task(self) -> Optional[str]:
        """The current task's name under :class:`~hf_altparams.plan.PerTaskCycle` (else ``None``)."""
        return None if self.switcher is None else self.switcher.task

    @contextlib.contextmanager
    def visiting(self, groups: Union[str, Iterable[str]]) -> Iterator[None]:
        """Bring non-resident ``groups`` back to the device for the ``with`` block (e.g. to evaluate them).

        See :meth:`~hf_altparams.engine.PhaseSwitcher.visiting`; from ``trainer.train()`` on.

        Example:
            >>> # with torch.no_grad(), callback.visiting(["head2"]):
            >>> #     metrics = evaluate(model, task="head2")
        """
        if self.switcher is None:
            raise AltParamsError(
                f"`visiting({groups!r})` was called before `trainer.train()`: no phase is applied "
                "yet, so every group is where the model put it; call it after that"
            )
        with self.switcher.visiting(groups):
            yield

    # ------------------------------------------------------------------ groups, reports
    def resolve(self, model: nn.Module) -> ParamGroups:
        """Build the groups on ``model`` and validate the schedule against them."""
        return resolve_groups(self.spec, self.schedule, model)

    def scheduled_param_names(self) -> frozenset[str]:
        """Canonical names of every parameter some phase of the schedule may train."""
        assert self.groups is not None
        return scheduled_param_names(self.groups, self.schedule)

    @property
    def records(self) -> list[SwitchRecord]:
        """What the recent switches of the current ``train()`` did (the first may be the wrapper's re-bucketing).

        At most ``switcher.history.window`` records, oldest first; the totals of
        the whole run are in ``switcher.history``.
        """
        return [] if self.switcher is None else self.switcher.records

    def metrics(self) -> Metrics:
        """The ``altparams/*`` values :meth:`on_log` adds to the Trainer's logs (see :class:`TrainerReport`)."""
        assert self.switcher is not None
        return self.report.metrics(self.switcher, self.comm, self.frozen_prefix)

    # ------------------------------------------------------------------ events
    def on_init_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Optional[nn.Module] = None,
        **kwargs: Any,
    ) -> None:
        config = configuration(args)
        check(config)
        if model is None:
            raise PlanError("AlternatingFreeze needs the Trainer's `model` (got None at on_init_end)")
        self.groups = self.resolve(model)
        make_scheduled_trainable(self.groups, self.schedule, only=uses_fsdp2(args))
        self.run.attach_prefix(model)
        frame = caller_frame()
        move_before_reporters(self, frame)
        if config.deepspeed:
            split_trainer_optimizer(trainer_from_stack(frame), args, model, self.groups)

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: Optional[nn.Module] = None,
        optimizer: Optional[Optimizer] = None,
        **kwargs: Any,
    ) -> None:
        check(configuration(args))
        if model is not None and (self.groups is None or self.groups.module is not model):
            self.groups = self.resolve(model)  # `model_init` built a new model in train()
        assert self.groups is not None
        resumed_from = saved_driver_state(state, self._epoch(state))  # a resumed checkpoint's record (or none)
        trained = set(resumed_from.trained_groups)
        self.run.restart()  # the last train()'s switcher (its optimizer step check) goes
        in_place = strategy_for(model) if model is not None else local_strategy()  # prepare wrapped it in place
        self.run.expect(in_place if in_place is not local_strategy() else None)
        if in_place is local_strategy() and uses_fsdp2(args) and state.is_world_process_zero:
            logger.warning(fsdp2_not_running("fsdp_config={'version': 2}", "plain DDP"))
        if in_place.capabilities.rebinds_parameters:  # FSDP2's shards: the groups, optimizer and DCP state follow
            assert model is not None
            self.groups = shard_trainer_groups(self.groups, model, optimizer, args, state, trained)
        self.run.attach_prefix(self.groups.module)
        if not configuration(args).deepspeed:  # DeepSpeed's optimizer holds partitions: the engine checks them
            check_optimizer_covers(self.groups, self.schedule, optimizer)
        resumed = resumed_checkpoint(caller_frame(), args, state)
        if resumed is not None:
            saved = state.stateful_callbacks.get(STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
            check_resumed(resumed, state, saved)
        self._check_saved_state(state)
        self._is_main = state.is_world_process_zero
        driving = optimizer_of(optimizer)
        if configuration(args).deepspeed:  # the torch optimizer inside DeepSpeed's (its engine steps it per group)
            driving = next((o for o in reversed(optimizer_chain(optimizer)) if isinstance(o, Optimizer)), driving)
        self.run.build(self.groups, driving)  # on_start is called here (_started)
        self.run.driver.restore(resumed_from)
        if in_place is not local_strategy():  # no wrapper to catch; the phase is read at the next all-gather
            assert model is not None
            self.run.attach(model)
        self.report.reset()
        self.run.move_to(state.global_step, self._epoch(state))
        assert self.switcher is not None
        self._save_state(state)
        if self._catcher is not None:
            self._catcher.remove()
        if self._output_guard is not None:
            self._output_guard.remove()
        self._output_guard = OutputGuard(self.groups.module, lambda: self.phase, self.groups)
        if dist.is_available() and dist.is_initialized() and in_place is local_strategy():
            self._catcher = FirstCallCatcher(self.groups.module, self._attach_wrapper, self._no_wrapper)
        if self._is_main:
            logger.info(
                "AlternatingFreeze: %s\n%s",
                self.schedule.describe(),
                self.groups.summary(self.switcher.current.trainable if self.switcher.current else None),
            )

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.switcher is None:
            return
        if control.should_save:
            self._prepare_save(args, state)  # drift check; the folder the Trainer saves next may be an old run's
        last = bool(state.max_steps and state.global_step >= state.max_steps)  # no step follows: no switch
        switched = self.run.stepped(state.global_step, self._epoch(state), switch=not last) is not None
        if switched or control.should_save:  # the checkpoint's record holds the groups trained up to this step
            self._save_state(state)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or self.switcher is None or any(k.startswith(("eval_", "test_")) for k in logs):
            return
        metrics = self.metrics()
        logs.update(metrics)
        # Trainer.log appended a copy of `logs` to the history before calling us.
        last: Optional[dict[str, Any]] = state.log_history[-1] if state.log_history else None
        if (
            last is not None
            and last.get("step") == state.global_step
            and all(k in last for k in logs if k not in metrics)
        ):
            last.update(metrics)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.switcher is not None and control.should_save:  # save_strategy="epoch"
            self._prepare_save(args, state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self.switcher is None:
            return
        if self._save_prepared_at != state.global_step and self.switcher.drift.at_save:
            # A save no step-end foresaw (save_strategy="best"): checked before the marker, which a drift withholds.
            self.switcher.check_weights(
                f"after the Trainer's save at step {state.global_step}",
                "The checkpoint is left without its completion marker",
            )
        if is_distributed(None):
            dist.barrier()  # every rank has written its part (its RNG state) of the checkpoint
        current = self.switcher.current
        mark_complete(
            args, state, {"epoch": self._epoch(state), "phase": None if current is None else sorted(current.trainable)}
        )

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._catcher is not None:
            self._catcher.remove()
            self._catcher = None
        if self._output_guard is not None:
            self._output_guard.remove()
            self._output_guard = None

    # ------------------------------------------------------------------ internals
    def _started(self, switcher: PhaseSwitcher) -> None:
        """The run's switcher was built (every ``train()``): the user's ``on_start`` sees it first."""
        if self._on_start is not None:
            self._on_start(switcher)

    def _attach_wrapper(self, wrapper: nn.Module) -> None:
        """Called on the first call of the Trainer's wrapper, before its forward: re-bucket it for the phase."""
        self.run.attach(wrapper, rebuild=True)
        assert self.switcher is not None
        self.find_unused_parameters = self.switcher.backend.find_unused
        if self.find_unused_parameters and self._is_main:
            logger.warning(FIND_UNUSED_WARNING)

    def _no_wrapper(self) -> None:
        """Called when the model trains without a DDP wrapper: refused in a multi-process run (:mod:`.refusals`)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        check(Configuration(TRAINER, world_size=world, processes=world, unwrapped=True))

    @staticmethod
    def _epoch(state: TrainerState) -> int:
        # The Trainer sets `epoch = e + (batch + 1) / batches_in_epoch`, exactly e + 1 after the
        # last step of epoch e, so the floor is the epoch the next step belongs to.
        return int(state.epoch or 0)

    def _prepare_save(self, args: TrainingArguments, state: TrainerState) -> None:
        assert self.switcher is not None
        prepare_save(args, state, self.switcher)
        self._save_prepared_at = state.global_step

    def _save_state(self, state: TrainerState) -> None:
        assert self.switcher is not None and self.groups is not None
        save_callback_state(state, self.schedule, self.groups, self.switcher.current, self.switcher.driver.state())

    def _check_saved_state(self, state: TrainerState) -> None:
        if self.check_resume:
            assert self.groups is not None
            check_callback_state(state, self.schedule, self.groups)
