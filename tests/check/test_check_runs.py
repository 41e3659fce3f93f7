"""``python -m hf_altparams check`` run for real on CPU ranks: it passes a correct set-up, fails each broken one.

The runs a user starts (``check``) self-launch their ranks (torchrun, gloo) and
print the verdict as JSON; the broken set-ups of :mod:`tests.check.setups`, each
making one mistake the library guards against, run as the ranks of the user's
own launcher (``check_launched``: forked from the suite's warm server, which
spares each run its processes' start-up), and the check must name that cause.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import pytest

from hf_altparams.testing.launch import launch_ranks
from tests.scripts import script_path

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.distributed


def _env(**extra: str) -> dict[str, str]:
    env = dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("ACCELERATE_USE_CPU", None)  # the self-launch sets it; a user's own torchrun must
    env.update(extra)
    return env


def check(
    *args: str, ranks: int = 2, steps: int = 12, env: Optional[dict[str, str]] = None
) -> tuple[int, dict[str, Any]]:
    """Run the check as a user would (CPU only, this checkout first on the path); ``(exit code, verdict)``."""
    proc = subprocess.run(
        [sys.executable, "-m", "hf_altparams", "check", "--ranks", str(ranks), "--steps", str(steps), "--json", *args],
        cwd=ROOT,
        env=_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.stdout.strip(), proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout)


def check_launched(
    *args: str, ranks: int = 2, steps: int = 12, env: Optional[dict[str, str]] = None, cpu: bool = True
) -> tuple[int, dict[str, Any]]:
    """The check as the ranks of the user's own launcher; ``(exit code, verdict)``.

    The ranks are forked from the suite's warm server (``launch_ranks``: what a
    ``torchrun`` rank sees, without a fresh interpreter per rank and run); the
    check judges on rank 0, as under the user's own ``torchrun``, and every rank
    exits with the verdict's code. ``cpu``: ``ACCELERATE_USE_CPU=1``, as a user's
    own launch on CPU ranks needs (not for DeepSpeed, which it would drop). The
    check's self-launch is tested as a user starts it in ``check`` and
    ``tests/check/test_launch.py``.
    """
    with tempfile.TemporaryDirectory(prefix="check_verdict_") as folder:
        out = Path(folder) / "verdict.json"
        ends = launch_ranks(
            script_path("check_cli.py"),
            "--steps",
            str(steps),
            "--json-out",
            str(out),
            *args,
            nproc=ranks,
            env={**({"ACCELERATE_USE_CPU": "1"} if cpu else {}), **(env or {})},
            cwd=ROOT,
            timeout=500,
        )
        assert out.is_file(), "\n".join(
            f"--- rank {r}: exit {e.returncode}\n{e.stdout[-3000:]}" for r, e in enumerate(ends)
        )
        verdict = json.loads(out.read_text())
    codes = [end.returncode for end in ends]
    assert len(set(codes)) == 1, f"the ranks exited with {codes}: every rank exits with the verdict's code"
    return codes[0], verdict


def under_torchrun(*args: str, **env: str) -> tuple[int, dict[str, Any]]:
    """The check as one of the ranks of the user's own ``torchrun`` (rank 0 prints the verdict)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "hf_altparams",
            "check",
            "--json",
            *args,
        ],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=500,
    )
    start = proc.stdout.find("{")
    assert start >= 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.returncode, json.JSONDecoder().raw_decode(proc.stdout[start:])[0]


def assert_lisa_passed(code: int, verdict: dict[str, Any], ranks: int) -> None:
    """A correct LISA run of 12 steps on ``ranks`` ranks: passed, every check judged, a switch at each new draw."""
    assert code == 0 and verdict["passed"], verdict["failures"]
    status = {f["check"]: f["status"] for f in verdict["findings"]}
    assert status["memory flat after warm-up"] == "pass"
    assert status["memory held vs plan"] == "pass"
    assert status["idle optimizer state as its policy says"] == "pass"  # lisa drops it
    if ranks > 1:
        assert status["ranks bit-identical after each switch"] == "pass"
        assert status["bytes all-reduced = trainable bytes"] == "pass"
    assert [r["world"] for r in verdict["ranks"]] == [ranks] * ranks
    for result in verdict["ranks"]:  # a switch wherever the draw changed the phase (k=1 of 4, every step)
        phases = [s["phase"] for s in result["steps"]]
        changes = sum(a != b for a, b in zip(phases, phases[1:]))
        assert len(phases) == 12 and changes >= 5 and len(result["switches"]) in (changes, changes + 1)


