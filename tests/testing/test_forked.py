"""``launch(..., launcher="forked")``: ranks forked from a warm server behave, to the test, as torchrun's ranks."""

from __future__ import annotations

import contextlib
import select
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from hf_altparams.testing import LaunchError, launch, rank_results
from hf_altparams.testing.forked import server_for, server_key
from hf_altparams.testing.launch import LAUNCH_TAG_ENV, launch_env, launch_ranks

# What a rank sees of its process: environment, argv, cwd, sys.path[0], parent, what is already imported.
# Written as `write_rank_result` writes it, without importing hf_altparams (and torch): a real torchrun rank
# then starts in a fraction of a CPU-second.
_REPORT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    preloaded = "torch" in sys.modules
    import numpy
    Path(sys.argv[1]).mkdir(parents=True, exist_ok=True)
    Path(sys.argv[1], "rank" + os.environ["RANK"] + ".json").write_text(json.dumps({
        "env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
        "ppid": os.getppid(), "pid": os.getpid(), "pgid": os.getpgid(0), "torch_preloaded": preloaded,
        "numpy_draw": int(numpy.random.randint(2**31)),
    }))
""")

# Rank 1 fails at once; rank 0 would wait for it forever (a collective, in a real run).
_FAILING = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    Path(sys.argv[1], "pid" + os.environ["RANK"]).write_text(str(os.getpid()))
    if os.environ["RANK"] == "1":
        while not Path(sys.argv[1], "pid0").exists():
            time.sleep(0.05)
        raise RuntimeError("boom from rank 1")
    time.sleep(120)  # bounded, in case the kill under test fails
""")

