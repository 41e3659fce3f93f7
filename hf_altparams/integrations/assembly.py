"""The run assembly: what every integration does to run phases on a prepared model, written once.

``PhasedAccelerator`` (through :class:`~.accelerate_run.PhasedRun`) and
``AlternatingFreeze`` differ in how they meet their framework (``prepare``'s
forms; the Trainer's events, frames and checkpoint folders). What they do to
run phases is the same, and it is here, in :class:`PhaseRun`:

1. **pick the strategy**: the one the configuration asks for
   (:meth:`PhaseRun.expect`, its capability refusals,
   :func:`~.refusals.capability_refusal`), then the one the registry
   recognises in the wrapper (:meth:`PhaseRun.attach`);
2. **build the switcher** on the groups with the run's driver, settings and
   optimizer (:meth:`PhaseRun.build`), and **apply the first phase before the
   wrapper is built** where the wrapper reads ``requires_grad`` in its
   constructor (DDP), then the strategy's own hook on the optimizer
   (:meth:`~hf_altparams.engine.strategies.Strategy.before_wrap`)
   (:meth:`PhaseRun.start`); a strategy that replaces the parameters when it
   wraps (FSDP2) starts at the attach instead, on the groups rebound to them;
3. **attach the wrapper** (:meth:`PhaseRun.attach`): the switcher drives it
   from now on; the bytes it communicates are counted (``count_comm``); the
   optimizer state and parameters the framework moved wholesale go back where
   the phase wants them; the frozen-prefix cache attaches; the record of the
   phase now trained (the first phase, with what the wrapper communicates, or
   the re-bucketing of a wrapper built before it) is reported;
4. **step** (:meth:`PhaseRun.stepped`, :meth:`PhaseRun.set_epoch`): the comm
   counter closes the step, the driver counts it and switches when the
   schedule says so, and every switch record is reported (``on_switch``).

A third integration (say a Lightning callback) would use it as is: ``expect``
the strategy its configuration names, ``start`` before the strategy wraps the
model, ``attach`` the wrapper after, ``stepped`` at each optimizer step, and
``close`` at the end.

Example:
    >>> import torch
    >>> from hf_altparams.engine.config import SwitchConfig
    >>> from hf_altparams.plan import Alternating, ParamGroups
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> seen = []
    >>> run = PhaseRun(Alternating(["a", "b"]), RunOptions(SwitchConfig()), on_switch=lambda r: seen.append(r.phase))
    >>> run.start(ParamGroups(net, {"a": "0.*", "b": "1.*"}), torch.optim.SGD(net.parameters(), lr=0.1))
    >>> _ = run.attach(net)  # one process: the module itself
    >>> _ = run.stepped(); seen, net[1].weight.requires_grad
    (['a', 'b'], True)
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from torch import nn
from torch.optim import Optimizer

from ..engine.comm import CommCounter
from ..engine.config import SwitchConfig
from ..engine.driver import PhaseDriver
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache
from ..engine.records import SwitchRecord
from ..engine.strategies import Collective, Strategy, local_strategy, strategy_for
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError, Cause, SwitchError
from ..plan.groups import ParamGroups
from ..plan.schedules import Schedule
from .fsdp2 import rebind_groups, rebind_optimizer
from .refusals import capability_refusal

__all__ = ["PhaseRun", "RunOptions", "comm_metrics"]


@dataclass(frozen=True)
class RunOptions:
    """What an integration was given about phases, checked at its construction.

    Attributes:
        config: the switch's settings.
        count_comm: count the gradient bytes the wrapper communicates per step.
        prefix: the frozen-prefix cache's settings (``None``: no cache).
    """

    config: SwitchConfig
    count_comm: bool = False
    prefix: Optional[FrozenPrefix] = None


def comm_metrics(
    switcher: Optional[PhaseSwitcher], counter: Optional[CommCounter], record: SwitchRecord, prefix: str
) -> dict[str, int]:
    """A switch log's figures for a strategy whose collective is not an all-reduce (FSDP2: reduce-scatter).

    ``<collective>_bytes_per_step`` (what the record says each rank feeds it) and, when counted,
    ``<collective>_bytes_measured`` (the last step's count); the record's own
    ``allreduce_bytes_per_step`` covers an all-reduce.
    """
    if switcher is None:
        return {}
    collective = switcher.strategy.pricing.collective
    if collective in (Collective.ALL_REDUCE, Collective.NONE):
        return {}
    key = collective.value.replace("-", "_")
    out = {f"{prefix}{key}_bytes_per_step": int(record.allreduce_bytes_per_step)}
    if counter is not None and counter.history:
        out[f"{prefix}{key}_bytes_measured"] = int(counter.history[-1])
    return out


def _keeps_groups_off(schedule: Schedule) -> bool:
    """Whether some phase of ``schedule`` keeps only some groups resident (one period, or 1000 positions)."""
    horizon = schedule.pattern_length() or 1000
    return any(phase.resident is not None for _, _, phase in schedule.segments(horizon))


class PhaseRun:
    """The phases of one run on a prepared model: strategy, switcher, wrapper, comm counter, prefix cache, records.

    Args:
        schedule: the run's schedule.
        options: the checked settings.
        on_switch: called with every switch record (the first phase's included).
        on_built: called with the switcher as soon as it is built, before the first phase is applied
            (e.g. peft's ``follow_phases``).
        refuse_missing_grads: refuse, at the optimizer step, a trainable parameter without a gradient.
        set_epoch_call: how the loop sets the epoch (for the driver's messages).
    """

    def __init__(
        self,
        schedule: Schedule,
        options: RunOptions,
        *,
        on_switch: Optional[Callable[[SwitchRecord], Any]] = None,
        on_built: Optional[Callable[[PhaseSwitcher], Any]] = None,
        refuse_missing_grads: bool = False,
        set_epoch_call: str = "set_epoch(epoch)",
    ) -> None:
        self.schedule = schedule
        self.options = options
        self._on_switch, self._on_built = on_switch, on_built
        self._refuse_missing, self._set_epoch_call = refuse_missing_grads, set_epoch_call
        #: the schedule position and the current phase (a new one at every :meth:`restart`)
        self.driver = PhaseDriver(schedule, set_epoch_call=set_epoch_call)
        self.groups: Optional[ParamGroups] = None
        self.optimizer: Optional[Optimizer] = None
        self.switcher: Optional[PhaseSwitcher] = None
        #: the strategy the configuration asks for (``None``: the wrapper decides at attach)
        self.expected: Optional[Strategy] = None
        self.comm_counter: Optional[CommCounter] = None
        self.frozen_prefix: Optional[FrozenPrefixCache] = None

    @property
    def strategy(self) -> Strategy:
        """The strategy driving the run: the attached wrapper's, else the expected one, else one process."""
        if self.switcher is not None and self.switcher.strategy is not local_strategy():
            return self.switcher.strategy
        return self.expected or local_strategy()

    # ------------------------------------------------------------ before the wrapper
    def expect(self, strategy: Optional[Strategy]) -> None:
        """The strategy the run's configuration asks for (``None``: decided by the wrapper); its refusals now.

        Raises:
            AltParamsError: a feature of the run (frozen-prefix cache, comm counting, per-task residency)
                that ``strategy`` does not support.
        """
        self.expected = strategy
        if strategy is not None:
            self._refuse_features(strategy)

    def start(self, groups: ParamGroups, optimizer: Optional[Optimizer], *, first_phase: bool = True) -> None:
        """Before the wrapper is built: the switcher on ``groups``, the first phase, the strategy's hook.

        ``optimizer`` may come later (:meth:`bind_optimizer`). With a strategy
        that replaces the parameters when it wraps (FSDP2), nothing is built
        yet: the switcher comes at :meth:`attach`, on the groups rebound to the
        new parameters. ``first_phase=False``: the caller moves the driver
        itself (a resumed position, :meth:`move_to`).
        """
        self.groups, self.optimizer = groups, optimizer
        strategy = self.expected or local_strategy()
        if strategy.capabilities.rebinds_parameters:
            return
        self.build(groups, optimizer)
        if first_phase:  # reported at attach, with what the wrapper communicates
            self.driver.move_to(self.driver.step, self.driver.epoch)
        strategy.before_wrap(groups, optimizer)

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """While the framework builds the wrapper: with a strategy that must be built with every group the
        schedule trains (``builds_with_every_group``: DeepSpeed ZeRO), their parameters are trainable inside the
        block, and the phase's flags are back after it (the strategy's ``attached`` follows them)."""
        strategy, groups = self.expected or local_strategy(), self.groups
        if groups is None or not strategy.capabilities.builds_with_every_group:
            yield
            return
        scheduled = set(self.schedule.group_names())
        flags = {p: p.requires_grad for name in groups.names if name in scheduled for p in groups.params(name)}
        for param in flags:
            param.requires_grad_(True)
        try:
            yield
        finally:
            for param, flag in flags.items():
                param.requires_grad_(flag)

    def build(self, groups: ParamGroups, optimizer: Optional[Optimizer]) -> PhaseSwitcher:
        """The run's switcher over ``groups``, driven by the run's driver and optimizer (``on_built`` called)."""
        self.groups, self.optimizer = groups, optimizer
        if self.switcher is not None:
            self.switcher.close()
        self.switcher = PhaseSwitcher(
            groups,
            self.schedule,
            optimizer=optimizer,
            config=self.options.config,
            driver=self.driver,
            refuse_missing_grads=self._refuse_missing,
        )
        if self._on_built is not None:
            self._on_built(self.switcher)
        return self.switcher

    def bind_optimizer(self, optimizer: Optimizer) -> None:
        """The optimizer that drives the run, given after :meth:`start` (a separate ``prepare`` call)."""
        self.optimizer = optimizer
        if self.switcher is not None:
            self.switcher.set_optimizer(optimizer)

    def move_to(self, step: int, epoch: Optional[int] = None) -> Optional[SwitchRecord]:
        """Apply the phase of ``step`` / ``epoch`` now (the first phase, or a resumed position); reported."""
        return self._report(self.driver.move_to(step, epoch))

    # ------------------------------------------------------------ the wrapper
    def attach(
        self, wrapper: nn.Module, *, part: Optional[str] = None, rebuild: bool = False
    ) -> Optional[SwitchRecord]:
        """After the wrapper is built: drive it, count it, put state back, report the phase now trained.

        Args:
            wrapper: what the framework returned: a wrapper a registered strategy
                recognises, or the module itself (one process: nothing is attached).
            part: the model's name among several (``ParamGroups.of_models``); its
                wrapper was built over all its parameters and is re-bucketed now.
            rebuild: the wrapper was built before the current phase was applied
                (the Trainer's): re-bucket it now, as a switch.

        Returns:
            The record reported: the re-bucketing, or the first phase with what the wrapper communicates.

        Raises:
            AltParamsError: the configuration asked for a strategy that does not drive ``wrapper``, or the
                wrapper's strategy refuses a feature of the run.
        """
        strategy = strategy_for(wrapper)
        expected = self.expected
        if expected is not None and expected is not local_strategy() and strategy is not expected:
            raise AltParamsError(
                f"the run is configured for {expected.label}, but the framework returned a {type(wrapper).__name__}, "
                f"which {expected.label} does not drive ({strategy.label} does); pass the model {expected.label} "
                "wrapped itself",
                cause=Cause.STRATEGY_REFUSED,
            )
        self._refuse_features(strategy)
        if self.switcher is None and strategy.capabilities.rebinds_parameters:
            return self._start_rebound(wrapper, strategy)
        switcher = self.switcher
        assert switcher is not None, "start() before attach()"
        if strategy is local_strategy():
            if part is not None:
                return None  # one process: the model trains unwrapped
            switcher.reapply_placement()  # the framework moved the model, and the optimizer state, to the device
            return self._first_record(switcher)
        self._count(wrapper, strategy, shared=part is not None)  # before a rebuild: it re-registers the hook
        record = switcher.attach(wrapper, rebuild=rebuild or part is not None)
        switcher.reapply_placement()  # the framework moved the model, and the optimizer state, to the device
        if part is not None or rebuild:
            return self._report(record)
        return self._first_record(switcher)

    def _start_rebound(self, wrapper: nn.Module, strategy: Strategy) -> Optional[SwitchRecord]:
        """A strategy that replaced the parameters: groups and optimizer rebound, switcher built, first phase."""
        assert self.groups is not None, "start() before attach()"
        old = self.groups
        groups = rebind_groups(old, wrapper)
        rebind_optimizer(self.optimizer, old, groups)
        switcher = self.build(groups, self.optimizer)
        switcher.attach(wrapper)  # nothing is rebuilt at a switch: the phase is read at the next all-gather
        self._count(wrapper, strategy, shared=False)
        record = self.move_to(self.driver.step, self.driver.epoch)
        switcher.reapply_placement()
        return record

    def _first_record(self, switcher: PhaseSwitcher) -> Optional[SwitchRecord]:
        """The first phase's record, taken before the wrapper existed: what the wrapper communicates filled in."""
        history = switcher.history
        first = history.last
        if first is None:
            return None
        history.replace_last(
            dataclasses.replace(first, allreduce_bytes_per_step=switcher.allreduce_bytes_per_step(), rebuilt_ddp=False)
        )
        self._attach_prefix_once(switcher.module)
        return self._report(history.last)

    def _count(self, wrapper: nn.Module, strategy: Strategy, *, shared: bool) -> None:
        if not self.options.count_comm or not strategy.capabilities.counts_comm:
            return
        try:
            self.comm_counter = strategy.count_comm(wrapper, self.comm_counter if shared else None)
        except RuntimeError as err:
            raise SwitchError(
                f"`count_comm=True` could not register its counter on the {strategy.label} wrapper ({err}); "
                f"{strategy.label} takes one comm hook: drop the other one, or pass `count_comm=False`"
            ) from err

    def _refuse_features(self, strategy: Strategy) -> None:
        resident = self.options.config.offload_device is not None and _keeps_groups_off(self.schedule)
        reason = capability_refusal(
            strategy,
            frozen_prefix=self.options.prefix is not None,
            count_comm=self.options.count_comm,
            per_task_residency=resident,
        )
        if reason is not None:
            raise AltParamsError(reason, cause=Cause.STRATEGY_REFUSED)

    # ------------------------------------------------------------ the frozen prefix
    def attach_prefix(self, model: nn.Module) -> Optional[FrozenPrefixCache]:
        """The frozen-prefix cache on ``model`` (with the option set): a new one, or the same one's rows reset."""
        option = self.options.prefix
        if option is None:
            return None
        if self.frozen_prefix is not None and self.frozen_prefix.model is model:
            self.frozen_prefix.reset()  # a new run (or a resume): the rows of the last one are void
            return self.frozen_prefix
        if self.frozen_prefix is not None:
            self.frozen_prefix.detach()
        self.frozen_prefix = FrozenPrefixCache(model, option).attach()
        return self.frozen_prefix

    def _attach_prefix_once(self, model: nn.Module) -> None:
        if self.options.prefix is not None and (self.frozen_prefix is None or self.frozen_prefix.model is not model):
            self.attach_prefix(model)

    # ------------------------------------------------------------ the loop
    def stepped(
        self, step: Optional[int] = None, epoch: Optional[int] = None, *, switch: bool = True
    ) -> Optional[SwitchRecord]:
        """An optimizer step was taken: the comm counter closes it, the driver counts it and switches if due."""
        if self.switcher is None:
            return None
        if self.comm_counter is not None:
            self.comm_counter.end_step()
        return self._report(self.driver.stepped(step, epoch, switch=switch))

    def set_epoch(self, epoch: int) -> Optional[SwitchRecord]:
        """The loop entered ``epoch``: the driver moves there, switching if the schedule says so."""
        return self._report(self.driver.set_epoch(epoch))

    def _report(self, record: Optional[SwitchRecord]) -> Optional[SwitchRecord]:
        if record is not None and self._on_switch is not None:
            self._on_switch(record)
        return record

    # ------------------------------------------------------------ the end
    def restart(self) -> None:
        """A new run on the same settings (the Trainer's next ``train()``): a new driver, nothing attached.

        The frozen-prefix cache stays attached to its model (its rows are reset at the next
        :meth:`attach_prefix`).
        """
        if self.switcher is not None:
            self.switcher.close()
        self.driver = PhaseDriver(self.schedule, set_epoch_call=self._set_epoch_call)
        self.switcher, self.groups, self.optimizer, self.comm_counter = None, None, None, None

    def close(self) -> None:
        """Remove what the run hooked: the switcher's step check and guards, the frozen-prefix cache."""
        if self.frozen_prefix is not None:
            self.frozen_prefix.detach()
            self.frozen_prefix = None
        if self.switcher is not None:
            self.switcher.close()
