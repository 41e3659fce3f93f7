"""Wiring and loop mistakes on 2 ranks: each fails before a wrong step (or is repaired with a warning).

One launch of ``misuse_checks.py`` (2 gloo ranks under ``accelerate launch``)
serves every test here; the scenarios use different data on each rank, so a
gradient that is not all-reduced would show as ranks that differ.
"""

from __future__ import annotations

from typing import Any

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("misuse_checks")
    launch(
        script_path("misuse_checks.py"),
        str(out),
        nproc=NPROC,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return rank_results(out, nproc=NPROC)


@pytest.mark.distributed
def test_ddp_built_before_the_first_phase_is_rebucketed_with_a_warning(ranks: list[dict[str, Any]]) -> None:
    cases = [r["ddp_before_phase"] for r in ranks]
    for case in cases:
        assert any("built before phase 'a'" in w and "step_to(0)" in w for w in case["warnings"]), case["warnings"]
        assert case["reducer_after_attach"] == case["phase_a_params"]
    assert cases[0]["sha"] == cases[1]["sha"], "ranks diverged"


@pytest.mark.distributed
def test_forgotten_attach_is_refused_at_the_switch_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    cases = [r["forgot_attach"] for r in ranks]
    assert cases[0]["error"] == cases[1]["error"]
    assert "switcher.attach(ddp)" in cases[0]["error"] and "2 ranks" in cases[0]["error"]
    for case in cases:
        assert case["phase"] == "a" and case["b_trainable"] == [False, False]  # nothing half-applied


@pytest.mark.distributed
def test_training_forward_through_the_unwrapped_model_is_refused_at_step(ranks: list[dict[str, Any]]) -> None:
    cases = [r["unwrapped_forward"] for r in ranks]
    for case in cases:
        assert "unwrap_model" in case["error"] and "all-reduced" in case["error"]
        assert case["unchanged"] and case["steps"] == 1  # the wrong step was not applied
    assert cases[0]["sha"] == cases[1]["sha"]


@pytest.mark.distributed
def test_a_second_step_on_the_same_gradients_is_refused_as_such_not_blamed_on_the_forward(
    ranks: list[dict[str, Any]],
) -> None:
    cases = [r["doubled_step"] for r in ranks]
    for case in cases:
        assert "ran a second time on the same gradients" in case["error"], case["error"]
        assert "unwrap_model" not in case["error"]  # not the advice for a forward that bypassed DDP
        assert case["unchanged"] and case["steps"] == 1  # the second step was not applied, nor counted
    assert cases[0]["sha"] == cases[1]["sha"]


@pytest.mark.distributed
def test_epoch_schedule_without_set_epoch_fails_at_the_first_step_of_the_next_epoch(
    ranks: list[dict[str, Any]],
) -> None:
    for case in (r["epoch_never_set"] for r in ranks):
        assert "accelerator.set_epoch(epoch)" in case["error"] and "'b'" in case["error"]
        assert case["steps"] == case["per_epoch"]  # epoch 0 trained, nothing of epoch 1
        assert case["phases"] == ["a"] * case["per_epoch"] + ["a"]
    for case in (r["epoch_set"] for r in ranks):
        assert case["error"] == "" and case["warnings"] == []
        assert case["phases"] == ["a"] * case["per_epoch"] + ["b"] * case["per_epoch"]
    for case in (r["epoch_set_once"] for r in ranks):  # called once: maybe a long "epoch"; warned once
        assert case["error"] == "" and len(case["warnings"]) == 1
        assert "accelerator.set_epoch(epoch)" in case["warnings"][0]


@pytest.mark.distributed
def test_end_training_frees_the_reducer_then_destroys_the_group(ranks: list[dict[str, Any]]) -> None:
    for case in (r["end_training"] for r in ranks):
        assert case == {"reducer_freed": True, "group_destroyed": True}
