"""How ``check`` gets its ranks: it starts them itself, once, or it is one of them.

Which, for a process running ``python -m hf_altparams check``:

* **Started by the check** (:data:`RESULTS_ENV` in its environment, which the
  check gives every process it starts): a rank. It trains, writes its result
  and progress to that folder, and never starts a launcher, whatever the
  launcher did (one that set no ``WORLD_SIZE`` gives one process of world 1).
* **Started by a launcher** (:func:`launched`: torchrun's or ``accelerate
  launch``'s ``LOCAL_RANK`` and ``WORLD_SIZE``): one of the ranks; rank 0
  gathers the results and prints (:func:`decide_on_rank0`), and every rank
  exits with the verdict's code.
* **The one process of** ``accelerate launch`` (:func:`alone_under_accelerate`:
  its environment, no world): a config of ``distributed_type`` ``NO`` or
  ``MULTI_CPU`` makes ``accelerate launch`` start one process
  (:data:`~hf_altparams.integrations.accelerate_internals.ONE_PROCESS_TYPES`);
  the check runs as that process, says so, and starts nothing.
* **Started plainly**: :func:`plan_launch` decides the launch (by precedence:
  ``--ranks`` > an Accelerate config, ``--accelerate-config`` or the default
  file > the GPUs > 2 CPU ranks) and refuses one that cannot give the ranks
  wanted (:class:`LaunchRefused`: a config that starts one process where it asks
  for several); :func:`self_launch` starts it, waits at most ``--deadline``, and
  reads every rank's result. A job that runs past the deadline, or is
  interrupted (:func:`signals_interrupt`: Ctrl-C, SIGTERM, SIGHUP), is stopped
  with every process it started
  (:func:`hf_altparams.testing.launch.run_launchers`), and
  :class:`~hf_altparams.check.watch.Watch` says how far each rank got and
  which one a SIGKILL ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from ..errors import Cause, PlanError
from ..integrations.accelerate_internals import (
    ONE_PROCESS_TYPES,
    default_launch_config,
    read_launch_config,
    started_alone_by_accelerate,
)
from ..testing.launch import run_launchers, write_rank_result
from .rank import RankResult
from .watch import Watch
from .zero import CPU_ENV

__all__ = [
    "RESULTS_ENV",
    "Interrupted",
    "LaunchOutcome",
    "LaunchPlan",
    "LaunchRefused",
    "alone_under_accelerate",
    "deadline_left",
    "decide_on_rank0",
    "launched",
    "plan_launch",
    "rank_env",
    "read_results",
    "self_launch",
    "signals_interrupt",
    "started_by_check",
    "write_result",
]

#: The folder a self-launched rank writes its ``rank{r}.json`` and ``progress{r}.json`` to; set in every
#: process the check starts, it also marks that process as started by the check (it never launches).
RESULTS_ENV = "HF_ALTPARAMS_CHECK_RESULTS"

_SIGNAL_NAMES: dict[int, str] = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP"}


def started_by_check() -> bool:
    """Whether this process was started by a self-launching check (it must never start a launcher itself)."""
    return RESULTS_ENV in os.environ


def launched() -> bool:
    """Whether this process is a rank started by a launcher (torchrun, accelerate launch)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def alone_under_accelerate() -> bool:
    """Whether ``accelerate launch`` started this process as its only one (its environment, no world size)."""
    return not launched() and started_alone_by_accelerate(os.environ)


class LaunchRefused(Exception):
    """The launch the flags and config describe cannot give the ranks wanted; ``cause`` names why (``CAUSES``)."""

    def __init__(self, cause: Cause, detail: str) -> None:
        super().__init__(detail)
        self.cause = cause
        self.detail = detail


