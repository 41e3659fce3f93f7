"""A dead or stuck rank during a phase switch: the survivor fails in bounded time, naming the switch.

Three 2-rank ``PhasedAccelerator`` jobs run side by side
(``tests/scripts/fault_switch.py``); right before the switch at
step 2, rank 1 dies (``os._exit``) or hangs (sleeps for a minute). Rank 0 must
raise a :class:`~hf_altparams.errors.SwitchError` naming the phase and the step,
and its process must end non-zero within 60 s of the fault (the hung rank sleeps
longer than that); its exit waits for gloo's pending receive up to the process
group's timeout:

* ``dead``: the process group's timeout is 60 s and no ``collective_timeout``:
  gloo sees the closed connection at once;
* ``stuck`` with ``collective_timeout=1`` (group timeout 6 s): the error comes
  after about 1 s;
* ``stuck`` with the process group's timeout alone (3 s): the error comes then.

A fourth job checks what ``collective_timeout`` means for the first switch: rank
1 reaches ``prepare`` 4 s after rank 0 (``late``, ``collective_timeout=1``, as a
rank still loading its model); the first switch waits under the process group's
timeout and the run completes.

The ranks are started without a launcher: on one node torchrun would stop the
survivor itself when a rank dies, which hides what a job spread over nodes meets.
Each is forked on its own from the suite's warm server
(:mod:`hf_altparams.testing.forked`: torch, accelerate and hf_altparams
imported once, not once per rank) with the environment variables the script
reads, and nothing watches it but this test. They meet in a file barrier before
the process group exists and in a long-timeout barrier before ``prepare`` (the
script's docstring), so a loaded machine, where their start-up differs by
seconds, changes none of the timings checked here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.forked import ForkServer, server_for
from hf_altparams.testing.launch import free_port, launch_env
from tests.scripts import script_path

# name: (mode, process-group timeout s, collective_timeout)
SCENARIOS = {
    "dead": ("dead", 60.0, "none"),
    "stuck_collective_timeout": ("stuck", 6.0, "1"),
    "stuck_group_timeout": ("stuck", 3.0, "none"),
    "late_first_switch": ("late", 60.0, "1"),
    "skip_step": ("skip_step", 6.0, "none"),
}
EXIT_WITHIN = 60.0  # s from the fault to the survivor's exit
START_WITHIN = 240.0  # s for 10 ranks to start and meet on a loaded 2-core box


class _Ranks:
    """Ranks forked from `server`, watched by the test alone: when each exit was first seen, its code, its output."""

    def __init__(self, server: ForkServer) -> None:
        self.server = server
        self.logs: dict[int, Path] = {}
        self.ended: dict[int, tuple[int, float]] = {}  # pid -> (exit code, time.time() when seen)

    def start(self, args: list[str], env: dict[str, str], log: Path) -> int:
        pid = self.server.start_rank(script_path("fault_switch.py"), args, env, cwd=os.getcwd(), log=log)
        self.logs[pid] = log
        return pid

    def wait(self, pid: int, timeout: float) -> bool:
        """Whether `pid` has exited, waiting up to `timeout` s; every rank's exit is stamped as it is seen."""
        deadline = time.monotonic() + timeout
        while True:
            for seen, code in self.server.exits(timeout=min(0.1, max(0.0, deadline - time.monotonic()))).items():
                if seen in self.logs and seen not in self.ended:
                    self.ended[seen] = (code, time.time())
            if pid in self.ended or time.monotonic() >= deadline:
                return pid in self.ended

    def output(self, pid: int) -> str:
        log = self.logs[pid]
        return log.read_text("utf-8", "replace") if log.exists() else ""

    def stop(self) -> None:
        """SIGKILL the session of every rank still running (each leads one of its own); wait until all are reaped."""
        for pid in self.logs:
            if not self.wait(pid, 0.0):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
        for pid in self.logs:
            self.wait(pid, 60.0)
        self.server.forget(list(self.logs))


def _start(ranks: _Ranks, sync: Path, mode: str, group_timeout: float, collective_timeout: str) -> list[int]:
    job = dict(
        launch_env("accelerate", None),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        FAULT_SYNC_DIR=str(sync),
    )
    return [
        ranks.start(
            [mode, str(group_timeout), collective_timeout],
            dict(job, RANK=str(rank), LOCAL_RANK=str(rank)),
            sync.parent / f"{sync.name}.rank{rank}.log",
        )
        for rank in range(2)
    ]


