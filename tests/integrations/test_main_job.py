"""The README's main job (examples/fit_large_model.py) at a tiny size: what a user reads in its output holds.

The same code as the default run: the precision chosen (and why) and the plan printed before
training, two gloo ranks started by the script itself, PhasedAccelerator under LISA or BAdam with
either fp32 weights (GroupedOptimizer) or bf16 storage + fp32 masters (PrecisionOptimizer), then the
measured figures next to the planned ones. The memory budget is given (``--memory-gib``) so that at
this size, too, the plan says plain DDP does not fit while hf_altparams does.

The README's command runs as it is, in a fresh interpreter that starts its ranks with torchrun
(``default_run``). The second run, the other precision and recipe, runs the same ``main()`` in
this process with its ranks forked from the suite's warm server (``launcher="forked"``): the
launcher is the first run's subject, not the second's, and a torchrun launch costs CI three fresh
interpreters.

Which precision trains is decided by ``bf16_speed`` (a timed probe matmul on CPU); the runs that
test the choice force the verdict with ``HF_ALTPARAMS_BF16``, so no assertion depends on how fast
this machine is.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest
import torch

from hf_altparams.planner.hardware import BF16_ENV, cpu_verdict
from hf_altparams.testing import launch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fit_large_model.py"
#: The tiny size; the budget that plain DDP does not fit at that size; a run that crosses phase switches.
MAIN_JOB_ARGS = ("--size", "tiny", "--memory-gib", "0.6", "--steps", "5", "--every", "2", "--batch", "2", "--seq", "64")
ROWS = {"fp32": "hf_altparams, fp32 weights", "bf16": "hf_altparams, bf16 + fp32 masters"}


def run_main_job(out: Path, *extra: str, bf16: Optional[str] = None) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.pop(BF16_ENV, None)
    if bf16 is not None:
        env[BF16_ENV] = bf16
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *MAIN_JOB_ARGS, "--out", str(out), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


def check_run(out: str, result: dict[str, Any], precision: str) -> None:
    """What the user reads holds: the plan printed first, then measured = planned, identical ranks, loss falls."""
    ranks, plan = result["ranks"], result["plan"]
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert result["precision"] == plan["precision"] == precision and plan["trains"] == ROWS[precision]

    # The plan printed before training: plain DDP does not fit the budget, hf_altparams does, the row that trains.
    assert re.search(r"plain DDP, fp32, AdamW over all\s+[\d.]+ GiB\s+[\d.]+ MiB\s+does NOT fit", out), out[-3000:]
    row = re.escape(ROWS[precision])
    assert re.search(row + r"\s+[\d.]+ GiB\s+[\d.]+ MiB\s+fits \(\d+% of [\d.]+ GiB\)\s+<- trains", out), out[-3000:]
    assert out.count("<- trains") == 1
    assert out.index("Precision:") < out.index("does NOT fit") < out.index("Measured")

    planned_state = plan["rows"][ROWS[precision]]["state_bytes"]
    size = 2 if precision == "bf16" else 4  # bytes per trainable gradient element, all-reduced
    for rank in ranks:
        steps = rank["steps"]
        # The planner's model state equals the tensors counted on the rank, to the byte, at its peak.
        assert max(s["state_bytes"] for s in steps) == planned_state
        # Each step all-reduced exactly the trainable bytes of its phase, as planned.
        assert [s["allreduced_bytes"] for s in steps] == [s["trainable_bytes"] for s in steps]
        assert [s["allreduced_bytes"] for s in steps] == plan["per_step_allreduce"]
        assert all(s["trainable_bytes"] % size == 0 for s in steps)
        # The peak is the process before the model + the planned state + the parts the plan does not count.
        assert rank["peak_bytes"] > rank["baseline_bytes"] + planned_state
    assert all(a["unexplained"] <= 0 for a in result["accounted"]), result["accounted"]
    assert len({s["phase"] for s in ranks[0]["steps"]}) >= 2, "the run must cross a phase switch"
    # Ranks end bit-identical.
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert "identical on every rank" in out
    # The loss on held-out text falls.
    assert ranks[0]["held_out_after"] < ranks[0]["held_out_before"]
    assert "counted = planned, to the byte: yes" in out
    assert "all-reduced = trainable bytes = planned: yes" in out
    # The recipe trains under a quarter of the model in every phase: no TrainShareWarning from the run.
    assert "TrainShareWarning" not in out, out[-3000:]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """The README's command as it is (--precision auto: the probe decides), LISA; its output and JSON."""
    folder = tmp_path_factory.mktemp("main_job_default")
    out = run_main_job(folder)
    return out, json.loads((folder / "fit_large_model_cpu_tiny_lisa.json").read_text())


