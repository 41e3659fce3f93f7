"""The phase switch: one collective transaction on every rank.

:class:`PhaseSwitcher` owns the run's groups, schedule and (optionally) the
DDP wrapper and optimizer. At a switch it

1. checks the preconditions (optimizer-step boundary, not inside ``no_sync``),
2. checks that every rank asks for the same phase (one small all-reduce; a
   mismatch or a local refusal raises the same error on every rank),
3. clears every gradient (``None``: bucket views must not pin old buckets),
4. flips ``requires_grad`` to the new trainable set,
5. rebuilds the DDP reducer in place (:mod:`hf_altparams.engine._ddp`),
6. re-applies the optimizer's idle-state policy,
7. releases memory (gc, barrier, ``empty_cache``), and
8. records what it did in a :class:`SwitchRecord`.

If step 4 or 5 fails on any rank, every rank restores the previous flags and
reducer and raises :class:`~hf_altparams.errors.SwitchError`.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..errors import AltParamsError, SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from . import _ddp
from .memory import release_memory
from .optim import GroupedOptimizer

__all__ = ["PhaseSwitcher", "SwitchRecord"]


@dataclass(frozen=True)
class SwitchRecord:
    """What one switch did; ``as_log()`` gives flat metrics for trackers."""

    step: Optional[int]
    epoch: Optional[int]
    phase: str
    trainable_groups: tuple[str, ...]
    trainable_params: int
    trainable_bytes: int
    allreduce_bytes_per_step: int
    rebuilt_ddp: bool
    seconds: float

    def as_log(self, prefix: str = "altparams/") -> dict[str, Union[int, float, str]]:
        """Flat ``{name: value}`` metrics (numbers only, plus the phase name)."""
        data = asdict(self)
        data["trainable_groups"] = ",".join(self.trainable_groups)
        data["rebuilt_ddp"] = int(self.rebuilt_ddp)
        return {f"{prefix}{k}": v for k, v in data.items() if v is not None}


def _collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


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
        release: after each switch, run a young-generation gc pass, a barrier,
            ``empty_cache`` and ``malloc_trim`` (:func:`~hf_altparams.engine.release_memory`).
        full_gc: make that gc pass a full collection (80-300 ms with torch and
            transformers imported; a switch's garbage is freed by reference count,
            so this is only for user-side reference cycles).

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
    ) -> None:
        schedule.validate(groups)
        self.groups = groups
        self.schedule = schedule
        self.optimizer = optimizer
        self.release = release
        self.full_gc = full_gc
        self.ddp: Optional[DistributedDataParallel] = None
        self.current: Optional[Phase] = None
        self.records: list[SwitchRecord] = []
        self._names = [name for name, _ in groups.all_named_params()]
        if model is not None:
            self.attach(model)

    # ------------------------------------------------------------ wiring
    @property
    def module(self) -> nn.Module:
        return self.groups.module

    def attach(self, model: nn.Module) -> None:
        """Attach the DDP wrapper built around ``groups.module`` (no-op for a plain module).

        The wrapper must have been built while the current phase was applied
        (``requires_grad`` set); from now on switches re-bucket it in place.
        """
        if not _ddp.is_ddp(model):
            if model is not self.module:
                raise SwitchError(
                    f"`model` ({type(model).__name__}) is neither the grouped module nor a "
                    "DistributedDataParallel around it; build ParamGroups on the model you train"
                )
            return
        if model.module is not self.module:
            raise SwitchError(
                "`model` is a DistributedDataParallel around a different module than the one "
                "ParamGroups was built on; build ParamGroups on `ddp.module` (or before wrapping)"
            )
        _ddp.check_ddp_supported(model)
        self.ddp = model

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return self.ddp.process_group if self.ddp is not None else None

    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1

    # ------------------------------------------------------------ queries
    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        """The schedule's phase at ``step`` / ``epoch`` (pure; switches nothing)."""
        return self.schedule.phase_at(step, epoch)

    def trainable_names(self, phase: Phase) -> frozenset[str]:
        return self.groups.trainable_param_names(phase.trainable)

    def allreduce_bytes_per_step(self) -> int:
        """Bytes the current reducer all-reduces per optimizer step (0 without DDP)."""
        if self.ddp is None:
            return 0
        return sum(p.numel() * p.element_size() for p in _ddp.reduced_parameters(self.ddp))

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
            return None
        return self.switch(phase, step=step, epoch=epoch)

    def switch(self, phase: Phase, *, step: Optional[int] = None, epoch: Optional[int] = None) -> SwitchRecord:
        """Apply ``phase`` now, as one collective transaction (see the module docstring)."""
        started = time.perf_counter()
        self._agree(phase, step, self._precondition_error())

        trainable = self.trainable_names(phase)
        before = {name: p.requires_grad for name, p in self.groups.all_named_params()}
        failure: Optional[BaseException] = None
        try:
            self._apply_flags(trainable)
            if self.ddp is not None:
                _ddp.rebuild_reducer(self.ddp)
        except Exception as exc:  # roll back locally, then tell every rank
            failure = exc
        if self._any_rank_failed(failure is not None):
            self._rollback(before)
            reason = f"{type(failure).__name__}: {failure}" if failure else "it failed on another rank"
            raise SwitchError(
                f"phase switch to {phase.name!r} at step {step} failed ({reason}); the previous "
                "trainable set and DDP reducer were restored on every rank"
            ) from failure

        if isinstance(self.optimizer, GroupedOptimizer):
            self.optimizer.set_active(phase.trainable)
        if self.release:
            release_memory(barrier=self._distributed(), group=self.process_group, full_gc=self.full_gc)
        self.current = phase
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
        )
        self.records.append(record)
        return record

    # ------------------------------------------------------------ internals
    def _precondition_error(self) -> Optional[str]:
        if self.ddp is not None and not self.ddp.require_backward_grad_sync:
            return ("called inside `no_sync()` (a gradient-accumulation window): switch only at "
                    "an optimizer-step boundary, after optimizer.step() and zero_grad()")
        pending = [n for n, p in self.groups.all_named_params()
                   if p.grad is not None and bool(p.grad.ne(0).any())]
        if pending:
            return (f"{len(pending)} parameters hold pending gradients (e.g. {pending[:3]}): "
                    "call optimizer.step() and optimizer.zero_grad(set_to_none=True) before switching")
        return None

    def _agree(self, phase: Phase, step: Optional[int], local_error: Optional[str]) -> None:
        if not self._distributed():
            if local_error:
                raise SwitchError(f"phase switch at step {step} refused: {local_error}")
            return
        group = self.process_group
        code = _digest_int(phase.digest())
        flags = torch.tensor([code, -code, int(local_error is not None)], dtype=torch.int64,
                             device=_collective_device(group))
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        if int(flags[0]) == -int(flags[1]) and int(flags[2]) == 0:
            return
        # Slow path, taken by every rank alike: gather the details for one clear message.
        world = dist.get_world_size(group)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, (phase.name, phase.digest(), local_error), group=group)
        refusals = [f"rank {r}: {e}" for r, (_, _, e) in enumerate(gathered) if e]
        if refusals:
            raise SwitchError(f"phase switch at step {step} refused; " + "; ".join(refusals))
        asked = ", ".join(f"rank {r} -> {name!r}" for r, (name, _, _) in enumerate(gathered))
        raise SwitchError(
            f"ranks disagree on the phase at step {step} ({asked}); every rank must call the "
            "switch with the same step, schedule and seed"
        )

    def _any_rank_failed(self, failed: bool) -> bool:
        if not self._distributed():
            return failed
        group = self.process_group
        flag = torch.tensor([int(failed)], dtype=torch.int64, device=_collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _apply_flags(self, trainable: frozenset[str]) -> None:
        for name, param in self.groups.all_named_params():
            param.grad = None
            param.requires_grad_(name in trainable)

    def _rollback(self, before: Mapping[str, bool]) -> None:
        for name, param in self.groups.all_named_params():
            param.grad = None
            param.requires_grad_(before[name])
        if self.ddp is not None:
            try:
                _ddp.rebuild_reducer(self.ddp)
            except Exception as exc:
                raise SwitchError(
                    "phase switch failed and restoring the previous DDP reducer failed too "
                    f"({type(exc).__name__}: {exc}); the DDP wrapper is unusable, restart from "
                    "the last checkpoint"
                ) from exc

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
