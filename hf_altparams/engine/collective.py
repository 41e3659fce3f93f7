"""The switch's collectives: every rank agrees on the phase, and learns whether any rank failed.

:func:`settle` does both in ONE small all-gather (the switch's fast path, for
backends whose apply runs no collective; see ``docs/switch.md``); :func:`agree`
and :func:`any_rank_failed` are the two-step form for the other backends. A
disagreement, a refusal or a failure takes a slow path that every rank takes
alike (an ``all_gather_object`` of the details), so every rank raises the very
same :class:`~hf_altparams.errors.SwitchError`.

A rank that died or hangs must not block the others forever: every collective
here waits at most ``timeout`` seconds (the switcher's ``collective_timeout``;
``None``: the process group's own timeout), and a collective that fails or
times out becomes a :class:`SwitchError` naming the switch and the step
(:func:`collective_errors`). The process group is unusable after that: the job
must stop and restart from its latest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from ..errors import Cause, PlanError, Refusal, SwitchError, cause_of
from ..plan.phase import Phase

__all__ = [
    "agree",
    "any_rank_failed",
    "check_timeout",
    "collective_device",
    "collective_errors",
    "gather_rows",
    "is_collective_failure",
    "is_distributed",
    "settle",
]


def is_distributed(group: Optional[dist.ProcessGroup]) -> bool:
    """True when ``group`` (default: the world) spans more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def collective_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """Where a collective's tensor must live for ``group``'s backend (NCCL: the current GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_timeout(timeout: Optional[float]) -> Optional[float]:
    """Validate ``collective_timeout``: ``None`` or a positive number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise PlanError(
            f"`collective_timeout` must be None (the process group's timeout) or a positive "
            f"number of seconds, got {timeout!r}"
        )
    return float(timeout)


class _TimedOut(RuntimeError):
    """A collective of the switch did not complete within ``collective_timeout``."""


def gather_rows(values: list[int], group: Optional[dist.ProcessGroup], timeout: Optional[float]) -> list[list[int]]:
    """Every rank's ``values`` (one row per rank, in rank order): one all-gather of int64.

    An all-gather, not an all-reduce: with two gloo ranks it is one exchange
    instead of a reduce-scatter and an all-gather (0.38-0.44 ms against
    0.52-0.57 ms for the all-reduce on the 2-core dev box, ``benchmarks/RESULTS.md``),
    and each rank's row says who refused or failed. Waits at most ``timeout``
    seconds (``None``: the group's timeout).
    """
    local = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    rows = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    if timeout is None:
        dist.all_gather(rows, local, group=group)
    else:
        work = dist.all_gather(rows, local, group=group, async_op=True)
        try:
            done = work.wait(timeout=datetime.timedelta(seconds=timeout))
        except RuntimeError as exc:  # gloo: "Operation timed out!"; a dead peer: connection closed
            if "timed out" in str(exc).lower():
                raise _TimedOut(str(exc)) from exc
            raise
        if done is False:
            raise _TimedOut("wait returned before completion")
    return torch.stack(rows).tolist()  # one read (one device sync under NCCL), not one per row