# Both ranks hang, each with a child process of its own (in its process group), past the timeout.
_HANGING = textwrap.dedent("""
    import os, subprocess, sys, time
    from pathlib import Path
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    Path(sys.argv[1], "pid" + os.environ["RANK"]).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _script(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


@pytest.mark.distributed
def test_a_forked_rank_sees_what_a_torchrun_rank_sees(tmp_path: Path) -> None:
    script = _script(tmp_path, "report.py", _REPORT)
    results = {}
    for launcher in ("torchrun", "forked"):
        out = tmp_path / launcher
        launch(script, str(out), nproc=2, launcher=launcher, cwd=tmp_path, timeout=300)
        results[launcher] = rank_results(out, nproc=2)
    for rank, (real, forked) in enumerate(zip(results["torchrun"], results["forked"])):
        assert sorted(forked["env"]) == sorted(real["env"]), rank
        differ = sorted(k for k in real["env"] if real["env"][k] != forked["env"][k])
        # per run: the port, the tag, the error file's folder; no agent holds a store under the forked launcher
        assert differ == sorted(
            ["MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_USE_AGENT_STORE", LAUNCH_TAG_ENV]
        ), differ
        assert forked["env"]["RANK"] == forked["env"]["LOCAL_RANK"] == str(rank)
        assert forked["argv"] == [str(script), str(tmp_path / "forked")]
        assert real["argv"] == [str(script), str(tmp_path / "torchrun")]
        assert forked["cwd"] == real["cwd"] == str(tmp_path)
        assert forked["path0"] == real["path0"] == str(tmp_path)
        assert forked["pgid"] == forked["pid"], "each forked rank leads a session of its own"
        assert forked["torch_preloaded"] and not real["torch_preloaded"]
    assert results["forked"][0]["numpy_draw"] != results["forked"][1]["numpy_draw"], "numpy's global state reseeded"


@pytest.mark.distributed
def test_a_second_launch_reuses_the_server(tmp_path: Path) -> None:
    script = _script(tmp_path, "report.py", _REPORT)
    server = server_for(launch_env("forked"))
    parents = []
    for run in ("first", "second"):
        launch(script, str(tmp_path / run), nproc=2, launcher="forked", timeout=300)
        parents.append({r["ppid"] for r in rank_results(tmp_path / run, nproc=2)})
    assert parents == [{server.pid}, {server.pid}], "every rank of both runs is a child of the one warm server"
    assert server_for(launch_env("forked")) is server


@pytest.mark.distributed
def test_a_launch_whose_import_time_environment_differs_gets_its_own_server(tmp_path: Path) -> None:
    script = _script(tmp_path, "report.py", _REPORT)
    launch(script, str(tmp_path / "plain"), nproc=2, launcher="forked", timeout=300)
    launch(script, str(tmp_path / "omp"), nproc=2, launcher="forked", env={"OMP_NUM_THREADS": "2"}, timeout=300)
    plain, omp = rank_results(tmp_path / "plain", nproc=2), rank_results(tmp_path / "omp", nproc=2)
    assert plain[0]["ppid"] != omp[0]["ppid"]
    assert psutil.Process(omp[0]["ppid"]).environ()["OMP_NUM_THREADS"] == "2", "the server imported with it"
    assert [r["env"]["OMP_NUM_THREADS"] for r in omp] == ["2", "2"]


def test_the_server_key_ignores_what_a_launch_sets_per_run() -> None:
    base = launch_env("forked")
    per_run = {**base, "MASTER_PORT": "1234", "RANK": "1", LAUNCH_TAG_ENV: "x", "TORCHELASTIC_RUN_ID": "none"}
    assert server_key(per_run) == server_key(base)
    for name, value in [("ACCELERATE_USE_CPU", "1"), ("HF_HOME", "/elsewhere"), ("PYTHONPATH", "/x")]:
        assert server_key({**base, name: value}) != server_key(base), name


@pytest.mark.distributed
def test_a_failing_rank_raises_with_its_traceback_and_the_other_rank_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys.modules["hf_altparams.testing.launch"], "_GRACE_AFTER_FAILURE", 2.0)
    script = _script(tmp_path, "failing.py", _FAILING)
    with pytest.raises(LaunchError) as info:
        launch(script, str(tmp_path), nproc=2, launcher="forked", timeout=300)
    message = str(info.value)
    assert "exit codes [-9, 1]" in message, message
    assert "torch.distributed.run" in message and str(script) in message
    assert "Traceback" in message and "RuntimeError: boom from rank 1" in message
    assert not _alive(int((tmp_path / "pid0").read_text()))


@pytest.mark.distributed
def test_a_hanging_run_past_the_timeout_leaves_no_process(tmp_path: Path) -> None:
    script = _script(tmp_path, "hanging.py", _HANGING)
    with pytest.raises(LaunchError, match="timed out after 15 s"):
        launch(script, str(tmp_path), nproc=2, launcher="forked", timeout=15)
    pids = [int(pid) for f in sorted(tmp_path.glob("pid*")) for pid in f.read_text().split()]
    assert len(pids) == 4, "both ranks and their children should have started within the timeout"
    assert not [pid for pid in pids if _alive(pid)]


@pytest.mark.distributed
def test_the_script_s_exit_code_is_the_rank_s(tmp_path: Path) -> None:
    script = _script(tmp_path, "exits.py", "import os, sys\nsys.exit(3 + int(os.environ['RANK']))\n")
    with pytest.raises(LaunchError, match=r"exit codes \[3, 4\]"):
        launch(script, nproc=2, launcher="forked", timeout=300)
    # launch_ranks returns them (a test that expects ranks to fail), with each rank's own output
    script = _script(
        tmp_path,
        "says.py",
        "import os, sys\nprint('rank', os.environ['RANK'])\nsys.exit(3 + int(os.environ['RANK']))\n",
    )
    ends = launch_ranks(script, nproc=2, timeout=300)
    assert [end.returncode for end in ends] == [3, 4]
    assert [end.stdout.split() for end in ends] == [["rank", "0"], ["rank", "1"]]


def test_json_protocol_carries_any_environment(tmp_path: Path) -> None:
    # Values with newlines and non-ASCII text reach the rank unchanged.
    script = _script(tmp_path, "env.py", "import os, sys\nopen(sys.argv[1], 'w').write(os.environ['ODD'])\n")
    odd = "line one\nline two: é"
    launch(script, str(tmp_path / "odd.txt"), nproc=1, launcher="forked", env={"ODD": odd}, timeout=300)
    assert (tmp_path / "odd.txt").read_text() == odd


def test_a_rank_s_full_collection_skips_what_the_server_imported(tmp_path: Path) -> None:
    # The Trainer and Accelerate's free_memory run full collections; the preloaded modules' objects are frozen.
    script = _script(
        tmp_path,
        "gc_counts.py",
        "import gc, sys\nopen(sys.argv[1], 'w').write(f'{gc.get_freeze_count()} {len(gc.get_objects())}')\n",
    )
    launch(script, str(tmp_path / "counts.txt"), nproc=1, launcher="forked", timeout=300)
    frozen, collected = map(int, (tmp_path / "counts.txt").read_text().split())
    assert frozen > 10 * collected, f"{frozen} objects frozen, {collected} left to every full collection"


# What Accelerate made of its launch: the state a script's Accelerator reads.
_ACCELERATE_STATE = textwrap.dedent("""
    import sys
    from accelerate import Accelerator
    from hf_altparams.testing import write_rank_result
    accelerator = Accelerator()
    state = accelerator.state
    write_rank_result(sys.argv[1], {
        "distributed_type": str(state.distributed_type), "num_processes": state.num_processes,
        "process_index": state.process_index, "local_process_index": state.local_process_index,
        "mixed_precision": str(state.mixed_precision), "device": str(state.device),
        "dynamo_backend": str(state.dynamo_plugin.backend), "backend": str(state.backend),
    })
""")


@pytest.mark.distributed
def test_forked_with_accelerate_use_cpu_gives_accelerate_launch_s_state(tmp_path: Path) -> None:
    script = _script(tmp_path, "state.py", _ACCELERATE_STATE)
    launch(script, str(tmp_path / "accelerate"), nproc=2, launcher="accelerate", timeout=300)
    launch(script, str(tmp_path / "forked"), nproc=2, launcher="forked", env={"ACCELERATE_USE_CPU": "1"}, timeout=300)
    real, forked = rank_results(tmp_path / "accelerate", nproc=2), rank_results(tmp_path / "forked", nproc=2)
    assert forked == real
    assert [r["distributed_type"] for r in forked] == ["DistributedType.MULTI_CPU"] * 2
    assert [r["num_processes"] for r in forked] == [2, 2]


# A client that launches `hanging.py` on 2 forked ranks; on Ctrl-C it says so with its server's pid, waits for the
# test to look at the ranks, and dies without closing its server (no atexit handler runs).
_CLIENT = textwrap.dedent("""
    import os, sys
    from hf_altparams.testing import launch
    from hf_altparams.testing.forked import server_for
    from hf_altparams.testing.launch import launch_env
    try:
        launch(sys.argv[1], sys.argv[2], nproc=2, launcher="forked", timeout=300)
    except KeyboardInterrupt:
        print("interrupted", server_for(launch_env("forked")).pid, flush=True)
        sys.stdin.readline()
        os._exit(7)
""")


@dataclass
class _Interrupted:
    """What the test saw of a client interrupted during its launch, then gone without closing its server."""

    code: int | None
    said: str
    pids: list[int]  # every rank and the child it started
    alive_after_interrupt: list[int]  # of those, alive while the interrupted client still ran
    server: int
    server_alive_after_client: bool


@pytest.fixture(scope="module")
def interrupted_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Interrupted]:
    """One client process for both tests below: it starts a server and a launch (the CPU of a fresh
    interpreter importing torch, transformers and accelerate, twice: paid once)."""
    folder = tmp_path_factory.mktemp("interrupted")
    script = _script(folder, "hanging.py", _HANGING)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLIENT, str(script), str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while len(list(folder.glob("pid*"))) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(0.5)  # both pid files written in full
        proc.send_signal(signal.SIGINT)
        assert proc.stdout is not None and proc.stdin is not None
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        said = proc.stdout.readline() if ready else ""
        pids = [int(pid) for f in sorted(folder.glob("pid*")) for pid in f.read_text().split()]
        stopping = time.monotonic() + 10  # a SIGKILLed process may take a moment to end; the client still waits
        while any(_alive(pid) for pid in pids) and time.monotonic() < stopping:
            time.sleep(0.1)
        alive = [pid for pid in pids if _alive(pid)]
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.write("\n")
            proc.stdin.flush()
        code = proc.wait(timeout=120)
        server = int(said.split()[-1]) if said.startswith("interrupted") else -1
        ends = time.monotonic() + 30
        while server > 0 and _alive(server) and time.monotonic() < ends:
            time.sleep(0.1)
        yield _Interrupted(code, said, pids, alive, server, server > 0 and _alive(server))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.distributed
def test_an_interrupted_launch_stops_every_rank(interrupted_client: _Interrupted) -> None:
    """Stopped by the launch itself, while its client still runs (not by the server's end with the client)."""
    assert interrupted_client.code == 7 and interrupted_client.said.startswith("interrupted")
    assert len(interrupted_client.pids) == 4
    assert interrupted_client.alive_after_interrupt == [], "a rank or its child outlived the interrupt"


@pytest.mark.distributed
def test_the_server_ends_when_its_client_is_gone(interrupted_client: _Interrupted) -> None:
    assert interrupted_client.code == 7 and interrupted_client.server > 0
    assert not interrupted_client.server_alive_after_client, "the server outlived its client"