@pytest.mark.distributed
def test_main_job_picks_the_precision_the_device_computes_fast_and_measures_the_plan(
    default_run: tuple[str, dict[str, Any]],
) -> None:
    out, result = default_run
    speed = result["bf16_speed"]
    assert speed["source"] == "probe" and speed["fp32_seconds"] > 0 and speed["bf16_seconds"] > 0
    precision = "bf16" if speed["fast"] else "fp32"
    check_run(out, result, precision)
    line = next(x for x in out.splitlines() if x.startswith("Precision:"))
    assert speed["reason"] in line and f"torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}" in line


def run_main_job_forked(out: Path, *extra: str, bf16: str, capfd: pytest.CaptureFixture[str]) -> str:
    """The main job as :func:`run_main_job` runs it, with its ranks forked from the suite's warm server.

    ``main()`` runs in this process (the verdict forced by ``HF_ALTPARAMS_BF16``, the plan, the report);
    only its ``launch`` (the ``torchrun`` command that the README's run, :func:`run_main_job`, exercises)
    is replaced: the same ranks (``--rank-of``: ``rank_main`` of the example) start as the ranks of
    ``launch(..., launcher="forked")``, with the environment a torchrun rank has. Every warning
    the driver raises is recorded (pytest would keep them out of its output); the driver's and
    the ranks' output and those warnings are returned.
    """
    example = load_example()

    def forked_ranks(run_dir: Path, args: Any) -> list[dict[str, Any]]:
        with pytest.MonkeyPatch.context() as env:
            env.delenv(BF16_ENV)  # decided before the launch; a rank never reads it (and it would key a new server)
            ranks = launch(EXAMPLE, "--rank-of", str(run_dir), nproc=args.ranks, launcher="forked", timeout=400)
        print(ranks.stdout, flush=True)
        return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(args.ranks)]

    argv = [*MAIN_JOB_ARGS, "--out", str(out), *extra]
    with pytest.MonkeyPatch.context() as env, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        env.setenv(BF16_ENV, bf16)
        env.setenv("CUDA_VISIBLE_DEVICES", "")
        env.setattr(example, "launch", forked_ranks)
        example.main(argv)
    captured = capfd.readouterr()
    return captured.out + captured.err + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)


@pytest.mark.distributed
def test_main_job_trains_fp32_where_bf16_is_slow_and_bf16_with_masters_where_it_is_fast(
    tmp_path: Path, default_run: tuple[str, dict[str, Any]], capfd: pytest.CaptureFixture[str]
) -> None:
    # The verdict forced to the one the probe did not give, with the other recipe: every CI run trains both
    # precisions (fp32 weights and bf16 + fp32 masters) and both recipes, in two runs of the main job.
    # The README's command itself (its own torchrun launch) is default_run's; this run forks its ranks.
    bf16 = "slow" if default_run[1]["bf16_speed"]["fast"] else "fast"
    recipe, precision = "badam", ("fp32" if bf16 == "slow" else "bf16")
    out = run_main_job_forked(tmp_path, "--recipe", recipe, bf16=bf16, capfd=capfd)
    result = json.loads((tmp_path / f"fit_large_model_cpu_tiny_{recipe}.json").read_text())
    check_run(out, result, precision)
    chosen = "fp32 weights" if precision == "fp32" else "bf16 weights + fp32 masters"
    assert f"Precision: {chosen}, because bf16 is taken as {bf16} on cpu: set by {BF16_ENV}={bf16}" in out
    assert ("--precision bf16 forces" if precision == "fp32" else "--precision fp32 forces") in out


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_large_model", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_precision_flag_forces_either_and_auto_follows_the_verdict() -> None:
    example = load_example()
    slow, fast = cpu_verdict("AVX2", 0.161, 16.205), cpu_verdict("AVX512", 0.035, 0.016)
    precision, why = example.choose_precision("auto", slow)
    assert precision == "fp32" and "16205.00 ms in bf16" in why and "~101x slower" in why
    assert example.choose_precision("auto", fast)[0] == "bf16"
    assert example.choose_precision("bf16", slow) == ("bf16", f"forced by --precision bf16; {slow.reason}")
    assert example.choose_precision("fp32", fast)[0] == "fp32"
    with pytest.raises(SystemExit):
        example.parse_args(["--precision", "fp16"])


def test_the_tiny_size_and_the_default_sizes_train_under_a_quarter_of_the_model_in_every_phase() -> None:
    example = load_example()
    from transformers import AutoModelForCausalLM

    def warning(shape: dict[str, int]) -> Optional[str]:
        example.SIZES["probe"] = shape
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(example.llama_config("probe", 30522))
        schedule = example.make_schedule("lisa", shape["layers"], 2, 4, 0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return schedule.trained_share(example.group_model(model)).warning

    assert warning(example.SIZES["tiny"]) is None
    assert warning(example.SIZES["tinyllama-1.1b"]) is None
    # the shape tiny had before (MLP 2048 wide): its embeddings and head were 37 % of it, and LISA warned
    old = warning(dict(example.SIZES["tiny"], intermediate=2048))
    assert old is not None and "in every phase" in old
