"""The one exception family of hf_altparams, and the causes its errors and warnings carry.

Every error the library raises on bad input or a failed switch is an
:class:`AltParamsError`. Messages name the argument, the value received and
what would be accepted, so a user can fix the call without reading our code.

Every such error also carries its cause (``err.cause``, a :class:`Cause`): the
mistake behind it, set where the error is raised. ``python -m hf_altparams
check`` names a failure by that cause and prints its usual fix; code of one's
own can branch on it instead of on the message, whose wording may change::

    try:
        optimizer.step()
    except AltParamsError as err:
        if err.cause is Cause.TRAINABLE_PARAM_UNUSED:
            ...

A warning about such a mistake is an :class:`AltParamsWarning`, carrying its
cause the same way (``caught.message.cause`` under ``warnings.catch_warnings``).
"""

from __future__ import annotations

from enum import Enum
from typing import Optional, Union

__all__ = [
    "AltParamsError",
    "AltParamsWarning",
    "Cause",
    "DriftError",
    "PlanError",
    "Refusal",
    "SwitchError",
    "UnreachedPhaseError",
    "cause_of",
]


class Cause(str, Enum):
    """Why a run failed: the vocabulary of the library's errors and warnings and of ``check``'s verdict.

    A ``str``: a member compares equal to its id (``Cause.RANKS_DRIFT == "ranks_drift"``), and its id is
    what ``check --json`` prints. Each has a title and a fix in ``hf_altparams.check.verdict.CAUSES``.

    Example:
        >>> Cause("ranks_drift") is Cause.RANKS_DRIFT, str(Cause.RANKS_DRIFT)
        (True, 'ranks_drift')
    """

    # Mistakes in the user's run that the library's errors and warnings name.
    REQUIRES_GRAD_BEHIND_SCHEDULE = "requires_grad_behind_schedule"
    OPTIMIZER_MISSES_PARAMETERS = "optimizer_misses_parameters"
    SCHEDULE_DIFFERS_PER_RANK = "schedule_differs_per_rank"
    RANKS_DRIFT = "ranks_drift"
    TRAINABLE_PARAM_UNUSED = "trainable_param_unused"
    LOSS_REACHES_NO_TRAINABLE = "loss_reaches_no_trainable"
    RANK_LOST = "rank_lost"
    SETUP_REFUSED = "setup_refused"
    STRATEGY_REFUSED = "strategy_refused"
    OUT_OF_MEMORY = "out_of_memory"
    # What ``check`` measures rather than catches.
    MEMORY_GROWS = "memory_grows"
    MEMORY_GROWS_PER_STEP = "memory_grows_per_step"
    MEMORY_OVER_PLAN = "memory_over_plan"
    IDLE_STATE_HELD = "idle_state_held"
    IDLE_GROUP_CHANGED = "idle_group_changed"
    BYTES_MISMATCH = "bytes_mismatch"
    UNSEEDED_SETUP = "unseeded_setup"
    # How ``check`` itself ran.
    DEADLINE = "deadline"
    INTERRUPTED = "interrupted"
    WONT_FIT = "wont_fit"
    LAUNCH_STARTS_ONE_PROCESS = "launch_starts_one_process"
    # None of the above: the message says what happened.
    ERROR = "error"

    def __str__(self) -> str:
        return self.value


class Refusal(str):
    """A refusal's message that knows its cause: a ``str`` wherever a message goes, with ``.cause``.

    What a precondition returns when it refuses (a switch's ``local_error``): the
    text travels through the switch's collectives (pickled, it keeps its cause)
    and becomes an error's message; an :class:`AltParamsError` built on it takes
    its cause. Joining or formatting it makes a plain ``str``: whoever combines
    refusals names the cause of the result.

    Example:
        >>> reason = Refusal("2 parameters got no gradient", Cause.TRAINABLE_PARAM_UNUSED)
        >>> reason == "2 parameters got no gradient", SwitchError(reason).cause
        (True, <Cause.TRAINABLE_PARAM_UNUSED: 'trainable_param_unused'>)
    """

    cause: Cause

    def __new__(cls, text: str, cause: Union[Cause, str]) -> Refusal:
        made = super().__new__(cls, text)
        made.cause = Cause(cause)
        return made

    def __reduce__(self) -> tuple[type[Refusal], tuple[str, str]]:
        return type(self), (str(self), self.cause.value)


def cause_of(text: Optional[str], default: Cause = Cause.ERROR) -> Cause:
    """The cause a message carries (a :class:`Refusal`'s), else ``default``."""
    return text.cause if isinstance(text, Refusal) else default


class AltParamsError(Exception):
    """Base class of every error raised by hf_altparams; ``cause`` names the mistake (:class:`Cause`).

    ``cause=`` where it is raised; without it, a :class:`Refusal` message brings its
    own, else the class's default (:data:`Cause.ERROR` here).
    """

    cause: Cause = Cause.ERROR

    def __init__(self, *args: object, cause: Optional[Union[Cause, str]] = None) -> None:
        super().__init__(*args)
        if cause is not None:
            self.cause = Cause(cause)
        elif args and isinstance(args[0], Refusal):
            self.cause = args[0].cause


class PlanError(AltParamsError, ValueError):
    """A parameter group or schedule is invalid (raised at construction, before any step)."""

    cause = Cause.SETUP_REFUSED


class SwitchError(AltParamsError, RuntimeError):
    """A phase switch was refused or failed; the model and optimizer are left as they were."""


class DriftError(AltParamsError, RuntimeError):
    """The ranks hold different weights (the drift check, :mod:`hf_altparams.engine.drift`).

    Raised on every rank alike, naming the groups and the ranks that differ;
    what it guarded (a checkpoint, the next step) was not done.
    """

    cause = Cause.RANKS_DRIFT


class UnreachedPhaseError(AltParamsError, RuntimeError):
    """A training step's loss depends on no trainable parameter of the current phase.

    Raised before the backward (instead of torch's "element 0 of tensors does not
    require grad"), naming the phase, its groups and the likely causes.
    """

    cause = Cause.LOSS_REACHES_NO_TRAINABLE


class AltParamsWarning(UserWarning):
    """A warning of hf_altparams about a mistake in the run, naming it (``cause``).

    The library mended what it warns about this time; the code that caused it
    will do it again. ``warnings.filterwarnings("error", category=AltParamsWarning)``
    turns these into errors.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warnings.warn(AltParamsWarning("flags put back", Cause.REQUIRES_GRAD_BEHIND_SCHEDULE))
        >>> caught[0].category.__name__, caught[0].message.cause
        ('AltParamsWarning', <Cause.REQUIRES_GRAD_BEHIND_SCHEDULE: 'requires_grad_behind_schedule'>)
    """

    def __init__(self, message: str, cause: Union[Cause, str]) -> None:
        super().__init__(message)
        self.cause = Cause(cause)

    def __reduce__(self) -> tuple[type[AltParamsWarning], tuple[str, str]]:
        return type(self), (str(self), self.cause.value)