@contextlib.contextmanager
def collective_errors(
    phase: Optional[Phase],
    step: Optional[int],
    group: Optional[dist.ProcessGroup],
    timeout: Optional[float],
    what: str = "agreement",
) -> Iterator[None]:
    """Turn a failed or timed-out collective of a switch into a :class:`SwitchError`.

    The message names the phase, the step, this rank and what to do; a dead peer
    (gloo: "Connection closed by peer") fails at once, a stuck one after
    ``timeout`` seconds or the process group's timeout.
    """
    try:
        yield
    except SwitchError:
        raise
    except RuntimeError as exc:  # torch.distributed's errors (DistBackendError, gloo's RuntimeError)
        rank, world = _rank_world(group)
        to = f" to {phase.name!r}" if phase is not None else ""
        head = f"phase switch{to} at step {step}: rank {rank} of {world}"
        tail = (
            "a rank died, hangs or skipped this switch; the process group is unusable now: stop the job "
            "and restart it from the latest complete checkpoint (docs/faults.md)"
        )
        if isinstance(exc, _TimedOut):
            message = (
                f"{head} waited {timeout:g} s (collective_timeout) for the other ranks in the switch's "
                f"{what} and got no answer; {tail}"
            )
        elif "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            message = (
                f"{head}: the other ranks did not answer within the process group's timeout in the "
                f"switch's {what} ({_short(exc)}); {tail}"
            )
        else:
            message = f"{head}: the switch's {what} collective failed ({_short(exc)}); {tail}"
        raise SwitchError(message, cause=Cause.RANK_LOST) from exc


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed or timed-out collective (a dead peer, a timeout, mismatched collectives).

    Example:
        >>> is_collective_failure(RuntimeError("[Gloo] Timed out waiting 5000ms for recv operation to complete"))
        True
        >>> is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
        False
    """
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return any(
        mark in text
        for mark in (
            "gloo",
            "nccl",
            "timed out",
            "connection closed",
            "connection reset",
            "processgroup",
            "broken pipe",
        )
    )


def _rank_world(group: Optional[dist.ProcessGroup]) -> tuple[Any, Any]:
    try:
        return dist.get_rank(), dist.get_world_size(group)
    except Exception:  # the group may be gone
        return "?", "?"


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:300]}"


def _digest_int(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


@functools.lru_cache(maxsize=256)
def _phase_code(phase: Phase) -> int:
    # Per phase (equal phases, equal digest): a switch runs cold after a training
    # step, where hashing the phase again costs ~30 us on the critical path.
    return _digest_int(phase.digest())


def agree(
    group: Optional[dist.ProcessGroup],
    phase: Phase,
    step: Optional[int],
    local_error: Optional[str],
    timeout: Optional[float] = None,
) -> None:
    """Raise the same :class:`SwitchError` on every rank unless all ask for ``phase`` and none refuses.

    Single process: raises only for ``local_error``.
    """
    if not is_distributed(group):
        if local_error:
            raise SwitchError(f"phase switch at step {step} refused: {local_error}", cause=cause_of(local_error))
        return
    code = _phase_code(phase)
    with collective_errors(phase, step, group, timeout):
        rows = gather_rows([code, int(local_error is not None)], group, timeout)
    if all(row == [code, 0] for row in rows):
        return
    # Slow path, taken by every rank alike: gather the details for one clear message.
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    with collective_errors(phase, step, group, None):
        dist.all_gather_object(gathered, (repr(phase), local_error, step), group=group)
    # Built from gathered data only, so every rank raises the very same message.
    steps = sorted({s for _, _, s in gathered}, key=str)
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    refusals = [f"rank {r}: {e}" for r, (_, e, _) in enumerate(gathered) if e]
    if refusals:
        raise SwitchError(
            f"phase switch at {where} refused; " + "; ".join(refusals), cause=_first_cause(e for _, e, _ in gathered)
        )
    asked = ", ".join(f"rank {r} -> {p} at step {s}" for r, (p, _, s) in enumerate(gathered))
    raise SwitchError(
        f"ranks disagree on the phase at {where} ({asked}); every rank must call the "
        "switch with the same step, schedule and seed",
        cause=Cause.SCHEDULE_DIFFERS_PER_RANK,
    )


def any_rank_failed(
    group: Optional[dist.ProcessGroup],
    failed: bool,
    phase: Optional[Phase] = None,
    step: Optional[int] = None,
    timeout: Optional[float] = None,
) -> bool:
    """Whether ``failed`` is true on any rank (an all-gather; the switch's closing barrier)."""
    if not is_distributed(group):
        return failed
    with collective_errors(phase, step, group, timeout, "closing"):
        rows = gather_rows([int(failed)], group, timeout)
    return any(row[0] for row in rows)


def settle(
    group: Optional[dist.ProcessGroup],
    phase: Phase,
    step: Optional[int],
    local_error: Optional[str],
    failure: Optional[str],
    timeout: Optional[float] = None,
) -> tuple[Optional[str], bool]:
    """One small all-gather: did every rank ask for ``phase``, none refuse and none fail?

    Returns ``(None, False)`` when so, else ``(message, every rank refused)``:
    the message of the error every rank must raise, the same text on every rank
    (built from gathered details only); a refusal's or a disagreement's is a
    :class:`~hf_altparams.errors.Refusal` carrying its cause (the first refusing
    rank's, or ``schedule_differs_per_rank``).
    ``local_error`` is this rank's refusal (it applied nothing), ``failure``
    its failed attempt (already rolled back locally). Single process: the
    local refusal or failure, if any.

    Each rank contributes ``[digest, refused, failed]``; the ranks agree when
    every row is ``[digest, 0, 0]`` with this rank's digest.
    """
    if not is_distributed(group):
        if local_error:
            return Refusal(f"phase switch at step {step} refused: {local_error}", cause_of(local_error)), True
        if failure:
            return _failure_message(phase, step, [failure]), False
        return None, False
    code = _phase_code(phase)
    with collective_errors(phase, step, group, timeout):
        rows = gather_rows([code, int(local_error is not None), int(failure is not None)], group, timeout)
    if all(row == [code, 0, 0] for row in rows):
        return None, False
    world = dist.get_world_size(group)
    gathered: list[Any] = [None] * world
    with collective_errors(phase, step, group, None):
        dist.all_gather_object(gathered, (repr(phase), local_error, step, failure), group=group)
    steps = sorted({s for _, _, s, _ in gathered}, key=str)
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    refusals = [f"rank {r}: {e}" for r, (_, e, _, _) in enumerate(gathered) if e]
    if refusals:
        return Refusal(
            f"phase switch at {where} refused; " + "; ".join(refusals), _first_cause(e for _, e, _, _ in gathered)
        ), len(refusals) == world
    if len({p for p, _, _, _ in gathered}) > 1:
        asked = ", ".join(f"rank {r} -> {p} at step {s}" for r, (p, _, s, _) in enumerate(gathered))
        return Refusal(
            f"ranks disagree on the phase at {where} ({asked}); every rank must call the "
            "switch with the same step, schedule and seed",
            Cause.SCHEDULE_DIFFERS_PER_RANK,
        ), False
    return _failure_message(phase, step, [f"rank {r}: {f}" for r, (_, _, _, f) in enumerate(gathered) if f]), False


def _first_cause(refusals: Iterator[Optional[str]]) -> Cause:
    """The cause of the first rank's refusal (gathered, so the same on every rank)."""
    return cause_of(next(e for e in refusals if e))


def _failure_message(phase: Phase, step: Optional[int], reasons: list[str]) -> str:
    return (
        f"phase switch to {phase.name!r} at step {step} failed ({'; '.join(reasons)}); the previous "
        "trainable set and DDP reducer were restored on every rank"
    )
