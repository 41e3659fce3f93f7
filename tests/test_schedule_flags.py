"""``plan`` and ``check`` read one schedule registry: the same flags, meaning the same, and a kind registered
anywhere shows up in both. Unit tests: parsers and schedules, no process started."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any, Iterator

import pytest

from hf_altparams.check import cli as check_cli
from hf_altparams.check.workload import CHECK_DEFAULTS, schedule_for
from hf_altparams.plan import SCHEDULES, ParamGroups, PhaseSequence, Schedule
from hf_altparams.plan.registry import Derived, ScheduleArgs, ScheduleKind
from hf_altparams.planner import build_from_argv, plan_from_argv
from hf_altparams.planner import cli as plan_cli

DOCS = Path(__file__).resolve().parents[1] / "docs"

#: The built-in Llama of ``check``, grouped for the planner as ``check`` groups it (layer0..7, emb, head).
LLAMA = [
    "--model",
    "hf_altparams.check.workload:builtin_model",
    "--layers",
    "model.layers",
    "--group",
    "emb=model.embed_tokens.*",
    "--group",
    "head=lm_head.*",
]

PARSERS = {"plan": plan_cli.build_parser, "check": check_cli.build_parser}


def _schedule_actions(parser: argparse.ArgumentParser) -> tuple[list[argparse.Action], list[argparse.Action]]:
    """The actions of the argument group holding ``--schedule``, and every other action of the parser."""
    holding = [g for g in parser._action_groups if any("--schedule" in a.option_strings for a in g._group_actions)]
    assert len(holding) == 1, "one argument group holds --schedule and the other schedule flags"
    inside = holding[0]._group_actions
    return list(inside), [a for a in parser._actions if a not in inside]


def _shape(action: argparse.Action) -> tuple[Any, ...]:
    """What a flag is, whatever the command's help and defaults say about it."""
    return (
        tuple(action.option_strings),
        action.dest,
        type(action).__name__,
        action.nargs,
        action.const,
        action.default,
        action.metavar,
    )


def test_both_commands_expose_exactly_the_registry_s_schedule_flags() -> None:
    """Fails if either command grows a schedule flag of its own (in the group or beside it) or drops one."""
    registry_flags = {"--schedule", *(o.flag for o in SCHEDULES.options)}
    dests = {"schedule", *(o.name for o in SCHEDULES.options)}
    shapes = {}
    for command, build in PARSERS.items():
        inside, outside = _schedule_actions(build())
        assert {s for a in inside for s in a.option_strings} == registry_flags, command
        assert not [a.option_strings for a in outside if set(a.option_strings) & registry_flags or a.dest in dests]
        shapes[command] = sorted(_shape(a) for a in inside)
    assert shapes["plan"] == shapes["check"]


def test_every_flag_of_every_kind_means_the_same_in_both_commands() -> None:
    """Every option of every kind given explicitly: both commands build the same schedule over the same groups."""
    full = {
        "alternating": ["--always", "head", "--ratios", "layer0,layer1+layer2", "--every", "2", "--unit", "step"],
        "gradual": [
            "--always",
            "head",
            "--blocks",
            "layer0,layer1,emb",
            "--every",
            "2",
            "--order",
            "first_to_last",
            "--unit",
            "step",
        ],
        "progressive": [
            "--always",
            "emb",
            "--blocks",
            "layer0,layer1",
            "--every",
            "2",
            "--order",
            "last_to_first",
            "--unit",
            "step",
        ],
        "random-blocks": [
            "--always",
            "head",
            "--blocks",
            "layer0,layer1,layer2",
            "--k",
            "2",
            "--every",
            "3",
            "--seed",
            "4",
            "--unit",
            "step",
        ],
        "lisa": ["--always", "emb", "--blocks", "layer0,layer1,layer2", "--k", "2", "--every", "3", "--seed", "4"],
        "badam": ["--always", "head", "--blocks", "layer2,layer0", "--every", "2", "--order", "random", "--seed", "1"],
        "per-task": ["--trunk", "emb,head", "--tasks", "layer0+layer1,layer2", "--every", "2", "--unit", "step"],
        "sequence": ["--phase", "layer0+head:2", "--phase", "emb:1", "--repeat", "--unit", "step"],
    }
    assert sorted(full) == sorted(SCHEDULES)
    for kind, flags in full.items():
        assert {f for f in flags if f.startswith("--")} == {
            SCHEDULES.option(o).flag for o in SCHEDULES.kind(kind).options
        }, kind
        _, _, groups, planned = build_from_argv([*LLAMA, "--schedule", kind, *flags])
        args = check_cli.build_parser().parse_args(["--schedule", kind, *flags])
        name, given = SCHEDULES.given(args)
        assert _describe(planned) == _describe(SCHEDULES.build(name, groups, given)), kind
        if kind not in CHECK_DEFAULTS.refused.get("schedule", {}):  # check's defaults change nothing given
            assert _describe(planned) == _describe(schedule_for(name, groups, **given)), kind


