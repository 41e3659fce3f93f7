"""How ``python -m hf_altparams check`` launches, stops and explains an early end; its pre-flight.

Each run starts the check as a user would, in a process of its own, with
``HF_HOME`` in a temporary folder (its default Accelerate config is the one a
test writes there, never the developer's), and watches it: every process it
starts carries a tag in its environment, the rank processes are counted as
they appear, and whatever outlives the check, or a run that starts more ranks
than expected or hangs, is killed by the tag, so a runaway launch cannot hang
CI. Small models, few steps.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import psutil
import pytest

from hf_altparams.check.launch import LaunchRefused, plan_launch
from hf_altparams.check.preflight import Price, meta_model, price_check
from hf_altparams.check.verdict import judge
from hf_altparams.check.watch import ProgressFile, Watch
from hf_altparams.errors import Cause, PlanError
from hf_altparams.planner import build_model

ROOT = Path(__file__).resolve().parents[2]
TAG = "CHECK_LAUNCH_TEST_TAG"
pytestmark = pytest.mark.distributed

SMALL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _config(folder: Path, distributed_type: str, num_processes: int, name: str = "default_config.yaml") -> Path:
    """An Accelerate config file as `accelerate config` writes it (the type quoted)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(
        f"compute_environment: LOCAL_MACHINE\ndistributed_type: '{distributed_type}'\n"
        f"num_processes: {num_processes}\nnum_machines: 1\nmachine_rank: 0\nmixed_precision: 'no'\n"
        "use_cpu: true\n"
    )
    return path


def _tagged(tag: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(TAG) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _kill(processes: list[psutil.Process]) -> None:
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)


def _is_rank(process: psutil.Process) -> bool:
    """A process running ``python [-u] -m hf_altparams ...`` (a launcher runs its own module first).

    Not a fork that has not yet run its program: it still shows its parent's command line (the check's own
    while the check starts its launcher; a rank's while the rank starts a helper program), for a few
    milliseconds, longer on a loaded machine, where a poll saw a third "rank" next to the two real ones.
    """
    try:
        cmd = process.cmdline()
        parent = process.parent()
        if parent is not None and parent.cmdline() == cmd:
            return False
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "-m" in cmd and cmd.index("-m") + 1 < len(cmd) and cmd[cmd.index("-m") + 1] == "hf_altparams"


@dataclass
class Run:
    """A check run as a user starts it, watched: its exit code, output, and the rank processes seen."""

    code: Optional[int]
    stdout: str
    stderr: str
    ranks_seen: set[int] = field(default_factory=set)
    outlived: list[int] = field(default_factory=list)

    def verdict(self) -> dict[str, Any]:
        start = self.stdout.find("{")
        assert start >= 0, self.stdout[-3000:] + self.stderr[-3000:]
        return dict(json.JSONDecoder().raw_decode(self.stdout[start:])[0])

    def announced(self) -> int:
        found = re.search(r"hf_altparams check: starting (\d+) ranks? with", self.stderr)
        assert found, self.stderr[-3000:]
        return int(found.group(1))


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_HOME=str(home),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("ACCELERATE_USE_CPU", None)
    env.pop("XDG_CACHE_HOME", None)
    env.update(extra)
    return env


def _as_from_a_terminal() -> None:
    """In the child before it runs the check: SIGINT, SIGTERM and SIGHUP at their defaults, as a user's shell starts
    a command. A test run in the background of a non-interactive shell (`nohup bash -c '...' &`) inherits SIGINT
    ignored, and the check rightly leaves an ignored signal ignored: Ctrl-C would then not be what is tested."""
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(number, signal.SIG_DFL)


