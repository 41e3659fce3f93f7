"""The schedule registry: every kind builds from its defaults as its constructor would, bad input is refused
naming the flag, aliases resolve, and a registry refuses what would make two kinds or options collide."""

from __future__ import annotations

import json
from typing import Any

import pytest
from torch import nn

from hf_altparams.errors import PlanError
from hf_altparams.plan import (
    SCHEDULES,
    Alternating,
    GradualUnfreeze,
    ParamGroups,
    PerTaskCycle,
    PhaseSequence,
    ProgressiveFreeze,
    RandomBlocks,
    Schedule,
    badam,
    lisa,
)
from hf_altparams.plan.registry import ANY_KIND, CommandDefaults, Derived, Option, ScheduleKind, ScheduleRegistry

NAMES = ("l0", "l1", "l2", "l3", "head")


@pytest.fixture(scope="module")
def groups() -> ParamGroups:
    net = nn.ModuleDict({n: nn.Linear(2, 2) for n in NAMES})
    return ParamGroups(net, {n: f"{n}.*" for n in NAMES})


def describe(schedule: Schedule, positions: int = 30) -> dict[str, Any]:
    """What a schedule does: its kind, recipe policy, the phase at each position and its saved state."""
    phases = [schedule.phase_at(s, s) for s in range(positions)]
    return {
        "type": type(schedule).__name__,
        "idle": schedule.idle_state,
        "phases": [(sorted(p.trainable), None if p.resident is None else sorted(p.resident), p.name) for p in phases],
        "state": json.dumps(schedule.state_dict(), default=str, sort_keys=True),
    }


LAYERS = ["l0", "l1", "l2", "l3"]
EVERYTHING = [*LAYERS, "head"]

#: Per built-in kind: the fewest options it needs, and the schedule its constructor gives for them with
#: the documented defaults (blocks: every group not in --always; no --always; seed 0; step unit).
FROM_DEFAULTS: dict[str, tuple[dict[str, Any], Schedule]] = {
    "alternating": ({}, Alternating(EVERYTHING, every=1)),
    "gradual": ({"every": "2"}, GradualUnfreeze(EVERYTHING, every=2, order="last_to_first")),
    "progressive": ({"every": "2"}, ProgressiveFreeze(EVERYTHING, every=2, order="first_to_last")),
    "random-blocks": ({"k": "2", "every": "3"}, RandomBlocks(EVERYTHING, k=2, every=3, seed=0)),
    "lisa": ({"k": "2", "every": "3"}, lisa(EVERYTHING, k=2, every=3, always=(), seed=0)),
    "badam": ({"every": "2"}, badam(EVERYTHING, steps_per_block=2, order="ascending")),
    "per-task": ({"trunk": "head", "every": "2"}, PerTaskCycle(["head"], LAYERS, every=2)),
    "sequence": ({"phase": ["l0+head:2", "l1:3"]}, PhaseSequence([(["l0", "head"], 2), (["l1"], 3)])),
}


def test_the_table_covers_every_registered_kind() -> None:
    assert sorted(FROM_DEFAULTS) == sorted(SCHEDULES)


@pytest.mark.parametrize("kind", sorted(FROM_DEFAULTS))
def test_every_kind_builds_from_its_defaults_as_its_constructor_would(groups: ParamGroups, kind: str) -> None:
    given, expected = FROM_DEFAULTS[kind]
    built = SCHEDULES.build(kind, groups, given)
    built.validate(groups)
    assert describe(built) == describe(expected)


@pytest.mark.parametrize("kind", sorted(FROM_DEFAULTS))
def test_each_required_option_left_out_is_named(groups: ParamGroups, kind: str) -> None:
    given, _ = FROM_DEFAULTS[kind]
    for name in SCHEDULES.kind(kind).required:
        flag = SCHEDULES.option(name).flag
        with pytest.raises(PlanError) as refused:
            SCHEDULES.build(kind, groups, {k: v for k, v in given.items() if k != name})
        message = str(refused.value)
        assert (
            f"`{flag}` " in message
            and f"is required for `--schedule {kind}`" in message
            or f"`--schedule {kind}` needs at least one `{flag} " in message
        )


