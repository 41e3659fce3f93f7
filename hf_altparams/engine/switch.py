"""The phase switch: one collective transaction on every rank.

:class:`PhaseSwitcher` owns the run's groups, schedule and (optionally) the
DDP wrapper and optimizer. At a switch it

1. checks the preconditions (optimizer-step boundary, not inside ``no_sync``),
2. clears every gradient (``None``: bucket views must not pin old buckets),
3. flips ``requires_grad`` to the new trainable set,
4. lets the backend adapt the wrapper (:mod:`.backend`; for DDP the reducer
   is rebuilt in place, :mod:`hf_altparams.engine._ddp`),
5. settles, in ONE small all-gather, that every rank asked for the same phase,
   none refused and none failed (:func:`._collective.settle`); otherwise every
   rank restores the previous flags and reducer and raises the same
   :class:`~hf_altparams.errors.SwitchError`,
6. re-applies the optimizer's idle-state policy,
7. releases memory when the schedule says it pays (``release="auto"``,
   :mod:`._release`; the all-gather of step 5 is the barrier), and
8. records what it did in a :class:`SwitchRecord` (a bounded
   :class:`~hf_altparams.engine.records.SwitchHistory` keeps the recent ones
   and running totals).

Steps 2-4 are local and undone on the slow path (:mod:`._undo`); a backend
whose apply runs collectives agrees first and checks the outcome after, in two
all-gathers. ``docs/switch.md`` explains the choice.

Memory (see :mod:`.residency`, :mod:`.buffers`, :mod:`.report`): before step 4,
groups the phase does not keep resident (``Phase.resident``) move off the
device and the returning ones come back; step 5 passes DDP the matching ignore
list; a failure there rolls the moves back too. After the transaction, groups
resident for the first time since the wrap are broadcast from rank 0 once,
guards go on modules of non-resident groups, and the buffer-sync policy is
applied. With ``prefetch``, the next phase's offloaded parameters and state
start copying back during the last step of the current phase.

This module holds the switcher's construction, ``attach`` and the transaction;
its queries, ``reapply_placement`` and checkpoint state are in
:mod:`._switch_state`, each backend's wrapper surgery in its own module
(:mod:`._ddp`, :mod:`._fsdp2`).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from ..errors import SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from . import _ddp, _misuse
from ._collective import agree, any_rank_failed, check_timeout, collective_errors, settle
from ._layout import PhaseLayouts, remember
from ._undo import resync_refusing, rollback
from ._prefetch import PhasePrefetch, PrefetchSetting
from ._reducer_cache import check_keep_reducers
from ._release import ReleasePolicy, ReleaseSetting
from ._switch_state import SwitcherState
from ._transfer import optimizer_of
from .backend import Backend, LocalBackend, backend_for
from .buffers import BufferSync, BufferSyncPolicy, FrozenNormPolicy
from .drift import DriftCheck, DriftSetting
from .memory import release_memory
from .optim import GroupedOptimizer
from .records import SwitchHistory, SwitchRecord
from .residency import DeviceLike, ResidencyManager

__all__ = ["PhaseSwitcher", "SwitchRecord"]


class PhaseSwitcher(SwitcherState):
    """Applies a schedule's phases to a model (plain or DDP) and its optimizer.

    Args:
        groups: the parameter groups (their module is the model to switch).
        schedule: maps a step (and epoch) to a :class:`~hf_altparams.plan.Phase`;
            validated against ``groups`` here, before any training step.
        optimizer: optional; a :class:`GroupedOptimizer` gets its active groups
            and idle-state policy applied at every switch. A plain optimizer over
            all parameters needs nothing (torch skips parameters whose grad is None).
        model: the DDP wrapper around ``groups.module``, if already built (else
            call :meth:`attach` once it is).
        release: when to run, after a switch, a young-generation gc pass,
            ``empty_cache`` and ``malloc_trim`` (:func:`~hf_altparams.engine.release_memory`;
            the ranks are already in step: the transaction ends with an all-gather).
            ``"auto"`` (default): when the coming phase needs less memory than
            was held and lasts long enough to amortise it; skipped when the next
            phase reuses the freed memory at once (equal-sized groups alternating);
            see :mod:`hf_altparams.engine._release`. ``True``: at every switch;
            ``False``: never. The decision is in each record (``released``,
            ``release_reason``).
        full_gc: make that gc pass a full collection (80-300 ms with torch and
            transformers imported; a switch's garbage is freed by reference count,
            so this is only for user-side reference cycles).
        trim: let that release return freed host heap pages to the OS
            (``malloc_trim``): host RSS stays at what live tensors need, at
            10-50 ms per switch plus page faults in the next step. ``False``
            for fast per-step alternation when host memory is not the limit.
        offload_device: where the groups a phase does not keep resident live
            (``Phase.resident``, e.g. the other tasks of ``PerTaskCycle``): their
            parameters, gradients and optimizer state. Default the CPU; ``None``
            leaves them in place (still out of DDP and guarded).
        device: where resident groups live (default: where each tensor left from,
            else the DDP wrapper's device).
        guard_offloaded: refuse, with a :class:`SwitchError` naming the parameter,
            a forward through a module whose parameters are all non-resident.
        prefetch: start copying the next phase's offloaded parameters and
            optimizer state back on a CUDA side stream during the last step of
            the current phase, so the copy overlaps its compute. The trade-off:
            during that step the device holds both phases' copies. ``False``
            (default): copy at the switch, the peak stays that of the larger
            phase. ``True``: prefetch everything. An ``int``: at most that many
            bytes. ``"auto"``: at most the headroom between the current phase's
            expected peak and the largest expected peak seen so far (or the next
            phase's), so the run's expected peak does not rise (activations are
            not part of that estimate). Step schedules only; a no-op off CUDA.
        buffer_sync: ``"keep"`` (default: DDP's buffer broadcast as built) or
            ``"auto"`` (broadcast only while a module that updates its buffers in
            forward may train; see :mod:`hf_altparams.engine.buffers`).
        frozen_norms: ``"train"`` (default) or ``"eval"``: hold norm layers whose
            parameters are frozen in a phase in eval mode (running stats stop drifting).
        buffer_updating_types: module types besides norm layers that update buffers in forward.
        history_window: how many recent :class:`SwitchRecord` s :attr:`history`
            keeps (its running totals cover every switch).
        collective_timeout: seconds a rank waits in the switch's agreement for
            the others before it raises a :class:`SwitchError` naming the switch
            and the step (a rank died or hangs). ``None`` (default): the process
            group's timeout (``InitProcessGroupKwargs(timeout=...)`` in
            Accelerate, ``TrainingArguments(ddp_timeout=...)``; 30 min by
            default). A dead rank's peers fail at once either way (connection
            closed). Set it above the longest gap between ranks reaching a switch
            in training. The first switch, the first after :meth:`load_state_dict`
            and :meth:`attach`'s re-bucketing wait under the group's timeout
            instead: ranks reach them seconds apart (loading a model, starting loaders).
        drift_check: when every rank's weights are compared (:mod:`.drift`; a
            :class:`~hf_altparams.errors.DriftError` names the groups and ranks
            that differ): ``"save"`` (default) before every checkpoint of the
            integrations; ``"switch"`` also after every switch; ``N`` also every
            ``N`` optimizer steps (:meth:`step_to`); ``False`` never.
        keep_reducers: how many idle phases' DDP reducers to keep for switches
            back (default 0: a switch frees the old reducer and builds a new
            one). Each kept reducer holds one copy of its phase's trainable
            gradients (its buckets); in return a switch back re-installs it
            instead of building one (faster), with the bucket layout it learned
            in autograd order instead of DDP's first-iteration single bucket.
            For per-step alternation of two sets, ``1``. Not used with
            ``find_unused_parameters=True``, ``static_graph=True`` or PowerSGD
            (a warning says so); see ``docs/switch.md``.

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
        release: ReleaseSetting = "auto",
        full_gc: bool = False,
        trim: bool = True,
        offload_device: Optional[DeviceLike] = "cpu",
        device: Optional[DeviceLike] = None,
        guard_offloaded: bool = True,
        prefetch: PrefetchSetting = False,
        buffer_sync: BufferSyncPolicy = "keep",
        frozen_norms: FrozenNormPolicy = "train",
        buffer_updating_types: tuple[type, ...] = (),
        history_window: int = 256,
        collective_timeout: Optional[float] = None,
        keep_reducers: int = 0,
        drift_check: DriftSetting = "save",
    ) -> None:
        schedule.validate(groups)
        self.collective_timeout = check_timeout(collective_timeout)
        self.drift = DriftCheck(drift_check)
        self._ranks_met = False  # collective_timeout applies once the ranks met in a transaction
        self.keep_reducers = check_keep_reducers(keep_reducers)
        self.release_policy = ReleasePolicy(release)
        self.history = SwitchHistory(history_window)
        self.prefetcher = PhasePrefetch(prefetch)
        self.residency = ResidencyManager(groups, offload_device=offload_device, device=device,
                                          guard=guard_offloaded)
        self.residency.optimizer = optimizer
        self.buffer_sync = BufferSync(buffer_sync, frozen_norms, buffer_updating_types)
        self.groups = groups
        self.schedule = schedule
        self.optimizer = optimizer
        self.release = release
        self.full_gc = full_gc
        self.trim = trim
        self.backend: Backend = LocalBackend()
        self.current: Optional[Phase] = None
        # Per-phase caches (the groups never change): flags, sizes, reduced bytes.
        self._layouts = PhaseLayouts(groups)
        self._names, self._params = self._layouts.names, self._layouts.params
        self._reduced_bytes: dict[Phase, int] = {}
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------ wiring
    def attach(self, model: nn.Module, *, rebuild: bool = False) -> Optional[SwitchRecord]:
        """Attach the DDP wrapper built around ``groups.module`` (no-op for a plain module).

        Without ``rebuild`` the wrapper must have been built while the current
        phase was applied (``requires_grad`` set); from now on switches
        re-bucket it in place.

        Args:
            model: the DDP wrapper (or the plain grouped module).
            rebuild: the wrapper was built before the current phase was applied
                (the HF Trainer wraps the model before any callback can set the
                phase, and on resume): re-bucket it now for the current phase, as
                one collective transaction like a switch, and return its record.
                Allowed at the start of a gradient-accumulation window (inside
                ``no_sync``) as long as no gradient is pending.
        """
        if not _ddp.is_ddp(model):
            if model is not self.module:
                raise SwitchError(
                    f"`model` ({type(model).__name__}) is neither the grouped module nor a "
                    "DistributedDataParallel around it; build ParamGroups on the model you train"
                )
            self._plain_attached = True  # no DDP wrapper, on purpose
            backend = backend_for(model)
            if backend.kind == "local":
                return None
            backend.bind(self)  # FSDP2: groups vs units checked, residency moves routed
            self.backend = backend  # fully_shard changed the module in place (FSDP2)
            self._reduced_bytes.clear()
            if self.current is not None:
                self.backend.apply(self.residency.ignore_names())
            return None
        if model.module is not self.module:
            raise SwitchError(
                "`model` is a DistributedDataParallel around a different module than the one "
                "ParamGroups was built on; build ParamGroups on `ddp.module` (or before wrapping)"
            )
        self.backend = backend_for(model)
        why_not = self.backend.keep_reducers(self.keep_reducers)
        if why_not:
            warnings.warn(f"hf_altparams: keep_reducers={self.keep_reducers} is not used with this DDP wrapper "
                          f"({why_not}); every switch builds a new reducer", stacklevel=2)
        grouped = optimizer_of(self.optimizer) if self.optimizer is not None else None
        attach_ddp = getattr(grouped, "attach_ddp", None)  # PrecisionOptimizer: its comm hook
        if attach_ddp is not None:
            attach_ddp(model)
        self._reduced_bytes.clear()
        self.release_policy.forget_footprints()  # DDP adds a gradient copy per trainable byte
        if self.current is not None and not rebuild:
            mismatch = _misuse.wrapper_mismatch(model, self.process_group if self._distributed() else None)
            if mismatch:
                warnings.warn(
                    f"hf_altparams: the DDP wrapper passed to `attach` was built before phase "
                    f"{self.current.name!r} was applied: its reducer {mismatch}, so the ranks would diverge. "
                    "Re-bucketing it now for the current phase; build DDP after `switcher.step_to(0)` "
                    "(or pass `attach(ddp, rebuild=True)`) to skip this.", stacklevel=2)
                rebuild = True
        self.residency.attached(self.backend.ignored_at_wrap(), self.backend.device)
        self.buffer_sync.attach(model, user_ignore=self.residency.ignore_names(frozenset()))
        if self.current is not None:
            # Accelerate's prepare() and the Trainer move the whole model to the device.
            self.residency.enforce(keep_state_off=self._state_stays_off(self.current))
            self.residency.install_guards(self.current.name)
            if not rebuild:
                if self.backend.ignored_at_wrap() != self.residency.ignore_names():
                    self.backend.apply(self.residency.ignore_names())
                self.buffer_sync.apply(self.module, self.trainable_names(self.current), ddp=model,
                                       ignore=self.residency.ignore_names())
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
        phase = self.phase_at(step, epoch)
        if phase == self.current:
            self.prefetcher.maybe_start(self, step, epoch)
            record = None
        else:
            record = self.switch(phase, step=step, epoch=epoch)
        if self.drift.due_at_step(step):
            self.check_weights(f"at step {step} (drift_check={self.drift.setting!r})", timeout=self._timeout())
        return record

    def switch(self, phase: Phase, *, step: Optional[int] = None, epoch: Optional[int] = None) -> SwitchRecord:
        """Apply ``phase`` now, as one collective transaction (see the module docstring)."""
        return self._transaction(phase, step, epoch, self._precondition_error())

    def _transaction(
        self, phase: Phase, step: Optional[int], epoch: Optional[int], local_error: Optional[str]
    ) -> SwitchRecord:
        started = time.perf_counter()
        group = self.process_group if self._distributed() else None
        timeout = self._timeout()
        one_collective = self.backend.collective_free_apply
        if not one_collective:
            agree(group, phase, step, local_error, timeout)
        layout = self._layouts.get(phase.trainable)
        before = [param.requires_grad for param in self._params]
        offloaded_before = self.residency.offloaded
        snapshot = self.backend.snapshot()
        failure: Optional[BaseException] = None
        applied, moved = False, 0
        if local_error is None:
            try:
                applied = True
                moved = self.residency.apply(self.residency.non_resident(phase),
                                             keep_state_off=self._state_stays_off(phase))
                self._apply_flags(layout.trainable)
                self.backend.apply(self.residency.ignore_names())
            except Exception as exc:  # rolled back below, once every rank has heard of it
                failure = exc
        if one_collective:
            reason = f"{type(failure).__name__}: {failure}" if failure else None
            message, all_refused = settle(group, phase, step, local_error, reason, timeout)
        elif any_rank_failed(group, failure is not None, phase, step, timeout):
            reason = f"{type(failure).__name__}: {failure}" if failure else "it failed on another rank"
            message, all_refused = (f"phase switch to {phase.name!r} at step {step} failed ({reason}); the "
                                    "previous trainable set and DDP reducer were restored on every rank"), False
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
        self.residency.install_guards(phase.name)
        grouped = optimizer_of(self.optimizer) if self.optimizer is not None else None
        if isinstance(grouped, GroupedOptimizer):  # also inside an AcceleratedOptimizer
            grouped.set_active(phase.trainable)
        plan = self.buffer_sync.apply(self.module, layout.trainable, ddp=self.ddp,
                                      ignore=self.residency.ignore_names())
        released, release_reason = self.release_policy.decide(self, self.current, phase, step, epoch)
        if released:
            # No barrier: the settling all-gather above is one every rank just passed.
            release_memory(barrier=False, full_gc=self.full_gc, trim=self.trim)
        self.current = phase
        self.prefetcher.switched(self, phase)
        self.prefetcher.maybe_start(self, step, epoch)
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
            rebuilt_ddp=self.ddp is not None,
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

    # ------------------------------------------------------------ internals
    def _timeout(self) -> Optional[float]:
        """``collective_timeout`` once the ranks have met in a transaction; the group's own before."""
        return self.collective_timeout if self._ranks_met else None

    def _precondition_error(self) -> Optional[str]:
        return (self.backend.precondition_error() or self._pending_grads_error()
                or _misuse.unattached_error(self))

    def _pending_grads_error(self) -> Optional[str]:
        pending = [n for n, p in self.groups.all_named_params() if p.grad is not None and _nonzero(p.grad)]
        if pending:
            return (f"{len(pending)} parameters hold pending gradients (e.g. {pending[:3]}): "
                    "call optimizer.step() and optimizer.zero_grad(set_to_none=True) before switching")
        return None

    def _apply_flags(self, trainable: frozenset[str]) -> None:
        for param, flag in zip(self._params, self._layouts.flags(trainable)):
            param.grad = None
            if param.requires_grad != flag:
                param.requires_grad_(flag)

    def _resync_refusing(self, snapshot: Any) -> None:
        resync_refusing(self.backend, self._params, snapshot)

    def _rollback(self, before: list[bool], offloaded: Optional[frozenset[str]] = None,
                  snapshot: Any = None) -> None:
        keep_off = self._state_stays_off(self.current) if self.current is not None else None
        rollback(self.residency, self.backend, self._params, before, offloaded, snapshot,
                 keep_off or (lambda group: False))


def _nonzero(grad: Any) -> bool:
    """Whether a gradient holds any non-zero value (a sparse one, e.g. from ``Embedding(sparse=True)``, too)."""
    if grad.is_sparse:
        grad = grad.coalesce().values()
    return bool(grad.ne(0).any())
