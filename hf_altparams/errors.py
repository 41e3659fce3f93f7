"""The one exception family of hf_altparams.

Every error the library raises on bad input or a failed switch is an
:class:`AltParamsError`. Messages name the argument, the value received and
what would be accepted, so a user can fix the call without reading our code.
"""

from __future__ import annotations

__all__ = ["AltParamsError", "DriftError", "PlanError", "SwitchError", "UnreachedPhaseError"]


class AltParamsError(Exception):
    """Base class of every error raised by hf_altparams."""


class PlanError(AltParamsError, ValueError):
    """A parameter group or schedule is invalid (raised at construction, before any step)."""


class SwitchError(AltParamsError, RuntimeError):
    """A phase switch was refused or failed; the model and optimizer are left as they were."""


class DriftError(AltParamsError, RuntimeError):
    """The ranks hold different weights (the drift check, :mod:`hf_altparams.engine.drift`).

    Raised on every rank alike, naming the groups and the ranks that differ;
    what it guarded (a checkpoint, the next step) was not done.
    """


class UnreachedPhaseError(AltParamsError, RuntimeError):
    """A training step's loss depends on no trainable parameter of the current phase.

    Raised before the backward (instead of torch's "element 0 of tensors does not
    require grad"), naming the phase, its groups and the likely causes.
    """
