"""The phased part of a :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` run: :class:`PhasedRun`.

The accelerator keeps Accelerate's own state and delegates everything about
phases to one ``PhasedRun``: the settings given at construction, the
:class:`~hf_altparams.engine.driver.PhaseDriver` (schedule position and current
phase), the :class:`~hf_altparams.engine.PhaseSwitcher` built at ``prepare``,
the optimizer that drives the schedule, the loop guard, the comm counter and the
frozen-prefix cache. The prepared optimizer talks to the run's two step hooks
(:meth:`PhasedRun.before_step`, :meth:`PhasedRun.after_step`), never to the
accelerator's internals.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch import nn
from torch.optim import Optimizer

from ..engine.comm import CommCounter, register_comm_counter, register_reduce_scatter_counter
from ..engine.config import SwitchConfig
from ..engine.ddp import is_ddp
from ..engine.fsdp2 import is_fsdp2
from ..engine.driver import PhaseDriver
from ..engine.optim import GroupedOptimizer
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache
from ..engine.records import SwitchRecord
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError
from ..plan.groups import ParamGroups
from ..plan.schedules import Schedule
from ._fsdp2_prepare import rebind_groups, rebind_optimizer
from ._loop_guard import LoopGuard
from ._user_optimizers import GradientArrivals

__all__ = ["PhasedRun", "RunSettings"]


@dataclass(frozen=True)
class RunSettings:
    """What ``PhasedAccelerator(...)`` was given about phases, checked at construction."""

    config: SwitchConfig
    find_unused: Optional[bool] = None
    count_comm: bool = False
    log_switches: bool = True
    prefix: Optional[FrozenPrefix] = None


class PhasedRun:
    """The phases of one accelerator run, from ``prepare`` to ``free_memory``.

    Args:
        schedule: the run's schedule (``None``: the accelerator runs unphased).
        groups: the groups given at construction (``None``: taken from a
            GroupedOptimizer at ``prepare``).
        settings: the checked settings.
        log: ``accelerator.log``; receives each switch's metrics.
        metrics: builds the metrics of a switch record.
        steps_per_epoch: optimizer steps in one pass over the longest prepared dataloader.
    """

    def __init__(self, schedule: Optional[Schedule], groups: Optional[ParamGroups], settings: RunSettings, *,
                 log: Callable[..., Any], metrics: Callable[[SwitchRecord], dict[str, Any]],
                 steps_per_epoch: Callable[[], int]) -> None:
        self.schedule = schedule
        self.groups_given = groups
        self.settings = settings
        self._log, self._metrics, self._steps_per_epoch = log, metrics, steps_per_epoch
        self.groups: Optional[ParamGroups] = groups
        self.driver: Optional[PhaseDriver] = None
        self.guard: Optional[LoopGuard] = None
        self.switcher: Optional[PhaseSwitcher] = None
        self.grouped: Optional[GroupedOptimizer] = None  # the GroupedOptimizer that drives, if one does
        self.driving: Optional[Optimizer] = None  # the optimizer being prepared to drive (inside prepare)
        self.arrivals: Optional[GradientArrivals] = None  # one optimizer per group (_user_optimizers)
        self.comm_counter: Optional[CommCounter] = None
        self.frozen_prefix: Optional[FrozenPrefixCache] = None
        self.prepared_models: set[Optional[str]] = set()  # grouped models prepared (None: the groups' module)
        self.driving_bound = False  # the optimizer that drives the schedule was prepared
        self.reset()

    def reset(self) -> None:
        """Forget the model: a new driver at step 0, nothing prepared (``free_memory``, construction)."""
        self.close()
        self.groups = self.groups_given
        self.switcher, self.grouped, self.driving, self.comm_counter = None, None, None, None
        self.prepared_models, self.driving_bound = set(), False
        self.driver = (PhaseDriver(self.schedule, set_epoch_call="accelerator.set_epoch(epoch)")
                       if self.schedule is not None else None)
        self.guard = LoopGuard(self.driver, self._steps_per_epoch) if self.driver is not None else None

    def close(self) -> None:
        """Remove what the run hooked (loop guard, gradient arrivals, the prefix cache, the step check)."""
        if self.guard is not None:
            self.guard.close()
        if self.arrivals is not None:
            self.arrivals.close()
            self.arrivals = None
        if self.frozen_prefix is not None:
            self.frozen_prefix.detach()
            self.frozen_prefix = None
        if self.switcher is not None:
            self.switcher.close()

    # ------------------------------------------------------------ prepare
    def start(self, groups: ParamGroups, driving: Optional[Optimizer], apply_first: bool = True) -> None:
        """Build the switcher for ``groups`` and apply the first phase (before DDP's constructor reads the flags).

        ``driving`` may come in a later ``prepare`` call (:meth:`bind_optimizer`).
        """
        assert self.driver is not None and self.schedule is not None
        self.groups = groups
        self._take_driving(driving)
        if not apply_first:  # FSDP2: the phases start after fully_shard (start_sharded)
            return
        self.switcher = self._new_switcher()
        self.driver.move_to(self.driver.step, self.driver.epoch)

    def _new_switcher(self) -> PhaseSwitcher:
        """The run's switcher over :attr:`groups`, driven by the run's driver and optimizer."""
        assert self.groups is not None and self.schedule is not None and self.driver is not None
        switcher = PhaseSwitcher(self.groups, self.schedule, optimizer=self.driving, config=self.settings.config,
                                 driver=self.driver)
        switcher.check_missing_grads = True  # a missing gradient is refused at the step, before the update
        return switcher

    def bind_optimizer(self, driving: Optimizer) -> None:
        """The optimizer that drives the schedule, prepared after the model (a separate ``prepare`` call)."""
        assert self.switcher is not None
        self._take_driving(driving)
        self.switcher.set_optimizer(driving)

    def _take_driving(self, driving: Optional[Optimizer]) -> None:
        self.grouped = driving if isinstance(driving, GroupedOptimizer) else None
        self.driving = driving
        self.driving_bound = driving is not None

    def start_sharded(self, model: nn.Module) -> None:
        """After Accelerate's FSDP2 ``prepare``: groups rebound, switcher built and attached, first phase applied."""
        if not is_fsdp2(model):
            raise AltParamsError(
                f"Accelerate runs FSDP2 but `prepare` returned a {type(model).__name__} that is not a fully_shard "
                "module; PhasedAccelerator needs the sharded module itself"
            )
        if self.settings.prefix is not None:
            raise AltParamsError("`frozen_prefix` is not supported with FSDP2 (not verified); leave it out")
        assert self.groups is not None and self.schedule is not None and self.driver is not None
        old = self.groups
        self.groups = rebind_groups(old, model)
        rebind_optimizer(self.driving, old, self.groups)
        self.switcher = self._new_switcher()
        self.switcher.attach(model)  # the FSDP2 backend: nothing is rebuilt at a switch
        self.driver.move_to(self.driver.step, self.driver.epoch)  # the first phase, read at the next all-gather
        if self.settings.count_comm:
            self.comm_counter = register_reduce_scatter_counter(model)

    def find_unused(self, handler_value: bool) -> bool:
        """DDP's ``find_unused_parameters``: the setting given, else the handler's (default ``False``)."""
        return handler_value if self.settings.find_unused is None else self.settings.find_unused

    def attach(self, prepared: nn.Module, part: Optional[str] = None) -> None:
        """After Accelerate's ``prepare``: attach the wrapper, put state back, log the first phase.

        ``part``: the model's name among several (``ParamGroups.of_models``); its
        wrapper was built over all its parameters and is re-bucketed now.
        """
        switcher = self.switcher
        assert switcher is not None and self.guard is not None
        self.prepared_models.add(part)
        if part is not None:
            if not is_ddp(prepared):
                return  # one process: the model trains unwrapped
            if self.settings.count_comm:
                self.comm_counter = register_comm_counter(prepared, counter=self.comm_counter)
            record = switcher.attach(prepared, rebuild=True)
            self.guard.watch_many(switcher.wrappers)
            switcher.reapply_placement()
            if record is not None:
                self.after_switch(record)
            return
        if is_ddp(prepared):
            switcher.attach(prepared)
            if self.settings.count_comm:
                self.comm_counter = register_comm_counter(prepared)
        if is_ddp(prepared) or switcher.backend.kind == "fsdp2":  # FSDP2: attached at start_sharded
            self.guard.watch(prepared)
        elif prepared is not switcher.module:
            raise AltParamsError(
                f"`prepare` returned a {type(prepared).__name__} around the grouped model; PhasedAccelerator "
                "supports a DistributedDataParallel wrapper or the module itself"
            )
        # prepare() moved the whole model to the device and AcceleratedOptimizer(device_placement=True)
        # moved every optimizer state tensor there: back to where the current phase wants them.
        switcher.reapply_placement()
        history = switcher.history
        first = history.last  # taken before DDP existed: fill in what its reducer reduces
        assert first is not None
        history.replace_last(dataclasses.replace(
            first, allreduce_bytes_per_step=switcher.allreduce_bytes_per_step(), rebuilt_ddp=False))
        if self.settings.prefix is not None:
            self.frozen_prefix = FrozenPrefixCache(switcher.module, self.settings.prefix).attach()
        self.after_switch(history.last)  # type: ignore[arg-type]

    def wrapping_all(self, models: list[nn.Module]) -> Any:
        """Every parameter of ``models`` trainable while DDP wraps them (it refuses a module with nothing to
        train); their wrappers are re-bucketed for the phase right after (:meth:`attach`)."""
        return _all_trainable(models)

    # ------------------------------------------------------------ the loop
    def before_step(self) -> None:
        """Before a sync-boundary step: the loop checks (the phase's invariants run in the optimizer's own hook)."""
        if self.switcher is not None and self.guard is not None:
            self.guard.check(self.switcher.trainable_params())

    def after_step(self) -> Optional[SwitchRecord]:
        """After a sync-boundary step (fp16-skipped too, as the Trainer counts it): count it, switch if due."""
        if self.switcher is None or self.driver is None:  # used after free_memory(): nothing to drive
            return None
        if self.comm_counter is not None:
            self.comm_counter.end_step()
        if self.grouped is not None and self.driver.current is not None:
            self.grouped.stepped = self.driver.current.trainable  # what a GroupedLRScheduler advances
        record = self.driver.stepped()
        if record is not None:
            self.after_switch(record)
        return record  # type: ignore[no-any-return]

    def set_epoch(self, epoch: int) -> Optional[SwitchRecord]:
        """The loop entered ``epoch``: move the driver there; switch if the schedule says so."""
        if self.driver is None:
            return None
        if self.switcher is None:  # before prepare: the position only
            self.driver.epoch = int(epoch)
            self.driver.loop.epoch_set_at, self.driver.loop.epoch_calls = self.driver.step, 1
            return None
        record = self.driver.set_epoch(epoch)
        if record is not None:
            self.after_switch(record)
        return record  # type: ignore[no-any-return]

    def after_switch(self, record: SwitchRecord) -> None:
        if self.settings.log_switches:
            self._log(self._metrics(record), step=record.step)


@contextlib.contextmanager
def _all_trainable(models: list[nn.Module]) -> Iterator[None]:
    """Every parameter of ``models`` has ``requires_grad=True`` inside the block (restored on exit)."""
    flags = {p: p.requires_grad for m in models for p in m.parameters()}
    for param in flags:
        param.requires_grad_(True)
    try:
        yield
    finally:
        for param, flag in flags.items():
            param.requires_grad_(flag)
