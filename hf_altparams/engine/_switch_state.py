"""The phase switcher's queries, placement re-application and checkpoint state.

:class:`SwitcherState` is the part of :class:`~hf_altparams.engine.switch.PhaseSwitcher`
that runs no transaction: what is attached (the DDP wrapper, its process group),
what the schedule says (phase at a step, trainable names, bytes reduced per
step, the switch records), putting parameters and optimizer state back where
the current phase wants them after something moved them wholesale, and the
``state_dict`` / ``load_state_dict`` pair for checkpoints. The transaction
itself (and ``attach``, which may run one) stays in :mod:`.switch`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..errors import AltParamsError, SwitchError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from ._collective import is_distributed
from ._transfer import optimizer_of
from .backend import Backend
from .drift import DriftCheck, check_drift
from .optim import GroupedOptimizer, reapply_state_policy
from .records import SwitchHistory, SwitchRecord
from .residency import ResidencyManager

__all__ = ["SwitcherState"]


class SwitcherState:
    """Queries, placement and checkpoint state of :class:`~hf_altparams.engine.switch.PhaseSwitcher` (a mixin).

    The switcher sets every attribute annotated here in its ``__init__``.
    """

    groups: ParamGroups
    schedule: Schedule
    optimizer: Optional[Optimizer]
    backend: Backend
    current: Optional[Phase]
    history: SwitchHistory
    residency: ResidencyManager
    drift: DriftCheck
    _ranks_met: bool

    # ------------------------------------------------------------ wiring
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

    def check_weights(self, when: str, refused: str = "", timeout: Optional[float] = None) -> None:
        """The drift check (:func:`~hf_altparams.engine.drift.check_drift`) now: a collective, on every rank.

        Compares every parameter's digest across the ranks that must agree (the
        DDP wrapper's process group; otherwise the world) and raises the same
        :class:`~hf_altparams.errors.DriftError` on every rank when they differ.
        The integrations call it before each checkpoint unless ``drift_check=False``.
        """
        group = self.process_group if self.backend.kind == "ddp" else None
        check_drift(self.groups, group, when=when, refused=refused, timeout=timeout)

    # ------------------------------------------------------------ internals
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
        self._ranks_met = False  # a resume: ranks finish loading apart (see collective_timeout)
        try:
            self.schedule.load_state_dict(state["schedule"])
        except AltParamsError:
            raise
        except KeyError as exc:
            raise SwitchError(f"switcher state is missing {exc}; expected keys ['schedule', 'phase']") from exc
