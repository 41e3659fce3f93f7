"""Unit tests of the schedule kinds: phases, validation, segments, describe, state."""

from __future__ import annotations

import json
import re
from typing import Callable

import pytest
from torch import nn

from hf_altparams.errors import PlanError
from hf_altparams.plan import (
    Alternating,
    Chain,
    FnSchedule,
    GradualUnfreeze,
    ParamGroups,
    PerTaskCycle,
    Phase,
    PhaseSequence,
    ProgressiveFreeze,
    RandomBlocks,
    Schedule,
)
from hf_altparams.plan.schedules import Pattern


def _trainable(schedule: Schedule, positions: range | list[int]) -> list[str]:
    return ["+".join(sorted(schedule.phase_at_position(p).trainable)) for p in positions]


# -- phases of each kind --------------------------------------------------------------------------

PHASE_TABLE = [
    pytest.param(
        lambda: PhaseSequence([("a", 2), (["a", "b"], 1), (Phase(["c"]), 2)]),
        ["a", "a", "a+b", "c", "c", "c", "c"],
        id="sequence-last-persists",
    ),
    pytest.param(
        lambda: PhaseSequence([("a", 2), ("b", 1)], repeat=True),
        ["a", "a", "b", "a", "a", "b", "a"],
        id="sequence-repeat",
    ),
    pytest.param(
        lambda: Alternating({"a": 3, "b": 1}), ["a", "a", "a", "b", "a", "a", "a", "b"], id="alternating-ratio"
    ),
    pytest.param(
        lambda: Alternating(["a", ("b", "c")], every=2),
        ["a", "a", "b+c", "b+c", "a", "a", "b+c"],
        id="alternating-every-tuple",
    ),
    pytest.param(
        lambda: Alternating({("a", "b"): 1, "c": 2}), ["a+b", "c", "c", "a+b", "c"], id="alternating-tuple-key"
    ),
    pytest.param(
        lambda: GradualUnfreeze(["a", "b", "c"], every=2),
        ["c", "c", "b+c", "b+c", "a+b+c", "a+b+c", "a+b+c", "a+b+c"],
        id="unfreeze-last-first",
    ),
    pytest.param(
        lambda: GradualUnfreeze(["a", "b", "c"], every=1, order="first_to_last", always="head"),
        ["a+head", "a+b+head", "a+b+c+head", "a+b+c+head"],
        id="unfreeze-first-last-always",
    ),
    pytest.param(
        lambda: ProgressiveFreeze(["a", "b", "c"], every=2),
        ["a+b+c", "a+b+c", "b+c", "b+c", "c", "c", "c", "c"],
        id="freeze-first-last",
    ),
    pytest.param(
        lambda: ProgressiveFreeze(["a", "b", "c"], every=1, order="last_to_first", always=["h"]),
        ["a+b+c+h", "a+b+h", "a+h", "a+h"],
        id="freeze-last-first-always",
    ),
    pytest.param(
        lambda: ProgressiveFreeze(["a", "b"], every=1, allow_empty=True),
        ["a+b", "b", "", ""],
        id="freeze-allow-empty",
    ),
    pytest.param(
        lambda: PerTaskCycle(["trunk"], ["x", ["y", "z"]], every=2),
        ["trunk+x", "trunk+x", "trunk+y+z", "trunk+y+z", "trunk+x"],
        id="per-task",
    ),
    pytest.param(
        lambda: PerTaskCycle("trunk", ["x", "y"], every=1, train_trunk=False),
        ["x", "y", "x", "y"],
        id="per-task-frozen-trunk",
    ),
]


@pytest.mark.parametrize(("make", "expected"), PHASE_TABLE)
def test_phases_by_step(make: Callable[[], Schedule], expected: list[str]) -> None:
    schedule = make()
    assert _trainable(schedule, range(len(expected))) == expected
    assert [schedule.phase_at(i, epoch=7) for i in range(len(expected))] == [
        schedule.phase_at_position(i) for i in range(len(expected))
    ]