def test_python_values_read_as_the_text_does(groups: ParamGroups) -> None:
    text = SCHEDULES.build(
        "badam", groups, {"every": "2", "always": "head", "blocks": "l2,l0", "seed": "3", "order": "random"}
    )
    python = SCHEDULES.build(
        "badam", groups, {"every": 2, "always": ["head"], "blocks": ("l2", "l0"), "seed": 3, "order": "random"}
    )
    assert describe(text) == describe(python)
    ratios = SCHEDULES.build("alternating", groups, {"ratios": {"l0": 2, ("l1", "l2"): 1}})
    assert describe(ratios) == describe(SCHEDULES.build("alternating", groups, {"ratios": "l0=2,l1+l2=1"}))
    phases = SCHEDULES.build("sequence", groups, {"phase": [(["l0", "head"], 2), ("l1", 3)], "repeat": True})
    assert describe(phases) == describe(PhaseSequence([(["l0", "head"], 2), (["l1"], 3)], repeat=True))


BAD = [
    ("gradual", {"every": "0"}, "`--every` must be a positive integer, got '0'"),
    ("gradual", {"every": "two"}, "`--every` must be a positive integer, got 'two'"),
    ("lisa", {"k": "0", "every": "1"}, "`--k` must be a positive integer, got '0'"),
    ("lisa", {"k": "9", "every": "1"}, "`--k` must be an integer from 1 to 5 (the groups in `--blocks`"),
    ("badam", {"every": "1", "seed": "x"}, "`--seed` must be an integer, got 'x'"),
    (
        "badam",
        {"every": "1", "order": "sideways"},
        "`--order` must be one of ['last_to_first', 'first_to_last', "
        "'ascending', 'descending', 'random'], got 'sideways'",
    ),
    (
        "gradual",
        {"every": "1", "order": "random"},
        "`--order` 'random' does not apply to `--schedule gradual`; accepted: last_to_first, first_to_last",
    ),
    (
        "gradual",
        {"every": "1", "k": "2"},
        "`--k` '2' does not apply to `--schedule gradual`; it applies to random-blocks, lisa",
    ),
    (
        "per-task",
        {"trunk": "head", "every": "1", "always": "l0"},
        "`--always` 'l0' does not apply to `--schedule per-task`; the trunk trains in every phase: --trunk",
    ),
    ("sequence", {"phase": ["l0:1"], "unit": "week"}, "`--unit` must be one of ['step', 'epoch'], got 'week'"),
    ("sequence", {"phase": ["l0"]}, "`--phase` must look like GROUP[+GROUP...]:DURATION, got 'l0'"),
    ("sequence", {"phase": ["l0:1"], "repeat": "yes"}, "`--repeat` must be True or False, got 'yes'"),
    ("alternating", {"ratios": "l0=x"}, "`--ratios` entry 'l0=x' must be GROUP[+GROUP]=INT"),
    ("alternating", {"ratios": "l0=1,l1"}, "`--ratios` mixes a=N and plain entries: 'l0=1,l1'; use one form"),
    (
        "alternating",
        {"ratios": "l0=2,l1=1", "every": "3"},
        "`--every` 3 does not apply with durations in `--ratios` (l0=2,l1=1)",
    ),
    (
        "badam",
        {"every": "1", "always": "emb"},
        "`--always` names ['emb'], which are not groups; the groups are ['l0', 'l1', 'l2', 'l3', 'head']",
    ),
    ("per-task", {"trunk": "head", "tasks": "l0+nope", "every": "1"}, "`--tasks` names ['nope'], which are not groups"),
    ("gradual", {"every": "1", "always": "l0,l0"}, "`--always` lists group(s) ['l0'] more than once"),
    (
        "lisa",
        {"k": "1", "every": "1", "always": ",".join(EVERYTHING)},
        "`--blocks` was not given, and its default (every group not in --always) is () here: `--blocks` must name "
        "at least one group",
    ),
    ("weekly", {}, "`--schedule` is 'weekly'; accepted: ['alternating', "),
    ("gradual", {"every": "1", "nope": "1"}, "unknown schedule option 'nope' (`--nope`); the options are ["),
]


#: The refusals above that need the groups (the rest are refused before any model is built).
NEED_GROUPS = ("which are not groups", "(the groups in `--blocks`", "its default (every group", "with durations in")