def run(
    cmd: list[str],
    env: dict[str, str],
    tmp: Path,
    *,
    most_ranks: int,
    timeout: float,
    signal_when: Optional[tuple[Path, int, int]] = None,
) -> Run:
    """Run ``cmd`` watched (see the module docstring); ``signal_when=(folder, files, signum)`` sends ``signum``
    to it once ``folder`` holds ``files`` files. Fails the test when more than ``most_ranks`` rank processes
    appear, or on ``timeout``, after killing every process carrying the run's tag."""
    tag = uuid.uuid4().hex
    out, err = tmp / f"out-{tag}", tmp / f"err-{tag}"
    seen: set[int] = set()
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**env, TAG: tag},
            stdout=stdout,
            stderr=stderr,
            preexec_fn=_as_from_a_terminal if signal_when is not None else None,
        )
        ends = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                try:
                    seen |= {p.pid for p in psutil.Process(proc.pid).children(recursive=True) if _is_rank(p)}
                except psutil.NoSuchProcess:
                    pass
                assert len(seen) <= most_ranks, f"{len(seen)} rank processes started, at most {most_ranks} wanted"
                assert time.monotonic() < ends, f"the check ran past the test's {timeout} s"
                if signal_when is not None and len(list(signal_when[0].iterdir())) >= signal_when[1]:
                    proc.send_signal(signal_when[2])
                    signal_when = None
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                _kill(_tagged(tag))
                proc.wait()
    left = _tagged(tag)
    _kill(left)
    return Run(proc.returncode, out.read_text(), err.read_text(), seen, [p.pid for p in left])


def check_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_altparams", "check", *args]


# ------------------------------------------------------------------ one launch, always
def test_a_default_config_of_distributed_type_no_starts_the_one_process_it_announces(tmp_path: Path) -> None:
    """accelerate launch runs one process for NO; the check runs it once (no relaunch), priced first."""
    _config(tmp_path / "home" / "accelerate", "NO", 1)
    model = tmp_path / "small.json"
    model.write_text(json.dumps(SMALL))
    done = run(
        check_cmd("--model", str(model), "--steps", "3", "--json"),
        _env(tmp_path / "home"),
        tmp_path,
        most_ranks=1,
        timeout=500,
    )
    assert done.code == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.announced() == 1 == len(done.ranks_seen) and done.outlived == []
    assert "accelerate launch" in done.stderr and "distributed_type NO" in done.stderr
    assert re.search(r"pre-flight: 1 rank x .* available .*; fits", done.stderr), done.stderr[-2000:]
    verdict = done.verdict()
    assert verdict["passed"] and [r["world"] for r in verdict["ranks"]] == [1]


def test_a_default_config_of_multi_cpu_for_two_processes_is_refused_naming_it(tmp_path: Path) -> None:
    """accelerate launch would start ONE process for it: refused before any rank starts (exit 2)."""
    path = _config(tmp_path / "home" / "accelerate", "MULTI_CPU", 2)
    done = run(check_cmd("--json"), _env(tmp_path / "home"), tmp_path, most_ranks=0, timeout=200)
    assert done.code == 2, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = done.verdict()
    assert verdict["causes"] == ["launch_starts_one_process"]
    detail = verdict["failures"][0]["detail"]
    assert str(path) in detail and "distributed_type MULTI_CPU" in detail and "num_processes 2" in detail
    assert "--ranks 2" in detail and "MULTI_GPU" in detail
    assert done.ranks_seen == set() and done.outlived == []


def test_under_accelerate_launch_with_a_one_process_config_it_runs_as_that_process(tmp_path: Path) -> None:
    """The user's own launch trains one process: the check tests that one, and starts nothing of its own."""
    config = _config(tmp_path / "configs", "MULTI_CPU", 2, name="multi_cpu.yaml")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(config),
        "-m",
        "hf_altparams",
        "check",
        "--setup",
        "tests.check.setups:lisa_small",
        "--steps",
        "3",
        "--json",
    ]
    done = run(cmd, _env(tmp_path / "home"), tmp_path, most_ranks=1, timeout=500)
    assert done.code == 0, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = done.verdict()
    assert "the one process accelerate launch started" in verdict["header"]
    assert [r["world"] for r in verdict["ranks"]] == [1] and len(done.ranks_seen) == 1 and done.outlived == []


