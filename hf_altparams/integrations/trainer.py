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
every switch; this module holds the callback's arguments and events. Groups:
:mod:`._trainer_groups`; log values: :mod:`._trainer_reporting`; refusals and
the wrapper's first call: :mod:`._trainer_support`; the saved schedule and the
checkpoint markers: :mod:`._trainer_state`, :mod:`._trainer_checkpoints`.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Callable, Mapping, Optional, Union

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from transformers import (
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..engine.comm import CommCounter, register_comm_counter, register_reduce_scatter_counter
from ..engine.config import SwitchConfig
from ..engine.driver import PhaseDriver
from ..engine.fsdp2 import is_fsdp2
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache, as_frozen_prefix
from ..engine.records import SwitchRecord
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError, PlanError, SwitchError
from ..plan.groups import ParamGroups, Spec, UngroupedPolicy
from ..plan.schedules import Schedule
from ._fsdp2_prepare import fsdp2_not_running, shard_trainer_groups, uses_fsdp2
from ._phase_queries import PhaseQueries
from ._trainer_checkpoints import check_resumed, last_complete_checkpoint, mark_complete, prepare_save
from ._trainer_checkpoints import resumed_checkpoint
from ._trainer_groups import (
    GroupsSpec,
    check_optimizer_covers,
    make_scheduled_trainable,
    resolve_groups,
    scheduled_param_names,
)
from ._trainer_optim import grouped_optimizer
from ._trainer_reporting import Metrics, TrainerReport
from ._trainer_state import STATE_KEY, check_callback_state, save_callback_state, trained_groups
from ._trainer_support import FIND_UNUSED_WARNING, FirstCallCatcher, no_wrapper_error, run_before_reporters
from ._trainer_support import unsupported_backend
from ._unreached import OutputGuard
from ._trainer_support import unwrap_optimizer

__all__ = ["STATE_KEY", "AlternatingFreeze", "grouped_optimizer", "last_complete_checkpoint"]

logger = logging.getLogger(__name__)

#: Groups given to :class:`AlternatingFreeze`: a mapping group -> spec, a
#: function model -> ParamGroups, or ParamGroups built on the Trainer's model.
GroupsArg = Union[Mapping[str, Spec], Callable[[nn.Module], ParamGroups], ParamGroups]

class AlternatingFreeze(PhaseQueries, TrainerCallback):
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
    ``trainer.train()`` on (:class:`~._phase_queries.PhaseQueries`).

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

    _started_by = "`trainer.train()`"

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
                f"`schedule` must be an hf_altparams Schedule (e.g. GradualUnfreeze, Alternating), "
                f"got {schedule!r}"
            )
        if (groups is None) == (layers is None):
            raise PlanError(
                "give exactly one of `groups` (a mapping group -> patterns, a function model -> "
                f"ParamGroups, or ParamGroups) and `layers` (e.g. 'bert.encoder.layer'); got "
                f"groups={groups!r}, layers={layers!r}"
            )
        if groups is not None and not (
            isinstance(groups, (Mapping, ParamGroups)) or callable(groups)
        ):
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
        self._prefix_option = prefix_option
        self.frozen_prefix: Optional[FrozenPrefixCache] = None
        self.groups: Optional[ParamGroups] = None
        self.switcher: Optional[PhaseSwitcher] = None
        self.comm: Optional[CommCounter] = None
        self.find_unused_parameters: Optional[bool] = None
        self._catcher: Optional[FirstCallCatcher] = None
        self._is_main = True
        self._save_prepared_at: Optional[int] = None  # the step whose save `_prepare_save` checked
        self._output_guard: Optional[OutputGuard] = None  # a training forward without grad: a clear error

    @property
    def driver(self) -> Optional[PhaseDriver]:
        """The schedule position and current phase of the current ``train()`` (``None`` before it)."""
        return None if self.switcher is None else self.switcher.driver

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
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    model: Optional[nn.Module] = None, **kwargs: Any) -> None:
        refusal = unsupported_backend(args)
        if refusal:
            raise AltParamsError(refusal)
        if model is None:
            raise PlanError("AlternatingFreeze needs the Trainer's `model` (got None at on_init_end)")
        self.groups = self.resolve(model)
        make_scheduled_trainable(self.groups, self.schedule, only=uses_fsdp2(args))
        self._attach_prefix(model)
        run_before_reporters(self, sys._getframe(0))

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       model: Optional[nn.Module] = None, optimizer: Optional[Optimizer] = None,
                       **kwargs: Any) -> None:
        refusal = unsupported_backend(args)
        if refusal:
            raise AltParamsError(refusal)
        if model is not None and (self.groups is None or self.groups.module is not model):
            self.groups = self.resolve(model)  # `model_init` built a new model in train()
        assert self.groups is not None
        trained = trained_groups(state)  # from a resumed checkpoint's record (empty otherwise)
        sharded = model if model is not None and is_fsdp2(model) else None  # prepare ran fully_shard in place
        if sharded is None and uses_fsdp2(args) and state.is_world_process_zero:
            logger.warning(fsdp2_not_running("fsdp_config={'version': 2}", "plain DDP"))
        if sharded is not None:
            self.groups = shard_trainer_groups(self.groups, sharded, optimizer, args, state, trained,
                                               has_prefix=self._prefix_option is not None)
        self._attach_prefix(self.groups.module)
        check_optimizer_covers(self.groups, self.schedule, optimizer)
        resumed = resumed_checkpoint(sys._getframe(0), args, state)
        if resumed is not None:
            saved = state.stateful_callbacks.get(STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
            check_resumed(resumed, state, saved)
        self._check_saved_state(state)
        self._is_main = state.is_world_process_zero
        if self.switcher is not None:
            self.switcher.close()  # the last train()'s: its optimizer step check goes
        self.switcher = PhaseSwitcher(self.groups, self.schedule, optimizer=unwrap_optimizer(optimizer),
                                      config=self.config)
        self.switcher.driver.trained_groups = trained
        if self._on_start is not None:
            self._on_start(self.switcher)
        self.comm = None
        if sharded is not None:  # FSDP2: no wrapper to catch; the phase is read at the next all-gather
            self.switcher.attach(sharded)
            self.comm = register_reduce_scatter_counter(sharded) if self.count_comm else None
        self.report.reset()
        self.switcher.step_to(state.global_step, self._epoch(state))
        self._save_state(state)
        if self._catcher is not None:
            self._catcher.remove()
        if self._output_guard is not None:
            self._output_guard.remove()
        self._output_guard = OutputGuard(self.groups.module, lambda: self.phase, self.groups)
        if dist.is_available() and dist.is_initialized() and sharded is None:
            self._catcher = FirstCallCatcher(self.groups.module, self._attach_ddp, self._no_wrapper)
        if self._is_main:
            logger.info("AlternatingFreeze: %s\n%s", self.schedule.describe(),
                        self.groups.summary(self.switcher.current.trainable if self.switcher.current else None))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.switcher is None:
            return
        if self.comm is not None:
            self.comm.end_step()
        if control.should_save:
            self._prepare_save(args, state)  # drift check; the folder the Trainer saves next may be an old run's
        last = bool(state.max_steps and state.global_step >= state.max_steps)  # no step follows: no switch
        if self.switcher.driver.stepped(state.global_step, self._epoch(state), switch=not last) is not None:
            self._save_state(state)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        if logs is None or self.switcher is None or any(k.startswith(("eval_", "test_")) for k in logs):
            return
        metrics = self.metrics()
        logs.update(metrics)
        # Trainer.log appended a copy of `logs` to the history before calling us.
        last = state.log_history[-1] if state.log_history else None
        if last is not None and last.get("step") == state.global_step and all(k in last for k in logs if k not in metrics):
            last.update(metrics)

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.switcher is not None and control.should_save:  # save_strategy="epoch"
            self._prepare_save(args, state)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if self.switcher is None:
            return
        if self._save_prepared_at != state.global_step and self.switcher.drift.at_save:
            # A save no step-end foresaw (save_strategy="best"): checked before the marker, which a drift withholds.
            self.switcher.check_weights(f"after the Trainer's save at step {state.global_step}",
                                        "The checkpoint is left without its completion marker")
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()  # every rank has written its part (its RNG state) of the checkpoint
        current = self.switcher.current
        mark_complete(args, state, {"epoch": self._epoch(state),
                                    "phase": None if current is None else sorted(current.trainable)})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._catcher is not None:
            self._catcher.remove()
            self._catcher = None
        if self._output_guard is not None:
            self._output_guard.remove()
            self._output_guard = None

    # ------------------------------------------------------------------ internals
    def _attach_ddp(self, ddp: nn.parallel.DistributedDataParallel) -> None:
        """Called on the first call of the Trainer's DDP, before its forward: re-bucket it."""
        assert self.switcher is not None
        if self.count_comm and self.comm is None:
            try:
                self.comm = register_comm_counter(ddp)
            except RuntimeError as err:
                raise SwitchError(
                    f"`count_comm=True` could not register its comm hook on the Trainer's DDP ({err}); "
                    "DDP takes one comm hook: drop the other one, or pass `count_comm=False`"
                ) from err
        self.switcher.attach(ddp, rebuild=True)
        self.find_unused_parameters = bool(ddp.find_unused_parameters)
        if self.find_unused_parameters and self._is_main:
            logger.warning(FIND_UNUSED_WARNING)

    def _no_wrapper(self) -> None:
        """Called when the model trains without a DDP wrapper: refused in a multi-process run."""
        error = no_wrapper_error()
        if error is not None:
            raise SwitchError(error)

    def _attach_prefix(self, model: nn.Module) -> None:
        if self._prefix_option is None:
            return
        if self.frozen_prefix is not None and self.frozen_prefix.model is model:
            self.frozen_prefix.reset()  # a new train() (or a resume): rows of the last one are void
            return
        if self.frozen_prefix is not None:
            self.frozen_prefix.detach()
        self.frozen_prefix = FrozenPrefixCache(model, self._prefix_option).attach()

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
        save_callback_state(state, self.schedule, self.groups, self.switcher.current, self._epoch(state),
                            self.switcher.driver.trained_groups)

    def _check_saved_state(self, state: TrainerState) -> None:
        if self.check_resume:
            assert self.groups is not None
            check_callback_state(state, self.schedule, self.groups)
