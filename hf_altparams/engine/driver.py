"""Where a phased run is: :class:`PhaseDriver`, the one owner of the schedule position and the phase.

Every question a phased run asks about *where it is* has its answer here, and
nowhere else keeps a copy:

* the schedule position: the optimizer step (``step``) and the epoch;
* the phase applied now (``current``), the phase of the optimizer step just
  taken (``trained``: what an LR scheduler advances) and the groups that have
  trained at least once (``trained_groups``, saved in checkpoints);
* whether a switch is due (:meth:`due`) and which phase comes next
  (:meth:`upcoming`, for prefetch);
* what the training loop did since the last step (:class:`LoopFacts`: a
  backward waiting for its step, forwards through the DDP wrapper, when the
  epoch was last set), which the run's checks read.

The driver decides *when* to switch; the switch itself (flags, reducer,
optimizer state, memory: one collective transaction) is applied by the
``apply`` function it is bound to (:class:`~hf_altparams.engine.PhaseSwitcher`
binds its transaction), and the driver commits the new phase only once that
returned. So the path of an optimizer step to a reducer rebuild is:
``optimizer.step()`` -> :meth:`stepped` -> ``apply`` (the transaction) -> the
backend's ``apply`` (for DDP, the rebuild). ``PhasedAccelerator``,
``AlternatingFreeze`` and a bare ``PhaseSwitcher`` all go through it.

Example:
    >>> from hf_altparams.plan import Alternating, Phase
    >>> applied = []
    >>> driver = PhaseDriver(Alternating(["a", "b"], every=2))
    >>> driver.bind(lambda phase, step, epoch: applied.append((phase.name, step)))
    >>> _ = driver.move_to(0)
    >>> for _ in range(4):
    ...     _ = driver.stepped()
    >>> applied, driver.step, driver.current.name, driver.trained.name
    ([('a', 0), ('b', 2), ('a', 4)], 4, 'a', 'b')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import AltParamsError, PlanError
from ..plan.phase import Phase
from ..plan.schedules import Schedule

__all__ = ["LoopFacts", "PhaseDriver"]

#: Applies a phase (the switch transaction): ``(phase, step, epoch) -> record``; raises on failure,
#: having restored the previous phase on every rank.
ApplyPhase = Callable[[Phase, Optional[int], Optional[int]], Any]


@dataclass
class LoopFacts:
    """What the training loop did since the last optimizer step, as the run's checks need it."""

    #: a backward ran whose gradients wait for a sync-boundary ``optimizer.step()``
    backward_pending: bool = False
    #: forwards of the DDP wrapper that will all-reduce their gradients, since the last step
    syncing_forwards: int = 0
    #: the step at which the epoch was last set (``set_epoch``), and how many times it was
    epoch_set_at: int = 0
    epoch_calls: int = 0


