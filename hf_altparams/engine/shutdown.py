"""Exit cleanly from a multi-rank CPU (gloo) run: no "terminate called" at interpreter exit.

The abort, found with gdb on torch 2.13 / Python 3.11: every ``backward()``
stashes a ``contextvars.Context`` in torch's thread-local state
(``torch.autograd.graph._engine_run_backward``), and each all-reduce that
DDP's reducer launches during that backward captures the thread-local state
in its gloo work object. A gloo worker thread (``pt_gloo_runloop``) drops its
reference to a finished work a moment after the collective completes; when it
is the last holder, destroying the captured state decrefs that Python object,
which needs the GIL. If the main thread has reached ``Py_FinalizeEx`` by then
(a script whose last backward ran just before it returned), the worker's
``take_gil`` calls ``pthread_exit`` inside a ``noexcept`` C++ destructor:
``std::terminate`` ("terminate called without an active exception",
SIGABRT), although training succeeded. Freeing the DDP wrapper or destroying
the process group does not stop it (the gloo threads outlive
``destroy_process_group``); what does is letting those threads finish their
pending releases while Python is still fully alive.

:func:`quiesce_comm_threads` does that: it releases the GIL (short sleeps)
until no gloo worker thread is runnable. :func:`shutdown` is the whole exit for
a script (free the reducers, quiesce, destroy the group, in that order), and
:func:`install_exit_hook` registers the quiescing at ``atexit`` (which runs
before finalization), so a script that does not tear down exits cleanly too;
:class:`~hf_altparams.engine.PhaseSwitcher` installs it when it attaches a
DDP wrapper. No collective runs at exit: a rank that failed must not leave the
others waiting in a barrier.

Example:
    >>> # end of a training script, on every rank:
    >>> # from hf_altparams.engine import shutdown
    >>> # shutdown(ddp)       # frees ddp's reducer, lets gloo threads finish, destroys the group
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Optional

import torch.distributed as dist
from torch import nn

from .ddp import free_reducer, is_ddp

__all__ = ["install_exit_hook", "quiesce_comm_threads", "shutdown"]

#: Thread names of torch's gloo process-group workers and transport loop.
_COMM_THREAD_PREFIXES = ("pt_gloo", "gloo_")

_hook_installed = False


def _runnable_comm_threads() -> Optional[int]:
    """How many gloo threads are runnable now (``None`` where /proc is unavailable)."""
    tasks = f"/proc/{os.getpid()}/task"
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    runnable = 0
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/stat") as handle:
                stat = handle.read()
        except OSError:  # the thread exited meanwhile
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
        if name.startswith(_COMM_THREAD_PREFIXES) and state in ("R", "D"):
            runnable += 1
    return runnable


def quiesce_comm_threads(min_wait: float = 0.02, timeout: float = 2.0) -> float:
    """Release the GIL until torch's gloo threads are idle; returns the seconds waited.

    Waits at least ``min_wait`` seconds (the sleeps release the GIL, so a worker
    waiting for it to free a finished work gets it), then until no gloo thread
    has been runnable for two checks in a row, at most ``timeout`` seconds.
    A no-op when ``torch.distributed`` was never initialised in this process.

    Example:
        >>> quiesce_comm_threads() < 2.5  # at once when no process group ever ran here
        True
    """
    if not _comm_started():
        return 0.0
    return _wait_idle(min_wait, timeout)


def _wait_idle(min_wait: float = 0.02, timeout: float = 2.0) -> float:
    started = time.monotonic()
    time.sleep(min_wait)
    idle_checks = 0
    while idle_checks < 2 and time.monotonic() - started < timeout:
        runnable = _runnable_comm_threads()
        if runnable is None:  # no /proc: a fixed wait is all we can do
            time.sleep(max(0.0, 0.1 - (time.monotonic() - started)))
            break
        idle_checks = idle_checks + 1 if runnable == 0 else 0
        time.sleep(0.005)
    return time.monotonic() - started


def _comm_started() -> bool:
    # A destroyed group leaves its gloo threads behind: what matters is whether one ever ran.
    return _hook_installed or (dist.is_available() and dist.is_initialized())


def shutdown(*wrappers: nn.Module, destroy: bool = True) -> None:
    """End a distributed script cleanly, on every rank: the last call before returning.

    In order: free the reducer of each DDP wrapper in ``wrappers`` (they cannot
    train afterwards; other objects are ignored), let the communication threads
    finish (:func:`quiesce_comm_threads`), and, with ``destroy``, destroy the
    default process group. Safe to call without a process group or twice.

    Example:
        >>> import torch
        >>> shutdown(torch.nn.Linear(2, 2))  # no process group: nothing to do
    """
    for wrapper in wrappers:
        if is_ddp(wrapper):
            free_reducer(wrapper)  # type: ignore[arg-type]
    quiesce_comm_threads()
    if destroy and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        _wait_idle()  # the gloo threads outlive the group


def _at_exit() -> None:
    try:
        quiesce_comm_threads()
    except Exception as exc:  # never turn a clean exit into a traceback
        print(f"hf_altparams: exit hook failed ({type(exc).__name__}: {exc})", file=sys.stderr)


def install_exit_hook() -> None:
    """Quiesce the communication threads at interpreter exit (once per process; idempotent).

    Example:
        >>> # install_exit_hook()  # PhaseSwitcher.attach does this for a DDP wrapper
    """
    global _hook_installed
    if not _hook_installed:
        atexit.register(_at_exit)
        _hook_installed = True