def test_the_launch_follows_flag_then_config_then_the_machine(tmp_path: Path) -> None:
    multi_cpu = str(_config(tmp_path, "MULTI_CPU", 2, name="cpu.yaml"))
    multi_gpu = str(_config(tmp_path, "MULTI_GPU", 2, name="gpu.yaml"))
    no = str(_config(tmp_path, "NO", 1, name="no.yaml"))
    flag = plan_launch(["--steps", "3"], 3, None)
    assert (flag.launcher, flag.processes) == ("torchrun", 3) and flag.command[-3:] == ["check", "--steps", "3"]
    config = plan_launch([], None, multi_gpu)
    assert (config.launcher, config.processes) == ("accelerate launch", 2) and multi_gpu in config.command
    both = plan_launch([], 4, multi_gpu)
    assert both.processes == 4 and both.command[both.command.index("--num_processes") + 1] == "4"
    assert plan_launch([], None, no).processes == 1
    with pytest.raises(LaunchRefused) as refused:
        plan_launch([], None, multi_cpu)
    assert refused.value.cause == "launch_starts_one_process" and multi_cpu in refused.value.detail
    with pytest.raises(LaunchRefused):
        plan_launch([], 2, no)  # --ranks 2 through a config that starts one process
    with pytest.raises(PlanError, match="does not exist"):
        plan_launch([], None, str(tmp_path / "missing.yaml"))


# ------------------------------------------------------------------ stopped cleanly
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_stops_every_process_with_one_line(tmp_path: Path, signum: int, code: int) -> None:
    """Ranks that ignore SIGTERM, in sessions of their own (as torchrun starts them), are stopped too."""
    marks = tmp_path / "marks"
    marks.mkdir()
    done = run(
        check_cmd("--ranks", "2", "--setup", "tests.check.setups:hangs_ignoring_sigterm"),
        _env(tmp_path / "home", HANG_MARK=str(marks)),
        tmp_path,
        most_ranks=2,
        timeout=300,
        signal_when=(marks, 2, signum),
    )
    assert done.code == code, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"], "both ranks got to ignore SIGTERM"
    assert done.outlived == [], "a process outlived the check"
    lines = [line for line in done.stderr.splitlines() if "interrupted" in line]
    assert len(lines) == 1 and signal.Signals(signum).name in lines[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr + done.stdout


def test_past_its_deadline_every_rank_is_stopped_and_named_with_how_far_it_got(tmp_path: Path) -> None:
    """Ranks that hang in their set-up, ignoring SIGTERM: cause ``deadline``, not ``rank_lost``, every rank gone."""
    marks = tmp_path / "marks"
    marks.mkdir()
    done = run(
        check_cmd("--ranks", "2", "--deadline", "60", "--json", "--setup", "tests.check.setups:hangs_ignoring_sigterm"),
        _env(tmp_path / "home", HANG_MARK=str(marks)),
        tmp_path,
        most_ranks=2,
        timeout=300,
    )
    assert done.code == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in marks.iterdir()) == ["rank0", "rank1"], "both ranks got to ignore SIGTERM"
    assert done.outlived == [], "a rank outlived the check"
    verdict = done.verdict()
    assert verdict["causes"] == ["deadline"], verdict["failures"]
    detail = verdict["failures"][0]["detail"]
    assert "--deadline 60 s" in detail
    assert "rank 0: building its set-up (no step yet)" in detail and "rank 1: building its set-up" in detail


def test_the_deadline_names_the_last_step_each_rank_reported(tmp_path: Path) -> None:
    watch = Watch(tmp_path, ranks=3)
    ProgressFile(tmp_path, rank=0)("step", 3)
    ProgressFile(tmp_path, rank=1)("prepare", 0)
    failure = watch.deadline_failure(90, planned=12)
    assert failure["cause"] == "deadline" and "--deadline 90 s" in failure["detail"]
    assert failure["detail"].endswith(
        "rank 0: 3 of 12 steps done; rank 1: preparing (no step yet); rank 2: never reported (not started)"
    )
    ranks = watch.ranks()
    assert ranks[0].pid == os.getpid() and ranks[0].rss is not None  # read by the watcher itself


# ------------------------------------------------------------------ out of memory named
def test_a_rank_killed_by_sigkill_is_reported_out_of_memory_with_its_figures(tmp_path: Path) -> None:
    done = run(
        check_cmd("--ranks", "2", "--steps", "4", "--json", "--setup", "tests.check.setups:killed_by_the_kernel"),
        _env(tmp_path / "home"),
        tmp_path,
        most_ranks=2,
        timeout=300,
    )
    assert done.code == 1, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = done.verdict()
    assert verdict["causes"] == ["out_of_memory"], verdict["failures"]
    failure = verdict["failures"][0]
    assert failure["rank"] == 1 and "killed by SIGKILL" in failure["detail"]
    assert "1 of 4 steps done" in failure["detail"] and "resident set last read" in failure["detail"]
    assert "last read 0 B" not in failure["detail"]
    assert "host memory available at launch" in failure["detail"] and done.outlived == []


