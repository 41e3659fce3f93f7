"""The phase switch: one collective transaction on every rank.

:class:`PhaseSwitcher` owns the run's groups, its optional DDP (or FSDP2)
wrapper and optimizer, and applies each phase its :class:`~.driver.PhaseDriver`
asks for (the driver owns the schedule position and the current phase). At a
switch it

1. checks the preconditions (optimizer-step boundary, not inside ``no_sync``),
2. clears every gradient (``None``: bucket views must not pin old buckets),
3. flips ``requires_grad`` to the new trainable set,
4. lets the backend adapt the wrapper (:mod:`.backend`; for DDP the reducer
   is rebuilt in place, :mod:`.ddp`),
5. settles, in ONE small all-gather, that every rank asked for the same phase,
   none refused and none failed (:func:`._collective.settle`); otherwise every
   rank restores the previous flags and reducer and raises the same
   :class:`~hf_altparams.errors.SwitchError`,
6. re-applies the optimizer's idle-state policy,
7. releases memory when the schedule says it pays (``release="auto"``,
   :mod:`.memory._release`; the all-gather of step 5 is the barrier), and
8. records what it did in a :class:`SwitchRecord` (a bounded
   :class:`~hf_altparams.engine.records.SwitchHistory` keeps the recent ones
   and running totals).

Steps 2-4 are local and undone on the slow path (:mod:`._undo`); a backend
whose apply runs collectives agrees first and checks the outcome after, in two
all-gathers. ``docs/switch.md`` explains the choice.

Memory (:mod:`.memory`, :mod:`.buffers`): before step 4, groups the phase does
not keep resident move off the device and returning ones come back (rolled back
on failure); after it, returning groups are broadcast from rank 0 once, guards
go on non-resident modules, the buffer-sync policy is applied, and with
``prefetch`` the next phase's offloaded tensors start copying back during the
last step of the current one. Settings: one
:class:`~hf_altparams.engine.config.SwitchConfig`; wiring a wrapper: :mod:`._attach`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..errors import AltParamsError, SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from . import _misuse
from ._attach import attach_wrapper
from ._transaction import run_transaction
from ._collective import is_distributed
from ._layout import PhaseLayouts
from ._undo import rollback
from .backend import Backend, LocalBackend
from .buffers import BufferSync
from .config import SwitchConfig
from .drift import DriftCheck, check_drift
from .driver import PhaseDriver
from .invariants import check_before_step, check_each_step
from .memory._prefetch import PhasePrefetch
from .memory._release import ReleasePolicy
from .memory._residency import ResidencyManager
from .memory._transfer import optimizer_of
from .memory.model import StatePolicy
from .optim._grouped import GroupedOptimizer
from .optim._scheduler import reapply_state_policy
from .records import SwitchHistory, SwitchRecord

__all__ = ["PhaseSwitcher", "SwitchRecord"]


class PhaseSwitcher:
    """Applies a schedule's phases to a model (plain, DDP or FSDP2) and its optimizer.

    Args:
        groups: the parameter groups (their module is the model to switch).
        schedule: maps a step (and epoch) to a :class:`~hf_altparams.plan.Phase`;
            validated against ``groups`` here, before any training step.
        optimizer: optional; a :class:`GroupedOptimizer` gets its active groups
            and idle-state policy applied at every switch. A plain optimizer over
            all parameters needs nothing (torch skips parameters whose grad is None).
        model: the DDP wrapper around ``groups.module``, if already built (else
            call :meth:`attach` once it is).
        config: the switch's settings (:class:`~hf_altparams.engine.config.SwitchConfig`:
            ``release``, ``prefetch``, ``offload_device``, ``keep_reducers``,
            ``collective_timeout``, ...); the same names may be given as keyword
            arguments (``**options``), which override it.
        driver: the :class:`~.driver.PhaseDriver` that owns the schedule position
            and the current phase (default: a new one for ``schedule``).

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
        **options: Any,
    ) -> None:
        self.config = SwitchConfig.build(config, argument="PhaseSwitcher's settings", **options)
        if driver is not None and driver.schedule is not schedule:
            raise AltParamsError("`driver` drives another schedule than `schedule`; pass the driver's own schedule")
        schedule.validate(groups)
        self.driver = driver if driver is not None else PhaseDriver(schedule)
        self.driver.bind(self._apply_phase, moved=self._moved, clear_grads=self._clear_grads)
        self.drift = DriftCheck(self.config.drift_check)
        self._ranks_met = False  # collective_timeout applies once the ranks met in a transaction
        self.release_policy = ReleasePolicy(self.config.release)
        self.history = SwitchHistory(self.config.history_window)
        self.prefetcher = PhasePrefetch(self.config.prefetch)
        self.residency = ResidencyManager(groups, offload_device=self.config.offload_device,
                                          device=self.config.device, guard=self.config.guard_offloaded)
        self.residency.optimizer = optimizer
        self.buffer_sync = BufferSync(self.config.buffer_sync, self.config.frozen_norms,
                                      self.config.buffer_updating_types)
        self.groups = groups
        self.schedule = schedule
        self.optimizer = optimizer
        self.backend: Backend = LocalBackend()
        #: a plain module was attached on purpose (a multi-rank run without a wrapper)
        self.plain_attached = False
        # Per-phase caches (the groups never change): flags, sizes, reduced bytes.
        self._layouts = PhaseLayouts(groups)
        self._names, self._params = self._layouts.names, self._layouts.params
        self._reduced_bytes: dict[Phase, int] = {}
        self._warned_flags: set[str] = set()
        #: refuse, at the step, a trainable parameter without a gradient (the integrations set it; else the
        #: next switch refuses it)
        self.check_missing_grads = False
        #: called with the new phase inside each switch, before ``requires_grad`` is set (and with
        #: the previous phase if the switch is rolled back): what else must follow the phase
        self.phase_hooks: list[Callable[[Phase], Any]] = []
        self._step_hook = check_each_step(optimizer, self)
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------ state
    @property
    def current(self) -> Optional[Phase]:
        """The phase applied now (the driver's; ``None`` before the first switch)."""
        return self.driver.current

    @property
    def phase(self) -> Optional[Phase]:
        """The phase that trains now (as ``PhasedAccelerator.phase``); same as :attr:`current`."""
        return self.driver.current

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
        return self.backend.wrapper if self.backend.kind == "ddp" else None  # type: ignore[return-value]

    @property
    def wrappers(self) -> list[nn.Module]:
        """Every DDP wrapper the switcher drives: one, one per model (``ParamGroups.of_models``), or none."""
        return list(getattr(self.backend, "wrappers", [])) or ([self.ddp] if self.ddp is not None else [])

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of the attached wrapper (``None``: no wrapper)."""
        return self.backend.process_group

    def _distributed(self) -> bool:
        return is_distributed(self.process_group)

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

    def check_before_step(self) -> int:
        """Check gradients and ``requires_grad`` against the phase before an optimizer step (:mod:`.invariants`).

        Runs by itself before every ``step()`` of the optimizer given to the
        switcher (a step pre-hook); returns how many flags were put back.
        """
        phase = self.current
        if phase is None:
            return 0
        trainable, idle = self._layouts.split(phase.trainable)
        wrappers = self.wrappers
        return check_before_step(phase, trainable, idle, ddp_reduces=bool(wrappers),
                                 find_unused=any(bool(w.find_unused_parameters) for w in wrappers),
                                 warned=self._warned_flags, check_missing=self.check_missing_grads)

    def set_optimizer(self, optimizer: Optimizer) -> None:
        """Take ``optimizer`` as the run's optimizer when it comes after the model (a separate ``prepare``)."""
        if self.optimizer is not None:
            raise AltParamsError("the switcher has an optimizer already; a second would step outside the schedule")
        self.optimizer = self.residency.optimizer = optimizer
        self._step_hook = check_each_step(optimizer, self)
        grouped = optimizer_of(optimizer)
        if isinstance(grouped, GroupedOptimizer) and self.current is not None:
            grouped.set_active(self.current.trainable)
        self.reapply_placement()

    def close(self) -> None:
        """The run that owns this switcher is over: stop checking the optimizer's steps, remove the forward guards."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.residency.remove_guards()

    # ------------------------------------------------------------ wiring
    def attach(self, model: nn.Module, *, rebuild: bool = False) -> Optional[SwitchRecord]:
        """Attach the DDP wrapper built around ``groups.module`` (or the module itself, or an FSDP2 model).

        Without ``rebuild`` the wrapper must have been built while the current
        phase was applied (``requires_grad`` set); from now on switches
        re-bucket it in place.

        Args:
            model: the DDP wrapper (or the plain grouped module, or the
                ``fully_shard`` model).
            rebuild: the wrapper was built before the current phase was applied
                (the HF Trainer wraps the model before any callback can set the
                phase, and on resume): re-bucket it now for the current phase, as
                one collective transaction like a switch, and return its record.
                Allowed at the start of a gradient-accumulation window (inside
                ``no_sync``) as long as no gradient is pending.
        """
        rebuild = attach_wrapper(self, model, rebuild)
        if not rebuild:
            return None
        if self.current is None:
            raise SwitchError("`attach(..., rebuild=True)` needs a current phase: call step_to() first")
        self._ranks_met = False  # ranks reach the wrapper's first call apart (their data loaders start)
        local_error = (self.backend.precondition_error(in_accumulation_window=True)
                       or self._pending_grads_error())
        return self._transaction(self.current, None, None, local_error)

    # ------------------------------------------------------------ switching
    def step_to(self, step: int, epoch: int = 0) -> Optional[SwitchRecord]:
        """Switch to the phase of ``step`` if it differs from the current one.

        Call it on every rank at an optimizer-step boundary (after ``step()`` and
        ``zero_grad(set_to_none=True)``). Returns the record, or ``None`` when the
        phase is unchanged (no collective is run then: every rank computes the
        same phase from the same step).
        """
        return self.driver.move_to(step, epoch)  # type: ignore[no-any-return]

    def switch(self, phase: Phase, *, step: Optional[int] = None, epoch: Optional[int] = None) -> SwitchRecord:
        """Apply ``phase`` now, as one collective transaction (see the module docstring)."""
        return self.driver.switch_to(phase, step, epoch)  # type: ignore[no-any-return]

    def _moved(self) -> None:
        """After every move of the driver's position: start a prefetch, run the every-N drift check."""
        self.prefetcher.maybe_start(self)
        step = self.driver.step
        if self.drift.due_at_step(step):
            self.check_weights(f"at step {step} (drift_check={self.drift.setting!r})", timeout=self._timeout())

    def check_weights(self, when: str, refused: str = "", timeout: Optional[float] = None) -> None:
        """The drift check (:func:`~hf_altparams.engine.drift.check_drift`) now: a collective, on every rank.

        Compares every parameter's digest across the ranks that must agree (the
        wrappers' process group; otherwise the world) and raises the same
        :class:`~hf_altparams.errors.DriftError` on every rank when they differ.
        The integrations call it before each checkpoint unless ``drift_check=False``.
        """
        check_drift(self.groups, self.process_group if self.wrappers else None, when=when, refused=refused,
                    timeout=timeout)

    def _timeout(self) -> Optional[float]:
        """``collective_timeout`` once the ranks have met in a transaction; the group's own before."""
        return self.config.collective_timeout if self._ranks_met else None

    def _apply_phase(self, phase: Phase, step: Optional[int], epoch: Optional[int]) -> SwitchRecord:
        """The driver's ``apply``: one transaction into ``phase`` (the driver commits it after)."""
        return self._transaction(phase, step, epoch, self._precondition_error())

    def _transaction(
        self, phase: Phase, step: Optional[int], epoch: Optional[int], local_error: Optional[str]
    ) -> SwitchRecord:
        return run_transaction(self, phase, step, epoch, local_error)

    # ------------------------------------------------------------ memory
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
            self.residency.install_guards(self.current.name)
        if self.optimizer is not None:
            moved += reapply_state_policy(self.optimizer)
        return moved

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The schedule's state and the current phase (for checkpoints)."""
        return {"schedule": self.schedule.state_dict(),
                "phase": None if self.current is None else sorted(self.current.trainable)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check the saved schedule matches this one (the phase itself follows the step)."""
        self._ranks_met = False  # a resume: ranks finish loading apart (see collective_timeout)
        try:
            self.schedule.load_state_dict(state["schedule"])
        except KeyError as exc:
            raise SwitchError(f"switcher state is missing {exc}; expected keys ['schedule', 'phase']") from exc

    # ------------------------------------------------------------ internals
    def _state_stays_off(self, phase: Phase) -> Callable[[str], bool]:
        """Whether a group's optimizer state stays off the device in ``phase`` (its idle policy)."""
        opt = optimizer_of(self.optimizer) if self.optimizer is not None else None
        if not isinstance(opt, GroupedOptimizer):
            return lambda group: False
        return lambda group: (group not in phase.trainable
                              and opt.policies.get(group, StatePolicy.KEEP) is not StatePolicy.KEEP)

    def _precondition_error(self) -> Optional[str]:
        return (self.backend.precondition_error() or self._pending_grads_error()
                or _misuse.unattached_error(self.current, self.backend, self.plain_attached))

    def _pending_grads_error(self) -> Optional[str]:
        return _misuse.pending_grads_error(self.groups.all_named_params())

    def _clear_grads(self) -> None:
        for param in self._params:
            param.grad = None

    def _apply_flags(self, trainable: frozenset[str]) -> None:
        for param, flag in zip(self._params, self._layouts.flags(trainable)):
            param.grad = None
            if param.requires_grad != flag:
                param.requires_grad_(flag)

    def _rollback(self, before: list[bool], offloaded: Optional[frozenset[str]] = None,
                  snapshot: Any = None) -> None:
        keep_off = self._state_stays_off(self.current) if self.current is not None else None
        if self.current is not None:
            for hook in self.phase_hooks:
                hook(self.current)
        rollback(self.residency, self.backend, self._params, before, offloaded, snapshot,
                 keep_off or (lambda group: False))
