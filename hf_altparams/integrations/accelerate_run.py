"""The phased part of a :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` run: :class:`PhasedRun`.

The accelerator keeps Accelerate's own state and delegates everything about
phases to one ``PhasedRun``: the settings given at construction, the shared
run assembly (:class:`~.assembly.PhaseRun`: the
:class:`~hf_altparams.engine.driver.PhaseDriver`, the
:class:`~hf_altparams.engine.PhaseSwitcher` built at ``prepare``, the comm
counter and the frozen-prefix cache), the optimizer that drives the schedule
and the loop guard. The prepared optimizer talks to the run's two step hooks
(:meth:`PhasedRun.before_step`, :meth:`PhasedRun.after_step`), never to the
accelerator's internals.

The loop guard (:class:`LoopGuard`) catches, at a gradient-sync boundary and
before the optimizer applies the step, two loop mistakes that would train
without any error while the ranks drift apart or a group never trains:

* **the training forward bypassed the DDP wrapper** (e.g.
  ``accelerator.unwrap_model(model)(x)``): the trainable parameters hold
  gradients, but no forward of the wrapper that would all-reduce them
  (gradients enabled, outside ``no_sync``) ran since the previous step, so the
  reducer never saw them. A forward pre-hook on the wrapper counts those
  forwards (in the driver). Raised on every rank (each rank runs the same loop).
  The same hook refuses, at once, a forward through a *copy* of the wrapper
  (``accelerate.utils.compile_regions`` of the prepared model): a copy shares
  the wrapper's hooks but keeps the reducer of the moment it was made, so from
  the first switch on it would all-reduce the wrong buckets.
* **an epoch-unit schedule whose epoch is never set**: more optimizer steps
  than one pass over the longest prepared dataloader went by since the last
  ``accelerator.set_epoch(...)`` (or the start) and the schedule's phase for
  the epoch the loop must be in differs from the current one. Raised when
  ``set_epoch`` was never called; a warning (once) when it was called before
  (an "epoch" longer than a pass is legitimate, if unusual).

and warns (once) about a sync-boundary ``zero_grad()`` that drops gradients no
``step()`` applied, the mark of ``zero_grad()`` called first inside
``accumulate()`` (it wipes the window's earlier micro-batches there, with or
without this library). The facts it checks are the
:class:`~hf_altparams.engine.driver.PhaseDriver`'s; the guard keeps only its
hooks and its warned-once flags.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from accelerate.utils import extract_model_from_parallel, is_compiled_module
from torch import nn
from torch.optim import Optimizer

from ..engine.comm import CommCounter
from ..engine.config import SwitchConfig
from ..engine.driver import PhaseDriver
from ..engine.prefix import FrozenPrefix, FrozenPrefixCache
from ..engine.records import SwitchRecord
from ..engine.strategies import StepBoundary, Strategy, local_strategy, strategy_for
from ..engine.switch import PhaseSwitcher
from ..engine.torch_internals import version_counter
from ..errors import AltParamsError
from ..plan.groups import ParamGroups
from ..plan.schedules import Schedule
from .accelerate_prepare import GradientArrivals
from .assembly import PhaseRun, RunOptions

__all__ = ["LoopGuard", "PhasedRun", "RunSettings"]


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

    What every integration does to run phases (the strategy, the switcher, the
    wrapper attached, state put back, comm counted, the frozen-prefix cache,
    the first-phase record, switch logs) is the shared run assembly,
    :class:`~.assembly.PhaseRun` (:attr:`phases`); this class adds what is
    Accelerate's: which ``prepare`` call brings the model and the optimizer
    that drives the schedule, the models prepared unphased, the DDP wrappers of
    several models made trainable while Accelerate builds them, and the loop
    checks (:class:`LoopGuard`).

    Args:
        schedule: the run's schedule (``None``: the accelerator runs unphased).
        groups: the groups given at construction (``None``: taken from a
            GroupedOptimizer at ``prepare``).
        settings: the checked settings.
        log: ``accelerator.log``; receives each switch's metrics.
        metrics: builds the metrics of a switch record.
        steps_per_epoch: optimizer steps in one pass over the longest prepared dataloader.
    """

    def __init__(
        self,
        schedule: Optional[Schedule],
        groups: Optional[ParamGroups],
        settings: RunSettings,
        *,
        log: Callable[..., Any],
        metrics: Callable[[SwitchRecord], dict[str, Any]],
        steps_per_epoch: Callable[[], int],
    ) -> None:
        self.schedule = schedule
        self.groups_given = groups
        self.settings = settings
        self._log, self._metrics, self._steps_per_epoch = log, metrics, steps_per_epoch
        self.phases: Optional[PhaseRun] = None
        self.guard: Optional[LoopGuard] = None
        self.driving: Optional[Optimizer] = None  # the optimizer being prepared to drive (inside prepare)
        self.arrivals: Optional[GradientArrivals] = None  # one optimizer per group (accelerate_prepare)
        self.prepared_models: set[Optional[str]] = set()  # grouped models prepared (None: the groups' module)
        self.unphased_models: list[str] = []  # models prepared while no schedule was set (set_phases refuses them)
        self.driving_bound = False  # the optimizer that drives the schedule was prepared
        self.reset()

    # ------------------------------------------------------------ the assembly's state
    @property
    def driver(self) -> Optional[PhaseDriver]:
        """The schedule position and current phase (``None`` without a schedule)."""
        return None if self.phases is None else self.phases.driver

    @property
    def switcher(self) -> Optional[PhaseSwitcher]:
        """The engine's switcher (``None`` before ``prepare``)."""
        return None if self.phases is None else self.phases.switcher

    @property
    def groups(self) -> Optional[ParamGroups]:
        """The groups of the prepared model (rebound to FSDP2's shards), else the ones given."""
        groups = None if self.phases is None else self.phases.groups
        return groups if groups is not None else self.groups_given

    @property
    def comm_counter(self) -> Optional[CommCounter]:
        return None if self.phases is None else self.phases.comm_counter

    @property
    def frozen_prefix(self) -> Optional[FrozenPrefixCache]:
        return None if self.phases is None else self.phases.frozen_prefix

    def note_unphased(self, args: tuple[Any, ...]) -> None:
        """``prepare`` ran without a schedule: remember the models it prepared (a later ``set_phases`` is too late)."""
        self.unphased_models += [type(a).__name__ for a in args if isinstance(a, nn.Module)]

    def set_phases(self, schedule: Optional[Schedule], groups: Optional[ParamGroups]) -> None:
        """A schedule (and groups) given after construction (``PhasedAccelerator.set_phases``); nothing prepared yet."""
        self.schedule, self.groups_given = schedule, groups
        self.reset()

    def reset(self) -> None:
        """Forget the model: a new driver at step 0, nothing prepared (``free_memory``, construction)."""
        self.close()
        self.driving = None
        self.prepared_models, self.driving_bound, self.unphased_models = set(), False, []
        settings = self.settings
        self.phases = (
            None
            if self.schedule is None
            else PhaseRun(
                self.schedule,
                RunOptions(settings.config, settings.count_comm, settings.prefix),
                on_switch=self.after_switch,
                refuse_missing_grads=True,  # a missing gradient is refused at the step
                set_epoch_call="accelerator.set_epoch(epoch)",
            )
        )
        self.guard = None if self.phases is None else LoopGuard(self.phases.driver, self._steps_per_epoch)

    def close(self) -> None:
        """Remove what the run hooked (loop guard, gradient arrivals, the prefix cache, the step check)."""
        if self.guard is not None:
            self.guard.close()
        if self.arrivals is not None:
            self.arrivals.close()
            self.arrivals = None
        if self.phases is not None:
            self.phases.close()

    # ------------------------------------------------------------ prepare
    def start(self, groups: ParamGroups, driving: Optional[Optimizer], strategy: Optional[Strategy]) -> None:
        """Before Accelerate wraps the model: ``strategy``'s refusals, the switcher, the first phase.

        ``strategy``: the one Accelerate is configured for, when it names one
        (FSDP2: the phases start after ``fully_shard``, at :meth:`attach`);
        ``driving`` may come in a later ``prepare`` call (:meth:`bind_optimizer`).
        """
        assert self.phases is not None
        self._take_driving(driving)
        self.phases.expect(strategy)
        self.phases.start(groups, driving)

    def bind_optimizer(self, driving: Optimizer) -> None:
        """The optimizer that drives the schedule, prepared after the model (a separate ``prepare`` call)."""
        assert self.phases is not None and self.phases.switcher is not None
        self._take_driving(driving)
        self.phases.bind_optimizer(driving)

    def _take_driving(self, driving: Optional[Optimizer]) -> None:
        self.driving = driving
        self.driving_bound = driving is not None

    def find_unused(self, handler_value: bool) -> bool:
        """DDP's ``find_unused_parameters``: the setting given, else the handler's (default ``False``)."""
        return handler_value if self.settings.find_unused is None else self.settings.find_unused

    def attach(self, prepared: nn.Module, part: Optional[str] = None) -> None:
        """After Accelerate's ``prepare``: the assembly attaches the wrapper; the loop guard watches it.

        ``part``: the model's name among several (``ParamGroups.of_models``); its
        wrapper was built over all its parameters and is re-bucketed now.
        """
        phases = self.phases
        assert phases is not None and self.guard is not None
        self.prepared_models.add(part)
        strategy = strategy_for(prepared)
        if strategy is local_strategy() and part is None:
            switcher = phases.switcher
            if (
                switcher is not None
                and prepared is not switcher.module
                and not (
                    is_compiled_module(prepared)
                    and extract_model_from_parallel(prepared, keep_torch_compile=False) is switcher.module
                )
            ):
                raise AltParamsError(
                    f"`prepare` returned a {type(prepared).__name__} around the grouped model; PhasedAccelerator "
                    "supports the wrappers of its strategies (DDP, FSDP2) or the module itself"
                )
        before = phases.groups
        phases.attach(prepared, part=part)
        if phases.groups is not before and self.groups_given is before:  # rebound to the strategy's parameters
            self.groups_given = phases.groups  # else it would keep every parameter from before fully_shard alive
        if strategy.capabilities.synchronises_gradients:
            switcher = phases.switcher
            assert switcher is not None
            self.guard.watch_many(switcher.wrappers if part is not None else [prepared])

    @contextlib.contextmanager
    def wrapping_all(self, models: list[nn.Module]) -> Iterator[None]:
        """Every parameter of ``models`` trainable while DDP wraps them (it refuses a module with nothing to
        train); their wrappers are re-bucketed for the phase right after (:meth:`attach`). With a strategy built
        with every scheduled group (DeepSpeed ZeRO), those groups are trainable while it is built too."""
        with _all_trainable(models), self.phases.building() if self.phases is not None else contextlib.nullcontext():
            yield

    # ------------------------------------------------------------ the loop
    @property
    def steps_in_backward(self) -> bool:
        """The run's strategy applies the update inside the sync-boundary backward (its declared step boundary):
        the schedule is driven from ``accelerator.backward`` then, not from ``optimizer.step()``."""
        return self.phases is not None and (self.phases.strategy.capabilities.step_boundary is StepBoundary.BACKWARD)

    def before_step(self) -> None:
        """Before a sync-boundary step: the loop checks (the phase's invariants run in the optimizer's own hook)."""
        if self.switcher is not None and self.guard is not None:
            self.guard.check(self.switcher.trainable_params())

    def after_step(self) -> Optional[SwitchRecord]:
        """After a sync-boundary step (fp16-skipped too, as the Trainer counts it): count it, switch if due."""
        if self.phases is None:  # used after free_memory(): nothing to drive
            return None
        return self.phases.stepped()

    def set_epoch(self, epoch: int) -> Optional[SwitchRecord]:
        """The loop entered ``epoch``: move the driver there; switch if the schedule says so."""
        return None if self.phases is None else self.phases.set_epoch(epoch)

    def after_switch(self, record: SwitchRecord) -> None:
        """Log a switch record (``log_switches``)."""
        if self.settings.log_switches:
            self._log(self._metrics(record), step=record.step)