def test_a_failure_the_launch_found_is_not_also_a_lost_rank() -> None:
    killed = {"cause": Cause.OUT_OF_MEMORY, "rank": 1, "detail": "rank 1 was killed by SIGKILL"}
    verdict = judge([None, None], stopped=[killed])
    assert verdict.causes == ["out_of_memory"] and not verdict.passed  # not also rank_lost for ranks 0 and 1
    assert judge([None, None]).causes == ["rank_lost"]


# ------------------------------------------------------------------ the pre-flight
def test_the_preflight_refuses_a_model_larger_than_the_machine_before_any_rank_starts(tmp_path: Path) -> None:
    """A config whose fp32 weights alone are twice the machine's memory, priced on meta: nothing allocated."""
    per_layer = 4 * 16384 * 16384 + 3 * 16384 * 65536  # attention + MLP parameters of one layer
    layers = 2 * psutil.virtual_memory().total // (4 * per_layer) + 1
    huge = dict(
        SMALL,
        hidden_size=16384,
        intermediate_size=65536,
        num_hidden_layers=int(layers),
        num_attention_heads=64,
        num_key_value_heads=64,
    )
    model = tmp_path / "huge.json"
    model.write_text(json.dumps(huge))
    done = run(
        check_cmd("--ranks", "2", "--model", str(model), "--json"),
        _env(tmp_path / "home"),
        tmp_path,
        most_ranks=0,
        timeout=300,
    )
    assert done.code == 1, done.stdout[-3000:] + done.stderr[-3000:]
    verdict = done.verdict()
    assert verdict["causes"] == ["wont_fit"] and done.ranks_seen == set()
    detail = verdict["failures"][0]["detail"]
    assert "available" in detail and "--dtype bf16" in detail and "--fsdp2" in detail and "smaller model" in detail


def test_the_preflight_prices_what_each_rank_builds_and_the_plans_worst_phase(tmp_path: Path) -> None:
    from hf_altparams.check.workload import layer_groups, schedule_for
    from hf_altparams.planner import plan_cost

    model = tmp_path / "small.json"
    model.write_text(json.dumps(SMALL))
    price = price_check(str(model), ranks=2, steps=6, fsdp2=False)
    real = build_model(str(model), model_class="AutoModelForCausalLM", device="cpu")  # what a rank builds
    assert price.built == sum(t.numel() * t.element_size() for t in (*real.parameters(), *real.buffers()))
    groups = layer_groups(real)
    plan = plan_cost(real, groups, schedule_for("lisa", groups), steps=6, world_size=2)
    assert price.worst == max(row.device_bytes for row in plan.phases)
    assert price.fits and price.host_need == 2 * (price.process + price.worst)
    cast, built = meta_model(str(model), dtype="bf16")
    assert built == price.built and next(cast.parameters()).dtype.itemsize == 2  # built in fp32, then cast


def test_a_price_over_the_memory_is_refused_with_its_figures_and_ways_out() -> None:
    gib = 1 << 30
    price = Price(
        ranks=4,
        device="cpu",
        built=2 * gib,
        worst=3 * gib,
        worst_phase="layer0",
        process=gib,
        host_available=9 * gib,
        host_total=16 * gib,
    )
    assert not price.fits and price.host_need == 16 * gib
    text = price.refusal(dtype=None, fsdp2=False)
    assert "16.00 GiB" in text and "9.00 GiB" in text and "--ranks 2" in text and "--fsdp2" in text
    on_gpus = Price(
        ranks=2,
        device="cuda",
        built=gib,
        worst=40 * gib,
        worst_phase="layer0",
        process=gib,
        host_available=64 * gib,
        host_total=64 * gib,
        gpu_free=(80 * gib, 20 * gib),
    )
    assert not on_gpus.fits and on_gpus.short_gpus() == [1] and "GPU 1" in on_gpus.refusal(dtype="bf16", fsdp2=True)
