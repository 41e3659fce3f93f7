"""The phase switch: one collective transaction on every rank.

:class:`PhaseSwitcher` owns the run's groups, its optional DDP (or FSDP2)
wrapper and optimizer, and applies each phase its :class:`~.driver.PhaseDriver`
asks for (the driver owns the schedule position and the current phase). At a
switch it

1. checks the preconditions (optimizer-step boundary, not inside ``no_sync``,
   no pending gradient, comm hooks that allow a rebuild,
   :mod:`.invariants`),
2. moves residency (groups the phase does not keep resident go off the
   device, returning ones come back), calls the phase hooks (peft's active
   adapters), clears every gradient (``None``: bucket views must not pin old
   buckets) and flips ``requires_grad`` to the new trainable set,
3. lets the backend adapt the wrapper (:class:`~.backend.Backend`; for DDP the
   reducer is rebuilt in place, :mod:`.ddp`),
4. settles, in ONE small all-gather, that every rank asked for the same phase,
   none refused and none failed (:func:`.collective.settle`); otherwise every
   rank restores the previous flags, residency and reducer and raises the same
   :class:`~hf_altparams.errors.SwitchError`,
5. broadcasts groups coming back for the first time since the wrap, puts the
   forward guards on non-resident modules, tells the optimizer which groups
   now train (their idle-state policy applies), applies the buffer-sync policy,
6. releases memory when the schedule says it pays (``release="auto"``,
   :mod:`.memory.release`; the all-gather of step 4 is the barrier), and
7. records what it did in a :class:`~.records.SwitchRecord` (a bounded
   :class:`~.records.SwitchHistory` keeps the recent ones and running totals).

Steps 2-3 are local and undone on the slow path; a backend whose apply runs
collectives agrees first and checks the outcome after, in two all-gathers.
``docs/switch.md`` explains the choices; ``docs/design.md`` shows where the
switch sits on an optimizer step's path.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol, Union

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..errors import AltParamsError, PlanError, SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from . import invariants
from .backend import Backend, LocalBackend, ModelsBackend, model_name_in
from .buffers import BufferSync
from .collective import agree, any_rank_failed, collective_errors, is_distributed, settle
from .config import SwitchConfig
from .drift import DriftCheck, check_drift
from .driver import DriverState, PhaseDriver
from .layouts import PhaseLayouts, remember
from .memory import PhasePrefetch, ReleasePolicy, ResidencyManager, StatePolicy, release_memory, run_idle_policies
from .optim import GroupedOptimizer, StateOwner, check_groups_argument, grouped_in
from .records import SwitchHistory, SwitchRecord
from .report import expected_peak_bytes
from .strategies import Strategy, local_strategy, registered, strategy_for

__all__ = ["PhaseHook", "PhaseSwitcher", "SwitchRecord", "backend_for"]

logger = logging.getLogger("hf_altparams")

STATE_FORMAT = "hf_altparams.PhaseSwitcher/2"


class PhaseHook(Protocol):
    """Called with the new phase inside each switch, before ``requires_grad`` is set (with the previous
    phase if the switch is rolled back): what else must follow the phase (peft's active adapters)."""

    def __call__(self, phase: Phase) -> Any: ...


def backend_for(model: nn.Module) -> Backend:
    """The backend of the strategy that recognises ``model`` (:func:`~hf_altparams.engine.strategies.strategy_for`).

    Example:
        >>> import torch
        >>> backend_for(torch.nn.Linear(2, 2)).kind
        'local'
    """
    return strategy_for(model).backend(model)


class PhaseSwitcher:
    """Applies a schedule's phases to a model (plain, DDP or FSDP2) and its optimizer.

    Args:
        groups: the parameter groups (their module is the model to switch).
        schedule: maps a step (and epoch) to a :class:`~hf_altparams.plan.Phase`;
            validated against ``groups`` here, before any training step.
        optimizer: optional; a :class:`GroupedOptimizer` follows the phases
            (its active groups and idle-state policy); a plain optimizer over
            all parameters steps what has a gradient (torch skips the rest) and
            its idle groups' state follows the run's ``idle_state``
            (:mod:`.optim.idle`).
        model: the DDP wrapper around ``groups.module``, if already built (else
            call :meth:`attach` once it is).
        config: the switch's settings (:class:`~hf_altparams.engine.config.SwitchConfig`:
            ``release``, ``prefetch``, ``offload_device``, ``keep_reducers``,
            ``collective_timeout``, ...); the same names may be given as keyword
            arguments (``**options``), which override it.
        driver: the :class:`~.driver.PhaseDriver` that owns the schedule position
            and the current phase (default: a new one for ``schedule``).
        refuse_missing_grads: refuse, at the optimizer step, a trainable
            parameter without a gradient under DDP (the integrations set it;
            otherwise the next switch refuses it).

    Example:
        >>> import torch
        >>> from hf_altparams.plan import ParamGroups, Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> switcher = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
        >>> switcher.step_to(0).phase, net[1].weight.requires_grad
        ('a', False)
        >>> switcher.step_to(1).phase, net[1].weight.requires_grad
        ('b', True)
    """

    def __init__(
        self,
        groups: ParamGroups,
        schedule: Schedule,
        *,
        optimizer: Optional[Optimizer] = None,
        model: Optional[nn.Module] = None,
        config: Union[None, SwitchConfig, Mapping[str, Any]] = None,
        driver: Optional[PhaseDriver] = None,
        refuse_missing_grads: bool = False,
        **options: Any,
    ) -> None:
        self.config = SwitchConfig.build(config, argument="PhaseSwitcher's settings", **options)
        if driver is not None and driver.schedule is not schedule:
            raise AltParamsError("`driver` drives another schedule than `schedule`; pass the driver's own schedule")
        check_groups_argument(groups)
        schedule.validate(groups)
        self.groups = groups
        self.schedule = schedule
        self.driver = driver if driver is not None else PhaseDriver(schedule)
        self.driver.bind(self)
        self.drift = DriftCheck(self.config.drift_check)
        self.history = SwitchHistory(self.config.history_window)
        self.residency = ResidencyManager(
            groups,
            self.driver,
            offload_device=self.config.offload_device,
            device=self.config.device,
            guard=self.config.guard_offloaded,
        )
        self.buffer_sync = BufferSync(
            self.config.buffer_sync, self.config.frozen_norms, self.config.buffer_updating_types
        )
        self.backend: Backend = LocalBackend()
        #: the strategy of the attached wrapper (one process until one is attached)
        self.strategy: Strategy = local_strategy()
        self.optimizer: Optional[Optimizer] = None
        self._grouped: Optional[GroupedOptimizer] = None
        self._state: Optional[StateOwner] = None  # where idle optimizer state lives: the strategy's choice
        self._idle_logged = False
        self._release = ReleasePolicy(self.config.release)
        self._prefetch = PhasePrefetch(self.config.prefetch)
        self._refuse_missing = bool(refuse_missing_grads)
        self._ranks_met = False  # collective_timeout applies once the ranks met in a transaction
        self._plain_attached = False  # a plain module was attached on purpose (multi-rank without a wrapper)
        # Per-phase caches (the groups never change): flags, sizes, reduced bytes, expected footprints.
        self._layouts = PhaseLayouts(groups)
        self._reduced_bytes: dict[Phase, int] = {}
        self._footprints: dict[tuple[Phase, frozenset[str]], int] = {}
        self._warned_flags: set[str] = set()
        self._hooks: list[PhaseHook] = []
        self._step_hook: Any = None
        if optimizer is not None:
            self.set_optimizer(optimizer)
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------ state (the driver's)
    @property
    def current(self) -> Optional[Phase]:
        """The phase applied now (the driver's; ``None`` before the first switch)."""
        return self.driver.current

    @property
    def phase(self) -> Optional[Phase]:
        """The phase that trains now (as ``PhasedAccelerator.phase``); same as :attr:`current`."""
        return self.driver.current

    @property
    def task(self) -> Optional[str]:
        """The current task's name under :class:`~hf_altparams.plan.PerTaskCycle` (else ``None``)."""
        return None if self.driver.current is None else self.driver.current.task

    @property
    def records(self) -> list[SwitchRecord]:
        """The recent switch records, oldest first (a copy of :attr:`history`'s window)."""
        return self.history.recent

    @property
    def module(self) -> nn.Module:
        return self.groups.module

    @property
    def ddp(self) -> Optional[DistributedDataParallel]:
        """The attached DDP wrapper, or ``None``."""
        wrapper = self.backend.wrapper
        return wrapper if isinstance(wrapper, DistributedDataParallel) else None

    @property
    def wrappers(self) -> list[nn.Module]:
        """Every wrapper whose gradient sync a switch rebuilds (DDP): one, one per model
        (``ParamGroups.of_models``), or none."""
        return self.backend.wrappers if self.strategy.capabilities.rebuckets_at_switch else []

    @property
    def grouped_optimizer(self) -> Optional[GroupedOptimizer]:
        """The :class:`GroupedOptimizer` that follows the phases (inside a prepared wrapper too), if any."""
        return self._grouped

    @property
    def idle_state_policies(self) -> dict[str, StatePolicy]:
        """Each group's idle optimizer-state policy in this run (``keep`` for every group without an optimizer)."""
        if self._state is None:
            return {name: StatePolicy.KEEP for name in self.groups.names}
        return dict(self._state.policies)

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of the attached wrapper (``None``: no wrapper)."""
        return self.backend.process_group

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        """The schedule's phase at ``step`` / ``epoch`` (pure; switches nothing)."""
        return self.driver.phase_at(step, epoch)

    def trainable_names(self, phase: Phase) -> frozenset[str]:
        return self.groups.trainable_param_names(phase.trainable)

    def allreduce_bytes_per_step(self) -> int:
        """Bytes the current reducer all-reduces per optimizer step (0 without DDP)."""
        return self.backend.reduced_bytes_per_step()

    def reduced_bytes(self, phase: Phase) -> int:
        """Bytes the reducer all-reduces per step in ``phase`` (now if current, else as when last applied)."""
        if phase == self.current:
            return self.allreduce_bytes_per_step()
        return self._reduced_bytes.get(phase, 0)

    def trainable_params(self) -> list[tuple[str, nn.Parameter]]:
        """The current phase's trainable ``(name, parameter)`` pairs (empty before the first switch)."""
        return [] if self.current is None else self._layouts.split(self.current.trainable)[0]

    def expected_peak(self, phase: Phase) -> int:
        """``phase``'s expected device peak, activations excluded (:func:`~hf_altparams.engine.expected_peak_bytes`).

        Computed once per phase and set of groups trained so far (an idle
        group holds optimizer state and a master only once it has trained).
        """
        key = (phase, self.driver.trained_groups)
        cached = self._footprints.get(key)
        if cached is None:
            cached = remember(self._footprints, key, expected_peak_bytes(self, phase)[0])
        return cached

    # ------------------------------------------------------------ what follows the phase
    def add_phase_hook(self, hook: PhaseHook) -> None:
        """Call ``hook(phase)`` inside every switch, before ``requires_grad`` is set (peft's active adapters)."""
        if hook not in self._hooks:
            self._hooks.append(hook)

    def remove_phase_hook(self, hook: PhaseHook) -> None:
        if hook in self._hooks:
            self._hooks.remove(hook)

    @property
    def phase_hooks(self) -> tuple[PhaseHook, ...]:
        """The phase hooks called at every switch, in order."""
        return tuple(self._hooks)

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Take ``optimizer`` as the run's optimizer (given later than the model: a separate ``prepare``).

        Its steps are checked against the phase from now on (a step pre-hook,
        :mod:`.invariants`); a :class:`GroupedOptimizer` inside it follows the
        driver's phase.
        """
        if self.optimizer is not None:
            raise AltParamsError("the switcher has an optimizer already; a second would step outside the schedule")
        self.optimizer = optimizer
        self._grouped = grouped_in(optimizer)
        self.residency.set_optimizer(optimizer)
        self._step_hook = invariants.check_each_step(optimizer, self)
        self._take_state_owner()
        self.reapply_placement()

    def _take_state_owner(self) -> None:
        """Ask the strategy who owns the optimizer's state, and hand that owner the run's policies and phase."""
        self._state = self.strategy.state_owner(self.optimizer, self.groups) if self.optimizer is not None else None
        if self._state is not None:
            idle_state, idle_master, _ = self.idle_policies()
            self._state.follow(self.driver, idle_state, idle_master)
            if self.current is not None:
                self._state.enter_phase(self.current.trainable)

    @property
    def state_owner(self) -> Optional[StateOwner]:
        """Who decides where idle groups' optimizer state lives in this run (``None`` without an optimizer)."""
        return self._state

    def idle_policies(self) -> tuple[StatePolicy, StatePolicy, str]:
        """``(optimizer state, fp32 masters, why)``: the run's idle-state policies where the optimizer leaves them open.

        The switcher's ``idle_state`` when set; else the schedule's assumption
        (``schedule.idle_state``: ``"drop"`` for lisa and badam); else state kept
        and masters offloaded.
        """
        return run_idle_policies(self.schedule.idle_state, self.schedule.kind, self.config.idle_state)

    def close(self) -> None:
        """The run that owns this switcher is over: stop checking the optimizer's steps, remove the forward guards."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.residency.remove_guards()

    def check_before_step(self) -> int:
        """Check gradients and ``requires_grad`` against the phase before an optimizer step (:mod:`.invariants`).

        Runs by itself before every ``step()`` of the optimizer given to the
        switcher (a step pre-hook); returns how many flags were put back.
        """
        phase = self.current
        if phase is None:
            return 0
        trainable, idle = self._layouts.split(phase.trainable)
        return invariants.check_before_step(
            phase,
            trainable,
            idle,
            ddp_reduces=bool(self.wrappers),
            find_unused=self.backend.find_unused,
            warned=self._warned_flags,
            check_missing=self._refuse_missing,
        )

    @contextlib.contextmanager
    def visiting(self, groups: Union[str, Iterable[str]]) -> Iterator[None]:
        """Bring non-resident ``groups`` back to the device for the ``with`` block (e.g. to evaluate them).

        Under a schedule whose phases keep only some groups resident
        (``PerTaskCycle``), the other groups live off the device, out of DDP,
        and a forward through them is refused. Inside the block their parameters
        and buffers are back and the forward is allowed; on leaving, they go back
        where they were. Their optimizer state stays where it is and DDP keeps
        ignoring them, so use it for evaluation, under ``torch.no_grad()``. Not
        a collective: a rank may visit alone.

        Raises:
            AltParamsError: before the first phase was applied.
            PlanError: a name that is not one of the groups.
        """
        if self.current is None:
            raise AltParamsError(
                f"`visiting({groups!r})` before the first phase was applied: every group is where the model put it"
            )
        names = [groups] if isinstance(groups, str) else list(groups)
        if not all(isinstance(n, str) for n in names):
            raise PlanError(f"`groups` must be group names (str), got {groups!r}")
        unknown = sorted(set(names) - set(self.groups.names))
        if unknown:
            raise PlanError(f"`visiting` got unknown group(s) {unknown}; the groups are {list(self.groups.names)}")
        with self.residency.visiting(names):
            yield

    # ------------------------------------------------------------ wiring
    def attach(self, model: nn.Module, *, rebuild: bool = False) -> Optional[SwitchRecord]:
        """Attach the wrapper that trains ``groups.module`` (DDP, an FSDP2 model, or the module itself).

        The wrapper's strategy comes from the registry
        (:func:`~hf_altparams.engine.strategies.strategy_for`); from now on
        its backend adapts the wrapper at every switch (DDP: re-buckets it in
        place). Without ``rebuild`` a DDP wrapper must have been built while
        the current phase was applied (``requires_grad`` set).

        Args:
            model: the wrapper (a DDP around the grouped module or one model of
                ``ParamGroups.of_models``), the ``fully_shard`` model, or the plain
                grouped module.
            rebuild: the wrapper was built before the current phase was applied
                (the HF Trainer wraps the model before any callback can set the
                phase, and on resume): re-bucket it now for the current phase, as
                one collective transaction like a switch, and return its record.
                Allowed at the start of a gradient-accumulation window (inside
                ``no_sync``) as long as no gradient is pending.
        """
        strategy = strategy_for(model)
        if not strategy.capabilities.wraps_module:
            self._attach_in_place(model, strategy)
            return None
        inner = strategy.wrapped_module(model)
        part = model_name_in(self.module, inner)
        if inner is not self.module and part is None:
            raise SwitchError(
                f"`model` is a {type(model).__name__} ({strategy.label}) around a different module than the one "
                "ParamGroups was built on; build ParamGroups on the module it wraps (or before wrapping), or on "
                "the models together with ParamGroups.of_models({...}) when each has its own wrapper"
            )
        backend = strategy.backend(model)
        rebuild = (
            self._attach_part(part, strategy, backend)
            if part is not None
            else self._attach_wrapper(model, strategy, backend, rebuild)
        )
        if not rebuild:
            return None
        if self.current is None:
            raise SwitchError("`attach(..., rebuild=True)` needs a current phase: call step_to() first")
        self._ranks_met = False  # ranks reach the wrapper's first call apart (their data loaders start)
        local_error = self.backend.precondition_error(in_accumulation_window=True) or invariants.pending_grads_error(
            self.groups.all_named_params()
        )
        return self._transaction(self.current, None, None, local_error)

    def release_wrappers(self) -> None:
        """End the attached wrappers' training life before the process group goes (DDP: reducers freed).

        The prepared model cannot train afterwards. ``PhasedAccelerator.end_training`` calls it.
        """
        self.backend.release()

    def _forget_sizes(self) -> None:
        """The wrapper changed: what it reduces and its gradient copies differ."""
        self._reduced_bytes.clear()
        self._footprints.clear()

    def _take_strategy(self, strategy: Strategy, backend: Backend) -> None:
        """``strategy`` drives the run from now on through ``backend``; a strategy owning the state owns it now."""
        changed = strategy is not self.strategy
        self.strategy, self.backend = strategy, backend
        if changed and strategy.capabilities.owns_optimizer_state and self.optimizer is not None:
            self._take_state_owner()
        self._forget_sizes()

    def _keep_reducers(self, backend: Backend, which: str) -> None:
        keep = self.config.keep_reducers
        why_not = backend.keep_reducers(keep)
        if why_not:
            warnings.warn(
                f"hf_altparams: keep_reducers={keep} is not used with {which} ({why_not}); every "
                "switch builds a new reducer",
                stacklevel=4,
            )

    def _attach_wrapper(self, model: nn.Module, strategy: Strategy, backend: Backend, rebuild: bool) -> bool:
        """A wrapper around the whole grouped module; returns whether it must be re-bucketed now."""
        self._take_strategy(strategy, backend)
        self._keep_reducers(backend, f"this {strategy.label} wrapper")
        strategy.attached(model, self.optimizer)  # e.g. PrecisionOptimizer(allreduce_dtype=...): its comm hook
        current = self.current
        if current is not None and not rebuild:
            mismatch = backend.built_for_other_flags(self.process_group if self._distributed() else None)
            if mismatch:
                warnings.warn(
                    f"hf_altparams: the {strategy.label} wrapper passed to `attach` was built before phase "
                    f"{current.name!r} was applied: its reducer {mismatch}, so the ranks would diverge. "
                    "Re-bucketing it now for the current phase; build the wrapper after `switcher.step_to(0)` "
                    "(or pass `attach(wrapper, rebuild=True)`) to skip this.",
                    stacklevel=3,
                )
                rebuild = True
        self.residency.attached(backend.ignored_at_wrap(), backend.device)
        ddp = self.ddp
        if ddp is not None:
            self.buffer_sync.attach(ddp, user_ignore=self.residency.ignore_names(frozenset()))
        if current is not None:
            # Accelerate's prepare() and the Trainer move the whole model to the device.
            self.residency.enforce(keep_state_off=self._state_stays_off(current))
            self.residency.install_guards()
            if not rebuild:
                if backend.ignored_at_wrap() != self.residency.ignore_names():
                    backend.apply(self.residency.ignore_names())
                self.buffer_sync.apply(
                    self.module, self.trainable_names(current), ddp=ddp, ignore=self.residency.ignore_names()
                )
        return rebuild

    def _attach_part(self, name: str, strategy: Strategy, backend: Backend) -> bool:
        """One model of several (``ParamGroups.of_models``): its wrapper joins the others'; always re-bucketed.

        Its wrapper was built over every parameter of the model (DDP refuses a
        module with nothing to train), so it is re-bucketed for the current phase now.
        """
        if not strategy.capabilities.wrapper_per_model:
            raise SwitchError(
                f"model {name!r} has its own {strategy.label} wrapper, but {strategy.label} is not "
                "supported with one wrapper per model; wrap the root module once"
            )
        if self.config.buffer_sync != "keep":
            raise SwitchError(
                f"`buffer_sync={self.config.buffer_sync!r}` is not supported with one wrapper per "
                "model; leave it at 'keep'"
            )
        models = self.backend if isinstance(self.backend, ModelsBackend) else ModelsBackend()
        if self.backend is not models and self.strategy is not local_strategy():
            raise SwitchError(
                f"model {name!r} has its own wrapper, but the switcher already drives a "
                f"{self.strategy.label} wrapper around the whole module; wrap either the models or "
                "the root"
            )
        if self.backend is models and strategy is not self.strategy:
            raise SwitchError(
                f"model {name!r} comes with a {strategy.label} wrapper, but the other models' "
                f"wrappers are {self.strategy.label}; wrap every model the same way"
            )
        self._keep_reducers(backend, f"model {name!r}'s wrapper")
        models.add(name, backend)
        self._take_strategy(strategy, models)
        self.residency.attached(models.ignored_at_wrap(), models.device)
        return self.current is not None

    def _attach_in_place(self, model: nn.Module, strategy: Strategy) -> None:
        """The grouped module itself: trained as it is, or wrapped in place (FSDP2)."""
        if model is not self.module:
            names = [s.label for s in registered() if s.capabilities.wraps_module and s.capabilities.trains]
            raise SwitchError(
                f"`model` ({type(model).__name__}) is neither the grouped module nor a wrapper around it "
                f"({', '.join(names)}); build ParamGroups on the model you train"
            )
        self._plain_attached = True  # no wrapper around it, on purpose
        if strategy is local_strategy():
            return
        backend = strategy.backend(model)
        backend.bind(self.groups, self.residency)  # FSDP2: groups vs units checked, residency moves routed
        self._take_strategy(strategy, backend)  # footprints are per-rank shards from now on
        strategy.attached(model, self.optimizer)
        if self.current is not None:
            backend.apply(self.residency.ignore_names())

    # ------------------------------------------------------------ switching
    def step_to(self, step: int, epoch: int = 0) -> Optional[SwitchRecord]:
        """Switch to the phase of ``step`` if it differs from the current one.

        Call it on every rank at an optimizer-step boundary (after ``step()`` and
        ``zero_grad(set_to_none=True)``). Returns the record, or ``None`` when the
        phase is unchanged (no collective is run then: every rank computes the
        same phase from the same step).
        """
        return self.driver.move_to(step, epoch)

    def switch(self, phase: Phase, *, step: Optional[int] = None, epoch: Optional[int] = None) -> SwitchRecord:
        """Apply ``phase`` now, as one collective transaction (see the module docstring)."""
        record = self.driver.switch_to(phase, step, epoch)
        assert record is not None
        return record

    # The driver's PhaseApplier interface.
    def apply_phase(self, phase: Phase, step: Optional[int], epoch: Optional[int]) -> SwitchRecord:
        """One transaction into ``phase`` (the driver commits it after); called by the driver."""
        local_error = (
            self.backend.precondition_error()
            or invariants.pending_grads_error(self.groups.all_named_params())
            or invariants.unattached_error(
                self.current, self._plain_attached or self.strategy.capabilities.synchronises_gradients
            )
        )
        return self._transaction(phase, step, epoch, local_error)

    def position_moved(self) -> None:
        """After every move of the driver's position: start a prefetch, run the every-N drift check."""
        self._start_prefetch()
        step = self.driver.step
        if self.drift.due_at_step(step):
            self.check_weights(f"at step {step} (drift_check={self.drift.setting!r})", timeout=self._timeout())

    def drop_applied_gradients(self) -> None:
        """Drop every gradient (the optimizer step applied them; none may reach the next phase)."""
        for param in self._layouts.params:
            param.grad = None

    def check_weights(self, when: str, refused: str = "", timeout: Optional[float] = None) -> None:
        """The drift check (:func:`~hf_altparams.engine.drift.check_drift`) now: a collective, on every rank.

        Compares every parameter's digest across the ranks that must agree (the
        wrappers' process group; otherwise the world) and raises the same
        :class:`~hf_altparams.errors.DriftError` on every rank when they differ.
        The integrations call it before each checkpoint unless ``drift_check=False``.
        """
        check_drift(
            self.groups, self.process_group if self.wrappers else None, when=when, refused=refused, timeout=timeout
        )

    def _distributed(self) -> bool:
        return is_distributed(self.process_group)

    def _timeout(self) -> Optional[float]:
        """``collective_timeout`` once the ranks have met in a transaction; the group's own before."""
        return self.config.collective_timeout if self._ranks_met else None

    def _transaction(
        self, phase: Phase, step: Optional[int], epoch: Optional[int], local_error: Optional[str]
    ) -> SwitchRecord:
        """One switch into ``phase`` on every rank: apply, settle, roll back or commit the rest, record."""
        started = time.perf_counter()
        timeout = self._timeout()
        group = self.process_group if self._distributed() else None
        one_collective = self.backend.collective_free_apply
        if not one_collective:
            agree(group, phase, step, local_error, timeout)
        layout = self._layouts.get(phase.trainable)
        before = [param.requires_grad for param in self._layouts.params]
        offloaded_before = self.residency.offloaded
        snapshot = self.backend.snapshot()
        failure: Optional[BaseException] = None
        applied, moved = False, 0
        if local_error is None:
            try:
                applied = True
                moved = self.residency.apply(
                    self.residency.non_resident(phase), keep_state_off=self._state_stays_off(phase)
                )
                for hook in self._hooks:  # e.g. peft's active adapters; the flags below win
                    hook(phase)
                self._apply_flags(layout.flags)
                self.backend.apply(self.residency.ignore_names())
            except Exception as exc:  # rolled back below, once every rank has heard of it
                failure = exc
        if one_collective:
            reason = f"{type(failure).__name__}: {failure}" if failure else None
            message, all_refused = settle(group, phase, step, local_error, reason, timeout)
        elif any_rank_failed(group, failure is not None, phase, step, timeout):
            reason = f"{type(failure).__name__}: {failure}" if failure else "it failed on another rank"
            message, all_refused = (
                (
                    f"phase switch to {phase.name!r} at step {step} failed ({reason}); the "
                    "previous trainable set and DDP reducer were restored on every rank"
                ),
                False,
            )
        else:
            message, all_refused = None, False
        if message is not None:
            if applied:
                self._rollback(before, offloaded_before, snapshot)
            elif group is not None and not all_refused:
                self._resync_refusing(snapshot)
            raise SwitchError(message) from failure

        with collective_errors(phase, step, group, None, "broadcast of returning groups"):
            synced = self.residency.sync_returning(self.process_group) if self._distributed() else 0
        self.residency.install_guards(phase)
        if self._state is not None:
            self._state.enter_phase(phase.trainable)
            idle = set(self.groups.names) - phase.trainable
            if not self._idle_logged and idle & set(self.driver.trained_groups):
                self._idle_logged = True  # the first switch that idles a trained group says what its state does
                logger.info("hf_altparams: %s", self._state.summary(idle, self.idle_policies()[2]))
        plan = self.buffer_sync.apply(self.module, layout.trainable, ddp=self.ddp, ignore=self.residency.ignore_names())
        previous = self.current
        released, release_reason = self._release.decide(
            previous,
            phase,
            step,
            self.schedule,
            held=None if previous is None else self.expected_peak(previous),
            coming=self.expected_peak(phase),
        )
        if released:
            # No barrier: the settling all-gather above is one every rank just passed.
            release_memory(barrier=False, full_gc=self.config.full_gc, trim=self.config.trim)
        if self._prefetch.enabled:
            self._prefetch.note_peak(self.expected_peak(phase))
        reduced = self._reduced_bytes.get(phase)
        if reduced is None:
            reduced = remember(self._reduced_bytes, phase, self.allreduce_bytes_per_step())
        record = SwitchRecord(
            step=step,
            epoch=epoch,
            phase=phase.name,
            trainable_groups=layout.groups,
            trainable_params=layout.params,
            trainable_bytes=layout.nbytes,
            allreduce_bytes_per_step=reduced,
            rebuilt_ddp=bool(self.wrappers),
            seconds=time.perf_counter() - started,
            moved_bytes=moved,
            offloaded_bytes=self.residency.offloaded_bytes(),
            synced_bytes=synced,
            buffer_broadcast_bytes=plan.bytes_per_forward,
            buffer_broadcast_saved_bytes=plan.saved_bytes_per_forward,
            released=released,
            release_reason=release_reason,
        )
        self.history.append(record)
        self._ranks_met = True
        if self.drift.after_switch:
            self.check_weights(f"after the switch to {phase.name!r} at step {step}", timeout=timeout)
        return record

    def _apply_flags(self, flags: tuple[bool, ...]) -> None:
        for param, flag in zip(self._layouts.params, flags):
            param.grad = None
            if param.requires_grad != flag:
                param.requires_grad_(flag)

    def _rollback(self, before: list[bool], offloaded: frozenset[str], snapshot: Any) -> None:
        """Put residency, phase hooks, ``requires_grad`` flags and the wrapper back as before the switch."""
        current = self.current
        keep_off = self._state_stays_off(current) if current is not None else None
        if current is not None:
            for hook in self._hooks:
                hook(current)
        try:
            self.residency.apply(offloaded, keep_state_off=keep_off or _never)
        except Exception as exc:
            raise SwitchError(
                "phase switch failed and moving parameters back to their previous devices "
                f"failed too ({type(exc).__name__}: {exc}); restart from the last checkpoint"
            ) from exc
        for param, flag in zip(self._layouts.params, before):
            param.grad = None
            param.requires_grad_(flag)
        try:
            self.backend.restore(snapshot)
        except Exception as exc:
            raise SwitchError(
                f"phase switch failed and restoring the previous {self.backend.kind} wrapper failed too "
                f"({type(exc).__name__}: {exc}); the wrapper is unusable, restart from the last checkpoint"
            ) from exc

    def _resync_refusing(self, snapshot: Any) -> None:
        """On a rank that refused while others applied and rolled back: rebuild the wrapper too.

        Every other rank now has a freshly rebuilt wrapper (for DDP: a reducer that
        re-buckets, with a broadcast, after its first iteration); this rank must
        match it, keeping its pending gradients (the refusal changed nothing else).
        Without it, the next steps pair mismatched collectives and hang.
        """
        grads = [param.grad for param in self._layouts.params]
        try:
            self.backend.restore(snapshot)
        except Exception as exc:
            raise SwitchError(
                f"phase switch refused and re-synchronising this rank's {self.backend.kind} wrapper with the "
                f"other ranks failed ({type(exc).__name__}: {exc}); restart from the last checkpoint"
            ) from exc
        for param, grad in zip(self._layouts.params, grads):
            param.grad = grad

    # ------------------------------------------------------------ memory
    def _state_stays_off(self, phase: Phase) -> Callable[[str], bool]:
        """Whether a group's optimizer state stays off the device in ``phase`` (its idle policy)."""
        state = self._state
        if state is None:
            return _never
        return lambda group: group not in phase.trainable and state.idle_state_leaves(group)

    def _start_prefetch(self) -> int:
        """If the driver's step is the current phase's last, start copying the next phase's offloaded tensors."""
        if not self._prefetch.enabled:
            return 0
        upcoming, current = self.driver.upcoming(), self.current
        if upcoming is None or current is None:  # same phase next step, epoch unit, or nothing applied yet
            return 0
        budget = self._prefetch.budget(
            self.expected_peak(current), self.expected_peak(upcoming) if self._prefetch.setting == "auto" else 0
        )
        residency = self.residency
        started = residency.prefetch(residency.offloaded - residency.non_resident(upcoming), budget)
        state = self._state
        if state is not None:
            for name in sorted(upcoming.trainable - state.active):
                if budget is None or started < budget:
                    started += state.prefetch(name, None if budget is None else budget - started)
        return started

    def reapply_placement(self) -> int:
        """Put parameters and optimizer state back where the current phase wants them.

        Call it on every rank after anything that moved them wholesale: a
        ``model.to(device)`` (Accelerate's ``prepare``, the Trainer's model
        placement), an optimizer ``load_state_dict`` outside
        :class:`GroupedOptimizer`, Accelerate's optimizer preparation, a Trainer
        resume. Returns the bytes moved.
        """
        moved = 0
        if self.current is not None:
            moved += self.residency.enforce(keep_state_off=self._state_stays_off(self.current))
            self.residency.install_guards()
        if self._state is not None:
            moved += self._state.reapply_policy()
        return moved

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The schedule's state, the position and the groups trained so far, and the current phase."""
        return {
            "format": STATE_FORMAT,
            "schedule": self.schedule.state_dict(),
            "driver": self.driver.state().as_dict(),
            "phase": None if self.current is None else sorted(self.current.trainable),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check the saved schedule matches this one; take the saved position (the phase follows the step).

        The phase saved is applied at the next :meth:`step_to` (or right away by
        the integrations, before the optimizer state loads).
        """
        self._ranks_met = False  # a resume: ranks finish loading apart (see collective_timeout)
        try:
            self.schedule.load_state_dict(state["schedule"])
        except KeyError as exc:
            raise SwitchError(
                f"switcher state is missing {exc}; expected keys ['schedule', 'driver', 'phase']"
            ) from exc
        if "driver" in state:
            self.driver.restore(DriverState.from_dict(state["driver"]))


def _never(group: str) -> bool:
    return False
