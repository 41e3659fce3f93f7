"""Watching a self-launched check: how far each rank got, what memory it held, and why the run ended early.

* Each rank the check started writes ``progress{r}.json`` in the results folder
  (:class:`ProgressFile`): its process id, its stage (``accelerator``, ``setup``,
  ``prepare``, ``step``, ``final``) and the optimizer steps it has done, at each
  stage and after every step.
* The check reads them while it waits (:class:`Watch`, from
  :func:`~hf_altparams.testing.launch.run_launchers`' ``on_poll``) and reads
  each rank's resident set itself, so a rank that dies while building its model
  still has a last reading.
* When the run ends early, :meth:`Watch.deadline_failure` and
  :meth:`Watch.killed_failures` say why, as failures of the verdict: the
  deadline (the seconds, and the last step each rank reached) or a rank killed
  by SIGKILL, which is what the kernel's out-of-memory killer sends
  (``out_of_memory``, with the rank's last reading, the pre-flight's price and
  the memory available at launch). Which rank a launcher saw die by which
  signal is read from its output (:func:`signals_of_ranks`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import psutil

from ..errors import Cause
from ..plan.groups import format_bytes

__all__ = ["ProgressFile", "RankProgress", "Watch", "oom_kills", "signals_of_ranks"]

_PROGRESS = "progress{rank}.json"

# torch's elastic launcher (torchrun, and accelerate launch's multi-process launchers, which run it) lists each
# failed worker in its summary as "rank : R (local_rank: L)" then "exitcode : -S (pid: P)" for signal S
# (torch 2.13); accelerate launch's one-process launcher raises CalledProcessError "died with <Signals.SIGKILL: 9>".
_ELASTIC_FAILURE = re.compile(
    r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)\s*\(pid:\s*\d+\)"
)
_SIMPLE_LAUNCHER_DEATH = re.compile(r"died with <Signals\.SIG\w+:\s*(\d+)>")


class ProgressFile:
    """What a rank tells the check while it runs: ``progress(stage, steps_done)`` rewrites ``progress{rank}.json``.

    Written atomically (a reader never sees half a file); the first write, at
    construction, says the process is up (stage ``accelerator``).

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> ProgressFile(folder, rank=1)("step", 3)
        >>> watch = Watch(folder, ranks=2); watch.poll(force=True)
        >>> watch.ranks()[1].steps, watch.ranks()[1].stage, 0 in watch.ranks()
        (3, 'step', False)
    """

    def __init__(self, folder: str | os.PathLike[str], rank: int) -> None:
        self.path = Path(folder) / _PROGRESS.format(rank=rank)
        self.rank = rank
        self("accelerator", 0)

    def __call__(self, stage: str, steps: int) -> None:
        payload = {"rank": self.rank, "pid": os.getpid(), "stage": stage, "steps": steps}
        partial = self.path.with_name(f".{self.path.name}.tmp")
        partial.write_text(json.dumps(payload))
        os.replace(partial, self.path)


@dataclass
class RankProgress:
    """How far one rank got: its stage, the steps it has done, and its resident set as the check last read it."""

    rank: int
    pid: int
    stage: str
    steps: int
    rss: Optional[int] = None
    rss_peak: Optional[int] = None

    def where(self, planned: Optional[int] = None) -> str:
        """``"3 of 12 steps done"``, or the stage it had reached before its first step."""
        if self.steps or self.stage in ("step", "final"):
            return f"{self.steps}{'' if planned is None else f' of {planned}'} steps done"
        return {
            "accelerator": "starting (no accelerator yet)",
            "setup": "building its set-up (no step yet)",
            "prepare": "preparing (no step yet)",
        }.get(self.stage, f"stage {self.stage}")

    def memory(self) -> str:
        if self.rss is None:
            return "its memory was never read"
        return f"its resident set last read {format_bytes(self.rss)} (peak read {format_bytes(self.rss_peak or 0)})"


def oom_kills() -> Optional[int]:
    """The kernel's count of out-of-memory kills since boot (``oom_kill`` in ``/proc/vmstat``); ``None`` where unread."""
    try:
        for line in Path("/proc/vmstat").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def signals_of_ranks(output: str) -> dict[int, int]:
    """``{rank: signal}`` for each rank the launcher's output says a signal ended.

    Example:
        >>> signals_of_ranks("  rank      : 1 (local_rank: 1)\\n  exitcode  : -9 (pid: 77)  (SIGKILL)")
        {1: 9}
        >>> signals_of_ranks("CalledProcessError: Command '['python', 'x.py']' died with <Signals.SIGKILL: 9>.")
        {0: 9}
    """
    found = {int(rank): -int(code) for rank, code in _ELASTIC_FAILURE.findall(output) if int(code) < 0}
    if not found:
        death = _SIMPLE_LAUNCHER_DEATH.search(output)
        if death:
            found[0] = int(death.group(1))
    return found


