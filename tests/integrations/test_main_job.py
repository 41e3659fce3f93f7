"""The README's main job (examples/fit_large_model.py) at a tiny size: what a user reads in its output holds.

The same code as the default run: the plan printed before training, two gloo ranks started by the
script itself, PhasedAccelerator + PrecisionOptimizer (bf16 storage, fp32 masters) under LISA, then
the measured figures next to the planned ones. The memory budget is given (``--memory-gib``) so
that at this size, too, the plan says plain DDP does not fit while bf16 + masters does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fit_large_model.py"


def run_main_job(out: Path, *extra: str) -> str:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--size", "tiny", "--memory-gib", "0.28", "--steps", "5",
                           "--every", "2", "--batch", "2", "--seq", "64", "--out", str(out), *extra],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["lisa", "badam"])
def test_main_job_trains_what_plain_ddp_cannot_fit_and_measures_the_plan(tmp_path: Path, recipe: str) -> None:
    out = run_main_job(tmp_path, "--recipe", recipe)
    result = json.loads((tmp_path / f"fit_large_model_cpu_tiny_{recipe}.json").read_text())
    ranks, plan = result["ranks"], result["plan"]
    assert [r["world_size"] for r in ranks] == [2, 2]

    # The plan printed before training: plain DDP does not fit the budget, bf16 + fp32 masters does.
    assert re.search(r"plain DDP, fp32, AdamW over all\s+[\d.]+ GiB\s+[\d.]+ MiB\s+does NOT fit", out), out[-3000:]
    assert re.search(r"hf_altparams, bf16 \+ fp32 masters\s+[\d.]+ GiB\s+[\d.]+ MiB\s+fits", out)
    assert out.index("does NOT fit") < out.index("Measured over")

    planned_state = plan["rows"]["hf_altparams, bf16 + fp32 masters"]["state_bytes"]
    for rank in ranks:
        steps = rank["steps"]
        # The planner's model state equals the tensors counted on the rank, to the byte, at its peak.
        assert max(s["state_bytes"] for s in steps) == planned_state
        # Each step all-reduced exactly the trainable bytes of its phase, as planned (bf16: 2 B each).
        assert [s["allreduced_bytes"] for s in steps] == [s["trainable_bytes"] for s in steps]
        assert [s["allreduced_bytes"] for s in steps] == plan["per_step_allreduce"]
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
