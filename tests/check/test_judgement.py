"""The judge's newer findings on made-up readings: start, idle changes, growth per step, what memory is made of.

Each test builds the :class:`RankResult` s a run would write and asserts what
the verdict says about them; the real runs that produce such readings are in
``tests/check/test_check_findings.py``.
"""

from __future__ import annotations

import argparse
import random

import pytest

from hf_altparams.check import RankResult, Tolerances, judge
from hf_altparams.check.cli import _header
from hf_altparams.check.rank import IdleChange, StepRow, SwitchRow

KIB, MIB = 1 << 10, 1 << 20
CPU = Tolerances.for_source("RSS")


def result(
    r: int = 0,
    world: int = 2,
    *,
    steps: int = 60,
    per_step: float = 0.0,
    noise: int = 0,
    jump: tuple[int, int] = (0, 0),
    plan: int = 40 * MIB,
    seed: int = 0,
) -> RankResult:
    """A rank that trained ``steps`` steps, a switch every 3, holding the plan plus ``per_step`` bytes a step.

    ``noise``: each end-of-step reading moves by up to that many bytes either way;
    ``jump``: ``(step, bytes)``, a one-time rise from that step on.
    """
    rng = random.Random(seed)
    out = RankResult(
        rank=r,
        world=world,
        device="cpu",
        parallel="DDP",
        memory_source="RSS",
        first_prediction=plan,
        trainable_everything=100 * MIB,
        weights_compared=steps // 3 + 1,
        available=8 << 30,
        model_class="LlamaForCausalLM",
        description="small Llama; lisa",
        precision={"mixed_precision": "no", "dtypes": {"float32": 1.0}},
    )
    for step in range(steps):
        extra = int(per_step * step) + rng.randint(-noise, noise) + (jump[1] if step >= jump[0] else 0)
        out.steps.append(
            StepRow(
                step=step,
                phase=f"p{step // 3 % 3}",
                grad_bytes=10 * MIB,
                reduced_bytes=10 * MIB,
                expected_reduced=10 * MIB,
                held=plan + extra,
                seconds=0.1,
            )
        )
        if step % 3 == 2:
            out.switches.append(
                SwitchRow(
                    step=step + 1, phase=f"p{(step + 1) // 3 % 3}", seconds=0.01, level=plan + extra, predicted=plan
                )
            )
            out.peaks.append((f"p{step // 3 % 3}", plan + 20 * MIB))
    return out


def finding(verdict, name: str):  # type: ignore[no-untyped-def]
    return {f.check: f for f in verdict.findings}[name]


# ------------------------------------------------------------------ growth per step
@pytest.mark.parametrize("per_step", [256 * KIB, 200 * KIB])
def test_a_steady_leak_under_the_switch_tolerance_fails_projected_over_the_run(per_step: int) -> None:
    """15 MiB over 60 steps: under the switch-to-switch tolerance (16 MiB), fatal over 10,000 steps."""
    verdict = judge([result(0, per_step=per_step, noise=2 * MIB), result(1, per_step=per_step, noise=2 * MIB)], CPU)
    assert finding(verdict, "memory flat after warm-up").status == "pass"
    assert verdict.causes == ["memory_grows_per_step"]
    detail = verdict.failures[0]["detail"]
    assert "per step" in detail and "by step 10,000" in detail and "left before the plan's allowance" in detail


def test_the_projection_is_over_the_run_the_user_plans() -> None:
    leak = [result(0, per_step=256 * KIB)]
    assert judge(leak, Tolerances.for_source("RSS", run_steps=200)).passed  # ~35 MiB more: within the allowance
    assert judge(leak, Tolerances.for_source("RSS", run_steps=100_000)).causes == ["memory_grows_per_step"]


def test_a_leak_that_would_exhaust_the_device_says_when() -> None:
    leaking = result(0, per_step=256 * KIB)
    leaking.available = 100 * MIB
    detail = judge([leaking], CPU).failures[0]["detail"]
    assert "100.00 MiB available" in detail and "runs out of memory around step" in detail


@pytest.mark.parametrize("seed", range(5))
def test_noise_and_bookkeeping_creep_are_not_a_leak(seed: int) -> None:
    """RSS readings jumping by MiBs, and the few KiB a step that the run's records take (measured: 5-7 KiB)."""
    verdict = judge(
        [result(0, per_step=7 * KIB, noise=6 * MIB, seed=seed), result(1, noise=3 * MIB, seed=seed + 9)], CPU
    )
    assert finding(verdict, "memory per step").status == "pass", finding(verdict, "memory per step").detail


def test_a_one_time_rise_is_not_growth_per_step() -> None:
    """A cache filled once (or a first touch) in mid-run: both halves of the run do not grow alike."""
    verdict = judge([result(0, jump=(30, 24 * MIB))], CPU)
    assert finding(verdict, "memory per step").status == "pass", finding(verdict, "memory per step").detail


def test_too_few_steps_are_reported_as_such() -> None:
    assert finding(judge([result(steps=9)], CPU), "memory per step").status == "info"