def test_resident_sets() -> None:
    cycle = PerTaskCycle(["t1", "t2"], ["x", ["y", "z"]], every=1, train_trunk=False)
    assert cycle.phase_at(1) == Phase(["y", "z"], resident=["t1", "t2", "y", "z"])
    assert cycle.phase_at(0).resident == frozenset({"t1", "t2", "x"})
    assert cycle.group_names() == frozenset({"t1", "t2", "x", "y", "z"})
    alt = Alternating(["a", "b"], resident=["trunk"])
    assert alt.phase_at(1).resident == frozenset({"b", "trunk"})
    assert Alternating(["a", "b"], resident=[]).phase_at(0).resident == frozenset({"a"})
    assert Alternating(["a", "b"]).phase_at(0).resident is None
    seq = PhaseSequence([(Phase("a", resident="r"), 1)])
    assert seq.group_names() == frozenset({"a", "r"})


def test_epoch_unit_uses_epoch_not_step() -> None:
    schedule = Alternating(["a", "b"], unit="epoch")
    assert schedule.phase_at(0, epoch=1).trainable == {"b"}
    assert schedule.phase_at(1, epoch=0).trainable == {"a"}
    assert schedule.phase_at(999, epoch=2).trainable == {"a"}
    assert schedule.describe() == "epochs 0-0: trainable a | epochs 1-1: trainable b (repeats every 2 epochs)"


@pytest.mark.parametrize(
    ("step", "epoch", "name"), [(-1, 0, "`step`"), (0, -2, "`epoch`"), (1.5, 0, "`step`"), (True, 0, "`step`")]
)
def test_negative_or_non_int_positions(step, epoch, name: str) -> None:
    with pytest.raises(
        PlanError, match=f"{name} must be an int >= 0, got {re.escape(repr(step if name == '`step`' else epoch))}"
    ):
        GradualUnfreeze(["a"], every=1).phase_at(step, epoch)


# -- invalid arguments ----------------------------------------------------------------------------

