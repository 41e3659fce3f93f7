"""FSDP2 (fully_shard) engine on 2 gloo CPU ranks: one launch, several checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_altparams.testing import launch, rank_results, script_path


@pytest.mark.distributed
def test_fsdp2_schedules_match_reference_and_count_trainable_bytes(tmp_out: Path) -> None:
    launch(script_path("fsdp2_check.py"), str(tmp_out), nproc=2, launcher="torchrun")
    rank0, rank1 = rank_results(tmp_out, nproc=2)
    assert set(rank0["schedules"]) == {"alternating", "gradual_unfreeze", "random_blocks"}
    for schedule, result in rank0["schedules"].items():
        # same parameters as one process on the concatenated batch
        assert result["max_diff"] < 1e-5, (schedule, result["max_diff"])
        # bytes fed to reduce-scatter each step == the phase's trainable (padded) gradient bytes
        assert result["counted"] == result["expected"], schedule
        assert len(set(result["expected"])) > 1, schedule  # the phases reduce different amounts
        assert result["digest"] == rank1["schedules"][schedule]["digest"], schedule  # ranks identical
    for result in (rank0, rank1):
        assert result["bf16_counted"] == result["bf16_expected"]
        # bf16 MixedPrecisionPolicy: the unit frozen at the first forward trains once unfrozen
        assert all(result["bf16_moved"].values()), result["bf16_moved"]
