"""Phased training in a stock Accelerate loop: :class:`PhasedAccelerator`.

``PhasedAccelerator`` is an :class:`accelerate.Accelerator` whose phases are one
:class:`~.accelerate_run.PhasedRun`: the schedule position and current phase
(a :class:`~hf_altparams.engine.driver.PhaseDriver`), the
:class:`~hf_altparams.engine.PhaseSwitcher` built at ``prepare``, and the loop
checks. Everything else in the loop stays Accelerate's: ``backward``,
``accumulate``, ``no_sync``, ``clip_grad_norm_``, trackers and ``log``, comm
hooks from ``DistributedDataParallelKwargs``. What it adds, and where:

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
  set (:class:`~.accelerate_run.LoopGuard`), and a step where ``requires_grad``
  or a gradient does not match the phase (:mod:`hf_altparams.engine.invariants`);
  ``end_training`` frees the reducer before the process group goes.
* with ``TorchDynamoPlugin(use_regional_compilation=True)``, ``prepare`` compiles
  the grouped model's regions in place before DDP wraps it
  (:mod:`.regions`) and keeps Accelerate from compiling the wrapper (it would
  compile a copy of the wrapper that keeps the reducer of that moment); a
  whole-model compile is refused (:mod:`.refusals`).
* ``save_state`` / ``load_state`` also save and restore the schedule position
  (``hf_altparams_state.json``) and switch to the saved phase *before* the
  optimizer state is loaded, so idle groups keep their state policy; a barrier
  follows ``save_state`` (:mod:`.accelerate_checkpoints`).

``prepare``'s accepted forms are in :mod:`.accelerate_prepare`; the few
Accelerate internals the class needs (its lists of prepared objects) are
reached through :mod:`.accelerate_internals`.

Subclass rather than composition with the Accelerator: the loop already talks to
one object, and the points to hook (``prepare``, ``prepare_optimizer``,
``backward``, ``save_state``, ``load_state``, ``free_memory``) are public methods
of it. A wrapper holding an ``Accelerator`` would have to forward the other
hundred methods, or leave users calling ``save_state`` on the inner object and
silently skipping the schedule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol, Sequence, Union

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import (
    DDPCommunicationHookType,
    DistributedDataParallelKwargs,
    DistributedType,
    has_compiled_regions,
    is_compiled_module,
)
from torch import nn
from torch.optim import Optimizer

from ..engine.collective import is_collective_failure
from ..engine.comm import CommCounter
from ..engine.config import SwitchConfig
from ..engine.driver import PhaseDriver
from ..engine.memory import rss_bytes
from ..engine.optim import GroupedLRScheduler
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache, as_frozen_prefix
from ..engine.records import SwitchHistory, SwitchRecord
from ..engine.shutdown import quiesce_comm_threads
from ..engine.strategies import Strategy, is_registered, strategy_for, strategy_named
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError, Cause, PlanError, SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from .accelerate_checkpoints import STATE_FILE, Checkpoints
from .accelerate_internals import (
    dynamo_settings,
    is_prepared,
    prepared_dataloaders,
    prepared_optimizers,
    register_prepared_optimizer,
    register_prepared_scheduler,
    without_compile,
)
from .accelerate_prepare import OptimizerHandle, checked_phases, find_grouped, unscale_once
from .accelerate_run import PhasedRun, RunSettings
from .assembly import comm_metrics
from .fsdp2 import fsdp2_not_running
from .refusals import ACCELERATE, Configuration, check
from .regions import compile_regions_in_place, has_repeated_blocks
from .unreached import check_loss

__all__ = [
    "OptimizerHandle",
    "PhasedAccelerator",
    "PhasedOptimizer",
    "PreparedGroupedLRScheduler",
    "STATE_FILE",
    "check_supported",
    "configuration",
]


class PhasedAccelerator(Accelerator):
    """An ``Accelerator`` that trains one phase of a schedule at a time.

    Args:
        schedule: which groups train at each optimizer step (or epoch); checked
            against the groups at ``prepare``, before any step. ``None``
            (default): no phases, the accelerator is a plain ``Accelerator``
            until :meth:`set_phases` gives it a schedule.
        groups: the :class:`~hf_altparams.plan.ParamGroups` of the model, or, for
            several models trained by one schedule (a GAN), a mapping of names to
            the models (``{"generator": gen, "discriminator": disc}``, see
            ``ParamGroups.of_models``). Leave it out when the optimizer is a
            :class:`~hf_altparams.engine.GroupedOptimizer` (its groups are used).
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
            ``True`` (every switch) or ``False`` (never).
        switcher_options: the switch's other settings: a
            :class:`~hf_altparams.engine.config.SwitchConfig` or a mapping of its
            names (``offload_device``, ``prefetch``, ``buffer_sync``,
            ``frozen_norms``, ``keep_reducers``, ``collective_timeout``, ...).
        frozen_prefix: ``True`` or a :class:`~hf_altparams.engine.prefix.FrozenPrefix`:
            run the frozen leading layers in eval mode and start the forward from
            their cached output per sample (the loop passes ``sample_index=`` to the
            model); ``accelerator.frozen_prefix`` reports, and switch logs carry
            ``altparams/prefix_*`` (hit rate, bytes held, seconds saved).
        **kwargs: passed to ``accelerate.Accelerator``.

    Raises:
        PlanError: on a bad argument. AltParamsError: with DeepSpeed, FSDP1 (FSDP2 is supported),
            Megatron-LM, XLA, tensor/context parallelism or a whole-model ``torch.compile``
            (``dynamo_backend`` without ``use_regional_compilation``).

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
        schedule: Optional[Schedule] = None,
        *,
        groups: Union[None, ParamGroups, Mapping[str, nn.Module]] = None,
        find_unused_parameters: Optional[bool] = None,
        count_comm: bool = False,
        log_switches: bool = True,
        release: Any = "auto",
        switcher_options: Union[None, SwitchConfig, Mapping[str, Any]] = None,
        frozen_prefix: Union[None, bool, FrozenPrefix] = None,
        **kwargs: Any,
    ) -> None:
        schedule, groups = checked_phases(schedule, groups)
        if find_unused_parameters not in (None, True, False):
            raise PlanError(f"`find_unused_parameters` must be None, True or False, got {find_unused_parameters!r}")
        if isinstance(switcher_options, Mapping) and "release" in switcher_options:
            raise PlanError("`switcher_options` may not set ['release']: pass `release=` to PhasedAccelerator")
        settings = RunSettings(
            config=SwitchConfig.build(switcher_options, release=release),  # checked before any model
            find_unused=find_unused_parameters,
            count_comm=bool(count_comm),
            log_switches=bool(log_switches),
            prefix=as_frozen_prefix(frozen_prefix),
        )
        super().__init__(**kwargs)
        self._fsdp_plugin_given = kwargs.get("fsdp_plugin")  # Accelerate drops it on CPU
        check_supported(self, self._fsdp_plugin_given)
        hook = getattr(self.ddp_handler, "comm_hook", DDPCommunicationHookType.NO)
        if count_comm and hook != DDPCommunicationHookType.NO:
            raise PlanError(
                f"`count_comm=True` cannot be combined with DistributedDataParallelKwargs(comm_hook={hook!r}): "
                "DDP runs one comm hook per wrapper and the counter is one; drop one of the two"
            )
        self.run = PhasedRun(
            schedule, groups, settings, log=self.log, metrics=self.switch_metrics, steps_per_epoch=self._steps_per_epoch
        )
        self._checkpoints = Checkpoints(self, self.run)
        self._hooks = [
            self.register_save_state_pre_hook(self._checkpoints.save_hook),
            self.register_load_state_pre_hook(self._checkpoints.load_hook),
        ]

    # ------------------------------------------------------------------ state (the run's)
    @property
    def schedule(self) -> Optional[Schedule]:
        return self.run.schedule

    @property
    def groups(self) -> Optional[ParamGroups]:
        """The groups of the prepared model (``None`` before ``prepare`` when none were given)."""
        return self.run.groups

    @property
    def switcher(self) -> Optional[PhaseSwitcher]:
        """The engine's switcher (``None`` before ``prepare``)."""
        return self.run.switcher

    @property
    def driver(self) -> Optional[PhaseDriver]:
        """The schedule position and the current phase."""
        return self.run.driver

    @property
    def schedule_step(self) -> int:
        """Sync-boundary optimizer steps taken (the schedule's position)."""
        return self.run.driver.step if self.run.driver is not None else 0

    @property
    def phase(self) -> Optional[Phase]:
        """The phase that trains now: the one the next forward and backward train (``None`` before ``prepare``).

        Read at the top of an iteration, it is right whatever the loop's order
        of ``zero_grad`` / ``backward`` / ``step``: a switch happens at the end
        of the sync-boundary ``step()`` that completes the previous phase.
        """
        return None if self.switcher is None else self.switcher.phase

    @property
    def task(self) -> Optional[str]:
        """The current task's name under :class:`~hf_altparams.plan.PerTaskCycle` (else ``None``).

        The task's group names joined by ``+`` (``"t0"``, or ``"a+b"`` for a
        task of two groups), as in the schedule, so a multi-task loop can pick
        its data directly: ``batch = next(iterators[accelerator.task])``.
        """
        return None if self.switcher is None else self.switcher.task

    @contextlib.contextmanager
    def visiting(self, groups: Union[str, Iterable[str]]) -> Iterator[None]:
        """Bring non-resident ``groups`` back to the device for the ``with`` block (e.g. to evaluate them).

        See :meth:`~hf_altparams.engine.PhaseSwitcher.visiting`: use it for
        evaluation, under ``torch.no_grad()``; not a collective.

        Raises:
            AltParamsError: before ``prepare`` (no phase applied yet).

        Example:
            >>> # with torch.no_grad(), accelerator.visiting(["head2"]):
            >>> #     loss2 = model(x, task="head2").mean()
        """
        if self.switcher is None:
            raise AltParamsError(
                f"`visiting({groups!r})` was called before `accelerator.prepare(model, optimizer, ...)`: no phase "
                "is applied yet, so every group is where the model put it; call it after that"
            )
        with self.switcher.visiting(groups):
            yield

    @property
    def comm_counter(self) -> Optional[CommCounter]:
        return self.run.comm_counter

    @property
    def frozen_prefix(self) -> Optional[FrozenPrefixCache]:
        return self.run.frozen_prefix

    def set_phases(
        self, schedule: Schedule, *, groups: Union[None, ParamGroups, Mapping[str, nn.Module]] = None
    ) -> None:
        """Give a ``PhasedAccelerator()`` built without a schedule its schedule (and groups), before ``prepare``.

        For scripts that build the accelerator before the model: the accelerator
        line stays where it was, and this one line goes anywhere before the
        ``prepare`` of the grouped model(s). Same arguments as the constructor's.

        Example:
            >>> # accelerator = PhasedAccelerator(mixed_precision="bf16")   # was Accelerator(...)
            >>> # gen, disc = Generator(), Discriminator()
            >>> # accelerator.set_phases(Alternating({"discriminator": 5, "generator": 1}),
            >>> #                        groups={"generator": gen, "discriminator": disc})
            >>> # gen, disc, opt_g, opt_d = accelerator.prepare(gen, disc, opt_g, opt_d)
        """
        if self.run.prepared_models or self.run.switcher is not None:
            raise PlanError(
                "`set_phases` came after `prepare` of the grouped model; call it before, so the first "
                "phase is applied before DDP wraps the model"
            )
        if self.run.unphased_models:
            raise PlanError(
                f"`set_phases` came after `prepare` of {self.run.unphased_models}, prepared while the accelerator "
                "had no schedule: that model is wrapped already (DDP over every parameter, the optimizer a plain "
                "one) and would train whole at every step, the schedule ignored. Call `set_phases(schedule, "
                "groups=...)` before `accelerator.prepare(model, optimizer, ...)`"
            )
        self.run.set_phases(*checked_phases(schedule, groups))

    # ---------------------------------------------------------------- prepare
    def prepare(self, *args: Any, device_placement: Optional[Sequence[Optional[bool]]] = None) -> Any:
        """``Accelerator.prepare``, plus the phase set-up for the grouped model.

        The grouped model (``groups.module``) and the optimizer(s) whose steps drive
        the schedule must be passed in the same call: a GroupedOptimizer, one
        optimizer over every parameter the schedule trains, or one optimizer per group
        (each handed back as an :class:`OptimizerHandle`); other
        forms are refused before anything is prepared. The first phase is applied
        before DDP is built. Returned objects should be reassigned, as with Accelerate.
        """
        if device_placement is not None and len(device_placement) != len(args):
            raise PlanError(
                f"`device_placement` has {len(device_placement)} entries for {len(args)} objects; "
                "give one bool (or None) per object"
            )
        run = self.run
        found = find_grouped(
            args,
            run.groups,
            run.schedule,
            prepared_models=run.prepared_models,
            driving_bound=run.driving_bound,
            multi_process=self.num_processes > 1,
        )
        if run.schedule is None:  # a plain Accelerator so far: a later set_phases must know what it missed
            run.note_unphased(args)
        check_supported(self, self._fsdp_plugin_given)
        call_args, placement = found.arguments(args, device_placement)  # one optimizer per group -> one
        regional = dynamo_settings(self).regional and bool(found.models)
        if regional:
            _check_regions(call_args, found.models)  # before anything changes
        root_index = next((i for i, part in found.models.items() if part is None), None)
        strategy = self._configured_strategy()
        if (
            found.models
            and getattr(self._fsdp_plugin_given, "fsdp_version", None) == 2
            and (root_index is None or strategy is None or strategy.name != "fsdp2")
        ):
            warnings.warn(
                fsdp2_not_running(
                    "fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)", str(self.distributed_type.value)
                ),
                stacklevel=2,
            )
        if found.models and run.switcher is None and not run.prepared_models:
            run.start(found.groups, found.driving, strategy)  # type: ignore[arg-type]
            handler = self.ddp_handler
            wanted = run.find_unused(handler.find_unused_parameters if handler is not None else False)
            self.ddp_handler = (
                DistributedDataParallelKwargs(find_unused_parameters=wanted)
                if handler is None
                else dataclasses.replace(handler, find_unused_parameters=wanted)
            )
        elif found.driving is not None:
            run.bind_optimizer(found.driving)  # the model came in an earlier call
        parts = [call_args[i] for i, part in found.models.items() if part is not None]
        compiling = without_compile(self) if regional else contextlib.nullcontext()
        if regional:
            _compile_regions(call_args, self)
        try:
            with run.wrapping_all(parts), compiling:
                result = super().prepare(*call_args, device_placement=placement)
            items = [result] if len(call_args) == 1 else list(result)
        finally:
            run.driving = None
        for i, obj in enumerate(items):
            if isinstance(obj, GroupedLRScheduler):
                items[i] = self._prepare_grouped_scheduler(obj)
        for i, part in found.models.items():
            run.attach(items[i], part)
        if found.models:
            found.groups = run.groups  # rebound to FSDP2's shards, if it replaced the parameters (hand_back hooks them)
        items, arrivals = found.hand_back(args, items)
        if arrivals is not None:
            run.arrivals = arrivals
        return items[0] if len(args) == 1 else tuple(items)

    def _configured_strategy(self) -> Optional[Strategy]:
        """The registered strategy Accelerate is configured to run (FSDP2, or DeepSpeed once registered), else
        ``None``: DDP or one process, as the wrapper ``prepare`` returns says."""
        name = {
            DistributedType.FSDP: "fsdp2" if self.is_fsdp2 else None,
            DistributedType.DEEPSPEED: configuration(self).strategy_name,
        }.get(self.distributed_type)
        return strategy_named(name) if name is not None and is_registered(name) else None

    def prepare_optimizer(self, optimizer: Optimizer, device_placement: Optional[bool] = None) -> AcceleratedOptimizer:
        """As in Accelerate; the optimizer that drives the schedule gets the phase-aware wrapper."""
        if optimizer is not self.run.driving or is_prepared(optimizer):
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        placement = self.device_placement if device_placement is None else device_placement
        wrapped = PhasedOptimizer(
            optimizer,
            self.run,
            lambda: int(self.gradient_accumulation_steps),
            device_placement=placement,
            scaler=self.scaler,
        )
        register_prepared_optimizer(self, wrapped)
        return wrapped

    def _prepare_grouped_scheduler(self, scheduler: GroupedLRScheduler) -> PreparedGroupedLRScheduler:
        prepared = prepared_optimizers(self)
        optimizer = next((o for o in prepared if o.optimizer is scheduler.optimizer), prepared)
        wrapped = PreparedGroupedLRScheduler(
            scheduler,
            optimizer,
            step_with_optimizer=self.step_scheduler_with_optimizer,
            split_batches=self.split_batches,
        )
        register_prepared_scheduler(self, wrapped)
        return wrapped

    # ------------------------------------------------------- the training loop
    def set_epoch(self, epoch: int) -> Optional[SwitchRecord]:
        """Tell an epoch-unit schedule the epoch; call at the top of each epoch, on every rank."""
        return self.run.set_epoch(epoch)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward``; notes that gradients now wait for a sync-boundary ``step()``.

        Under a strategy whose update runs inside the sync-boundary backward
        (its declared step boundary is ``backward``: DeepSpeed's engine under
        Accelerate), that backward is the step: the schedule counts it and
        switches phase at its end, and ``optimizer.step()`` drives nothing.

        A loss that depends on no trainable parameter is refused first, naming the
        phase and the likely causes (:mod:`.unreached`), instead of torch's
        "element 0 of tensors does not require grad".
        """
        if self.run.prepared_models and not self.run.driving_bound:
            raise PlanError(
                "the grouped model was prepared, but no optimizer over its parameters was passed to `prepare` "
                "yet: the schedule is driven by that optimizer's steps, so the phases would never advance. "
                "Pass the optimizer to `accelerator.prepare` (with the model, or in a later call) before training.",
                cause=Cause.OPTIMIZER_MISSES_PARAMETERS,
            )
        if self.switcher is not None:
            check_loss(
                loss,
                self.switcher.current,
                self.switcher.groups,
                "accelerator.backward(loss)",
                "`accelerator.task` / `accelerator.phase`",
            )
        try:
            super().backward(loss, **kwargs)
        except RuntimeError as exc:
            if self.switcher is None or self.num_processes <= 1 or not is_collective_failure(exc):
                raise
            step = self.run.driver.step if self.run.driver is not None else 0
            raise SwitchError(
                f"accelerator.backward at schedule step {step} (rank {self.process_index} of {self.num_processes}): "
                f"DDP's gradient all-reduce failed ({type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}). "
                "The ranks are out of step: another rank is in another collective, most likely a phase switch, "
                "because the ranks did not all call `optimizer.step()` at the same iterations (a step skipped or "
                "doubled on some rank) or one rank died. Every rank must run the same steps; the process group is "
                "unusable now: restart from the latest complete checkpoint",
                cause=Cause.RANK_LOST,
            ) from exc
        if self.run.driver is not None:
            self.run.driver.note_backward()
        if self.run.steps_in_backward and self.sync_gradients:
            self.run.after_step()  # the strategy's update ran inside this backward: its step boundary

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """``Accelerator.unscale_gradients``; one grouped optimizer behind several handles is unscaled once."""
        super().unscale_gradients(unscale_once(optimizer, prepared_optimizers(self), self.run.arrivals))

    def _steps_per_epoch(self) -> int:
        """Optimizer steps in one pass over the longest prepared dataloader (0: unknown)."""
        lengths = []
        for loader in prepared_dataloaders(self):
            try:
                lengths.append(len(loader))
            except TypeError:  # an iterable dataset has no length
                continue
        return math.ceil(max(lengths) / max(1, int(self.gradient_accumulation_steps))) if lengths else 0

    # ------------------------------------------------------------------ checkpoints
    def save_state(self, output_dir: Optional[str] = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        """``Accelerator.save_state`` plus the schedule position; drift-checked first, a completion marker last.

        See :meth:`~._accelerate_checkpoints.Checkpoints.save` (and ``docs/faults.md``).
        """
        return self._checkpoints.save(output_dir, safe_serialization, **kwargs)

    def load_state(
        self, input_dir: Optional[str] = None, load_kwargs: Optional[dict[str, Any]] = None, **kwargs: Any
    ) -> None:
        """``Accelerator.load_state``; refuses torn or foreign checkpoints, applies the saved phase first.

        See :meth:`~._accelerate_checkpoints.Checkpoints.load`.
        """
        self._checkpoints.load(input_dir, load_kwargs, **kwargs)

    def latest_checkpoint(self) -> Optional[str]:
        """The checkpoint ``load_state()`` would resume from, or ``None`` when there is none yet.

        With automatic checkpoint naming: the highest ``checkpoint_<n>`` under
        ``project_dir/checkpoints`` complete on every rank (a collective: call it
        on every rank). The start of an elastic job: ``if acc.latest_checkpoint():
        acc.load_state()`` (``examples/elastic_restart.py``).
        """
        return self._checkpoints.latest()

    # ------------------------------------------------------------------ reports
    @property
    def switch_records(self) -> list[SwitchRecord]:
        """The recent switches (the first phase applied at ``prepare`` included), oldest first.

        At most ``switcher.history.window`` (256 by default) records; the running
        totals of the whole run are in :attr:`switch_history`.
        """
        return [] if self.switcher is None else self.switcher.records

    @property
    def switch_history(self) -> Optional[SwitchHistory]:
        """Recent records plus running totals (count, seconds, bytes moved); ``None`` before ``prepare``."""
        return None if self.switcher is None else self.switcher.history

    def switch_metrics(self, record: SwitchRecord, prefix: str = "altparams/") -> dict[str, Any]:
        """What ``accelerator.log`` receives at a switch: the record, the run's switch totals, memory."""
        metrics: dict[str, Any] = record.as_log(prefix)
        metrics.update(comm_metrics(self.switcher, self.comm_counter, record, prefix))
        if self.switcher is not None:
            metrics.update(self.switcher.history.as_log(prefix))
        if self.device.type == "cuda":
            metrics[f"{prefix}memory_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
            metrics[f"{prefix}max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
        else:
            metrics[f"{prefix}rss_bytes"] = rss_bytes()
        if self.frozen_prefix is not None:  # what the cache did for the prefix that just ended
            metrics.update(self.frozen_prefix.metrics(prefix))
        return metrics

    # ------------------------------------------------------------------ the end
    def end_training(self) -> None:
        """``Accelerator.end_training`` (trackers finish, the process group goes), exiting cleanly.

        Before the group is destroyed, the wrappers end their training life (a
        DDP wrapper's reducer is freed; the prepared model cannot train afterwards) and the gloo threads finish their
        pending work (:mod:`hf_altparams.engine.shutdown`: a script whose last
        backward ran just before exit could otherwise abort with "terminate
        called without an active exception"). A script that never calls it is
        covered by the exit hook installed when the wrapper was attached.
        """
        if self.switcher is not None:
            self.switcher.release_wrappers()
        quiesce_comm_threads()
        super().end_training()
        quiesce_comm_threads()

    def free_memory(self, *objects: Any) -> Any:
        """``Accelerator.free_memory``; also forgets the phase set-up so a new model can be prepared."""
        self.run.reset()
        return super().free_memory(*objects)


class StepHooks(Protocol):
    """What the prepared optimizer calls around a sync-boundary step (a :class:`~.accelerate_run.PhasedRun`)."""

    guard: Any

    @property
    def steps_in_backward(self) -> bool:
        """The strategy applies the update inside the sync-boundary backward (its step boundary)."""

    def before_step(self) -> None: ...

    def after_step(self) -> Any: ...


def configuration(acc: Accelerator, fsdp_plugin_given: Any = None) -> Configuration:
    """The accelerator's run as the refusal table reads it (:mod:`.refusals`).

    The FSDP plugin given to the constructor (``fsdp_plugin_given``) counts even
    where Accelerate dropped it (on CPU): the same script on GPUs would run it.
    """
    kind = acc.distributed_type
    plugin = fsdp_plugin_given or getattr(acc.state, "fsdp_plugin", None)
    parallelism = getattr(acc, "parallelism_config", None)
    fsdp_version = getattr(plugin, "fsdp_version", None)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return Configuration(
        ACCELERATE,
        deepspeed=kind == DistributedType.DEEPSPEED,
        fsdp_version=fsdp_version,
        megatron=kind == DistributedType.MEGATRON_LM,
        xla=kind == DistributedType.XLA,
        tensor_parallel=parallelism is not None and bool(parallelism.tp_enabled or parallelism.cp_enabled),
        compiled=_whole_compile(acc, fsdp_version is not None or kind == DistributedType.FSDP),
        world_size=world,
        processes=int(acc.num_processes),
        distributed_type=str(kind.value),
        deepspeed_config=_deepspeed_config(acc) if kind == DistributedType.DEEPSPEED else {},
    )


def _deepspeed_config(acc: Accelerator) -> Mapping[str, Any]:
    """The DeepSpeed plugin's configuration (its ``zero_stage`` and the rest), empty without a plugin."""
    config = getattr(getattr(acc.state, "deepspeed_plugin", None), "deepspeed_config", None)
    return config if isinstance(config, Mapping) else {}


def _whole_compile(acc: Accelerator, fsdp: bool) -> Optional[str]:
    """How ``acc``'s dynamo plugin asks for a compile the phases refuse, else ``None``.

    Compiled regions (``use_regional_compilation=True``) are driven under DDP
    and in one process: ``prepare`` compiles them in place before DDP wraps the
    model. Under FSDP they are not verified; any other backend compiles whole.
    """
    dynamo = dynamo_settings(acc)
    if not dynamo.compiles or (dynamo.regional and not fsdp):
        return None
    return f"dynamo_backend={dynamo.backend!r}" + (
        " with `use_regional_compilation=True` under FSDP" if dynamo.regional else ""
    )


def _check_regions(args: tuple[Any, ...], models: Mapping[int, Optional[str]]) -> None:
    """``use_regional_compilation=True``: a grouped model without repeated blocks would be compiled whole.

    ``models``: the indexes of the grouped models in ``args`` (``prepare``'s arguments as Accelerate gets them).
    """
    for i in models:
        model = args[i]
        if is_compiled_module(model) or has_compiled_regions(model) or has_repeated_blocks(model):
            continue
        raise PlanError(
            f"`TorchDynamoPlugin(use_regional_compilation=True)`: `prepare` argument #{i + 1} "
            f"({type(model).__name__}), the grouped model, has no repeated blocks (an nn.ModuleList of modules of "
            "one class), so compiling it by regions would compile it whole, whose graph guards on `requires_grad` "
            "and is recompiled at every phase switch. Drop `dynamo_backend`, or keep its blocks in an nn.ModuleList"
        )


def _compile_regions(args: tuple[Any, ...], acc: Accelerator) -> None:
    """Compile the regions of every model ``prepare`` got, in place, as Accelerate's plugin asks (before DDP).

    A model compiled already (whole, or by Accelerate's ``compile_regions``) is
    left as it is, as Accelerate leaves it; one without repeated blocks (not a
    grouped one: :func:`_check_regions`) is compiled whole, as Accelerate would;
    a wrapper built before ``prepare`` (not the grouped model's: refused) is left uncompiled.
    """
    kwargs = dict(dynamo_settings(acc).compile_kwargs)
    for arg in args:
        if not isinstance(arg, nn.Module) or is_compiled_module(arg) or has_compiled_regions(arg):
            continue
        if strategy_for(arg).capabilities.wraps_module:
            continue
        if has_repeated_blocks(arg):
            compile_regions_in_place(arg, **kwargs)
        else:
            arg.compile(**kwargs)


def check_supported(acc: Accelerator, fsdp_plugin_given: Any = None) -> None:
    """Refuse, with the reason and the way out, a configuration the phases cannot drive (:func:`.refusals.check`)."""
    check(configuration(acc, fsdp_plugin_given))


class PhasedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: a sync-boundary ``step()`` is checked first, then drives the schedule.

    Before the update, the run's loop checks run (:class:`~.accelerate_run.LoopGuard`;
    the phase's invariants run in the inner optimizer's own step hook); after it,
    the run's driver counts the step and switches phase when the schedule says
    so, so the next iteration, whatever its order, starts in the right phase.

    Args:
        optimizer: the optimizer that drives the schedule.
        run: the accelerator's :class:`~.accelerate_run.PhasedRun`.
        accumulation_steps: the accelerator's gradient-accumulation steps (read at each call).
    """

    def __init__(
        self, optimizer: Optimizer, run: StepHooks, accumulation_steps: Callable[[], int], **kwargs: Any
    ) -> None:
        super().__init__(optimizer, **kwargs)
        self._run = run
        self._accumulation_steps = accumulation_steps

    # no loss returned, closure or not, as Accelerate's own step (torch's returns the closure's loss)
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        # a strategy whose update runs inside the sync-boundary backward switches there (PhasedAccelerator.backward)
        at_boundary = self.gradient_state.sync_gradients and not self._run.steps_in_backward
        if at_boundary:
            self._run.before_step()
        super().step(closure)
        if at_boundary:
            self._run.after_step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        guard = self._run.guard
        if self.gradient_state.sync_gradients and guard is not None:  # Accelerate skips it inside a window
            guard.zero_grad_at_boundary(self._accumulation_steps())
        super().zero_grad(set_to_none)


class PreparedGroupedLRScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper for a GroupedLRScheduler (which has no ``_step_count``)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.step_with_optimizer and not self.gradient_state.sync_gradients:
            return  # inside an accumulation window: the optimizer did not step
        super().step(*args, **kwargs)
