"""Two real processes, gloo on CPU, under each launcher the library supports."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hf_altparams.testing import LaunchError, launch, rank_results
from hf_altparams.testing.launch import Launcher
from tests.scripts import script_path

NPROC = 2


def _assert_two_ranks_allreduced_and_stepped(ranks: list[dict[str, Any]]) -> None:
    """What ``smoke_allreduce.py``'s ranks report: separate gloo processes, a sum all-reduced, one DDP step."""
    assert [r["rank"] for r in ranks] == list(range(NPROC))
    assert all(r["world_size"] == NPROC for r in ranks), ranks
    assert all(r["backend"] == "gloo" for r in ranks)
    assert len({r["pid"] for r in ranks}) == NPROC, "ranks must be separate processes"
    assert all(r["allreduce_sum"] == NPROC * (NPROC + 1) / 2 for r in ranks)

    # Seeded differently per rank, so DDP's constructor really had to broadcast ...
    assert ranks[0]["param_sha256_before_ddp"] != ranks[1]["param_sha256_before_ddp"]
    # ... and after one averaged step the ranks are bit-identical.
    assert all(r["grad_is_average"] for r in ranks)
    assert all(r["grad_sha256"] == ranks[0]["grad_sha256"] for r in ranks)
    assert all(r["param_sha256"] == ranks[0]["param_sha256"] for r in ranks)


@pytest.mark.distributed
def test_two_ranks_allreduce_and_ddp_step_under_accelerate_launch(tmp_out: Path) -> None:
    """The same under torchrun (and the forked launcher): the port-retry test's launches, below."""
    launch(script_path("smoke_allreduce.py"), str(tmp_out), nproc=NPROC, launcher="accelerate")
    _assert_two_ranks_allreduced_and_stepped(rank_results(tmp_out, nproc=NPROC))


# --- the launcher's own failure handling ------------------------------------

_FAILING = """
import os
if os.environ["RANK"] == "1":
    raise RuntimeError("boom from rank 1")
"""

_HANGING = """
import os, sys, time
from pathlib import Path
from typing import Any
Path(sys.argv[1], "pid" + os.environ["RANK"]).write_text(str(os.getpid()))
time.sleep(120)  # bounded, in case the kill under test fails
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"  # a zombie has exited; it only waits to be reaped


@pytest.mark.distributed
def test_failing_rank_raises_launch_error_with_command_and_output(tmp_path: Path) -> None:
    script = tmp_path / "failing.py"
    script.write_text(_FAILING)
    with pytest.raises(LaunchError) as info:
        launch(script, nproc=2, timeout=120)
    message = str(info.value)
    assert "exited with code" in message
    assert "torch.distributed.run" in message and str(script) in message
    assert "boom from rank 1" in message


@pytest.mark.distributed
def test_timeout_kills_launcher_and_ranks(tmp_path: Path) -> None:
    script = tmp_path / "hanging.py"
    script.write_text(_HANGING)
    with pytest.raises(LaunchError, match="timed out after 25 s"):
        launch(script, str(tmp_path), nproc=2, timeout=25)
    pids = [int(p.read_text()) for p in sorted(tmp_path.glob("pid*"))]
    assert len(pids) == 2, "both ranks should have started within the timeout"
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "forked"])
def test_port_taken_in_the_meantime_is_retried_once(
    tmp_out: Path, monkeypatch: pytest.MonkeyPatch, launcher: Launcher
) -> None:
    """Also each launcher's smoke test: the retried launch runs ``smoke_allreduce.py`` as any launch does."""
    # `hf_altparams.testing.launch` the function shadows the module of the same
    # name as an attribute of `hf_altparams.testing`; reach the module itself.
    launch_module = sys.modules["hf_altparams.testing.launch"]
    # forked: rank 1 waits for a store that never answers, until the grace after rank 0's failure
    monkeypatch.setattr(launch_module, "_GRACE_AFTER_FAILURE", 2.0)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        ports = iter([busy_port])
        real_free_port = launch_module.free_port
        monkeypatch.setattr(launch_module, "free_port", lambda: next(ports, None) or real_free_port())

        result = launch(script_path("smoke_allreduce.py"), str(tmp_out), nproc=NPROC, launcher=launcher)

    used = result.args[result.args.index("--master_port") + 1]
    assert used != str(busy_port)
    ranks = rank_results(tmp_out, nproc=NPROC)
    assert [r["world_size"] for r in ranks] == [2, 2]
    _assert_two_ranks_allreduced_and_stepped(ranks)
