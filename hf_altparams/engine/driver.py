"""Where a phased run is: :class:`PhaseDriver`, the one owner and the one writer of the position and the phase.

Every question a phased run asks about *where it is* has its answer here, and
nowhere else keeps a copy:

* the schedule position: the optimizer step (:attr:`~PhaseDriver.step`) and the epoch;
* the phase applied now (:attr:`~PhaseDriver.current`), the phase of the
  optimizer step just taken (:attr:`~PhaseDriver.trained`) and the groups that
  have trained at least once (:attr:`~PhaseDriver.trained_groups`; every
  checkpoint format saves it through :meth:`~PhaseDriver.state`);
* whether a switch is due (:meth:`~PhaseDriver.due`) and which phase comes
  next (:meth:`~PhaseDriver.upcoming`, for prefetch);
* what the training loop did since the last step (a backward waiting for its
  step, forwards through the DDP wrapper, when the epoch was last set), which
  the run's checks read.

Every field is read-only from outside; it changes only through the driver's
methods (:meth:`~PhaseDriver.stepped`, :meth:`~PhaseDriver.move_to`,
:meth:`~PhaseDriver.set_epoch`, :meth:`~PhaseDriver.restore`, the ``note_*``
methods). The driver decides *when* to switch; the switch itself (flags,
reducer, optimizer state, memory: one collective transaction) is applied by
the :class:`PhaseApplier` it is bound to (a
:class:`~hf_altparams.engine.PhaseSwitcher`), and the driver commits the new
phase only once that returned. The path of an optimizer step to a reducer
rebuild is: ``optimizer.step()`` -> :meth:`~PhaseDriver.stepped` ->
:meth:`PhaseApplier.apply_phase` (the transaction) -> the backend's ``apply``
(for DDP, the rebuild). ``PhasedAccelerator``, ``AlternatingFreeze`` and a bare
``PhaseSwitcher`` all go through it.

Example:
    >>> from hf_altparams.plan import Alternating, Phase
    >>> applied = []
    >>> class Recorder:  # what a PhaseSwitcher does, reduced to a record of the phases applied
    ...     def apply_phase(self, phase, step, epoch): applied.append((phase.name, step))
    ...     def position_moved(self): pass
    ...     def drop_applied_gradients(self): pass
    >>> driver = PhaseDriver(Alternating(["a", "b"], every=2))
    >>> driver.bind(Recorder())
    >>> _ = driver.move_to(0)
    >>> for _ in range(4):
    ...     _ = driver.stepped()
    >>> applied, driver.step, driver.current.name, driver.trained.name
    ([('a', 0), ('b', 2), ('a', 4)], 4, 'a', 'b')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Protocol

from ..errors import AltParamsError, PlanError
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from .records import SwitchRecord

__all__ = ["DriverState", "PhaseApplier", "PhaseDriver", "PhaseSource"]


class PhaseApplier(Protocol):
    """What applies a phase for a :class:`PhaseDriver` (a :class:`~hf_altparams.engine.PhaseSwitcher`)."""

    def apply_phase(self, phase: Phase, step: Optional[int], epoch: Optional[int]) -> Optional[SwitchRecord]:
        """One switch into ``phase`` on every rank; raises on failure, the previous phase restored everywhere."""

    def position_moved(self) -> None:
        """Called after every move of the position, switch or not (prefetch, the every-N drift check)."""

    def drop_applied_gradients(self) -> None:
        """Drop the gradients an optimizer step just applied (before a switch that step triggers)."""


class PhaseSource(Protocol):
    """Anything that says which phase is applied now (a :class:`PhaseDriver`; standalone objects keep their own)."""

    @property
    def current(self) -> Optional[Phase]:
        """The phase applied now (``None`` before the first)."""


@dataclass(frozen=True)
class DriverState:
    """What a checkpoint keeps of a driver: the position and the groups trained so far.

    Example:
        >>> state = DriverState(step=7, epoch=1, trained_groups=("a", "b"))
        >>> DriverState.from_dict(state.as_dict()) == state
        True
    """

    step: int
    epoch: int
    trained_groups: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``step``, ``epoch``, ``trained_groups``)."""
        return {"step": self.step, "epoch": self.epoch, "trained_groups": list(self.trained_groups)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DriverState:
        """The state :meth:`as_dict` wrote (a checkpoint without ``trained_groups`` gives none)."""
        try:
            return cls(int(data["step"]), int(data["epoch"]), tuple(sorted(data.get("trained_groups", ()))))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(
                f"a saved schedule position must hold integer `step` and `epoch`, got {dict(data)!r}"
            ) from exc


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
            raise PlanError(f"`schedule` must be an hf_altparams Schedule, got {type(schedule).__name__}: {schedule!r}")
        self._schedule = schedule
        self._set_epoch_call = set_epoch_call
        self._step = 0
        self._epoch = 0
        self._current: Optional[Phase] = None
        self._trained: Optional[Phase] = None
        self._trained_groups: frozenset[str] = frozenset()
        # what the loop did since the last optimizer step
        self._backward_pending = False
        self._syncing_forwards = 0
        self._epoch_set_at = 0
        self._epoch_calls = 0
        self._applier: Optional[PhaseApplier] = None

    # ------------------------------------------------------------ read-only state
    @property
    def schedule(self) -> Schedule:
        return self._schedule

    @property
    def step(self) -> int:
        """Optimizer steps taken (the schedule's position)."""
        return self._step

    @property
    def epoch(self) -> int:
        """The epoch last set (or restored)."""
        return self._epoch

    @property
    def current(self) -> Optional[Phase]:
        """The phase applied now (``None`` before the first switch)."""
        return self._current

    @property
    def trained(self) -> Optional[Phase]:
        """The phase of the optimizer step just taken (``None`` before the first): what an LR schedule advances."""
        return self._trained

    @property
    def trained_groups(self) -> frozenset[str]:
        """Every group that trained at least one step (a resumed run starts from the checkpoint's)."""
        return self._trained_groups

    @property
    def backward_pending(self) -> bool:
        """A backward ran whose gradients wait for a sync-boundary ``optimizer.step()``."""
        return self._backward_pending

    @property
    def syncing_forwards(self) -> int:
        """Forwards of the DDP wrapper that will all-reduce their gradients, since the last step."""
        return self._syncing_forwards

    @property
    def epoch_set_at(self) -> int:
        """The step at which the epoch was last set."""
        return self._epoch_set_at

    @property
    def epoch_calls(self) -> int:
        """How many times the loop set the epoch."""
        return self._epoch_calls

    @property
    def set_epoch_call(self) -> str:
        """How the user's loop sets the epoch (for messages)."""
        return self._set_epoch_call

    def bind(self, applier: PhaseApplier) -> None:
        """Bind what applies a phase (a :class:`~hf_altparams.engine.PhaseSwitcher` binds itself)."""
        self._applier = applier

    # ------------------------------------------------------------ queries
    def phase_at(self, step: Optional[int] = None, epoch: Optional[int] = None) -> Phase:
        """The schedule's phase at ``step`` / ``epoch`` (default: the current position); switches nothing."""
        return self._schedule.phase_at(self._step if step is None else step, self._epoch if epoch is None else epoch)

    def due(self) -> Optional[Phase]:
        """The phase to switch to at the current position, or ``None`` when it is :attr:`current`."""
        phase = self.phase_at()
        return None if phase == self._current else phase

    def upcoming(self) -> Optional[Phase]:
        """The phase of the next optimizer step if it differs from :attr:`current` (step schedules)."""
        if self._current is None or self._schedule.unit != "step":
            return None
        phase = self.phase_at(self._step + 1)
        return None if phase == self._current else phase

    def state(self) -> DriverState:
        """The position and the groups trained so far, as every checkpoint format saves them."""
        return DriverState(self._step, self._epoch, tuple(sorted(self._trained_groups)))

    # ------------------------------------------------------------ what the loop did
    def note_backward(self) -> None:
        """A backward ran; its gradients wait for a sync-boundary ``optimizer.step()``."""
        self._backward_pending = True

    def note_syncing_forward(self) -> None:
        """A forward of the DDP wrapper ran that will all-reduce its gradients."""
        self._syncing_forwards += 1

    def gradients_dropped(self) -> None:
        """A sync-boundary ``zero_grad()``: nothing waits for a step any more."""
        self._backward_pending = False

    def forwards_checked(self) -> None:
        """The step's loop check read :attr:`syncing_forwards`; count afresh."""
        self._syncing_forwards = 0

    # ------------------------------------------------------------ moving
    def stepped(
        self, step: Optional[int] = None, epoch: Optional[int] = None, *, switch: bool = True
    ) -> Optional[SwitchRecord]:
        """One optimizer step was taken: count it (or take ``step``, the caller's count) and switch if due.

        ``epoch``: the caller's epoch, when it keeps one (the Trainer). With
        ``switch=False`` the position moves but no switch is made (the run ends
        here). The gradients that step applied are dropped before a switch (none
        may reach the next phase, whatever the loop's order of ``zero_grad``).
        Returns the switch record, or ``None``.
        """
        if self._current is not None:
            self._trained = self._current
            self._trained_groups = self._trained_groups | self._current.trainable
        self._step = self._step + 1 if step is None else int(step)
        if epoch is not None:
            self._epoch = int(epoch)
        self._backward_pending = False
        self._syncing_forwards = 0
        if not switch:
            return None
        due = self.due()
        if self._applier is not None and due is not None:
            self._applier.drop_applied_gradients()  # the step applied them; none may reach the next phase
        return self._advance(due)

    def move_to(self, step: int, epoch: Optional[int] = None) -> Optional[SwitchRecord]:
        """Set the position (``step``, and ``epoch`` if given) and switch if the phase there differs."""
        self._step = int(step)
        if epoch is not None:
            self._epoch = int(epoch)
        return self._advance(self.due())

    def set_epoch(self, epoch: int) -> Optional[SwitchRecord]:
        """The loop entered ``epoch`` (an epoch-unit schedule's position): switch if due.

        Before anything is bound (``PhasedAccelerator.set_epoch`` before ``prepare``)
        only the position moves.
        """
        self._epoch = int(epoch)
        self._epoch_set_at = self._step
        self._epoch_calls += 1
        due = self.due()
        if self._applier is not None and not self._backward_pending and due is not None:
            self._applier.drop_applied_gradients()  # the last step applied them (a loop that zeroes first)
        return self._advance(due)

    def switch_to(
        self, phase: Phase, step: Optional[int] = None, epoch: Optional[int] = None
    ) -> Optional[SwitchRecord]:
        """Apply ``phase`` now (whatever the schedule says) and make it :attr:`current`."""
        if self._applier is None:
            raise AltParamsError("the phase driver has nothing bound to apply a phase with (bind a switcher first)")
        record = self._applier.apply_phase(phase, step, epoch)
        self._current = phase
        self._applier.position_moved()
        return record

    def restore(self, state: DriverState) -> None:
        """Take a saved position and trained groups without switching (the caller then applies the phase there).

        The epoch counts as set at the restored step.
        """
        self._step, self._epoch = int(state.step), int(state.epoch)
        self._trained_groups = frozenset(state.trained_groups)
        self._backward_pending = False
        self._syncing_forwards = 0
        self._epoch_set_at = self._step

    def _advance(self, due: Optional[Phase]) -> Optional[SwitchRecord]:
        """Switch to ``due`` (the phase :meth:`due` found at the new position), if any."""
        if self._applier is None:
            return None
        if due is None:
            self._applier.position_moved()
            return None
        if self._backward_pending:
            raise AltParamsError(
                f"the schedule switches to phase {due.name!r} now (step {self._step}, epoch {self._epoch}), but "
                "gradients of a backward still wait for `optimizer.step()` (a gradient-accumulation window is "
                f"open); switching would drop them. Call `{self._set_epoch_call}` at the top of the epoch, before "
                "its first forward."
            )
        return self.switch_to(due, self._step, self._epoch)
