"""Undoing a switch on the slow path: the rollback, and re-synchronising a rank that refused.

Used by :class:`~hf_altparams.engine.PhaseSwitcher` when the settling
all-reduce reports a disagreement, a refusal or a failure (``docs/switch.md``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from torch import nn

from ..errors import SwitchError
from .backend import Backend
from .memory._residency import ResidencyManager

__all__ = ["resync_refusing", "rollback"]


def rollback(
    residency: ResidencyManager,
    backend: Backend,
    params: Sequence[nn.Parameter],
    before: Sequence[bool],
    offloaded: Optional[frozenset[str]],
    snapshot: Any,
    keep_state_off: Callable[[str], bool],
) -> None:
    """Put residency, ``requires_grad`` flags and the wrapper back as they were before the switch."""
    if offloaded is not None:
        try:
            residency.apply(offloaded, keep_state_off=keep_state_off)
        except Exception as exc:
            raise SwitchError(
                "phase switch failed and moving parameters back to their previous devices "
                f"failed too ({type(exc).__name__}: {exc}); restart from the last checkpoint"
            ) from exc
    for param, flag in zip(params, before):
        param.grad = None
        param.requires_grad_(flag)
    try:
        backend.restore(snapshot)
    except Exception as exc:
        raise SwitchError(
            f"phase switch failed and restoring the previous {backend.kind} wrapper failed too "
            f"({type(exc).__name__}: {exc}); the wrapper is unusable, restart from the last checkpoint"
        ) from exc


def resync_refusing(backend: Backend, params: Sequence[nn.Parameter], snapshot: Any) -> None:
    """On a rank that refused while others applied and rolled back: rebuild the wrapper too.

    Every other rank now has a freshly rebuilt wrapper (for DDP: a reducer that
    re-buckets, with a broadcast, after its first iteration); this rank must
    match it, keeping its pending gradients (the refusal changed nothing else).
    Without it, the next steps pair mismatched collectives and hang.
    """
    grads = [param.grad for param in params]
    try:
        backend.restore(snapshot)
    except Exception as exc:
        raise SwitchError(
            f"phase switch refused and re-synchronising this rank's {backend.kind} wrapper with the "
            f"other ranks failed ({type(exc).__name__}: {exc}); restart from the last checkpoint"
        ) from exc
    for param, grad in zip(params, grads):
        param.grad = grad
