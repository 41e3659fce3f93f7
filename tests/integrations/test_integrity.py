"""PhasedAccelerator on two gloo ranks: diverged weights, torn or damaged checkpoints, other groups, raw errors.

One launch of ``integrity_checks.py`` (its docstring lists the scenarios); each
test asserts what a user would see on both ranks.
"""

from __future__ import annotations

from typing import Any

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("integrity")
    launch(
        script_path("integrity_checks.py"),
        str(out),
        nproc=NPROC,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=600,
    )
    return rank_results(out, nproc=NPROC)


def _both(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in ranks]


@pytest.mark.distributed
def test_a_rank_with_one_changed_element_is_caught_at_the_next_save(ranks: list[dict[str, Any]]) -> None:
    for r in _both(ranks, "drift_at_save"):
        error = r["error"]
        assert error["type"] == "DriftError", error
        assert "before save_state at step 3" in error["message"], error
        assert "group 'b' differs on rank 1 (compared with rank 0)" in error["message"], error
        assert "group 'a'" not in error["message"]  # only the changed group is named
        assert "nothing was written" in error["message"]
        # the refused save touched nothing: the earlier `latest` loads, and both ranks agree again
        assert r["loaded_step"] == 2 and r["loaded_is_saved"] and r["ranks_equal_after_load"], r
    assert ranks[0]["drift_at_save"]["error"]["message"] == ranks[1]["drift_at_save"]["error"]["message"]


@pytest.mark.distributed
def test_drift_check_every_n_steps_raises_at_the_step_it_is_due(ranks: list[dict[str, Any]]) -> None:
    for r in _both(ranks, "drift_every_n"):
        assert r["error"]["type"] == "DriftError", r
        assert "at step 2 (drift_check=2)" in r["error"]["message"], r
        assert "group 'a' differs on rank 1" in r["error"]["message"], r
        assert r["steps_done"] == [1]  # the optimizer step ending step 2 raised: no step after it ran


@pytest.mark.distributed
def test_a_save_into_an_existing_folder_killed_after_the_model_leaves_no_marker(ranks: list[dict[str, Any]]) -> None:
    for r in _both(ranks, "torn_in_place"):
        assert r["killed"]["type"] == "Killed", r  # the second save died right after model.safetensors
        assert r["load"]["is_library_error"], r  # refused: the old marker was removed before anything was written
        assert "has no hf_altparams_complete.json, so its save was interrupted" in r["load"]["message"], r


@pytest.mark.distributed
def test_a_complete_checkpoint_with_a_missing_or_truncated_file_is_refused_naming_it(
    ranks: list[dict[str, Any]],
) -> None:
    for r in _both(ranks, "damaged"):
        no_model, half, missing = r["no_model"], r["half_optimizer"], r["missing_folder"]
        assert no_model["is_library_error"] and "'model.safetensors' is missing" in no_model["message"], no_model
        assert "pytorch_model.bin" not in no_model["message"]
        assert half["is_library_error"] and "'optimizer.bin' has" in half["message"], half
        assert "truncated" in half["message"]
        assert missing["is_library_error"] and "does not exist" in missing["message"], missing
        assert "interrupted" not in missing["message"]


@pytest.mark.distributed
def test_resume_with_other_groups_is_refused_under_plain_sgd(ranks: list[dict[str, Any]]) -> None:
    for r in _both(ranks, "other_groups"):
        load = r["load"]
        assert load["is_library_error"] and "saved with other groups" in load["message"], load
        assert "group 'a' held ['trunk.weight', 'trunk.bias'] in the checkpoint only" in load["message"], load
        assert "group 'b'" in load["message"]


@pytest.mark.distributed
def test_total_limit_never_deletes_the_last_complete_checkpoint_for_torn_ones(ranks: list[dict[str, Any]]) -> None:
    for r in _both(ranks, "total_limit"):
        assert [t["type"] for t in r["torn"]] == ["Killed"] * 3, r["torn"]
        # plain Accelerate (total_limit=2) deleted checkpoint_0 to make room for torn folders
        assert r["after_torn"]["folders"] == [f"checkpoint_{n}" for n in range(4)], r
        assert r["after_torn"]["latest"].endswith("checkpoint_0"), r
        assert r["after_one_complete"] == ["checkpoint_0", "checkpoint_4"], r  # torn ones pruned
        assert r["after_two_complete"] == ["checkpoint_4", "checkpoint_5"], r
        assert r["latest"].endswith("checkpoint_5")


@pytest.mark.distributed
def test_a_forward_that_reaches_no_trainable_parameter_gets_the_library_error(ranks: list[dict[str, Any]]) -> None:
    for r in _both(ranks, "unreached"):
        error = r["error"]
        assert r["phase"] == "b"
        assert error["type"] == "UnreachedPhaseError" and error["is_library_error"], error
        assert "does not depend on any parameter that trains in phase 'b' (groups ['b']" in error["message"]
        assert "element 0 of tensors" not in error["message"]
        assert "find_unused_parameters" not in error["message"]  # would not fix any of the causes
        for cause in ("skips", "set_adapter", "torch.no_grad()", "use_reentrant", "requires_grad_(False)"):
            assert cause in error["message"], cause