@pytest.mark.parametrize("kind, given, message", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_values_are_refused_naming_the_flag(
    groups: ParamGroups, kind: str, given: dict[str, Any], message: str
) -> None:
    with pytest.raises(PlanError) as refused:
        SCHEDULES.build(kind, groups, given)
    assert message in str(refused.value)


def test_what_needs_no_groups_is_refused_before_any_group_exists() -> None:
    """``resolve`` (what ``check`` runs before it starts a rank) refuses every value that needs no model."""
    for kind, given, message in BAD:
        if any(needs in message for needs in NEED_GROUPS):
            SCHEDULES.resolve(kind, given)  # passes: the groups decide
            continue
        with pytest.raises(PlanError) as refused:
            SCHEDULES.resolve(kind, given)
        assert message in str(refused.value)


def test_aliases_any_case_and_underscores_name_the_same_kind(groups: ParamGroups) -> None:
    assert [
        SCHEDULES.kind(n).name for n in ("gradual-unfreeze", "Random_Blocks", "PER-TASK-CYCLE", "phase-sequence")
    ] == ["gradual", "random-blocks", "per-task", "sequence"]
    assert "progressive-freeze" in SCHEDULES and "freeze" not in SCHEDULES
    by_alias = SCHEDULES.build("gradual-unfreeze", groups, {"every": "2"})
    assert describe(by_alias) == describe(SCHEDULES.build("gradual", groups, {"every": "2"}))
    with pytest.raises(PlanError, match="'gradual-unfreeze' for 'gradual'"):
        SCHEDULES.kind("unfreeze")


def test_command_defaults_win_over_the_kind_s_and_refuse_what_the_command_cannot_run(groups: ParamGroups) -> None:
    mine = CommandDefaults(
        "mine",
        schedule="badam",
        values={"every": {"alternating": 5, ANY_KIND: 4}, "always": {"badam": Derived("head", lambda g, v: ("head",))}},
        refused={"unit": {"epoch": "it has no epochs"}, "schedule": {"sequence": "no"}},
    )
    built = SCHEDULES.build(None, groups, {}, mine)  # the command's kind, its `every` and its `always`
    assert describe(built) == describe(badam(LAYERS, steps_per_block=4, always=["head"]))
    assert describe(SCHEDULES.build("alternating", groups, {}, mine)) == describe(Alternating(EVERYTHING, every=5))
    given = SCHEDULES.build("badam", groups, {"every": "1", "always": ""}, mine)  # given beats the defaults
    assert describe(given) == describe(badam(EVERYTHING, steps_per_block=1))
    with pytest.raises(PlanError, match="`--unit` 'epoch' is refused by `mine`: it has no epochs"):
        SCHEDULES.resolve("gradual", {"unit": "epoch"}, mine)
    with pytest.raises(PlanError, match="`--schedule sequence` is refused by `mine`: no"):
        SCHEDULES.resolve("phase-sequence", {"phase": ["l0:1"]}, mine)
    with pytest.raises(PlanError, match="`--schedule` is required"):
        SCHEDULES.resolve(None, {})
    table = SCHEDULES.defaults_table(mine)
    assert "| `--schedule` | - | `badam` |" in table and "| `--always` | `badam` | head |" in table


def _tiny(groups: ParamGroups, args: Any) -> Schedule:
    return PhaseSequence([(list(groups.names), args["every"])])


def test_a_registry_refuses_collisions_and_undeclared_options() -> None:
    every = Option("every", "positions per phase", lambda v, flag: int(v))
    registry = ScheduleRegistry([every])
    registry.register(ScheduleKind("one", "all groups", _tiny, options=("every",), aliases=("uno",)))
    with pytest.raises(PlanError, match=r"lower case, with - between words .* got \['Two_Ways'\]"):
        registry.register(ScheduleKind("two", "all groups", _tiny, options=("every",), aliases=("Two_Ways",)))
    with pytest.raises(PlanError, match=r"takes the name\(s\) \['uno'\]"):
        registry.register(ScheduleKind("two", "all groups", _tiny, options=("every",), aliases=("uno",)))
    with pytest.raises(PlanError, match=r"names undeclared option\(s\) \['k'\]"):
        registry.register(ScheduleKind("two", "all groups", _tiny, options=("every", "k")))
    with pytest.raises(PlanError, match=r"`defaults` names option\(s\) \['every'\] that are not among its"):
        registry.register(ScheduleKind("two", "all groups", _tiny, options=(), defaults={"every": 1}))
    with pytest.raises(PlanError, match="declared already"):
        registry.add_option(Option("every", "again", lambda v, flag: v))
    assert registry.unregister("uno").name == "one" and list(registry) == []
