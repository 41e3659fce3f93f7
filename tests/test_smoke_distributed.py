"""Two real processes, gloo on CPU, under both launchers the library supports."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_altparams.testing import launch, rank_results, script_path

NPROC = 2


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_two_ranks_allreduce_and_ddp_step(tmp_out: Path, launcher: str) -> None:
    launch(script_path("smoke_allreduce.py"), str(tmp_out), nproc=NPROC, launcher=launcher)
    ranks = rank_results(tmp_out, nproc=NPROC)

    assert [r["rank"] for r in ranks] == list(range(NPROC))
    assert all(r["world_size"] == NPROC for r in ranks), ranks
    assert all(r["backend"] == "gloo" for r in ranks)
    assert len({r["pid"] for r in ranks}) == NPROC, "ranks must be separate processes"
    assert all(r["allreduce_sum"] == NPROC * (NPROC + 1) / 2 for r in ranks)

    # Seeded differently per rank, so DDP's constructor really had to broadcast ...
    assert ranks[0]["param_sha256_before_ddp"] != ranks[1]["param_sha256_before_ddp"]
    # ... and after one averaged step the ranks are bit-identical.
    assert all(r["grad_is_average"] for r in ranks)
    assert all(r["grad_sha256"] == ranks[0]["grad_sha256"] for r in ranks)
    assert all(r["param_sha256"] == ranks[0]["param_sha256"] for r in ranks)
