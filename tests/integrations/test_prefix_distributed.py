"""Frozen-prefix cache on two gloo ranks through PhasedAccelerator (one launch of ``prefix_checks.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path
from tests.scripts.prefix_checks import N

NPROC = 2
PER_RANK = N // NPROC


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("prefix_checks")
    launch(
        script_path("prefix_checks.py"),
        str(out),
        nproc=NPROC,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return rank_results(out, nproc=NPROC)


@pytest.mark.distributed
@pytest.mark.parametrize("kind, depths", [("progressive", [1, 2]), ("gradual", [4, 3, 2])])
def test_cached_run_equals_uncached_run_on_two_ranks(ranks: list[dict[str, Any]], kind: str, depths: list[int]) -> None:
    for r in ranks:
        s = r[kind]
        assert s["max_abs_diff"] < 1e-6 and s["plain_sha"] == s["cached_sha"]
        # each phase: two epochs over the rank's fixed shard: the first computes, the second hits
        assert [(x["depth"], x["hit"], x["miss"]) for x in s["cached_records"]] == [
            (d, PER_RANK, PER_RANK) for d in depths
        ]
        assert all(x["hit"] == 0 for x in s["plain_records"])
    assert ranks[0][kind]["cached_sha"] == ranks[1][kind]["cached_sha"], "ranks must stay bit-identical"
    logged = ranks[0][kind]["cached_logged_keys"]
    assert {"altparams/prefix_hit_rate", "altparams/prefix_memory_bytes", "altparams/prefix_seconds_saved"} <= set(
        logged
    )


@pytest.mark.distributed
def test_globally_shuffled_loader_stays_equal(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["global_shuffle"]
        assert s["max_abs_diff"] < 1e-6
        assert sum(x["miss"] for x in s["cached_records"]) > 0


@pytest.mark.distributed
def test_resume_with_the_cache_is_exact(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        s = r["resume"]
        assert s["resumed_sha"] == s["uninterrupted_sha"]
        assert s["records_resumed"][-1]["hit"] == PER_RANK  # the cache filled again after the resume
    assert ranks[0]["resume"]["resumed_sha"] == ranks[1]["resume"]["resumed_sha"]