BAD_ARGS = [
    # PhaseSequence
    (lambda: PhaseSequence([]), ["`phases`", "[]"]),
    (lambda: PhaseSequence("a"), ["`phases`", "'a'"]),
    (lambda: PhaseSequence([("a", 0)]), ["`phases[0] duration`", "got 0"]),
    (lambda: PhaseSequence([("a", 1), ("b", 2.5)]), ["`phases[1] duration`", "2.5"]),
    (lambda: PhaseSequence([("a",)]), ["`phases[0]`", "pair", "('a',)"]),
    (lambda: PhaseSequence([(3, 1)]), ["`phases[0]`", "3", "group name"]),
    (lambda: PhaseSequence([(["a", "a"], 1)]), ["`phases[0]`", "['a', 'a']"]),
    (lambda: PhaseSequence([([], 1)]), ["trains no group", "steps 0-0", "allow_empty"]),
    (lambda: PhaseSequence([("a", 1)], unit="batch"), ["`unit`", "'batch'", "'epoch'"]),
    (lambda: PhaseSequence([("a", 1)], repeat=1), ["`repeat`", "1"]),
    # Alternating
    (lambda: Alternating([]), ["`ratios`", "[]"]),
    (lambda: Alternating({}), ["`ratios`", "{}"]),
    (lambda: Alternating("ab"), ["`ratios`", "'ab'"]),
    (lambda: Alternating({"a": 0, "b": 1}), ["`ratios['a']`", "got 0"]),
    (lambda: Alternating({"a": 2}, every=3), ["`every`", "every=3", "mapping"]),
    (lambda: Alternating(["a", "b"], every=0), ["`every`", "got 0"]),
    (lambda: Alternating(["a", "b", "a"]), ["'a'", "entries 0 and 2"]),
    (lambda: Alternating(["a", ("b", "a")]), ["'a'", "entries 0 and 1"]),
    (lambda: Alternating(["a", ()]), ["`ratios[1]`", "()"]),
    (lambda: Alternating(["a", 5]), ["`ratios[1]`", "5"]),
    (lambda: Alternating(["a", "b"], resident=[1]), ["`resident`", "1"]),
    # GradualUnfreeze / ProgressiveFreeze
    (lambda: GradualUnfreeze([], every=1), ["`groups`", "[]"]),
    (lambda: GradualUnfreeze("abc", every=1), ["`groups`", "'abc'"]),
    (lambda: GradualUnfreeze(["a", "b", "a"], every=1), ["`groups`", "['a']"]),
    (lambda: GradualUnfreeze(["a"], every=0), ["`every`", "got 0"]),
    (lambda: GradualUnfreeze(["a"], every=-3), ["`every`", "got -3"]),
    (lambda: GradualUnfreeze(["a"], every=1, order="up"), ["`order`", "'up'", "'last_to_first'"]),
    (lambda: GradualUnfreeze(["a", "b"], every=1, always=["b"]), ["['b']", "`always`", "`groups`"]),
    (lambda: ProgressiveFreeze(["a"], every=None), ["`every`", "None"]),
    (lambda: ProgressiveFreeze(["a", "b"], every=1, always="a"), ["['a']", "`always`"]),
    (lambda: ProgressiveFreeze(["a"], every=1, allow_empty="yes"), ["`allow_empty`", "'yes'"]),
    # PerTaskCycle
    (lambda: PerTaskCycle([], ["x"], every=1), ["`trunk`", "[]"]),
    (lambda: PerTaskCycle(["t"], [], every=1), ["`tasks`", "[]"]),
    (lambda: PerTaskCycle(["t"], ["x", ["y", "x"]], every=1), ["'x'", "`tasks`", "entries 0 and 1"]),
    (lambda: PerTaskCycle(["t"], ["x", "t"], every=1), ["['t']", "`trunk`", "`tasks`"]),
    (lambda: PerTaskCycle(["t"], ["x", []], every=1), ["`tasks[1]`", "[]"]),
    (lambda: PerTaskCycle(["t"], ["x"], every=0), ["`every`", "got 0"]),
    # RandomBlocks
    (lambda: RandomBlocks(["a", "b"], k=0, every=1), ["`k`", "[1, 2]", "got 0"]),
    (lambda: RandomBlocks(["a", "b"], k=3, every=1), ["`k`", "[1, 2]", "got 3"]),
    (lambda: RandomBlocks(["a", "b"], k=1, every=0), ["`every`", "got 0"]),
    (lambda: RandomBlocks(["a", "b"], k=1, every=1, seed="x"), ["`seed`", "'x'"]),
    (lambda: RandomBlocks(["a", "b"], k=1, every=1, always=["a"]), ["['a']", "`always`"]),
    (lambda: RandomBlocks([], k=1, every=1), ["`groups`", "[]"]),
    # FnSchedule
    (lambda: FnSchedule(3, groups=["a"]), ["`fn`", "3"]),
    (lambda: FnSchedule(lambda s, e: ["a"], groups=[]), ["`groups`", "[]"]),
    (lambda: FnSchedule(lambda s, e: ["a"], groups=["a"], name=""), ["`name`", "''"]),
    # Chain
    (lambda: Chain([]), ["`parts`", "[]"]),
    (lambda: Chain([(Alternating(["a"]), None), (Alternating(["b"]), 3)]), ["`parts[0]`", "None", "last"]),
    (lambda: Chain([(Alternating(["a"]), 0)]), ["`parts[0] duration`", "got 0"]),
    (lambda: Chain([("a", 2)]), ["`parts[0]`", "('a', 2)", "Schedule"]),
    (
        lambda: Chain([(Alternating(["a"]), 2), (Alternating(["b"], unit="epoch"), None)]),
        ["unit", "Alternating: step", "Alternating: epoch"],
    ),
]


@pytest.mark.parametrize(("make", "expected"), BAD_ARGS, ids=[f"bad{i}" for i in range(len(BAD_ARGS))])
def test_bad_arguments_raise_plan_error_naming_the_value(make: Callable[[], Schedule], expected: list[str]) -> None:
    with pytest.raises(PlanError) as err:
        make()
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