class PhaseDriver:
    """The schedule position and the current phase of one run, and the decision to switch.

    Args:
        schedule: the run's schedule (validated by whoever built the groups).
        set_epoch_call: how the user's loop sets the epoch, for error messages
            (``"accelerator.set_epoch(epoch)"`` under Accelerate).

    The position moves with :meth:`stepped` (one optimizer step done),
    :meth:`move_to` (a position given from outside: the Trainer's global step,
    a resume) and :meth:`set_epoch`; each switches when the schedule's phase
    at the new position differs from :attr:`current`.
    """

    def __init__(self, schedule: Schedule, *, set_epoch_call: str = "set_epoch(epoch)") -> None:
        if not isinstance(schedule, Schedule):
            raise PlanError(f"`schedule` must be an hf_altparams Schedule, got {type(schedule).__name__}: "
                            f"{schedule!r}")
        self.schedule = schedule
        self.set_epoch_call = set_epoch_call
        self.step = 0
        self.epoch = 0
        #: the phase applied now (``None`` before the first switch)
        self.current: Optional[Phase] = None
        #: the phase of the optimizer step just taken (``None`` before the first)
        self.trained: Optional[Phase] = None
        #: every group that trained at least one step (a resumed run starts from the checkpoint's)
        self.trained_groups: set[str] = set()
        self.loop = LoopFacts()
        self._apply: Optional[ApplyPhase] = None
        self._moved: Optional[Callable[[], Any]] = None
        self._clear_grads: Optional[Callable[[], Any]] = None

    def bind(self, apply: ApplyPhase, moved: Optional[Callable[[], Any]] = None,
             clear_grads: Optional[Callable[[], Any]] = None) -> None:
        """Bind the switch transaction that applies a phase (a :class:`PhaseSwitcher` binds its own).

        ``moved`` is called after every move of the position, switch or not
        (the switcher starts its prefetch there); ``clear_grads`` drops the
        gradients an optimizer step just applied, before a switch that
        :meth:`stepped` makes.
        """
        self._apply, self._moved, self._clear_grads = apply, moved, clear_grads

    # ------------------------------------------------------------ queries
    def phase_at(self, step: Optional[int] = None, epoch: Optional[int] = None) -> Phase:
        """The schedule's phase at ``step`` / ``epoch`` (default: the current position); switches nothing."""
        return self.schedule.phase_at(self.step if step is None else step, self.epoch if epoch is None else epoch)

    def due(self) -> Optional[Phase]:
        """The phase to switch to at the current position, or ``None`` when it is :attr:`current`."""
        phase = self.phase_at()
        return None if phase == self.current else phase

    def upcoming(self) -> Optional[Phase]:
        """The phase of the next optimizer step if it differs from :attr:`current` (step schedules)."""
        if self.current is None or self.schedule.unit != "step":
            return None
        phase = self.phase_at(self.step + 1)
        return None if phase == self.current else phase

    # ------------------------------------------------------------ moving
    def stepped(self, step: Optional[int] = None, epoch: Optional[int] = None, *, switch: bool = True) -> Any:
        """One optimizer step was taken: count it (or take ``step``, the caller's count) and switch if due.

        ``epoch``: the caller's epoch, when it keeps one (the Trainer). With
        ``switch=False`` the position moves but no switch is made (the run ends
        here). The gradients that step applied are cleared before a switch (none
        may reach the next phase, whatever the loop's order of ``zero_grad``).
        Returns the switch record, or ``None``.
        """
        if self.current is not None:
            self.trained = self.current
            self.trained_groups |= self.current.trainable
        self.step = self.step + 1 if step is None else int(step)
        if epoch is not None:
            self.epoch = int(epoch)
        self.loop.backward_pending = False
        self.loop.syncing_forwards = 0
        if not switch:
            return None
        due = self.due()
        if self._clear_grads is not None and due is not None:
            self._clear_grads()  # the step applied them; none may reach the next phase
        return self._advance(due)

    def move_to(self, step: int, epoch: Optional[int] = None) -> Any:
        """Set the position (``step``, and ``epoch`` if given) and switch if the phase there differs."""
        self.step = int(step)
        if epoch is not None:
            self.epoch = int(epoch)
        return self._advance(self.due())

    def set_epoch(self, epoch: int) -> Any:
        """The loop entered ``epoch`` (an epoch-unit schedule's position): switch if due."""
        self.epoch = int(epoch)
        self.loop.epoch_set_at = self.step
        self.loop.epoch_calls += 1
        due = self.due()
        if self._clear_grads is not None and not self.loop.backward_pending and due is not None:
            self._clear_grads()  # the last step applied them (a loop that zeroes first still holds them)
        return self._advance(due)

    def switch_to(self, phase: Phase, step: Optional[int] = None, epoch: Optional[int] = None) -> Any:
        """Apply ``phase`` now (whatever the schedule says) and make it :attr:`current`."""
        if self._apply is None:
            raise AltParamsError("the phase driver has no switch bound to apply a phase with (bind one first)")
        record = self._apply(phase, step, epoch)
        self.current = phase
        if self._moved is not None:
            self._moved()
        return record

    def _advance(self, due: Optional[Phase]) -> Any:
        """Switch to ``due`` (the phase :meth:`due` found at the new position), if any."""
        if due is None or self._apply is None:
            if self._moved is not None and self._apply is not None:
                self._moved()
            return None
        if self.loop.backward_pending:
            raise AltParamsError(
                f"the schedule switches to phase {due.name!r} now (step {self.step}, epoch {self.epoch}), but "
                "gradients of a backward still wait for `optimizer.step()` (a gradient-accumulation window is "
                f"open); switching would drop them. Call `{self.set_epoch_call}` at the top of the epoch, before "
                "its first forward.")
        return self.switch_to(due, self.step, self.epoch)

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The position and the groups trained so far (what a resumed run needs)."""
        return {"step": self.step, "epoch": self.epoch, "trained_groups": sorted(self.trained_groups),
                "phase": None if self.current is None else sorted(self.current.trainable)}

    def load_position(self, step: int, epoch: int, trained_groups: Optional[set[str]] = None) -> None:
        """Restore a saved position without switching (the caller then applies the phase there)."""
        self.step, self.epoch = int(step), int(epoch)
        if trained_groups is not None:
            self.trained_groups = set(trained_groups)
        self.loop = LoopFacts(epoch_set_at=self.step, epoch_calls=self.loop.epoch_calls)