class Watch:
    """The parent's view of a launch: each rank's progress and resident set, read every ``every`` seconds.

    Args:
        folder: the results folder the ranks write ``progress{r}.json`` to.
        ranks: the processes the launch starts.
        every: seconds between readings (:meth:`poll` is called more often).
    """

    def __init__(self, folder: str | os.PathLike[str], ranks: int, every: float = 0.5) -> None:
        self.folder = Path(folder)
        self.count = ranks
        self.every = every
        self.started = time.monotonic()
        memory = psutil.virtual_memory()
        self.available_at_start, self.total = int(memory.available), int(memory.total)
        self.oom_kills_at_start = oom_kills()
        self._last = 0.0
        self._ranks: dict[int, RankProgress] = {}

    def poll(self, force: bool = False) -> None:
        """Read the progress files and each rank's resident set (at most every ``every`` seconds unless ``force``)."""
        now = time.monotonic()
        if not force and now - self._last < self.every:
            return
        self._last = now
        for path in self.folder.glob("progress*.json"):
            try:
                data: dict[str, Any] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # replaced while read: the next poll reads it
            rank = int(data["rank"])
            known = self._ranks.get(rank)
            if known is None or known.pid != data["pid"]:
                known = self._ranks[rank] = RankProgress(rank, int(data["pid"]), data["stage"], int(data["steps"]))
            known.stage, known.steps = data["stage"], int(data["steps"])
            try:
                rss = int(psutil.Process(known.pid).memory_info().rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if rss:  # 0: a process that has ended and not yet been reaped holds nothing to read
                known.rss, known.rss_peak = rss, max(rss, known.rss_peak or 0)

    def ranks(self) -> dict[int, RankProgress]:
        """Each rank that reported, by rank."""
        return dict(self._ranks)

    def _how_far(self, planned: int) -> str:
        parts = []
        for rank in range(self.count):
            known = self._ranks.get(rank)
            parts.append(f"rank {rank}: " + ("never reported (not started)" if known is None else known.where(planned)))
        return "; ".join(parts)

    def deadline_failure(self, deadline: float, planned: int) -> dict[str, Any]:
        """The ``deadline`` failure: the seconds allowed and how far each rank got."""
        self.poll(force=True)
        return {
            "cause": Cause.DEADLINE,
            "rank": None,
            "detail": f"the check ran past --deadline {deadline:g} s and was stopped, with its launcher and "
            f"every rank; how far each got: {self._how_far(planned)}",
        }

    def killed_failures(
        self, output: str, launcher_code: Optional[int], planned: int, priced: Optional[str]
    ) -> list[dict[str, Any]]:
        """An ``out_of_memory`` failure for each rank (or the launcher) a SIGKILL ended, with the figures known."""
        self.poll(force=True)
        killed = [rank for rank, number in signals_of_ranks(output).items() if number == signal.SIGKILL]
        if not killed and launcher_code != -signal.SIGKILL:
            return []
        now = oom_kills()
        if self.oom_kills_at_start is None or now is None:
            kernel = "the kernel's count of out-of-memory kills could not be read (/proc/vmstat)"
        elif now > self.oom_kills_at_start:
            kernel = (
                f"the kernel counted {now - self.oom_kills_at_start} out-of-memory kill(s) during the run "
                "(/proc/vmstat oom_kill)"
            )
        else:
            kernel = (
                "the kernel counted no out-of-memory kill during the run (/proc/vmstat oom_kill): if this was "
                "not the OOM killer (a container's limit, or a person), something else sent it"
            )
        shared = f"the pre-flight priced {priced}" if priced else "no pre-flight price (--setup or --no-preflight)"
        shared += (
            f"; host memory available at launch {format_bytes(self.available_at_start)} of "
            f"{format_bytes(self.total)}; {kernel}"
        )
        out = []
        who_died: list[Optional[int]] = list(killed) or [None]
        for rank in who_died:
            known = None if rank is None else self._ranks.get(rank)
            who = "the launcher" if rank is None else f"rank {rank}"
            state = "" if known is None else f"; how far: {known.where(planned)}; {known.memory()}"
            out.append(
                {
                    "cause": Cause.OUT_OF_MEMORY,
                    "rank": rank,
                    "detail": f"{who} was killed by SIGKILL, what the kernel's out-of-memory killer sends"
                    f"{state}; {shared}",
                }
            )
        return out
