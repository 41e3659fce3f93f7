"""Count the aborts at interpreter exit of repeated 2-rank runs (see :mod:`hf_altparams.engine.shutdown`).

:func:`repeat_exits` starts 2-rank jobs of ``tests/scripts/exit_check.py`` one after
the other (optionally next to busy-loop processes that load every core) and
counts the runs where a rank died of SIGABRT ("terminate called without an
active exception"). ``benchmarks/exit_stress.py`` runs it 200 times;
``tests/engine/test_exit.py`` a few times.

The ranks are started directly (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` /
``MASTER_PORT``), not through torchrun: the launcher's own start-up would
triple the time per exit and adds nothing to what is tested.

Example::

    tally = repeat_exits("phased", 10)
    assert tally.aborted == 0 and tally.failed == 0
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

from hf_altparams.testing.launch import free_port, launch_env
from tests.scripts import script_path

__all__ = ["MODES", "ExitTally", "repeat_exits"]

#: What a rank of ``scripts/exit_check.py`` does before returning without teardown.
MODES = ("phased", "trainer", "plain", "shutdown")


@dataclass
class ExitTally:
    """What :func:`repeat_exits` saw: runs, aborted runs, other failures, wall seconds."""

    mode: str
    runs: int = 0
    aborted: int = 0
    failed: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def _burn(stop: multiprocessing.synchronize.Event) -> None:  # a load generator
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def _one_run(mode: str, env: dict[str, str], timeout: float) -> tuple[bool, Optional[str]]:
    env = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    procs = []
    for rank in range(2):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script_path("exit_check.py")), mode],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outputs, codes = [], []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            out, _ = proc.communicate()
        outputs.append(out.decode(errors="replace"))
        codes.append(proc.returncode)
    aborted = any(code == -6 or "terminate called" in text for code, text in zip(codes, outputs))
    if aborted:
        return True, None
    if any(codes):
        return False, f"exit codes {codes}: " + " | ".join(t.strip()[-400:] for t in outputs)
    return False, None


def repeat_exits(mode: str, runs: int, *, load: int = 0, timeout: float = 120.0) -> ExitTally:
    """Run ``runs`` 2-rank jobs of ``mode`` one after another; count SIGABRT exits.

    Args:
        mode: ``"phased"``, ``"trainer"``, ``"plain"`` or ``"shutdown"`` (see ``scripts/exit_check.py``).
        runs: how many 2-rank jobs (each ends in two interpreter exits).
        load: busy-loop processes kept running meanwhile (CPU load).
        timeout: seconds allowed per job.
    """
    if mode not in MODES:
        raise ValueError(f"`mode` must be one of {MODES}, got {mode!r}")
    env = launch_env("accelerate", None)  # ACCELERATE_USE_CPU=1: two gloo ranks; PYTHONPATH to this checkout
    tally = ExitTally(mode)
    stop = multiprocessing.Event()
    burners = [multiprocessing.Process(target=_burn, args=(stop,), daemon=True) for _ in range(load)]
    for burner in burners:
        burner.start()
    started = time.perf_counter()
    try:
        for _ in range(runs):
            aborted, failure = _one_run(mode, env, timeout)
            tally.runs += 1
            tally.aborted += int(aborted)
            if failure is not None:
                tally.failed += 1
                tally.failures.append(failure)
    finally:
        stop.set()
        for burner in burners:
            burner.join(timeout=5)
    tally.seconds = time.perf_counter() - started
    return tally