def test_a_correct_lisa_setup_passes_on_four_ranks() -> None:
    """Four ranks of the user's own launcher (the check's own launch is run for real by the built-in default,
    below, and by ``tests/check/test_launch.py``)."""
    code, verdict = check_launched("--setup", "tests.check.setups:lisa_small", ranks=4)
    assert_lisa_passed(code, verdict, 4)


def test_a_correct_lisa_setup_passes_on_one_rank() -> None:
    code, verdict = check_launched("--setup", "tests.check.setups:lisa_small", ranks=1)
    assert_lisa_passed(code, verdict, 1)


def test_the_builtin_default_passes_and_reports_the_lean_idle_state() -> None:
    code, verdict = check()  # the built-in Llama under lisa, as `python -m hf_altparams check` runs it
    assert code == 0 and verdict["passed"], verdict["failures"]
    assert any("idle optimizer state: drop (the RandomBlocks recipe's assumption)" in n for n in verdict["notes"])
    steps = verdict["ranks"][0]["steps"]
    assert all(s["reduced_bytes"] == s["grad_bytes"] < verdict["ranks"][0]["trainable_everything"] for s in steps)


# Steps and ranks: what each mistake needs to show. The memory judgements need warm-up and 3 switches after it
# (a switch at nearly every step here); the others show by the first switches. Two ranks where the mistake is between ranks or
# under DDP (a flag behind the schedule is mended with a warning in one process, an error under DDP).
@pytest.mark.parametrize(
    "setup, cause, ranks, steps",
    [
        ("requires_grad_behind", "requires_grad_behind_schedule", 2, 4),
        ("optimizer_of_other_model", "optimizer_misses_parameters", 2, 4),
        ("optimizer_of_trainable_only", "optimizer_misses_parameters", 2, 6),
        ("leaking", "memory_grows", 1, 10),
        ("holding_beyond_plan", "memory_over_plan", 1, 10),
        ("schedule_per_rank", "schedule_differs_per_rank", 2, 6),
        ("drifting", "ranks_drift", 2, 6),
        ("drop_that_does_nothing", "idle_state_held", 1, 6),
        ("branch_skipped_on_some_steps", "trainable_param_unused", 2, 6),
    ],
)
def test_a_broken_setup_fails_naming_its_cause(setup: str, cause: str, ranks: int, steps: int) -> None:
    code, verdict = check_launched("--setup", f"tests.check.setups:{setup}", ranks=ranks, steps=steps)
    assert code == 1 and not verdict["passed"]
    assert verdict["causes"][0] == cause, verdict["failures"]


def test_under_the_user_s_own_torchrun_rank_0_reports_and_the_job_exits_with_the_verdict() -> None:
    """Also the correct LISA set-up on 2 ranks (the 1- and 4-rank runs are above)."""
    code, verdict = under_torchrun("--setup", "tests.check.setups:lisa_small", "--steps", "12", ACCELERATE_USE_CPU="1")
    assert_lisa_passed(code, verdict, 2)
    assert [r["rank"] for r in verdict["ranks"]] == [0, 1] and "launched" in verdict["header"]


def test_torchrun_on_cpu_without_accelerate_use_cpu_is_refused_naming_the_variable() -> None:
    """Accelerate would run each CPU rank alone (distributed_type NO): refused before training.

    The ranks of a launcher with torchrun's environment (``check_launched``, without ``ACCELERATE_USE_CPU``): what
    the check reads to refuse is that environment; the user's own torchrun itself is run above.
    """
    code, verdict = check_launched("--setup", "tests.check.setups:lisa_small", steps=4, cpu=False)
    assert code != 0 and verdict["causes"] == ["setup_refused"]
    assert "set ACCELERATE_USE_CPU=1 for `torchrun`" in verdict["failures"][0]["detail"]
