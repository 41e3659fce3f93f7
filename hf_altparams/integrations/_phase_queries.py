"""What a training loop asks a phased run: the phase, the task, and a visit to an absent group.

Shared by :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` and
:class:`~hf_altparams.integrations.trainer.AlternatingFreeze`: both hold the
engine's :class:`~hf_altparams.engine.PhaseSwitcher` once the run has started
(``switcher``), and both answer from it, so the loop never needs the engine.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Union

from ..errors import AltParamsError, PlanError
from ..plan.phase import Phase

if TYPE_CHECKING:
    from ..engine.switch import PhaseSwitcher

__all__ = ["PhaseQueries"]


class PhaseQueries:
    """``phase``, ``task`` and ``visiting(...)`` for an object that owns a ``switcher``.

    ``_started_by`` names, for error messages, the call that creates the
    switcher (``accelerator.prepare(...)``, ``trainer.train()``).
    """

    switcher: Optional[PhaseSwitcher]
    _started_by = "the run's start"

    @property
    def phase(self) -> Optional[Phase]:
        """The phase that trains now: the one the next forward and backward train.

        ``None`` before the run has started. Read at the top of an iteration,
        it is right whatever the loop's order of ``zero_grad`` / ``backward`` /
        ``step``: a switch happens at the end of the sync-boundary ``step()``
        that completes the previous phase (the Trainer: at ``on_step_end``).
        """
        switcher = getattr(self, "switcher", None)
        return None if switcher is None else switcher.current

    @property
    def task(self) -> Optional[str]:
        """The current task's name under :class:`~hf_altparams.plan.PerTaskCycle` (else ``None``).

        The task's group names joined by ``+`` (``"t0"``, or ``"a+b"`` for a
        task of two groups), as in the schedule, so a multi-task loop can pick
        its data directly: ``batch = next(iterators[accelerator.task])``.
        """
        phase = self.phase
        return None if phase is None else phase.task

    @contextlib.contextmanager
    def visiting(self, groups: Union[str, Iterable[str]]) -> Iterator[None]:
        """Bring non-resident ``groups`` back to the device for the ``with`` block (e.g. to evaluate them).

        Under a schedule whose phases keep only some groups resident
        (``PerTaskCycle``), the other groups live off the device, out of DDP,
        and a forward through them is refused. Inside the block their parameters
        and buffers are back and the forward is allowed; on leaving, they go back
        where they were. Their optimizer state stays where it is and DDP keeps
        ignoring them, so use it for evaluation, under ``torch.no_grad()``. Not
        a collective: a rank may visit alone. Groups that are resident already
        are left as they are.

        Raises:
            AltParamsError: before the run has started (no phase applied yet).
            PlanError: a name that is not one of the groups.

        Example:
            >>> # with torch.no_grad(), accelerator.visiting(["head2"]):
            >>> #     loss2 = model(x, task="head2").mean()
        """
        switcher = getattr(self, "switcher", None)
        if switcher is None:
            raise AltParamsError(
                f"`visiting({groups!r})` was called before {self._started_by}: no phase is applied yet, "
                "so every group is where the model put it; call it after that"
            )
        names = [groups] if isinstance(groups, str) else list(groups)
        if not all(isinstance(n, str) for n in names):
            raise PlanError(f"`groups` must be group names (str), got {groups!r}")
        known = list(switcher.groups.names)
        unknown = sorted(set(names) - set(known))
        if unknown:
            raise PlanError(f"`visiting` got unknown group(s) {unknown}; the groups are {known}")
        with switcher.residency.visiting(names):
            yield
