"""FSDP2 (fully_shard) engine on 2 and 4 gloo CPU ranks: one launch each, several checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [2, 4])
def test_fsdp2_schedules_match_reference_and_count_trainable_bytes(tmp_out: Path, nproc: int) -> None:
    launch(script_path("fsdp2_check.py"), str(tmp_out), nproc=nproc, launcher="forked")
    ranks = rank_results(tmp_out, nproc=nproc)
    rank0 = ranks[0]
    assert rank0["world"] == nproc
    planned = rank0["schedules"].pop("planner")
    assert set(rank0["schedules"]) == {"alternating", "gradual_unfreeze", "random_blocks"}
    # the planner's FSDP2 mode: reduce-scatter bytes per step as counted, rank 0's shards as held
    assert planned["reduce_scatter"] == rank0["schedules"]["alternating"]["counted"]
    assert planned["param_bytes"] == planned["local_param_bytes"]
    for schedule, result in rank0["schedules"].items():
        # same parameters as one process on the concatenated batch
        assert result["max_diff"] < 1e-5, (schedule, result["max_diff"])
        # bytes fed to reduce-scatter each step == the phase's trainable (padded) gradient bytes
        assert result["counted"] == result["expected"], schedule
        assert len(set(result["expected"])) > 1, schedule  # the phases reduce different amounts
        for other in ranks[1:]:  # ranks identical
            assert result["digest"] == other["schedules"][schedule]["digest"], schedule
    for result in ranks:
        assert result["bf16_counted"] == result["bf16_expected"]
        # bf16 MixedPrecisionPolicy: the unit frozen at the first forward trains once unfrozen
        assert all(result["bf16_moved"].values()), result["bf16_moved"]

    # DTensor optimizer state under each idle-state policy, and per-task residency with shard moves
    state = rank0["state"]
    for name, result in state.items():
        assert result["max_diff"] < 1e-5, (name, result["max_diff"])  # == the one-process run
        assert all(r["state"][name]["digest"] == result["digest"] for r in ranks), name
    assert state["offload"]["digest"] == state["keep"]["digest"]  # offloading changes nothing
    assert state["drop"]["digest"] != state["keep"]["digest"]  # dropping resets Adam's state
    for r in ranks:  # idle groups hold no state under drop; they do under keep (this rank's shards)
        assert r["state"]["drop"]["idle_state_bytes"][1:8] == [0] * 7
        assert all(b > 0 for b in r["state"]["keep"]["idle_state_bytes"][1:8])
        # memory_report's census == this rank's parameter and state shards (last entry: the difference)
        assert all(r["state"][name]["idle_state_bytes"][8] == 0 for name in state), r["state"]