# ------------------------------------------------------------------ the start
def test_ranks_built_differently_are_a_note_under_ddp_and_a_failure_where_nothing_makes_them_equal() -> None:
    ranks = [result(0), result(1)]
    for r in ranks:
        r.start_differs, r.start_equalized = ["layer0", "head"], True
    verdict = judge(ranks, CPU)
    assert verdict.passed and finding(verdict, "ranks start from the same weights").status == "info"
    assert any("DDP's constructor copies rank 0's parameters" in n and "torch.manual_seed" in n for n in verdict.notes)
    sharded = [result(0), result(1)]
    for r in sharded:
        r.parallel, r.start_differs, r.start_equalized, r.steps, r.switches = "FSDP2", ["layer0"], False, [], []
    verdict = judge(sharded, CPU)
    assert verdict.causes == ["unseeded_setup"]
    assert "under FSDP2 nothing makes them equal" in verdict.failures[0]["detail"]
    assert "FAILED: " in verdict.table() and "(unseeded_setup)" in verdict.table()


def test_ranks_built_alike_pass_the_start() -> None:
    assert finding(judge([result(0), result(1)], CPU), "ranks start from the same weights").status == "pass"


# ------------------------------------------------------------------ idle groups
def test_a_group_changed_while_idle_is_named_with_its_phase_and_steps() -> None:
    changed = result(1)
    changed.idle_changes = [IdleChange("layer2", "p0", 3, 6), IdleChange("head", "p0", 3, 6)]
    changed.idle_changed = 7
    verdict = judge([result(0), changed], CPU)
    assert verdict.causes == ["idle_group_changed"]
    detail = verdict.failures[0]["detail"]
    assert "rank 1" in detail and "'layer2' idle in phase 'p0', changed between steps 3 and 6" in detail
    assert "7 time(s)" in detail and "weight decay" in detail and "EMA" in detail


def test_idle_groups_that_stayed_put_pass() -> None:
    assert finding(judge([result(0), result(1)], CPU), "idle groups unchanged").status == "pass"


# ------------------------------------------------------------------ what memory is made of
def test_memory_over_the_plan_says_what_is_read_and_what_holds_it() -> None:
    held = result(0, jump=(0, 500 * MIB))
    held.census = {
        "weights and buffers": 30 * MIB,
        "gradients": 0,
        "optimizer state": 10 * MIB,
        "other tensors": 512 * MIB,
        "rest": -2 * MIB,
    }
    verdict = judge([held], CPU)
    assert verdict.causes == ["memory_over_plan"]
    detail = verdict.failures[0]["detail"]
    assert "resident memory above its baseline" in detail and "Planned: the memory model's weights" in detail
    assert "other tensors 512.00 MiB" in detail and "held by code outside the model and its optimizer" in detail


# ------------------------------------------------------------------ warnings, header
def test_the_ranks_warnings_are_printed_once_with_their_ranks() -> None:
    frozen = "UserWarning: hf_altparams: these parameters stay frozen for the whole run"
    ranks = [result(0), result(1)]
    ranks[0].warnings = [frozen, "FutureWarning: old"]
    ranks[1].warnings = [frozen]
    verdict = judge(ranks, CPU)
    table = verdict.table()
    assert table.count("stay frozen for the whole run") == 1
    assert f"- ranks 0, 1: {frozen}" in table and "- rank 0: FutureWarning: old" in table
    assert verdict.as_dict()["warnings"] == [
        {"text": frozen, "ranks": [0, 1]},
        {"text": "FutureWarning: old", "ranks": [0]},
    ]


def test_the_header_names_the_model_class_and_the_precision() -> None:
    rank0 = result(0)
    rank0.precision = {"mixed_precision": "bf16", "dtypes": {"float32": 0.9, "bfloat16": 0.1}}
    header = _header([rank0, result(1)], "torchrun, 2 ranks", argparse.Namespace(steps=60))
    assert "LlamaForCausalLM: small Llama; lisa" in header
    assert "float32 (90%) + bfloat16 (10%) weights, mixed precision bf16 (autocast to bf16)" in header


def test_autocast_to_bf16_where_it_is_slow_gets_a_note() -> None:
    slow = result(0)
    slow.bf16 = {"fast": False, "autocast": True, "warning": "Accelerate's mixed_precision='bf16' runs ... slow"}
    assert "Accelerate's mixed_precision='bf16' runs ... slow" in judge([slow], CPU).notes


def test_autocast_to_bf16_is_judged_by_the_planner_s_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    from torch import nn

    from hf_altparams.check.rank import _bf16

    monkeypatch.setenv("HF_ALTPARAMS_BF16", "slow")
    fp32 = nn.Linear(2, 2)
    slow = _bf16(fp32, torch.device("cpu"), "bf16")
    assert slow is not None and slow["autocast"] and not slow["fast"]
    assert "mixed_precision='bf16' runs the forward and backward in bf16" in slow["warning"]
    assert "ACCELERATE_MIXED_PRECISION=no" in slow["warning"]
    assert _bf16(fp32, torch.device("cpu"), "no") is None  # computes in fp32: nothing to say
    monkeypatch.setenv("HF_ALTPARAMS_BF16", "fast")
    assert _bf16(fp32, torch.device("cpu"), "bf16")["warning"] is None  # type: ignore[index]
