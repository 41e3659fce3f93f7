"""The 🤗 Trainer with AlternatingFreeze on two gloo ranks: diverged weights, damaged checkpoints, other groups,
a forward that reaches no trainable parameter, and an FSDP2 run resumed, saved and resumed again.

One launch of ``trainer_integrity.py`` (its docstring lists the scenarios).
"""

from __future__ import annotations

from typing import Any

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trainer_integrity")
    launch(script_path("trainer_integrity.py"), str(out), nproc=NPROC, launcher="forked", timeout=900)
    return rank_results(out, nproc=NPROC)


@pytest.mark.distributed
def test_a_drifted_rank_is_caught_before_the_trainer_saves(ranks: list[dict[str, Any]]) -> None:
    messages = set()
    for r in ranks:
        error = r["drift_at_save"]["error"]
        assert error["type"] == "DriftError", error
        assert "before the Trainer's save at step 2" in error["message"], error
        assert "group 'emb' differs on rank 1 (compared with rank 0)" in error["message"], error
        assert not r["drift_at_save"]["checkpoint_2_written"]  # refused before the Trainer wrote anything
        messages.add(error["message"])
    assert len(messages) == 1  # the same error on every rank


@pytest.mark.distributed
def test_drift_check_at_every_switch_through_switcher_options(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error = r["drift_at_switch"]["error"]
        assert error["type"] == "DriftError", error
        assert "after the switch to 'layer1' at step 2" in error["message"], error
        assert "group 'emb' differs on rank 1" in error["message"], error


@pytest.mark.distributed
def test_resume_with_same_sized_but_swapped_groups_is_refused(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error = r["other_groups"]
        assert error["type"] == "PlanError", error
        assert "saved with other groups" in error["message"], error
        assert "group 'layer0' held ['bert.encoder.layer.0" in error["message"], error
        assert "group 'layer1'" in error["message"]


@pytest.mark.distributed
def test_resume_from_a_checkpoint_missing_its_optimizer_file_is_refused_naming_it(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error = r["no_optimizer_file"]
        assert error["is_library_error"], error
        assert "'optimizer.pt' is missing" in error["message"], error


@pytest.mark.distributed
def test_a_forward_that_skips_the_phase_gets_the_library_error(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error = r["unreached"]["error"]
        assert error["type"] == "UnreachedPhaseError", error
        assert "trains in phase 'aux' (groups ['aux']; 2 of their 2 parameters require grad)" in error["message"]
        assert "element 0 of tensors" not in error["message"]
        assert "find_unused_parameters" not in error["message"]


@pytest.mark.distributed
def test_fsdp2_trainer_resumed_then_saved_resumes_again_exactly(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        run = r["fsdp2_resume_save"]
        assert run["first_resume"]["type"] is None, run["first_resume"]  # before: KeyError in get_optimizer_state_dict
        assert run["checkpoints_of_first"] == ["checkpoint-4", "checkpoint-6"], run
        assert run["second_resume"]["type"] is None, run["second_resume"]
        assert run["bitwise_equal"] == {"first": True, "second": True}, run
