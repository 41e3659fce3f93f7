"""The judge of ``check`` on made-up readings: each failure cause is found, named, and only when it is there."""

from __future__ import annotations

from typing import Optional

import pytest

from hf_altparams.check import CAUSES, RankResult, Tolerances, judge
from hf_altparams.check.rank import Failure, StepRow, SwitchRow
from hf_altparams.check.verdict import classify

MIB = 1 << 20
CPU = Tolerances.for_source("RSS")


def rank(
    r: int = 0,
    world: int = 2,
    *,
    growth_per_switch: int = 0,
    held_extra: int = 0,
    reduced_extra: int = 0,
    switches: int = 12,
    failure: Optional[Failure] = None,
    warnings: tuple[str, ...] = (),
    warning_causes: tuple[tuple[str, str], ...] = (),
) -> RankResult:
    """One rank's readings: a switch every step, 40 MiB planned, ``held_extra`` over it, flat unless told."""
    result = RankResult(
        rank=r,
        world=world,
        device="cpu",
        parallel="DDP",
        memory_source="RSS",
        first_prediction=40 * MIB,
        trainable_everything=100 * MIB,
        failure=failure,
        warnings=list(warnings),
        warning_causes=list(warning_causes),
        weights_compared=switches + 1,
    )
    for step in range(switches):
        phase = f"p{step % 3}"
        result.steps.append(
            StepRow(
                step=step,
                phase=phase,
                grad_bytes=10 * MIB,
                reduced_bytes=10 * MIB + reduced_extra,
                expected_reduced=10 * MIB,
                held=40 * MIB + held_extra,
                seconds=0.1,
            )
        )
        result.switches.append(
            SwitchRow(
                step=step + 1,
                phase=f"p{(step + 1) % 3}",
                seconds=0.01,
                level=40 * MIB + held_extra + step * growth_per_switch,
                predicted=40 * MIB,
            )
        )
        result.peaks.append((phase, 60 * MIB))
    return result


def test_a_correct_run_passes_with_every_check_judged() -> None:
    verdict = judge([rank(0), rank(1)])
    assert verdict.passed and verdict.causes == []
    status = {f.check: f.status for f in verdict.findings}
    assert status["ranks bit-identical after each switch"] == "pass"
    assert status["bytes all-reduced = trainable bytes"] == "pass"
    assert status["memory flat after warm-up"] == "pass"
    assert status["memory held vs plan"] == "pass"
    assert "PASSED" in verdict.table()


def test_memory_growing_from_switch_to_switch_is_named_with_its_figure() -> None:
    verdict = judge([rank(0), rank(1, growth_per_switch=8 * MIB)])
    assert not verdict.passed and verdict.causes[0] == "memory_grows"
    failure = verdict.failures[0]
    assert failure["rank"] == 1 and "MiB over 10 switches" in failure["detail"]
    assert "FAILED: memory grows from switch to switch (memory_grows)" in verdict.table()


def test_growth_within_the_tolerance_passes_and_beyond_it_fails() -> None:
    # the trend over 10 switches after warm-up is about 2/3 of the total growth
    assert judge([rank(growth_per_switch=MIB)], CPU).passed  # ~6 MiB < 16 MiB
    assert judge([rank(growth_per_switch=4 * MIB)], CPU).causes == ["memory_grows"]  # ~27 MiB


def test_noise_without_a_trend_is_not_growth() -> None:
    result = rank()
    for i, switch in enumerate(result.switches):
        switch.level += (12 * MIB) if i % 2 else 0  # up and down by 12 MiB, no trend
    assert judge([result], CPU).passed


def test_memory_beyond_the_plan_is_named() -> None:
    assert judge([rank(held_extra=10 * MIB)], CPU).passed  # 50 MiB <= 1.25 x 40 + 64 MiB
    verdict = judge([rank(held_extra=200 * MIB)], CPU)
    assert verdict.causes == ["memory_over_plan"] and "6.00x" in verdict.failures[0]["detail"]


