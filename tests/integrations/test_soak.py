"""A short soak: 300 switches of a random schedule on 2 ranks (``benchmarks/soak.py`` runs 10,000).

RandomBlocks phases and PerTaskCycle phases (the other task head off the
device) drawn at random every step, with ``keep`` / ``offload`` / ``drop``
optimizer state per group, through ``PhasedAccelerator``. RSS flatness is left
to the benchmark: over a few hundred switches on a loaded machine it is not a
robust assertion.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

SWITCHES = 300  # more than the history's default window (256): the bound is exercised


@pytest.mark.distributed
def test_random_schedule_soak_keeps_ranks_bit_identical_and_history_bounded(tmp_out: Path) -> None:
    launch(
        script_path("soak_check.py"),
        str(tmp_out),
        "--switches",
        str(SWITCHES),
        "--warmup",
        "100",
        "--sample-every",
        "100",
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    ranks = rank_results(tmp_out, nproc=2)

    assert ranks[0]["digest"] == ranks[1]["digest"], "parameters or optimizer state differ between ranks"
    for r in ranks:
        assert r["switches"] == SWITCHES
        assert r["steps"] > SWITCHES  # some draws repeat the phase: no switch then
        assert r["records_kept"] == r["window"] < SWITCHES
        kinds = r["phase_kinds_per_step"]
        assert kinds["random_blocks"] > 0 and kinds["per_task"] > 0, kinds
