"""LISA and BAdam recipes: the phases a user of those methods expects, equal across processes."""

from __future__ import annotations

import pytest

from hf_altparams import PlanError, badam, lisa

LAYERS = [f"l{i}" for i in range(6)]


def test_lisa_trains_embeddings_and_head_always_and_k_layers_redrawn_every_period() -> None:
    s = lisa(LAYERS, k=2, every=3, seed=7)
    draws = []
    for step in range(0, 30, 3):
        phase = s.phase_at(step)
        assert {"emb", "head"} <= phase.trainable
        layers = phase.trainable - {"emb", "head"}
        assert len(layers) == 2 and layers <= set(LAYERS)
        assert all(s.phase_at(step + i).trainable == phase.trainable for i in range(3))
        draws.append(frozenset(layers))
    assert len(set(draws)) > 1, "the layers must be re-drawn"
    again = lisa(LAYERS, k=2, every=3, seed=7)  # another rank, or a resumed run
    assert [again.phase_at(i) for i in range(30)] == [s.phase_at(i) for i in range(30)]


@pytest.mark.parametrize("order, first_sweep", [("ascending", LAYERS), ("descending", LAYERS[::-1])])
def test_badam_one_block_at_a_time_in_order(order: str, first_sweep: list[str]) -> None:
    s = badam(LAYERS, steps_per_block=2, order=order)  # type: ignore[arg-type]
    assert [s.phase_at(2 * i).name for i in range(6)] == first_sweep
    assert all(s.phase_at(2 * i).trainable == s.phase_at(2 * i + 1).trainable for i in range(12))
    assert s.phase_at(12).name == first_sweep[0]


def test_badam_random_order_trains_every_block_once_per_sweep_with_extra_groups() -> None:
    s = badam(LAYERS, steps_per_block=1, order="random", always=["head"], seed=3)
    sweeps = [[s.phase_at(n * 6 + i).trainable - {"head"} for i in range(6)] for n in range(3)]
    for sweep in sweeps:
        assert sorted(next(iter(b)) for b in sweep) == LAYERS
    assert sweeps[0] != sweeps[1] or sweeps[1] != sweeps[2], "a new order every sweep"
    assert all("head" in s.phase_at(i).trainable for i in range(18))


@pytest.mark.parametrize("call, message", [
    (lambda: badam(LAYERS, order="shuffled"), "`order` is 'shuffled'"),  # type: ignore[arg-type]
    (lambda: badam(LAYERS, steps_per_block=0), "`steps_per_block`"),
    (lambda: badam(LAYERS, always=["l0"]), r"`always` groups \['l0'\]"),
    (lambda: lisa("l0"), "`layers`"),
    (lambda: lisa(LAYERS, k=7), "`k`"),
])
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        call()  # type: ignore[operator]
