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


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: badam(LAYERS, order="shuffled"), "`order` is 'shuffled'"),  # type: ignore[arg-type]
        (lambda: badam(LAYERS, steps_per_block=0), "`steps_per_block`"),
        (lambda: badam(LAYERS, always=["l0"]), r"`always` groups \['l0'\]"),
        (lambda: lisa("l0"), "`layers`"),
        (lambda: lisa(LAYERS, k=7), "`k`"),
    ],
)
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        call()  # type: ignore[operator]


ORDERS = ["ascending", "descending", "random"]


@pytest.mark.parametrize("order", ORDERS)
def test_badam_always_trains_with_every_block_in_every_order(order: str) -> None:
    """The default order used to raise "group 'head' appears in ratios entries 0 and 1"."""
    s = badam(LAYERS, steps_per_block=2, order=order, always=["head"], seed=5)  # type: ignore[arg-type]
    s.validate([*LAYERS, "head"])
    assert s.always_groups() == {"head"}
    for sweep in range(3):
        blocks = []
        for i in range(6):
            step = sweep * 12 + 2 * i
            phase = s.phase_at(step)
            assert phase == s.phase_at(step + 1), "a block keeps its phase for steps_per_block steps"
            assert "head" in phase.trainable and len(phase.trainable) == 2
            block = next(iter(phase.trainable - {"head"}))
            assert phase.name == f"{block}+head"
            blocks.append(block)
        assert sorted(blocks) == LAYERS, "each sweep trains each block once"
        if order != "random":
            assert blocks == (LAYERS if order == "ascending" else LAYERS[::-1])


@pytest.mark.parametrize("order", ORDERS)
def test_badam_with_always_resumes_and_refuses_another_always(order: str) -> None:
    s = badam(LAYERS, steps_per_block=3, order=order, always=["head"], seed=2)  # type: ignore[arg-type]
    saved = s.state_dict()
    resumed = badam(LAYERS, steps_per_block=3, order=order, always=["head"], seed=2)  # type: ignore[arg-type]
    resumed.load_state_dict(saved)
    assert [resumed.phase_at(i) for i in range(60)] == [s.phase_at(i) for i in range(60)]
    for other in ([], ["norm"]):
        changed = badam(LAYERS, steps_per_block=3, order=order, always=other, seed=2)  # type: ignore[arg-type]
        with pytest.raises(PlanError, match="`always`"):
            changed.load_state_dict(saved)


@pytest.mark.parametrize("order", ORDERS)
def test_badam_without_always_keeps_its_names_and_state(order: str) -> None:
    s = badam(LAYERS, steps_per_block=1, order=order, seed=1)  # type: ignore[arg-type]
    assert all(s.phase_at(i).name in LAYERS for i in range(12))
    assert "always" not in s.state_dict()["config"]  # as saved before `always` existed


def test_badam_always_overlap_names_the_call_that_works() -> None:
    with pytest.raises(PlanError) as info:
        badam(LAYERS, always=["l0", "head"])
    message = str(info.value)
    assert "`always` groups ['l0'] are also in `blocks`" in message
    assert message.endswith("badam(['l1', 'l2', 'l3', 'l4', 'l5'], always=['head', 'l0'])")
    with pytest.raises(PlanError, match="`always` must be a group name or a list"):
        badam(LAYERS, always=5)  # type: ignore[arg-type]