class Interrupted(BaseException):
    """The check got ``signum`` (SIGINT, SIGTERM, SIGHUP) while it started or waited for its ranks.

    A ``BaseException``, as ``KeyboardInterrupt`` is: no ``except Exception`` on the way may swallow it.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(_SIGNAL_NAMES.get(signum, f"signal {signum}"))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """``128 + signum``, as a shell reports a process a signal ended: 130 for Ctrl-C, 143 for SIGTERM."""
        return 128 + self.signum


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """Within the block SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` (so every rank is stopped); restored after.

    A signal this process ignores stays ignored (``nohup`` ignores SIGHUP; a shell
    ignores SIGINT in a job it starts in the background).
    """

    def interrupt(signum: int, frame: Optional[FrameType]) -> None:
        raise Interrupted(signum)

    caught = [number for number in _SIGNAL_NAMES if signal.getsignal(number) != signal.SIG_IGN]
    before = {number: signal.signal(number, interrupt) for number in caught}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


@dataclass(frozen=True)
class LaunchPlan:
    """The launch the check will start: its command, launcher, the processes it starts, and why."""

    command: list[str]
    launcher: str
    processes: int
    why: str

    def line(self) -> str:
        """The one line announcing it."""
        return (
            f"hf_altparams check: starting {self.processes} rank{'s' if self.processes > 1 else ''} with "
            f"{self.launcher} ({self.why})"
        )

    @property
    def how(self) -> str:
        """The launch in a few words, for the report's header."""
        return f"{self.launcher}, {self.why}"


def _cuda_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _torchrun(argv: Sequence[str], count: int, why: str) -> LaunchPlan:
    return LaunchPlan(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(count),
            "-m",
            "hf_altparams",
            "check",
            *argv,
        ],
        "torchrun",
        count,
        why,
    )


def plan_launch(argv: Sequence[str], ranks: Optional[int], config_file: Optional[str]) -> LaunchPlan:
    """The launch for ``--ranks`` and ``--accelerate-config`` (either may be ``None``), by the precedence above.

    Raises:
        LaunchRefused: ``launch_starts_one_process``: the config makes ``accelerate launch``
            start one process where it (or ``--ranks``) asks for several.
        PlanError: the config cannot be read, names no process count, or is not a launch one
            command on this machine starts (several machines, mpirun, SageMaker).
    """
    given = config_file is not None
    config = Path(config_file) if config_file is not None else default_launch_config()
    if not given and (ranks is not None or not config.is_file()):
        gpus = _cuda_ranks()
        if ranks is not None:
            return _torchrun(argv, ranks, f"--ranks {ranks}")
        return _torchrun(argv, gpus, f"{gpus} GPUs") if gpus else _torchrun(argv, 2, "no GPU: 2 CPU ranks")
    where = "--accelerate-config" if given else "your default Accelerate config"
    if not config.is_file():
        raise PlanError(f"`--accelerate-config` {str(config)!r} does not exist")
    read = read_launch_config(config)
    elsewhere = read.elsewhere()
    if elsewhere:
        raise PlanError(
            f"{where} {str(config)} is not a launch the check can start on this machine alone: "
            f"{elsewhere}. Start the check under it yourself on every machine (`accelerate launch "
            f"--config_file {config} -m hf_altparams check`), or give `--ranks N` to use torchrun here"
        )
    wanted = ranks or read.num_processes or (1 if read.one_process else None)
    if wanted is None:
        raise PlanError(
            f"{where} {str(config)} (distributed_type {read.distributed_type}) names no num_processes; give `--ranks N`"
        )
    started = read.processes(ranks)
    assert started is not None  # wanted is known, so is what starts
    if started < wanted:
        raise LaunchRefused(
            Cause.LAUNCH_STARTS_ONE_PROCESS,
            (
                f"{where} {config} has distributed_type {read.distributed_type} and num_processes "
                f"{read.num_processes}{f' (--ranks {ranks})' if ranks else ''}, but `accelerate launch` starts ONE "
                f"process for distributed_type {' or '.join(ONE_PROCESS_TYPES)}: the check would test one process, not "
                f"{wanted} ranks, as would your own `accelerate launch` with it. Set `distributed_type: MULTI_GPU` in "
                f"that file, or give `--ranks {wanted}` (without --accelerate-config) to start {wanted} ranks with "
                "torchrun"
            ),
        )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if ranks is not None and not read.one_process:
        command += ["--num_processes", str(ranks)]
    counted = f", --ranks {ranks}" if ranks is not None else f", num_processes {read.num_processes}"
    why = f"{where} {config}: distributed_type {read.distributed_type}{counted}"
    return LaunchPlan([*command, "-m", "hf_altparams", "check", *argv], "accelerate launch", started, why)


def write_result(folder: str, result: RankResult) -> None:
    """Write ``rank{r}.json`` atomically (a reader never sees half a file)."""
    write_rank_result(folder, result.as_dict(), rank=result.rank)