def _result(output: str) -> dict[str, Any]:
    lines = [line for line in output.splitlines() if line.startswith("FAULT-RESULT ")]
    assert lines, f"rank 0 printed no FAULT-RESULT line:\n{output[-3000:]}"
    return dict(json.loads(lines[-1][len("FAULT-RESULT ") :]))


@pytest.mark.distributed
def test_a_dead_or_stuck_rank_makes_the_switch_fail_in_bounded_time(tmp_path: Path) -> None:
    started = time.monotonic()
    ranks = _Ranks(server_for(launch_env("accelerate", None)))
    jobs = {name: _start(ranks, tmp_path / name, *spec) for name, spec in SCENARIOS.items()}
    outcome: dict[str, tuple[int, float, str]] = {}
    skipped_rank1 = ""
    try:
        for name, (rank0, rank1) in jobs.items():
            left = max(1.0, START_WITHIN + EXIT_WITHIN - (time.monotonic() - started))
            if not ranks.wait(rank0, left):
                elapsed = time.monotonic() - started
                pytest.fail(f"{name}: rank 0 still running after {elapsed:.0f} s:\n{ranks.output(rank0)[-3000:]}")
            outcome[name] = (*ranks.ended[rank0], ranks.output(rank0))
            if name == "late_first_switch":  # nothing failed: rank 1 ends by itself too
                assert ranks.wait(rank1, left), (
                    f"late_first_switch: rank 1 still running:\n{ranks.output(rank1)[-3000:]}"
                )
                assert ranks.ended[rank1][0] == 0, f"late_first_switch: rank 1 failed:\n{ranks.output(rank1)[-3000:]}"
            if name == "skip_step":  # rank 1 fails too, in its own next collective
                assert ranks.wait(rank1, EXIT_WITHIN), (
                    f"skip_step: rank 1 still running:\n{ranks.output(rank1)[-3000:]}"
                )
                skipped_rank1 = ranks.output(rank1)
    finally:
        ranks.stop()
    late = outcome.pop("late_first_switch")
    assert late[0] == 0, f"late_first_switch: rank 0 failed:\n{late[2][-3000:]}"
    on_time = _result(late[2])
    # prepare's first switch waited for the late rank well past collective_timeout=1, then the run went on
    assert on_time["type"] is None and on_time["waited"] > 2.0 and on_time["switches"] >= 2, on_time
    for name, (code, ended, out) in outcome.items():
        assert code != 0, f"{name}: rank 0 exited 0:\n{out[-3000:]}"
        result = _result(out)
        fault_at = result["at"] - result["waited"]  # rank 0 entered the switch as rank 1 failed
        assert ended - fault_at < EXIT_WITHIN, (name, ended - fault_at, result)
        assert result["type"] == "SwitchError", result
        assert "phase switch to 'b' at step 2: rank 0 of 2" in result["message"], result
        assert "restart it from the latest complete checkpoint" in result["message"], result
        assert "SwitchError: phase switch to 'b' at step 2" in out  # the error reaches the log too
    dead = _result(outcome["dead"][2])
    assert "collective failed" in dead["message"] and dead["waited"] < 10, dead
    fast = _result(outcome["stuck_collective_timeout"][2])
    assert "waited 1 s (collective_timeout)" in fast["message"], fast
    assert 0.9 <= fast["waited"] < 5.0, fast  # well before the group's 6 s
    # a rank that skipped its step gets the library's error too, in its next backward, naming the way out
    other = _result(skipped_rank1)
    assert other["type"] == "SwitchError", other
    assert "accelerator.backward at schedule step 1" in other["message"], other
    assert "out of step" in other["message"] and "optimizer.step()" in other["message"], other
    slow = _result(outcome["stuck_group_timeout"][2])
    assert "within the process group's timeout" in slow["message"], slow
    assert 2.5 <= slow["waited"] < 20.0, slow


@pytest.mark.parametrize("bad", [0, -1.0, "5", True, float("nan")])
def test_collective_timeout_is_checked_before_any_step(bad: Any) -> None:
    import torch

    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    with pytest.raises(PlanError, match=r"`collective_timeout` must be None .* got"):
        PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]), collective_timeout=bad)
