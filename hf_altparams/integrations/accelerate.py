"""Phased training in a stock Accelerate loop: :class:`PhasedAccelerator`.

``PhasedAccelerator`` is an :class:`accelerate.Accelerator` that also owns a
:class:`~hf_altparams.engine.PhaseSwitcher`. Everything else in the loop stays
Accelerate's: ``backward``, ``accumulate``, ``no_sync``, ``clip_grad_norm_``,
trackers and ``log``, comm hooks from ``DistributedDataParallelKwargs``. What it
adds, and where:

* ``prepare`` applies the first phase *before* DDP is built (DDP picks the
  parameters it reduces in its constructor), sets ``find_unused_parameters``,
  and wraps the optimizer so that its steps drive the schedule. The raw module
  is prepared once; switches re-bucket the same DDP wrapper in place, so
  ``accelerator._models`` never grows and the autocast forward is wrapped once.
* ``optimizer.step()`` at a gradient-sync boundary (``accelerator.sync_gradients``)
  counts one schedule step and, right after the update, switches phase if the
  schedule says so; so ``accelerator.phase`` / ``accelerator.task`` read at the
  top of an iteration are right whatever the loop's order of ``zero_grad``,
  ``backward`` and ``step``. Micro-steps inside ``accumulate`` never switch.
* the same ``step()`` refuses, before the update, a step whose gradients never
  went through the DDP wrapper and an epoch-unit schedule whose epoch is never
  set (:mod:`._loop_guard`); ``end_training`` frees the reducer before the
  process group goes (:mod:`hf_altparams.engine.shutdown`).
* ``save_state`` / ``load_state`` also save and restore the schedule position
  (``hf_altparams_state.json``) and switch to the saved phase *before* the
  optimizer state is loaded, so idle groups keep their state policy; a barrier
  follows ``save_state``.

Subclass rather than composition: the loop already talks to one object, and the
points to hook (``prepare``, ``prepare_optimizer``, ``backward``, ``save_state``,
``load_state``, ``free_memory``) are public methods of it. A wrapper holding an
``Accelerator`` would have to forward the other hundred methods, or leave users
calling ``save_state`` on the inner object and silently skipping the schedule.

This module holds the constructor, ``prepare`` and the loop hooks; the rest is
in private siblings: checkpoints (:mod:`._accelerate_checkpoints`), switch
reports (:mod:`._accelerate_reporting`), the prepared optimizer wrapper and the
refused configurations (:mod:`._accelerate_parts`), one optimizer per group
(:mod:`._user_optimizers`), FSDP2 (:mod:`._fsdp2_prepare`) and the loop checks
at ``step()`` (:mod:`._loop_guard`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, Optional, Union

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn
from torch.optim import Optimizer

from ..engine import _ddp
from ..engine.comm import CommCounter, register_comm_counter
from ..engine.shutdown import quiesce_comm_threads
from ..engine.optim import GroupedLRScheduler, GroupedOptimizer
from ..engine._layout import remember
from ..engine._release import ReleasePolicy, ReleaseSetting
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache, as_frozen_prefix
from ..engine.switch import PhaseSwitcher, SwitchRecord
from ..errors import AltParamsError, PlanError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from ._accelerate_checkpoints import STATE_FILE, CheckpointMixin
from ._accelerate_parts import PhasedOptimizer, PreparedGroupedLRScheduler, check_supported
from ._accelerate_reporting import ReportingMixin
from ._fsdp2_prepare import start_sharded
from ._loop_guard import LoopGuard, check_trainable_gradients, mid_window_switch_error
from ._phase_queries import PhaseQueries
from ._unreached import check_loss
from ._user_optimizers import GradientArrivals, HandleUnscaleMixin, OptimizerHandle, find_grouped

__all__ = ["OptimizerHandle", "PhasedAccelerator", "STATE_FILE"]

class PhasedAccelerator(PhaseQueries, CheckpointMixin, ReportingMixin, HandleUnscaleMixin, Accelerator):
    """An ``Accelerator`` that trains one phase of a schedule at a time.

    Args:
        schedule: which groups train at each optimizer step (or epoch); checked
            against the groups at ``prepare``, before any step.
        groups: the :class:`~hf_altparams.plan.ParamGroups` of the model. Leave it
            out when the optimizer is a :class:`~hf_altparams.engine.GroupedOptimizer`
            (its groups are used).
        find_unused_parameters: DDP's setting. ``None`` (default) keeps the value of
            a ``DistributedDataParallelKwargs`` handler, else ``False``: frozen groups
            are outside the reducer, so ``True`` is only needed when the forward skips
            some *trainable* parameter of a phase (a branch or task head unused by
            a batch). With ``False``, a trainable parameter left without a gradient
            at a sync step raises a clear error instead of desynchronising ranks.
        count_comm: register :func:`~hf_altparams.engine.register_comm_counter` on
            the DDP wrapper (``accelerator.comm_counter``); it replaces DDP's default
            all-reduce with an equivalent counting one, so it cannot be combined with
            a ``comm_hook`` from ``DistributedDataParallelKwargs``.
        log_switches: ``accelerator.log`` a record of every switch (phase, trainable
            params and bytes, bytes all-reduced per step, memory, switch seconds).
        release: when a switch frees memory back to the OS / device (gc,
            ``empty_cache``, ``malloc_trim``): ``"auto"`` (default, decided from
            the schedule: skipped when the next phase reuses the memory at once),
            ``True`` (every switch) or ``False`` (never); see ``PhaseSwitcher``.
        switcher_options: more keyword arguments for the
            :class:`~hf_altparams.engine.PhaseSwitcher` (``offload_device``,
            ``prefetch``, ``buffer_sync``, ``frozen_norms``, ``full_gc``, ...).
        frozen_prefix: ``True`` or a :class:`~hf_altparams.engine.prefix.FrozenPrefix`:
            run the frozen leading layers in eval mode and start the forward from
            their cached output per sample (the loop passes ``sample_index=`` to the
            model); ``accelerator.frozen_prefix`` reports, and switch logs carry
            ``altparams/prefix_*`` (hit rate, bytes held, seconds saved).
        **kwargs: passed to ``accelerate.Accelerator``.

    Raises:
        PlanError: on a bad argument. AltParamsError: with DeepSpeed, FSDP1 (FSDP2 is supported),
            Megatron-LM, XLA, tensor/context parallelism or ``torch.compile``.

    Example:
        >>> # accelerator = PhasedAccelerator(Alternating(["layer1", "layer2"]), gradient_accumulation_steps=2)
        >>> # groups = ParamGroups(model, {"layer1": "layer1.*", "layer2": "layer2.*"})
        >>> # optimizer = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-3))
        >>> # model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        >>> # ... the stock loop: accumulate / backward / optimizer.step() / optimizer.zero_grad()
        >>> # or your own optimizers, one per group (PhasedAccelerator(schedule, groups=groups)):
        >>> # model, opt1, opt2, loader = accelerator.prepare(model, opt1, opt2, loader)
    """

    def __init__(
        self,
        schedule: Schedule,
        *,
        groups: Optional[ParamGroups] = None,
        find_unused_parameters: Optional[bool] = None,
        count_comm: bool = False,
        log_switches: bool = True,
        release: ReleaseSetting = "auto",
        switcher_options: Optional[Mapping[str, Any]] = None,
        frozen_prefix: Union[None, bool, FrozenPrefix] = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(schedule, Schedule):
            raise PlanError(
                f"`schedule` must be an hf_altparams Schedule, got {type(schedule).__name__}: {schedule!r}"
            )
        if groups is not None and not isinstance(groups, ParamGroups):
            raise PlanError(f"`groups` must be a ParamGroups or None, got {type(groups).__name__}")
        if groups is not None:
            schedule.validate(groups)
        if find_unused_parameters not in (None, True, False):
            raise PlanError(
                f"`find_unused_parameters` must be None, True or False, got {find_unused_parameters!r}"
            )
        self._prefix_option = as_frozen_prefix(frozen_prefix)
        self.frozen_prefix: Optional[FrozenPrefixCache] = None
        options = dict(switcher_options or {})
        accepted = sorted(set(inspect.signature(PhaseSwitcher.__init__).parameters)
                          - {"self", "groups", "schedule", "optimizer", "model", "release"})
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise PlanError(f"`switcher_options` has unknown keys {unknown}; accepted: {accepted}")
        super().__init__(**kwargs)
        self._fsdp_plugin_given = kwargs.get("fsdp_plugin")  # Accelerate drops it on CPU (DESIGN fact 13)
        self._check_supported()
        hook = getattr(self.ddp_handler, "comm_hook", DDPCommunicationHookType.NO)
        if count_comm and hook != DDPCommunicationHookType.NO:
            raise PlanError(
                f"`count_comm=True` cannot be combined with DistributedDataParallelKwargs(comm_hook={hook!r}): "
                "DDP runs one comm hook per wrapper and the counter is one; drop one of the two"
            )
        self.schedule = schedule
        self.groups = groups
        self._groups_given = groups
        self.switcher: Optional[PhaseSwitcher] = None
        self.comm_counter: Optional[CommCounter] = None
        self.schedule_step = 0
        self.schedule_epoch = 0
        self._find_unused = find_unused_parameters
        self._count_comm = bool(count_comm)
        self._log_switches = bool(log_switches)
        self._release = ReleasePolicy(release).setting  # checked before any training step
        self._switcher_options = options
        self._driving: Optional[Optimizer] = None
        self._grouped: Optional[GroupedOptimizer] = None
        self._arrivals: Optional[GradientArrivals] = None  # one optimizer per group (_user_optimizers)
        self._backward_since_step = False  # gradients wait for a sync-boundary step()
        self._trainable: list[tuple[str, nn.Parameter]] = []
        self._trainable_by_phase: dict[Phase, list[tuple[str, nn.Parameter]]] = {}
        self._loop_guard = LoopGuard()  # unwrapped training forward, epoch never set (at step())
        self._hooks = [self.register_save_state_pre_hook(self._save_hook),
                       self.register_load_state_pre_hook(self._load_hook)]

    def _check_supported(self) -> None:
        check_supported(self)  # DeepSpeed, FSDP1, Megatron-LM, XLA, TP/CP, torch.compile: refused

    # ------------------------------------------------------------------ state
    # `phase`, `task` and `visiting(...)` come from PhaseQueries; `switch_records`,
    # `switch_history` and `switch_metrics` from ReportingMixin (_accelerate_reporting).
    _started_by = "`accelerator.prepare(model, optimizer, ...)`"

    # ---------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: Optional[list[bool]] = None) -> Any:
        """``Accelerator.prepare``, plus the phase set-up for the grouped model.

        The grouped model (``groups.module``) and the optimizer(s) whose steps drive
        the schedule must be passed in the same call: a GroupedOptimizer, one
        optimizer over every parameter the schedule trains, or one optimizer per group
        (each handed back as an :class:`OptimizerHandle`); other
        forms are refused before anything is prepared. The first phase is applied
        before DDP is built. Returned objects should be reassigned, as with Accelerate.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise PlanError(f"`device_placement` has {len(device_placement)} entries for {len(args)} objects; "
                            "give one bool (or None) per object")
        found = find_grouped(args, self.groups, self.schedule, started=self.switcher is not None)
        self._check_supported()
        sharded = found.model_index is not None and self.is_fsdp2  # FSDP2: phases start after fully_shard
        if found.model_index is not None:
            self._start_phases(found.groups, found.driving, apply_first=not sharded)  # type: ignore[arg-type]
        call_args, placement = found.arguments(args, device_placement)  # one optimizer per group -> one
        try:
            result = super().prepare(*call_args, device_placement=placement)
            items = [result] if len(call_args) == 1 else list(result)
            if sharded:
                start_sharded(self, items[found.model_index])  # type: ignore[index]
                found.groups = self.groups  # rebound to the shards (hand_back hooks them)
        finally:
            self._driving = None
        for i, obj in enumerate(items):
            if isinstance(obj, GroupedLRScheduler):
                items[i] = self._prepare_grouped_scheduler(obj)
        if found.model_index is not None:
            self._attach(items[found.model_index])
        items = found.hand_back(args, items, self)
        return items[0] if len(args) == 1 else tuple(items)

    def _start_phases(self, groups: ParamGroups, driving: Optimizer, apply_first: bool = True) -> None:
        self.groups = groups
        self._grouped = driving if isinstance(driving, GroupedOptimizer) else None
        self._driving = driving
        self._trainable_by_phase = {}
        if not apply_first:
            return
        self.switcher = PhaseSwitcher(groups, self.schedule, optimizer=driving, release=self._release,
                                      **self._switcher_options)
        # The first phase, before DDP's constructor reads the requires_grad flags (logged at _attach).
        self.switcher.step_to(self.schedule_step, self.schedule_epoch)
        handler = self.ddp_handler
        keep = handler.find_unused_parameters if handler is not None else False
        wanted = keep if self._find_unused is None else self._find_unused
        self.ddp_handler = (DistributedDataParallelKwargs(find_unused_parameters=wanted) if handler is None
                            else dataclasses.replace(handler, find_unused_parameters=wanted))

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: Optional[bool] = None) -> Optimizer:
        """As in Accelerate; the optimizer that drives the schedule gets the phase-aware wrapper."""
        if optimizer is not self._driving or getattr(optimizer, "_is_accelerate_prepared", False):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        placement = self.device_placement if device_placement is None else device_placement
        wrapped = PhasedOptimizer(optimizer, self, device_placement=placement, scaler=self.scaler)
        self._optimizers.append(wrapped)
        return wrapped

    def _prepare_grouped_scheduler(self, scheduler: GroupedLRScheduler) -> PreparedGroupedLRScheduler:
        optimizer = next((o for o in self._optimizers if o.optimizer is scheduler.optimizer), self._optimizers)
        wrapped = PreparedGroupedLRScheduler(
            scheduler, optimizer, step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        wrapped._is_accelerate_prepared = True  # type: ignore[attr-defined]
        self._schedulers.append(wrapped)
        return wrapped

    def _attach(self, prepared: nn.Module) -> None:
        assert self.switcher is not None
        if _ddp.is_ddp(prepared):
            self.switcher.attach(prepared)
            if self._count_comm:
                self.comm_counter = register_comm_counter(prepared)
        if _ddp.is_ddp(prepared) or self.switcher.backend.kind == "fsdp2":  # FSDP2: attached at start_sharded
            self._loop_guard.watch(prepared)
        elif prepared is not self.switcher.module:
            raise AltParamsError(
                f"`prepare` returned a {type(prepared).__name__} around the grouped model; PhasedAccelerator "
                "supports a DistributedDataParallel wrapper or the module itself"
            )
        # prepare() moved the whole model to the device and AcceleratedOptimizer(device_placement=True)
        # moved every optimizer state tensor there: back to where the current phase wants them.
        self.switcher.reapply_placement()
        history = self.switcher.history
        first = history.last  # taken before DDP existed: fill in what its reducer reduces
        assert first is not None
        history.replace_last(dataclasses.replace(
            first, allreduce_bytes_per_step=self.switcher.allreduce_bytes_per_step(), rebuilt_ddp=False))
        if self._prefix_option is not None:
            self.frozen_prefix = FrozenPrefixCache(self.switcher.module, self._prefix_option).attach()
        self._after_switch(history.last)  # type: ignore[arg-type]

    # ------------------------------------------------------- the training loop
    def _check_gradients(self) -> None:
        self._loop_guard.check(self)  # gradients that bypassed DDP, an epoch never set
        check_trainable_gradients(self)  # a trainable parameter without a gradient

    def _sync_step_done(self) -> None:
        """End of a sync-boundary ``step()`` (fp16-skipped too, as the Trainer counts it): count it, switch."""
        if self.switcher is None:  # used after free_memory(): nothing to drive
            return
        self.schedule_step += 1
        self._backward_since_step = False
        if self.comm_counter is not None:
            self.comm_counter.end_step()
        if self._grouped is not None and self.switcher.current is not None:
            self._grouped.stepped = self.switcher.current.trainable  # what a GroupedLRScheduler advances
        self._advance()

    def _advance(self) -> Optional[SwitchRecord]:
        assert self.switcher is not None
        due = self.switcher.phase_at(self.schedule_step, self.schedule_epoch)
        if due != self.switcher.current:
            if self._backward_since_step:
                raise mid_window_switch_error(due.name, self.schedule_step, self.schedule_epoch)
            # Gradients the step just applied: cleared, so none reaches the next phase, whatever the loop's order.
            for _, param in self.switcher.groups.all_named_params():
                param.grad = None
        record = self.switcher.step_to(self.schedule_step, self.schedule_epoch)
        if record is not None:
            self._after_switch(record)
        return record

    def _after_switch(self, record: SwitchRecord) -> None:
        assert self.switcher is not None
        phase = self.switcher.current
        trainable = self._trainable_by_phase.get(phase) if phase is not None else None
        if trainable is None:
            trainable = [(n, p) for n, p in self.switcher.groups.all_named_params() if p.requires_grad]
            if phase is not None:
                remember(self._trainable_by_phase, phase, trainable)
        self._trainable = trainable
        if self._log_switches:
            self.log(self.switch_metrics(record), step=record.step)

    def set_epoch(self, epoch: int) -> Optional[SwitchRecord]:
        """Tell an epoch-unit schedule the epoch; call at the top of each epoch, on every rank."""
        self.schedule_epoch = int(epoch)
        self._loop_guard.epoch_set(self.schedule_step)
        if self.switcher is None:
            return None
        return self._advance()

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``; notes that gradients now wait for a sync-boundary ``step()``.

        A loss that depends on no trainable parameter is refused first, naming the
        phase and the likely causes (:mod:`._unreached`), instead of torch's
        "element 0 of tensors does not require grad".
        """
        if self.switcher is not None:
            check_loss(loss, self.switcher.current, self.switcher.groups, "accelerator.backward(loss)",
                       "`accelerator.task` / `accelerator.phase`")
        super().backward(loss, **kwargs)
        self._backward_since_step = True

    def end_training(self) -> None:
        """``Accelerator.end_training`` (trackers finish, the process group goes), exiting cleanly.

        Before the group is destroyed, the DDP wrapper's reducer is freed (the
        prepared model cannot train afterwards) and the gloo threads finish their
        pending work (:mod:`hf_altparams.engine.shutdown`: a script whose last
        backward ran just before exit could otherwise abort with "terminate
        called without an active exception"). A script that never calls it is
        covered by the exit hook installed when the wrapper was attached.
        """
        ddp = None if self.switcher is None else self.switcher.ddp
        if ddp is not None:
            _ddp.free_reducer(ddp)
        quiesce_comm_threads()
        super().end_training()
        quiesce_comm_threads()

    def free_memory(self, *objects: Any) -> Any:
        """``Accelerator.free_memory``; also forgets the phase set-up so a new model can be prepared."""
        if self.frozen_prefix is not None:
            self.frozen_prefix.detach()
        self.switcher, self.comm_counter, self._grouped, self.frozen_prefix = None, None, None, None
        self._loop_guard.close()
        self._loop_guard = LoopGuard()
        if self._arrivals is not None:
            self._arrivals.close()
        self._arrivals = None
        self.groups = self._groups_given
        self._trainable, self._backward_since_step = [], False
        self._trainable_by_phase = {}
        self.schedule_step, self.schedule_epoch = 0, 0
        return super().free_memory(*objects)