def test_bytes_other_than_the_trainable_gradients_are_named() -> None:
    verdict = judge([rank(0), rank(1, reduced_extra=4096)])
    assert verdict.causes == ["bytes_mismatch"]
    assert "24 of 24 rank-steps" not in verdict.failures[0]["detail"]
    assert "12 of 24 rank-steps differ" in verdict.failures[0]["detail"]


@pytest.mark.parametrize(
    "kind, message, cause",
    [
        ("SwitchError", "ranks disagree on the phase at step 0 (...)", "schedule_differs_per_rank"),
        (
            "AltParamsError",
            "2 trainable parameter(s) of phase 'b' got no gradient (...) `requires_grad` off behind "
            "the schedule's back causes it too",
            "trainable_param_unused",
        ),
        ("RuntimeError", "ranks disagree on the phase at step 0 (...)", "error"),
    ],
)
def test_a_recorded_failure_is_named_by_its_cause_whatever_its_message_says(
    kind: str, message: str, cause: str
) -> None:
    # (tests/check/test_causes.py raises each cause the way the library does)
    assert classify(Failure("step", 3, kind, message, cause=cause)) == cause
    assert cause in CAUSES


def test_a_requires_grad_warning_fails_the_run_although_the_library_mended_it() -> None:
    line = (
        "hf_altparams: `requires_grad` of 2 parameter(s) (e.g. ['a.weight']) no longer matched "
        "phase 'b' at this optimizer step; ..."
    )
    caused = (("requires_grad_behind_schedule", line),)
    verdict = judge(
        [
            rank(0, warnings=(f"AltParamsWarning: {line}",), warning_causes=caused),
            rank(1, warnings=(f"AltParamsWarning: {line}",), warning_causes=caused),
        ]
    )
    assert verdict.causes == ["requires_grad_behind_schedule"]
    assert len(verdict.failures) == 1 and verdict.failures[0]["ranks"] == [0, 1]  # one failure, both ranks
    assert judge([rank(0, warnings=(f"UserWarning: {line}",))]).passed  # a warning's text names no cause


def test_a_rank_without_a_result_is_lost_unless_another_names_the_cause() -> None:
    assert judge([rank(0), None]).causes == ["rank_lost"]
    drift = Failure(
        "step", 4, "DriftError", "the ranks hold different weights after the switch to 'b'", cause="ranks_drift"
    )
    lost = Failure("step", 4, "AltParamsError", "got no answer from the other ranks", cause="rank_lost")
    verdict = judge([rank(0, failure=drift), rank(1, failure=lost), None])
    assert verdict.causes == ["ranks_drift"]


def test_the_same_error_on_every_rank_is_one_failure_with_its_ranks() -> None:
    error = Failure("prepare", None, "SwitchError", "ranks disagree on the phase at step 0 (...)")
    verdict = judge([rank(0, failure=error), rank(1, failure=error)])
    assert len(verdict.failures) == 1 and verdict.failures[0]["ranks"] == [0, 1]


def test_too_few_switches_are_reported_as_such_not_passed() -> None:
    finding = {f.check: f for f in judge([rank(switches=3)]).findings}["memory flat after warm-up"]
    assert finding.status == "info" and "too few" in finding.detail


def test_results_survive_the_json_round_trip() -> None:
    original = rank(1, failure=Failure("step", 2, "DriftError", "x", "f.py:3"))
    assert RankResult.from_dict(original.as_dict()) == original
    assert judge([original]).as_dict()["causes"] == ["ranks_drift"]


def test_idle_state_left_on_the_device_against_its_policy_is_named() -> None:
    result = rank()
    for switch in result.switches:
        switch.idle_checked = 2
    assert {f.check: f.status for f in judge([result]).findings}["idle optimizer state as its policy says"] == "pass"
    result.switches[5].idle_held, result.switches[5].idle_held_groups = 3 * MIB, ["layer2"]
    verdict = judge([result])
    assert verdict.causes == ["idle_state_held"]
    assert "idle group(s) ['layer2'] still hold 3.00 MiB" in verdict.failures[0]["detail"]