# -- validate -------------------------------------------------------------------------------------


def test_validate_against_names_and_param_groups() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    groups = ParamGroups(model, {"a": "0.*", "b": "1.*"})
    Alternating(["a", "b"]).validate(groups)
    Alternating(["a", "b"]).validate(["a", "b", "c"])
    with pytest.raises(PlanError) as err:
        GradualUnfreeze(["a", "x"], every=1, always="y").validate(groups)
    assert str(err.value) == (
        "`GradualUnfreeze` schedule references unknown group(s) ['x', 'y']; known groups: ['a', 'b']"
    )
    with pytest.raises(PlanError, match="`PerTaskCycle`.*\\['t'\\]"):
        PerTaskCycle(["t"], ["a", "b"], every=1).validate(groups)  # the resident-only trunk counts too


def test_validate_chain_names_the_part() -> None:
    chain = Chain([(Alternating(["a"]), 2), (RandomBlocks(["a", "zz"], k=1, every=1), None)])
    with pytest.raises(PlanError, match="in `Chain` part 1 \\(RandomBlocks\\).*\\['zz'\\]"):
        chain.validate(["a", "b"])
    chain.validate(["a", "zz"])


def test_allow_empty() -> None:
    seq = PhaseSequence([("a", 1), ([], 2)], allow_empty=True)
    seq.validate(["a"])
    assert seq.phase_at(2).trainable == frozenset()
    assert "steps 1+: trainable <none>" in seq.describe()
    assert ProgressiveFreeze(["a"], every=1, allow_empty=True).allow_empty


class EmptyAfterTwo(Schedule):
    """A user-defined schedule with the pattern hooks: trains nothing from position 2 on."""

    def phase_at(self, step: int, epoch: int = 0) -> Phase:
        return Phase(["a"] if self._position(step, epoch) < 2 else [])

    def group_names(self) -> frozenset[str]:
        return frozenset({"a"})

    def pattern(self) -> Pattern:
        return Pattern(2, None)


def test_validate_rejects_an_empty_phase_of_a_user_schedule() -> None:
    with pytest.raises(PlanError, match="`EmptyAfterTwo` schedule trains no group at steps 2-2.*allow_empty"):
        EmptyAfterTwo().validate(["a"])
    assert EmptyAfterTwo().state_dict() == {"kind": "EmptyAfterTwo", "config": {}, "seed": None}


# -- segments, next_change, describe --------------------------------------------------------------

