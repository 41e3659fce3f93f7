"""The switch's one collective (``settle``) and the two-step form, on three gloo ranks.

Every rank must take the same branch and, on the slow path, get the very same
text, also when a single rank of three is the odd one out (the majority's own
rows agree with it; only the gathered rows show the difference).
"""

from __future__ import annotations

from typing import Any

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 3


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("settle3")
    launch(script_path("settle_check.py"), str(out), nproc=NPROC, launcher="forked", timeout=180)
    return rank_results(out, nproc=NPROC)


def _same(ranks: list[dict[str, Any]], key: str) -> dict[str, Any]:
    outcomes = [r[key] for r in ranks]
    assert all(o == outcomes[0] for o in outcomes), (key, outcomes)
    return outcomes[0]


pytestmark = pytest.mark.distributed


def test_three_ranks_ran(ranks: list[dict[str, Any]]) -> None:
    assert [r["world_size"] for r in ranks] == [NPROC] * NPROC


@pytest.mark.parametrize("key", ["settle_all_agree", "settle_timeout_path", "in_step_after"])
def test_agreement_is_the_fast_path_on_every_rank(ranks: list[dict[str, Any]], key: str) -> None:
    assert _same(ranks, key) == {"returned": [None, False]}


@pytest.mark.parametrize("key", ["settle_last_disagrees", "settle_first_disagrees"])
def test_one_rank_of_three_asking_another_phase_fails_every_rank_alike(ranks: list[dict[str, Any]], key: str) -> None:
    message, all_refused = _same(ranks, key)["returned"]
    assert all_refused is False
    assert "ranks disagree on the phase at step 7" in message
    odd = 0 if key == "settle_first_disagrees" else NPROC - 1
    assert f"rank {odd} -> Phase(trainable=frozenset({{'b'}})" in message
    assert all(f"rank {r} -> Phase(trainable=frozenset({{'a'}})" in message for r in range(NPROC) if r != odd)


def test_a_rank_at_another_step_is_named(ranks: list[dict[str, Any]]) -> None:
    message, _ = _same(ranks, "settle_other_step")["returned"]
    assert (
        "steps [7, 8]" in message and "rank 1 -> Phase(trainable=frozenset({'b'}), resident=all) at step 8" in message
    )


def test_refusals_are_reported_with_their_ranks(ranks: list[dict[str, Any]]) -> None:
    message, all_refused = _same(ranks, "settle_one_refuses")["returned"]
    assert message == "phase switch at step 7 refused; rank 1: busy" and all_refused is False
    message, all_refused = _same(ranks, "settle_all_refuse")["returned"]
    assert all_refused is True
    assert message == "phase switch at step 7 refused; " + "; ".join(f"rank {r}: busy on {r}" for r in range(NPROC))


def test_a_failure_on_one_rank_fails_every_rank(ranks: list[dict[str, Any]]) -> None:
    message, all_refused = _same(ranks, "settle_one_fails")["returned"]
    assert all_refused is False
    assert message.startswith(f"phase switch to 'a' at step 7 failed (rank {NPROC - 1}: OOM)")
    assert "restored on every rank" in message


def test_the_two_step_form_agrees_alike(ranks: list[dict[str, Any]]) -> None:
    assert _same(ranks, "agree_all") == {"returned": None}
    assert "ranks disagree on the phase" in _same(ranks, "agree_last_disagrees")["error"]
    assert _same(ranks, "agree_one_refuses")["error"] == "phase switch at step 7 refused; rank 0: busy"
    assert _same(ranks, "failed_none") == {"returned": False}
    assert _same(ranks, "failed_last") == {"returned": True}
