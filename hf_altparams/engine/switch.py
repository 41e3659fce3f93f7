"""The phase switch: one collective transaction on every rank.

:class:`PhaseSwitcher` owns the run's groups, schedule and (optionally) the
DDP wrapper and optimizer. At a switch it

1. checks the preconditions (optimizer-step boundary, not inside ``no_sync``),
2. checks that every rank asks for the same phase (one small all-reduce; a
   mismatch or a local refusal raises the same error on every rank;
   :mod:`._collective`),
3. clears every gradient (``None``: bucket views must not pin old buckets),
4. flips ``requires_grad`` to the new trainable set,
5. lets the backend adapt the wrapper (:mod:`.backend`; for DDP the reducer
   is rebuilt in place, :mod:`hf_altparams.engine._ddp`),
6. re-applies the optimizer's idle-state policy,
7. releases memory (gc, ``empty_cache``, ``malloc_trim``; the all-reduce
   that closes step 5 is the barrier), and
8. records what it did in a :class:`SwitchRecord`.

If step 4 or 5 fails on any rank, every rank restores the previous flags and
reducer and raises :class:`~hf_altparams.errors.SwitchError`.

Memory (see :mod:`.residency`, :mod:`.buffers`, :mod:`.report`): before step 4,
groups the phase does not keep resident (``Phase.resident``) move off the
device and the returning ones come back; step 5 passes DDP the matching ignore
list; a failure there rolls the moves back too. After the transaction, groups
resident for the first time since the wrap are broadcast from rank 0 once,
guards go on modules of non-resident groups, and the buffer-sync policy is
applied. With ``prefetch``, the next phase's offloaded parameters and state
start copying back during the last step of the current phase.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..errors import AltParamsError, SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from . import _ddp
from ._collective import agree, any_rank_failed, is_distributed
from ._prefetch import PhasePrefetch, PrefetchSetting
from ._transfer import optimizer_of
from .backend import Backend, LocalBackend, backend_for
from .buffers import BufferSync, BufferSyncPolicy, FrozenNormPolicy
from .memory import release_memory
from .optim import GroupedOptimizer, reapply_state_policy
from .records import SwitchRecord
from .residency import DeviceLike, ResidencyManager

__all__ = ["PhaseSwitcher", "SwitchRecord"]


class PhaseSwitcher:
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
        release: after each switch, run a young-generation gc pass,
            ``empty_cache`` and ``malloc_trim`` (:func:`~hf_altparams.engine.release_memory`);
            the ranks are already in step (the transaction ends with an all-reduce).
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
        release: bool = True,
        full_gc: bool = False,
        trim: bool = True,
        offload_device: Optional[DeviceLike] = "cpu",
        device: Optional[DeviceLike] = None,
        guard_offloaded: bool = True,
        prefetch: PrefetchSetting = False,
        buffer_sync: BufferSyncPolicy = "keep",
        frozen_norms: FrozenNormPolicy = "train",
        buffer_updating_types: tuple[type, ...] = (),
    ) -> None:
        schedule.validate(groups)
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
        self.records: list[SwitchRecord] = []
        self._names = [name for name, _ in groups.all_named_params()]
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------ wiring
    @property
    def module(self) -> nn.Module:
        return self.groups.module

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
            backend = backend_for(model)
            if backend.kind == "local":
                return None
            self.backend = backend  # fully_shard changed the module in place (FSDP2)
            if self.current is not None:
                self.backend.apply(self.residency.ignore_names())
            return None
        if model.module is not self.module:
            raise SwitchError(
                "`model` is a DistributedDataParallel around a different module than the one "
                "ParamGroups was built on; build ParamGroups on `ddp.module` (or before wrapping)"
            )
        self.backend = backend_for(model)
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
        local_error = (self.backend.precondition_error(in_accumulation_window=True)
                       or self._pending_grads_error())
        return self._transaction(self.current, None, None, local_error)

    @property
    def ddp(self) -> Optional[DistributedDataParallel]:
        """The attached DDP wrapper, or ``None``."""
        return self.backend.wrapper if self.backend.kind == "ddp" else None  # type: ignore[return-value]

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The process group of the attached wrapper (``None``: no wrapper)."""
        return self.backend.process_group

    def _distributed(self) -> bool:
        return is_distributed(self.process_group)

    # ------------------------------------------------------------ queries
    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        """The schedule's phase at ``step`` / ``epoch`` (pure; switches nothing)."""
        return self.schedule.phase_at(step, epoch)

    def trainable_names(self, phase: Phase) -> frozenset[str]:
        return self.groups.trainable_param_names(phase.trainable)

    def allreduce_bytes_per_step(self) -> int:
        """Bytes the current reducer all-reduces per optimizer step (0 without DDP)."""
        return self.backend.reduced_bytes_per_step()

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
            return None
        return self.switch(phase, step=step, epoch=epoch)

    def switch(self, phase: Phase, *, step: Optional[int] = None, epoch: Optional[int] = None) -> SwitchRecord:
        """Apply ``phase`` now, as one collective transaction (see the module docstring)."""
        return self._transaction(phase, step, epoch, self._precondition_error())

    def _transaction(
        self, phase: Phase, step: Optional[int], epoch: Optional[int], local_error: Optional[str]
    ) -> SwitchRecord:
        started = time.perf_counter()
        agree(self.process_group if self._distributed() else None, phase, step, local_error)

        trainable = self.trainable_names(phase)
        before = {name: p.requires_grad for name, p in self.groups.all_named_params()}
        offloaded_before = self.residency.offloaded
        snapshot = self.backend.snapshot()
        failure: Optional[BaseException] = None
        moved = 0
        try:
            moved = self.residency.apply(self.residency.non_resident(phase),
                                         keep_state_off=self._state_stays_off(phase))
            self._apply_flags(trainable)
            self.backend.apply(self.residency.ignore_names())
        except Exception as exc:  # roll back locally, then tell every rank
            failure = exc
        if any_rank_failed(self.process_group if self._distributed() else None, failure is not None):
            self._rollback(before, offloaded_before, snapshot)
            reason = f"{type(failure).__name__}: {failure}" if failure else "it failed on another rank"
            raise SwitchError(
                f"phase switch to {phase.name!r} at step {step} failed ({reason}); the previous "
                "trainable set and DDP reducer were restored on every rank"
            ) from failure

        synced = self.residency.sync_returning(self.process_group) if self._distributed() else 0
        self.residency.install_guards(phase.name)
        grouped = optimizer_of(self.optimizer) if self.optimizer is not None else None
        if isinstance(grouped, GroupedOptimizer):  # also inside an AcceleratedOptimizer
            grouped.set_active(phase.trainable)
        plan = self.buffer_sync.apply(self.module, trainable, ddp=self.ddp,
                                      ignore=self.residency.ignore_names())
        if self.release:
            # No barrier: `any_rank_failed` above is an all-reduce every rank just passed.
            release_memory(barrier=False, full_gc=self.full_gc, trim=self.trim)
        self.current = phase
        self.prefetcher.switched(self, phase)
        self.prefetcher.maybe_start(self, step, epoch)
        record = SwitchRecord(
            step=step,
            epoch=epoch,
            phase=phase.name,
            trainable_groups=tuple(sorted(phase.trainable)),
            trainable_params=sum(p.numel() for n, p in self.groups.all_named_params() if n in trainable),
            trainable_bytes=sum(p.numel() * p.element_size()
                                for n, p in self.groups.all_named_params() if n in trainable),
            allreduce_bytes_per_step=self.allreduce_bytes_per_step(),
            rebuilt_ddp=self.ddp is not None,
            seconds=time.perf_counter() - started,
            moved_bytes=moved,
            offloaded_bytes=self.residency.offloaded_bytes(),
            synced_bytes=synced,
            buffer_broadcast_bytes=plan.bytes_per_forward,
            buffer_broadcast_saved_bytes=plan.saved_bytes_per_forward,
        )
        self.records.append(record)
        return record

    # ------------------------------------------------------------ internals
    def _precondition_error(self) -> Optional[str]:
        return self.backend.precondition_error() or self._pending_grads_error()

    def _pending_grads_error(self) -> Optional[str]:
        pending = [n for n, p in self.groups.all_named_params()
                   if p.grad is not None and bool(p.grad.ne(0).any())]
        if pending:
            return (f"{len(pending)} parameters hold pending gradients (e.g. {pending[:3]}): "
                    "call optimizer.step() and optimizer.zero_grad(set_to_none=True) before switching")
        return None

    def _apply_flags(self, trainable: frozenset[str]) -> None:
        for name, param in self.groups.all_named_params():
            param.grad = None
            param.requires_grad_(name in trainable)

    def _rollback(
        self,
        before: Mapping[str, bool],
        offloaded: Optional[frozenset[str]] = None,
        snapshot: Any = None,
    ) -> None:
        if offloaded is not None:
            try:
                keep_off = self._state_stays_off(self.current) if self.current is not None else None
                self.residency.apply(offloaded, keep_state_off=keep_off or (lambda group: False))
            except Exception as exc:
                raise SwitchError(
                    "phase switch failed and moving parameters back to their previous devices "
                    f"failed too ({type(exc).__name__}: {exc}); restart from the last checkpoint"
                ) from exc
        for name, param in self.groups.all_named_params():
            param.grad = None
            param.requires_grad_(before[name])
        try:
            self.backend.restore(snapshot)
        except Exception as exc:
            raise SwitchError(
                f"phase switch failed and restoring the previous {self.backend.kind} wrapper failed too "
                f"({type(exc).__name__}: {exc}); the wrapper is unusable, restart from the last checkpoint"
            ) from exc

    def _state_stays_off(self, phase: Phase) -> Callable[[str], bool]:
        """Whether a group's optimizer state stays off the device in ``phase`` (its idle policy)."""
        opt = optimizer_of(self.optimizer) if self.optimizer is not None else None
        if not isinstance(opt, GroupedOptimizer):
            return lambda group: False
        return lambda group: group not in phase.trainable and opt.policies.get(group, "keep") != "keep"

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

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The schedule's state and the current phase (for checkpoints)."""
        return {
            "schedule": self.schedule.state_dict(),
            "phase": None if self.current is None else sorted(self.current.trainable),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Check the saved schedule matches this one (the phase itself follows the step)."""
        try:
            self.schedule.load_state_dict(state["schedule"])
        except AltParamsError:
            raise
        except KeyError as exc:
            raise SwitchError(f"switcher state is missing {exc}; expected keys ['schedule', 'phase']") from exc