ALL_KINDS = [
    pytest.param(lambda: PhaseSequence([("a", 3), ("b", 2), ("c", 1)]), id="sequence"),
    pytest.param(lambda: PhaseSequence([("a", 2), ("b", 4)], repeat=True), id="sequence-repeat"),
    pytest.param(lambda: Alternating({"a": 3, "b": 1, ("c", "d"): 2}), id="alternating"),
    pytest.param(lambda: GradualUnfreeze(["a", "b", "c"], every=4), id="unfreeze"),
    pytest.param(lambda: ProgressiveFreeze(["a", "b", "c"], every=3, allow_empty=True), id="freeze"),
    pytest.param(lambda: PerTaskCycle(["t"], ["x", "y", "z"], every=2), id="per-task"),
    pytest.param(lambda: RandomBlocks(["a", "b", "c", "d"], k=2, every=3, seed=7), id="random"),
    pytest.param(lambda: FnSchedule(lambda s, e: ["a"] if (s // 5) % 3 else ["b"], groups=["a", "b"]), id="fn"),
    pytest.param(
        lambda: Chain(
            [
                (PhaseSequence([("a", 1)]), 5),
                (RandomBlocks(["a", "b", "c"], k=1, every=2), 8),
                (Alternating(["b", "c"], every=3), None),
            ]
        ),
        id="chain-forever",
    ),
    pytest.param(
        lambda: Chain([(GradualUnfreeze(["a", "b"], every=2), 3), (Alternating(["b", "c"], every=2), 7)]),
        id="chain-finite",
    ),
]


def _brute_segments(schedule: Schedule, total: int) -> list[tuple[int, int, Phase]]:
    segs: list[tuple[int, int, Phase]] = []
    for pos in range(total):
        phase = schedule.phase_at_position(pos)
        if segs and segs[-1][2] == phase:
            segs[-1] = (segs[-1][0], pos + 1, phase)
        else:
            segs.append((pos, pos + 1, phase))
    return segs


@pytest.mark.parametrize("make", ALL_KINDS)
@pytest.mark.parametrize("total", [0, 1, 7, 60])
def test_segments_match_a_position_by_position_scan(make: Callable[[], Schedule], total: int) -> None:
    schedule = make()
    segs = schedule.segments(total)
    assert segs == _brute_segments(schedule, total)
    assert all(a[2] != b[2] for a, b in zip(segs, segs[1:]))  # maximal ranges
    if total:
        assert segs[0][0] == 0 and segs[-1][1] == total


@pytest.mark.parametrize("make", ALL_KINDS)
def test_next_change_matches_a_scan(make: Callable[[], Schedule]) -> None:
    schedule = make()
    for position in range(40):
        current = schedule.phase_at_position(position)
        expected = next(
            (p for p in range(position + 1, position + 101) if schedule.phase_at_position(p) != current), None
        )
        assert schedule.next_change(position, horizon=100) == expected, position


def test_next_change_values_and_horizon() -> None:
    assert Alternating({"a": 3, "b": 1}).next_change(0) == 3
    assert Alternating({"a": 3, "b": 1}).next_change(3) == 4
    assert GradualUnfreeze(["a", "b"], every=10).next_change(9) == 10
    assert GradualUnfreeze(["a", "b"], every=10).next_change(10) is None
    assert GradualUnfreeze(["a", "b"], every=10).next_change(0, horizon=5) is None
    assert GradualUnfreeze(["a", "b"], every=10).next_change(0, horizon=10) == 10
    assert Alternating(["a"]).next_change(0) is None  # one entry: never changes
    with pytest.raises(PlanError, match="`position` must be an int >= 0, got -1"):
        Alternating(["a", "b"]).next_change(-1)
    with pytest.raises(PlanError, match="`horizon` must be an int >= 1, got 0"):
        Alternating(["a", "b"]).next_change(0, horizon=0)


def test_segments_of_long_runs_are_fast_and_right() -> None:
    segs = Alternating({"a": 999, "b": 1}).segments(1_000_000)
    assert len(segs) == 2000 and segs[-1] == (999_999, 1_000_000, Phase("b"))
    assert GradualUnfreeze(["a", "b"], every=5).segments(10**9)[-1] == (5, 10**9, Phase(["a", "b"]))
    with pytest.raises(PlanError, match="`total` must be an int >= 0, got -5"):
        Alternating(["a"]).segments(-5)


@pytest.mark.parametrize(
    ("make", "total", "expected"),
    [
        (
            lambda: Alternating({"a": 3, "b": 1}),
            None,
            "steps 0-2: trainable a | steps 3-3: trainable b (repeats every 4 steps)",
        ),
        (
            lambda: Alternating({"a": 3, "b": 1}),
            6,
            "steps 0-2: trainable a | steps 3-3: trainable b | steps 4-5: trainable a",
        ),
        (
            lambda: GradualUnfreeze(["x", "y"], every=2, always="h"),
            None,
            "steps 0-1: trainable h+y | steps 2+: trainable h+x+y",
        ),
        (
            lambda: PerTaskCycle(["t"], ["x", "y"], every=1, train_trunk=False),
            None,
            "steps 0-0: trainable x (resident t+x) | steps 1-1: trainable y (resident t+y) (repeats every 2 steps)",
        ),
        (
            lambda: Chain([(PhaseSequence([("a", 1)]), 2), (Alternating(["a", "b"], every=2), None)]),
            None,
            "steps 0-3: trainable a | steps 4-5: trainable b (repeats every 4 steps from step 2)",
        ),
        (
            lambda: FnSchedule(lambda s, e: ["a"] if e < 4 else ["b"], groups=["a", "b"], unit="epoch"),
            None,
            "epochs 0-3: trainable a | epochs 4+: trainable b (no change within 10000 epochs)",
        ),
    ],
)
def test_describe(make: Callable[[], Schedule], total: int | None, expected: str) -> None:
    assert make().describe(total) == expected


def test_describe_random_lists_a_few_blocks() -> None:
    schedule = RandomBlocks(["a", "b", "c", "d", "e"], k=2, every=4, seed=3)
    text = schedule.describe()
    parts = text.split(" | ")
    assert parts[-1] == "..." and len(parts) == 9
    start, end, phase = schedule.segments(100)[0]
    assert parts[0] == f"steps {start}-{end - 1}: trainable {'+'.join(sorted(phase.trainable))}"
    with pytest.raises(PlanError, match="`total` must be an int >= 1, got 0"):
        schedule.describe(0)


# -- RandomBlocks ---------------------------------------------------------------------------------


def test_random_blocks_are_deterministic_distinct_and_blockwise() -> None:
    groups = [f"l{i}" for i in range(8)]
    first = RandomBlocks(groups, k=3, every=5, seed=11, always=["head"])
    again = RandomBlocks(groups, k=3, every=5, seed=11, always=["head"])
    other = RandomBlocks(groups, k=3, every=5, seed=12, always=["head"])
    draws = [first.phase_at(b * 5) for b in range(50)]
    assert draws == [again.phase_at(b * 5) for b in range(50)]
    assert draws != [other.phase_at(b * 5) for b in range(50)]
    for block, phase in enumerate(draws):
        assert "head" in phase.trainable
        assert len(phase.trainable - {"head"}) == 3 and phase.trainable - {"head"} <= set(groups)
        assert all(first.phase_at(block * 5 + i) == phase for i in range(5))
    assert len(set(draws)) > 10  # the draws vary between blocks
    assert set().union(*(p.trainable for p in draws)) == set(groups) | {"head"}


def test_random_blocks_draws_are_pinned() -> None:
    # Seeded by the string f"{seed}:{block}" (sha512 inside random.Random): stable across processes.
    schedule = RandomBlocks(["a", "b", "c", "d"], k=2, every=1, seed=0)
    assert [schedule.phase_at(i).name for i in range(4)] == ["a+b", "a+b", "b+d", "c+d"]


# -- FnSchedule -----------------------------------------------------------------------------------


def test_fn_schedule_accepts_names_and_phases() -> None:
    schedule = FnSchedule(lambda s, e: Phase(["a"], resident=["b"]) if e else "b", groups=["a", "b"], name="mine")
    assert schedule.phase_at(3, epoch=0) == Phase("b")
    assert schedule.phase_at(3, epoch=1) == Phase("a", resident=["a", "b"])
    assert schedule.state_dict() == {"kind": "FnSchedule", "config": {"name": "mine"}, "seed": None}
    assert schedule.group_names() == frozenset({"a", "b"})


@pytest.mark.parametrize(
    ("fn", "kwargs", "expected"),
    [
        (lambda s, e: ["a", "zz"], {}, ["step 4", "['a', 'zz']", "['zz']", "['a', 'b']"]),
        (lambda s, e: None, {}, ["step 4", "None", "['a', 'b']"]),
        (lambda s, e: 7, {}, ["step 4", "7"]),
        (lambda s, e: [], {}, ["step 4", "[]", "trains no group", "allow_empty"]),
        (lambda s, e: Phase(["a"], resident=["q"]), {}, ["step 4", "['q']"]),
    ],
)
def test_fn_schedule_checks_each_answer(fn, kwargs: dict, expected: list[str]) -> None:
    schedule = FnSchedule(fn, groups=["a", "b"], **kwargs)
    with pytest.raises(PlanError) as err:
        schedule.phase_at(4)
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


def test_fn_schedule_allow_empty() -> None:
    assert FnSchedule(lambda s, e: [], groups=["a"], allow_empty=True).phase_at(0).trainable == frozenset()


# -- Chain ----------------------------------------------------------------------------------------


def test_chain_parts_see_local_positions() -> None:
    calls: list[tuple[int, int]] = []

    def record(step: int, epoch: int) -> list[str]:
        calls.append((step, epoch))
        return ["b"]

    chain = Chain([(PhaseSequence([("a", 1)]), 3), (FnSchedule(record, groups=["b"]), None)])
    assert _trainable(chain, range(6)) == ["a", "a", "a", "b", "b", "b"]
    assert calls == [(0, 0), (1, 0), (2, 0)]
    calls.clear()
    assert chain.phase_at(10, epoch=4).trainable == {"b"}
    assert calls == [(7, 4)]
    assert chain.group_names() == frozenset({"a", "b"})


def test_chain_offsets_restart_the_inner_schedules() -> None:
    chain = Chain(
        [
            (Alternating(["a", "b"]), 3),
            (GradualUnfreeze(["x", "y"], every=2), 4),
            (Alternating(["a", "b"]), None),
        ]
    )
    assert _trainable(chain, range(10)) == ["a", "b", "a", "y", "y", "x+y", "x+y", "a", "b", "a"]


def test_chain_finite_end_persists_the_last_phase() -> None:
    chain = Chain([(Alternating(["a", "b"]), 2), (Alternating(["c", "d"]), 3)])
    assert _trainable(chain, range(8)) == ["a", "b", "c", "d", "c", "c", "c", "c"]
    assert chain.next_change(4) is None


def test_chain_in_epochs_passes_local_epoch() -> None:
    chain = Chain([(Alternating(["a"], unit="epoch"), 2), (Alternating(["b", "c"], unit="epoch"), None)])
    assert chain.unit == "epoch"
    assert [chain.phase_at(0, e).name for e in range(5)] == ["a", "a", "b", "c", "b"]


# -- state_dict -----------------------------------------------------------------------------------

STATEFUL = [
    pytest.param(lambda: PhaseSequence([(Phase("a", resident="r"), 3), (["a", "b"], 2)], repeat=True), id="sequence"),
    pytest.param(lambda: Alternating({"a": 3, ("b", "c"): 1}, resident=["t"]), id="alternating"),
    pytest.param(lambda: GradualUnfreeze(["a", "b"], every=2, always="h"), id="unfreeze"),
    pytest.param(lambda: ProgressiveFreeze(["a", "b"], every=2, order="last_to_first"), id="freeze"),
    pytest.param(lambda: PerTaskCycle(["t"], ["x", ["y", "z"]], every=2), id="per-task"),
    pytest.param(lambda: RandomBlocks(["a", "b", "c"], k=2, every=2, seed=5), id="random"),
    pytest.param(lambda: FnSchedule(lambda s, e: ["a"], groups=["a"], name="const"), id="fn"),
    pytest.param(
        lambda: Chain([(Alternating(["a"]), 2), (RandomBlocks(["a", "b"], k=1, every=1, seed=3), None)]), id="chain"
    ),
]


@pytest.mark.parametrize("make", STATEFUL)
def test_state_dict_round_trips_through_json(make: Callable[[], Schedule]) -> None:
    saved = json.loads(json.dumps(make().state_dict()))
    fresh = make()
    fresh.load_state_dict(saved)
    assert fresh.state_dict() == saved
    assert saved["kind"] == type(fresh).__name__


def test_load_state_dict_names_the_differing_fields() -> None:
    saved = Alternating({"a": 3, "b": 1}).state_dict()
    with pytest.raises(PlanError) as err:
        Alternating({"a": 2, "b": 1}, unit="epoch").load_state_dict(saved)
    message = str(err.value)
    assert "`durations`: saved [3, 1], here [2, 1]" in message
    assert "`unit`: saved 'step', here 'epoch'" in message
    assert "`entries`" not in message
    with pytest.raises(
        PlanError, match="saved schedule kind 'Alternating' differs from this schedule's kind 'GradualUnfreeze'"
    ):
        GradualUnfreeze(["a", "b"], every=3).load_state_dict(saved)
    with pytest.raises(PlanError, match="`name`: saved 'f', here 'g'"):
        FnSchedule(len, groups=["a"], name="g").load_state_dict(FnSchedule(len, groups=["a"], name="f").state_dict())
    with pytest.raises(PlanError, match="`state`.*'kind'"):
        Alternating(["a"]).load_state_dict({"config": {}})


def test_load_state_dict_restores_the_seed() -> None:
    saved = RandomBlocks(["a", "b", "c", "d"], k=2, every=1, seed=42).state_dict()
    resumed = RandomBlocks(["a", "b", "c", "d"], k=2, every=1, seed=0)
    resumed.load_state_dict(saved)
    assert resumed.seed == 42
    reference = RandomBlocks(["a", "b", "c", "d"], k=2, every=1, seed=42)
    assert [resumed.phase_at(i) for i in range(20)] == [reference.phase_at(i) for i in range(20)]

    chain = Chain([(Alternating(["a"]), 1), (RandomBlocks(["a", "b"], k=1, every=1, seed=0), None)])
    chain.load_state_dict({**chain.state_dict(), "seed": [None, 9]})
    assert chain.seed == [None, 9] and chain.parts[1].seed == 9
    with pytest.raises(PlanError, match="`seed`.*'nine'"):
        resumed.load_state_dict({**saved, "seed": "nine"})


def test_repr_names_kind_and_arguments() -> None:
    assert repr(GradualUnfreeze(["a", "b"], every=2)) == (
        "GradualUnfreeze(groups=['a', 'b'], every=2, unit='step', order='last_to_first', always=[])"
    )
    assert repr(RandomBlocks(["a", "b"], k=1, every=2, seed=3)).endswith("seed=3)")


@pytest.mark.parametrize(
    ("fn", "unit", "where"),
    [
        (lambda s, e: ["a"] if s < 700 else ["a", "zz"], "step", "step 700, epoch 0"),
        (lambda s, e: ["b"] if e < 3 else ["q"], "epoch", "step 0, epoch 3"),
        (lambda s, e: ["a"] if s < 10 else [], "step", "step 10"),
    ],
)
def test_fn_schedule_validate_probes_before_training(fn, unit: str, where: str) -> None:
    schedule = FnSchedule(fn, groups=["a", "b"], unit=unit)
    with pytest.raises(PlanError) as err:
        schedule.validate(["a", "b"])
    assert where in str(err.value) and "validate()" in str(err.value) and "`probe=`" in str(err.value)


def test_fn_schedule_probe_sets_the_horizon() -> None:
    late = FnSchedule(lambda s, e: ["a"] if s < 50 else ["zz"], groups=["a", "b"], probe=50)
    late.validate(["a", "b"])  # the mistake lies beyond the probed horizon: found at its step
    with pytest.raises(PlanError, match="step 50"):
        late.phase_at(50)
    with pytest.raises(PlanError, match="`probe`"):
        FnSchedule(lambda s, e: ["a"], groups=["a"], probe=-1)


def test_per_task_phases_are_labelled_by_the_task_groups_and_carry_the_task() -> None:
    schedule = PerTaskCycle(["trunk"], ["x", ["y", "z"]], every=2)
    seen = [(p.name, p.task) for p in (schedule.phase_at(s) for s in range(6))]
    assert seen == [("x", "x"), ("x", "x"), ("y+z", "y+z"), ("y+z", "y+z"), ("x", "x"), ("x", "x")]
    assert Phase("x").task is None and Phase("x", task="x") == Phase("x")  # the task is not part of equality


def test_phase_repr_shows_the_frozensets_it_holds() -> None:
    phase = Phase(["b", "a"], resident=["t"])
    shown = repr(phase)
    assert shown == "Phase(trainable=frozenset({'a', 'b'}), resident=frozenset({'a', 'b', 't'}))"
    assert eval(shown.split("trainable=")[1].split(", resident")[0]) == phase.trainable
    assert repr(Phase([])) == "Phase(trainable=frozenset(), resident=all)"
