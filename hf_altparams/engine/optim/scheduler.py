"""One LR schedule per group of a :class:`~hf_altparams.engine.GroupedOptimizer`: :class:`GroupedLRScheduler`.

It keeps one torch LR scheduler per group and advances only the groups that
stepped, so a group's schedule pauses while it is idle. Import it from
:mod:`hf_altparams.engine.optim` or from :mod:`hf_altparams.engine`.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Mapping, Union

from torch.optim import Optimizer

from ...errors import PlanError
from .grouped import GroupedOptimizer

__all__ = ["GroupedLRScheduler", "SchedulerFactory"]

SchedulerFactory = Callable[[Optimizer], Any]


class GroupedLRScheduler:
    """One LR scheduler per group of a :class:`GroupedOptimizer`.

    Args:
        optimizer: the grouped optimizer.
        schedulers: a factory ``inner_optimizer -> LRScheduler`` for every group,
            or a mapping group name -> factory (groups left out keep a constant LR).
        advance_idle: if ``False`` (default), a group's schedule advances only on
            steps where the group is active, so it resumes where it paused; if
            ``True``, every group's schedule advances every step (wall-clock
            schedules).

    Example:
        >>> # sched = GroupedLRScheduler(opt, lambda o: torch.optim.lr_scheduler.StepLR(o, 10))
        >>> # after opt.step(): sched.step()
    """

    def __init__(
        self,
        optimizer: GroupedOptimizer,
        schedulers: Union[SchedulerFactory, Mapping[str, SchedulerFactory]],
        *,
        advance_idle: bool = False,
    ) -> None:
        if not isinstance(optimizer, GroupedOptimizer):
            raise PlanError(
                f"GroupedLRScheduler: `optimizer` is {type(optimizer).__name__}; a GroupedOptimizer is required"
            )
        self.optimizer = optimizer
        self.advance_idle = advance_idle
        if isinstance(schedulers, Mapping):
            unknown = sorted(set(schedulers) - set(optimizer.inner))
            if unknown:
                raise PlanError(f"`schedulers` names unknown groups {unknown}; known: {sorted(optimizer.inner)}")
            factories = dict(schedulers)
        else:
            factories = {name: schedulers for name in optimizer.inner}
        self.schedulers = {name: f(optimizer.inner[name]) for name, f in factories.items()}

    def step(self) -> None:
        """Advance the schedules of the active groups (of all groups if ``advance_idle``).

        The groups the optimizer's last ``step()`` stepped advance
        (``optimizer.last_stepped``), not the next phase's when a switch came
        right after the step (``PhasedAccelerator`` switches at the end of
        ``step()``); before any step, the active groups.
        """
        stepped = self.optimizer.last_stepped
        trained = self.optimizer.active if stepped is None else stepped
        for name, sched in self.schedulers.items():
            if self.advance_idle or name in trained:
                with warnings.catch_warnings():
                    # An idle group's optimizer did not step; torch warns about the order.
                    warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*")
                    sched.step()

    def get_last_lr(self) -> list[float]:
        """Current learning rates in ``optimizer.param_groups`` order."""
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {
            "advance_idle": self.advance_idle,
            "schedulers": {n: s.state_dict() for n, s in self.schedulers.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        for name, sched in self.schedulers.items():
            sched.load_state_dict(state_dict["schedulers"][name])