def read_results(folder: Path, world: int) -> list[Optional[RankResult]]:
    """Every rank's result, ``None`` for a rank that wrote none."""
    out: list[Optional[RankResult]] = []
    for rank in range(world):
        path = folder / f"rank{rank}.json"
        out.append(RankResult.from_dict(json.loads(path.read_text())) if path.is_file() else None)
    return out


def decide_on_rank0(result: RankResult, decide: Callable[[list[Optional[RankResult]]], int], timeout: float) -> int:
    """Gather every rank's result on rank 0, let ``decide`` judge and print there; its exit code on every rank.

    Runs while the training's process group is still up, on a gloo group of its
    own (``gather_object`` needs one that carries CPU tensors). When the gather
    fails (a rank is lost), rank 0 judges what it has: its own result, the
    others missing; the other ranks exit 1.
    """
    if result.world == 1:
        return decide([result])
    import datetime

    import torch.distributed as dist

    gathered: Optional[list[Any]] = [None] * result.world if result.rank == 0 else None
    try:
        if not dist.is_initialized():
            raise RuntimeError("no process group (the accelerator was never built)")
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        dist.gather_object(result.as_dict(), gathered, dst=0, group=group)
        code = torch.tensor([0])
        if gathered is not None:
            code[0] = decide([RankResult.from_dict(d) if d else None for d in gathered])
        dist.broadcast(code, src=0, group=group)
        return int(code.item())
    except RuntimeError:  # a rank is gone: judge this rank's own result
        if result.rank != 0:
            return 1
        return decide([result] + [None] * (result.world - 1))


@dataclass
class LaunchOutcome:
    """What a self-launch gave: every rank's result, the launch's last lines, and why it ended early, if it did."""

    results: list[Optional[RankResult]]
    tail: str
    stopped: list[dict[str, Any]] = field(default_factory=list)


def rank_env(folder: str, deepspeed: bool) -> dict[str, str]:
    """The environment :func:`self_launch` starts its launch with: this process's, :data:`RESULTS_ENV` set to
    ``folder``; for DeepSpeed a plain ``torchrun`` one, without ``ACCELERATE_USE_CPU`` (with it Accelerate drops
    DeepSpeed); else, without a GPU, ``ACCELERATE_USE_CPU=1`` (without it Accelerate runs each CPU rank alone).

    Example::

        rank_env("/tmp/results", deepspeed=True).get("ACCELERATE_USE_CPU")  # None, whatever this process has
    """
    env = dict(os.environ, **{RESULTS_ENV: folder})
    if deepspeed:
        env.pop(CPU_ENV, None)
    elif not torch.cuda.is_available():
        env.setdefault(CPU_ENV, "1")
    return env


def self_launch(
    plan: LaunchPlan,
    deadline: float,
    steps: int,
    priced: Optional[str] = None,
    allowed: Optional[float] = None,
    deepspeed: bool = False,
) -> LaunchOutcome:
    """Start ``plan``, wait for it at most ``deadline`` seconds, and read what the ranks wrote.

    ``steps``: the steps each rank trains (to say how far one got); ``priced``: the
    pre-flight's price, quoted when a rank is killed; ``allowed``: the ``--deadline``
    the report names (default ``deadline``; less may be left once the check has
    priced the run). :class:`Interrupted` (inside :func:`signals_interrupt`) passes
    through, once every process is stopped. ``deepspeed``: the ranks run DeepSpeed
    (their environment: :func:`rank_env`).
    """
    allowed = deadline if allowed is None else allowed
    with tempfile.TemporaryDirectory(prefix="hf_altparams_check_") as folder:
        watch = Watch(folder, plan.processes)
        (done,), timed_out = run_launchers(
            [plan.command], rank_env(folder, deepspeed=deepspeed), timeout=deadline, on_poll=watch.poll
        )
        tail = "\n".join((done.stdout or "").splitlines()[-40:])
        results = read_results(Path(folder), plan.processes)
        world = max([plan.processes] + [r.world for r in results if r is not None])
        if world > plan.processes:  # the launch started more than it said: read them all
            results = read_results(Path(folder), world)
        if timed_out:
            stopped = [watch.deadline_failure(allowed, steps)]
        else:
            stopped = watch.killed_failures(done.stdout or "", done.returncode, steps, priced)
        return LaunchOutcome(results, tail, stopped)


def deadline_left(started: float, deadline: float) -> float:
    """Seconds left of ``deadline`` since ``started`` (``time.monotonic()``), at least one."""
    return max(1.0, deadline - (time.monotonic() - started))