def _describe(schedule: Schedule) -> list[Any]:
    phases = [schedule.phase_at(s) for s in range(24)]
    return [
        type(schedule).__name__,
        schedule.idle_state,
        json.dumps(schedule.state_dict(), default=str),
        [(sorted(p.trainable), p.name) for p in phases],
    ]


def test_the_commands_differ_only_by_check_s_declared_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    _, _, groups, planned = build_from_argv([*LLAMA, "--schedule", "lisa", "--k", "2", "--every", "3"])
    assert all(len(planned.phase_at(s).trainable) == 2 for s in range(12))  # the planner: no --always
    checked = schedule_for("lisa", groups)  # check: CHECK_DEFAULTS' emb and head, and 2 of the layers
    assert all(
        {"emb", "head"} < checked.phase_at(s).trainable and len(checked.phase_at(s).trainable) == 4 for s in range(12)
    )
    assert CHECK_DEFAULTS.default("always", "lisa")[0] and not CHECK_DEFAULTS.default("always", "badam")[0]
    with pytest.raises(SystemExit) as exit_info:  # a plan needs what a check defaults
        plan_cli.main([*LLAMA, "--schedule", "lisa"])
    assert exit_info.value.code == 2 and "`--k` (groups drawn per block) is required" in capsys.readouterr().err


def _halves(groups: ParamGroups, args: ScheduleArgs) -> Schedule:
    blocks = list(args["blocks"])
    half = len(blocks) // 2
    return PhaseSequence([(blocks[:half], args["every"]), (blocks[half:], args["every"])], repeat=True)


@pytest.fixture
def halves() -> Iterator[ScheduleKind]:
    """A kind of the test's own, registered for the test only."""
    kind = SCHEDULES.register(
        ScheduleKind(
            "test-halves",
            "the first half of --blocks, then the second",
            _halves,
            options=("blocks", "every"),
            required=("every",),
            defaults={"blocks": Derived("every group", lambda groups, values: groups.names)},
            aliases=("test-two-halves",),
        )
    )
    try:
        yield kind
    finally:
        SCHEDULES.unregister(kind.name)


def test_a_kind_registered_once_appears_in_both_commands(
    halves: ScheduleKind, capsys: pytest.CaptureFixture[str]
) -> None:
    for command, build in PARSERS.items():
        assert "test-halves: the first half of --blocks" in " ".join(build().format_help().split()), command
        assert build().parse_args(["--schedule", "test-two-halves", "--model", "x"]).schedule == "test-halves"
    _, plan = plan_from_argv([*LLAMA, "--schedule", "test-halves", "--every", "2", "--blocks", "layer0,layer1"])
    assert [(row.phase, row.ranges) for row in plan.phases] == [("layer0", [(0, 2)]), ("layer1", [(2, 4)])]
    _, _, groups, _ = build_from_argv([*LLAMA, "--schedule", "test-halves", "--every", "2"])
    checked = schedule_for("test-halves", groups)  # check's defaults reach a new kind: 3 steps, the layers
    assert [checked.phase_at(s).name for s in (0, 3, 6)] == [
        "layer0+layer1+layer2+layer3",
        "layer4+layer5+layer6+layer7",
        "layer0+layer1+layer2+layer3",
    ]
    assert check_cli.main(["--schedule", "test-halves", "--k", "2"]) == 2  # refused before any rank starts
    assert "`--k` '2' does not apply to `--schedule test-halves`" in capsys.readouterr().err


def test_the_docs_tables_are_the_registry_s() -> None:
    planner, check = (DOCS / "planner.md").read_text(), (DOCS / "check.md").read_text()
    for doc in (planner, check):
        assert SCHEDULES.table() in doc and SCHEDULES.flag_table() in doc
    assert SCHEDULES.defaults_table(CHECK_DEFAULTS) in check
    documented = set(re.findall(r"^\| `([a-z-]+)`", planner, flags=re.M))
    assert set(SCHEDULES) <= documented
