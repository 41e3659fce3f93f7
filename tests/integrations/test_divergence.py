"""No silent divergence when ``requires_grad`` changes behind the schedule's back (2 gloo ranks).

Before: with one plain optimizer and ``groups=``, a helper calling
``model.requires_grad_(True)`` once at step 1 gave an idle group gradients DDP
never all-reduced, and ten steps later the ranks' weights differed, without a
word; following the old advice (``find_unused_parameters=True``) silenced the
refusal for the wrong head and diverged too. Now every such step is refused on
every rank before a weight changes (``tests/scripts/divergence_check.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("divergence")
    launch(
        script_path("divergence_check.py"),
        str(out),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return rank_results(out, nproc=2)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "case,phase,names",
    [
        ("helper_unfreezes", "a", "['trunk.weight', 'trunk.bias']"),
        ("advice_followed", "trunk_a", "['b.weight', 'b.bias']"),
    ],
)
def test_an_unreduced_gradient_is_refused_on_every_rank_before_the_step(
    ranks: list[dict[str, Any]], case: str, phase: str, names: str
) -> None:
    for r in ranks:
        error = r[case]["error"]
        assert error is not None and f"outside phase {phase!r} hold gradients (e.g. {names})" in error
        assert "The step was not applied" in error and "set_adapter" in error
        assert r[case]["unchanged"] == [True] and r[case]["steps"] == 1
    assert ranks[0][case]["digest"] == ranks[1][case]["digest"]


@pytest.mark.distributed
def test_flags_changed_after_the_backward_are_put_back_and_the_ranks_stay_identical(
    ranks: list[dict[str, Any]],
) -> None:
    for r in ranks:
        assert r["after_backward"]["error"] is None and r["after_backward"]["steps"] == 10
        assert len(r["after_backward"]["warnings"]) == 1 and "flags were put back" in r["after_backward"]["warnings"][0]
    assert ranks[0]["after_backward"]["digest"] == ranks[1]["after_backward"]["digest"]


@pytest.mark.distributed
def test_the_trainer_refuses_it_too(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        error = r["trainer_callback"]["error"]
        assert error is not None and "outside phase 'a' hold gradients (e.g. ['trunk.weight', 'trunk.bias'])" in error