def _copy_of_wrapper(module: nn.Module) -> AltParamsError:
    """The forward of a copy of the prepared wrapper ran (it shares the wrapper's hooks, not its future reducers)."""
    return AltParamsError(
        f"the training forward ran through a copy of the {type(module).__name__} that `accelerator.prepare` "
        "returned, not through that object: `accelerate.utils.compile_regions(model)` (or `copy.copy`) applied to "
        "the prepared model makes such a copy, and it keeps the gradient reducer the wrapper had when it was made, "
        "while each phase switch rebuilds the wrapper's own: from the first switch on, the new phase's gradients "
        "would not be all-reduced and the ranks would diverge. Compile by regions before DDP wraps the model: "
        "`PhasedAccelerator(..., dynamo_plugin=TorchDynamoPlugin(backend=..., use_regional_compilation=True))`, or "
        "`hf_altparams.compile_regions_in_place(model)` before `prepare`; then train with the object `prepare` "
        "returned"
    )


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


class LoopGuard:
    """The loop checks of one run (the module docstring); :meth:`check` runs at every sync-boundary ``step()``.

    Args:
        driver: the run's driver (its loop facts are read and reset here).
        steps_per_epoch: optimizer steps in one pass over the longest prepared
            dataloader (0: unknown).
    """

    def __init__(self, driver: PhaseDriver, steps_per_epoch: Callable[[], int]) -> None:
        self.driver = driver
        self.steps_per_epoch = steps_per_epoch
        self.warned_epoch = False
        self.warned_zero_grad = False
        self._handles: list[Any] = []
        self._wrappers: list[nn.Module] = []
        self._seen_grads: tuple[tuple[int, int], ...] = ()

    # ------------------------------------------------------------ wiring
    def watch(self, ddp: nn.Module) -> None:
        """Count ``ddp``'s forwards that will all-reduce their gradients."""
        self.watch_many([ddp])

    def watch_many(self, wrappers: Sequence[nn.Module]) -> None:
        """Count the forwards of every wrapper in ``wrappers`` (one per model) that will all-reduce."""
        self.close()
        self._wrappers = list(wrappers)
        self._handles = [w.register_forward_pre_hook(self._seen) for w in wrappers]

    def _seen(self, module: nn.Module, args: Any) -> None:
        if not any(module is wrapper for wrapper in self._wrappers):
            raise _copy_of_wrapper(module)
        if torch.is_grad_enabled() and getattr(module, "require_backward_grad_sync", True):
            self.driver.note_syncing_forward()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def zero_grad_at_boundary(self, accumulation_steps: int) -> None:
        """A sync-boundary ``zero_grad()``: warn (once) if it drops gradients no step applied."""
        if self.driver.backward_pending and not self.warned_zero_grad and accumulation_steps > 1:
            self.warned_zero_grad = True
            warnings.warn(
                "hf_altparams: `optimizer.zero_grad()` ran at a gradient-sync boundary after a backward whose "
                "gradients no `optimizer.step()` applied yet: they are dropped. Inside `accelerator.accumulate()` "
                "this is `zero_grad()` called at the top of the iteration, which wipes the window's earlier "
                "micro-batches (plain Accelerate does the same); call it after `optimizer.step()` there. If you "
                "skipped the step on purpose (e.g. a non-finite loss), ignore this.",
                stacklevel=4,
            )
        self.driver.gradients_dropped()  # nothing is pending any more

    # ------------------------------------------------------------ checks
    def check(self, trainable: Sequence[tuple[str, nn.Parameter]]) -> None:
        """Raise (or warn) before the optimizer applies a step the loop got wrong."""
        try:
            self._check_forward(trainable)
            self._check_epoch()
        finally:
            self.driver.forwards_checked()

    def _check_forward(self, trainable: Sequence[tuple[str, nn.Parameter]]) -> None:
        if not self._handles:
            return
        grads = [(name, p.grad) for name, p in trainable if p.grad is not None]
        with_grad = [name for name, _ in grads]
        # The gradients as the last sync-boundary step saw them: the same tensors, unchanged since, mean that
        # no backward ran in between (a second `step()` of one iteration), whatever the forwards did.
        seen, self._seen_grads = self._seen_grads, tuple((id(g), version_counter(g)) for _, g in grads[:8])
        if with_grad and self.driver.syncing_forwards == 0 and seen == self._seen_grads:
            raise AltParamsError(
                f"`optimizer.step()` ran a second time on the same gradients ({len(with_grad)} trainable "
                f"parameter(s), e.g. {with_grad[:3]}, hold the gradients the previous step already applied: no "
                "backward ran since), which would apply them twice. Call `optimizer.step()` once per "
                "`accelerator.backward(loss)` at a sync boundary (with one optimizer per group, stepping every "
                "handle is fine: they share one step), and `optimizer.zero_grad()` after it."
            )
        if with_grad and self.driver.syncing_forwards == 0:
            raise AltParamsError(
                f"{len(with_grad)} trainable parameter(s) (e.g. {with_grad[:3]}) hold gradients, but no "
                "forward of the prepared DDP model ran since the last optimizer step, so DDP never "
                "all-reduced them and each rank would apply its own gradients (the ranks would diverge). "
                "Run the training forward through the object `accelerator.prepare` returned "
                "(`model(x)`), not `accelerator.unwrap_model(model)(x)` or the original module; use the "
                "unwrapped model only under `torch.no_grad()` (evaluation)."
            )

    def _check_epoch(self) -> None:
        driver = self.driver
        if driver.schedule.unit != "epoch" or driver.current is None:
            return
        per_epoch = self.steps_per_epoch()
        if not per_epoch:
            return
        passed = (driver.step - driver.epoch_set_at) // per_epoch
        if passed < 1:
            return
        implied = driver.epoch + passed
        due = driver.phase_at(driver.step, implied)
        if due == driver.current:
            return
        what = (
            f"{driver.step - driver.epoch_set_at} optimizer steps went by since "
            f"{'the last `accelerator.set_epoch(...)`' if driver.epoch_calls else 'the start'}, more "
            f"than one pass over the prepared dataloader ({per_epoch} steps), but the epoch-unit "
            f"schedule is still at epoch {driver.epoch} (phase {driver.current.name!r}); at "
            f"epoch {implied} it trains {due.name!r}."
        )
        fix = "Call `accelerator.set_epoch(epoch)` at the top of every epoch, on every rank."
        if driver.epoch_calls == 0:
            raise AltParamsError(f"{what} {fix}")
        if not self.warned_epoch:
            self.warned_epoch = True
            warnings.warn(
                f"hf_altparams: {what} If an epoch is meant to span several passes, ignore this; otherwise: {fix}",
                stacklevel=5,
            )
