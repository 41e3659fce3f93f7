"""The switch's collectives: every rank agrees on the phase, and learns whether any rank failed.

:func:`settle` does both in ONE small all-reduce (the switch's fast path, for
backends whose apply runs no collective; see ``docs/switch.md``); :func:`agree`
and :func:`any_rank_failed` are the two-step form for the other backends. A
disagreement, a refusal or a failure takes a slow path that every rank takes
alike (an ``all_gather_object`` of the details), so every rank raises the very
same :class:`~hf_altparams.errors.SwitchError`.
"""

from __future__ import annotations

import hashlib
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..errors import SwitchError
from ..plan.phase import Phase

__all__ = ["agree", "any_rank_failed", "collective_device", "is_distributed", "settle"]


def is_distributed(group: Optional[dist.ProcessGroup]) -> bool:
    """True when ``group`` (default: the world) spans more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a collective's tensor must live for ``group``'s backend (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _digest_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def agree(group: Optional[dist.ProcessGroup], phase: Phase, step: Optional[int],
          local_error: Optional[str]) -> None:
    """Raise the same :class:`SwitchError` on every rank unless all ask for ``phase`` and none refuses.

    Single process: raises only for ``local_error``.
    """
    if not is_distributed(group):
        if local_error:
            raise SwitchError(f"phase switch at step {step} refused: {local_error}")
        return
    code = _digest_int(phase.digest())
    flags = torch.tensor([code, -code, int(local_error is not None)], dtype=torch.int64,
                         device=collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0]) == -int(flags[1]) and int(flags[2]) == 0:
        return
    # Slow path, taken by every rank alike: gather the details for one clear message.
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (repr(phase), local_error, step), group=group)
    # Built from gathered data only, so every rank raises the very same message.
    steps = sorted({s for _, _, s in gathered}, key=str)
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    refusals = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(gathered) if e]
    if refusals:
        raise SwitchError(f"phase switch at {where} refused; " + "; ".join(refusals))
    asked = ", ".join(f"rank {r} -> {p} at step {s}" for r, (p, _, s) in enumerate(gathered))
    raise SwitchError(
        f"ranks disagree on the phase at {where} ({asked}); every rank must call the "
        "switch with the same step, schedule and seed"
    )


def any_rank_failed(group: Optional[dist.ProcessGroup], failed: bool) -> bool:
    """Whether ``failed`` is true on any rank (an all-reduce; the switch's closing barrier)."""
    if not is_distributed(group):
        return failed
    flag = torch.tensor([int(failed)], dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def settle(group: Optional[dist.ProcessGroup], phase: Phase, step: Optional[int],
           local_error: Optional[str], failure: Optional[str]) -> tuple[Optional[str], bool]:
    """One all-reduce: did every rank ask for ``phase``, none refuse and none fail?

    Returns ``(None, False)`` when so, else ``(message, every rank refused)``:
    the message of the error every rank must raise, the same text on every rank
    (built from gathered details only).
    ``local_error`` is this rank's refusal (it applied nothing), ``failure``
    its failed attempt (already rolled back locally). Single process: the
    local refusal or failure, if any.

    The vector ``[digest, -digest, refused, failed]`` is all-reduced with MAX:
    the digests agree exactly when ``max == -max(-digest) == min``.
    """
    if not is_distributed(group):
        if local_error:
            return f"phase switch at step {step} refused: {local_error}", True
        if failure:
            return _failure_message(phase, step, [failure]), False
        return None, False
    code = _digest_int(phase.digest())
    flags = torch.tensor([code, -code, int(local_error is not None), int(failure is not None)],
                         dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0]) == -int(flags[1]) and int(flags[2]) == 0 and int(flags[3]) == 0:
        return None, False
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (repr(phase), local_error, step, failure), group=group)
    steps = sorted({s for _, _, s, _ in gathered}, key=str)
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    refusals = [f"rank {r}: {e}" for r, (_, e, _, _) in enumerate(gathered) if e]
    if refusals:
        return f"phase switch at {where} refused; " + "; ".join(refusals), len(refusals) == world
    if len({p for p, _, _, _ in gathered}) > 1:
        asked = ", ".join(f"rank {r} -> {p} at step {s}" for r, (p, _, s, _) in enumerate(gathered))
        return (f"ranks disagree on the phase at {where} ({asked}); every rank must call the "
                "switch with the same step, schedule and seed"), False
    return _failure_message(phase, step, [f"rank {r}: {f}" for r, (_, _, _, f) in enumerate(gathered) if f]), False


def _failure_message(phase: Phase, step: Optional[int], reasons: list[str]) -> str:
    return (f"phase switch to {phase.name!r} at step {step} failed ({'; '.join(reasons)}); the previous "
            "trainable set and DDP reducer were restored on every rank")
