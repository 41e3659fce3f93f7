"""Unit tests of ParamGroups on tiny modules (no process group)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from hf_altparams.errors import PlanError
from hf_altparams.plan import ParamGroups


class TinyLM(nn.Module):
    """Embedding, three layers, a norm and an LM head tied to the embedding."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.act = nn.ReLU()
        self.norm = nn.LayerNorm(4)
        self.lm_head = nn.Linear(4, 10, bias=False)
        if tied:
            self.lm_head.weight = self.emb.weight


@pytest.fixture
def lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _numel(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


# -- resolution -----------------------------------------------------------------------------------


def test_glob_regex_and_module_specs(lm: TinyLM) -> None:
    groups = ParamGroups(
        lm,
        {
            "first": "layers.0.*",
            "rest": ["re:layers\\.[12]\\.weight", "layers.1.b*", lm.layers[2]],
            "norm": lm.norm,
        },
    )
    assert groups.names == ("first", "rest", "norm")
    assert groups.param_names("first") == ("layers.0.weight", "layers.0.bias")
    assert groups.param_names("rest") == (
        "layers.1.weight",
        "layers.1.bias",
        "layers.2.weight",
        "layers.2.bias",
    )
    assert groups.param_names("norm") == ("norm.weight", "norm.bias")
    assert [p is lm.layers[0].weight for p in groups.params("first")] == [True, False]
    assert groups.named_params("norm") == [("norm.weight", lm.norm.weight), ("norm.bias", lm.norm.bias)]
    assert groups.ungrouped_names() == ("emb.weight",)
    assert groups.group_of("layers.2.bias") == "rest"
    assert groups.group_of("emb.weight") is None
    assert groups.module is lm and groups.ungrouped == "frozen"
    assert "first" in groups and "nope" not in groups


def test_regex_is_fullmatch_and_glob_is_case_sensitive(lm: TinyLM) -> None:
    with pytest.raises(PlanError, match="'re:layers'"):
        ParamGroups(lm, {"a": "re:layers"})  # a prefix is not a full match
    with pytest.raises(PlanError, match="'NORM.\\*'"):
        ParamGroups(lm, {"a": "NORM.*"})


def test_all_named_params_is_unique_canonical_and_in_module_order(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"norm": "norm.*"})
    assert groups.all_named_params() == list(lm.named_parameters())
    names = [n for n, _ in groups.all_named_params()]
    assert "lm_head.weight" not in names and names[0] == "emb.weight"


def test_numel_and_nbytes(lm: TinyLM) -> None:
    lm.norm.to(torch.float64)
    groups = ParamGroups(lm, {"norm": "norm.*", "layers": "layers.*"})
    assert groups.numel("norm") == 8 and groups.nbytes("norm") == 8 * 8
    assert groups.numel("layers") == 3 * 20 and groups.nbytes("layers") == 3 * 20 * 4


# -- tied / shared parameters ---------------------------------------------------------------------


def test_tied_names_in_one_group_count_once(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"embed": ["emb.*", "lm_head.*"]})
    assert groups.param_names("embed") == ("emb.weight",)
    assert groups.numel("embed") == 40
    assert groups.group_of("lm_head.weight") == "embed"  # alias name accepted
    assert groups.params("embed")[0] is lm.lm_head.weight


def test_tied_names_in_two_groups_is_an_error(lm: TinyLM) -> None:
    with pytest.raises(PlanError) as err:
        ParamGroups(lm, {"embed": "emb.*", "head": "lm_head.*"})
    message = str(err.value)
    for part in ("'embed'", "'head'", "'emb.weight'", "'lm_head.weight'", "tied"):
        assert part in message


def test_alias_claimed_alone_maps_to_canonical_name(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"head": "lm_head.*"})
    assert groups.param_names("head") == ("emb.weight",)
    assert groups.ungrouped_names() == tuple(n for n, _ in lm.named_parameters() if n != "emb.weight")


def test_shared_submodule_claimed_by_two_groups_is_an_error() -> None:
    model = nn.Module()
    model.a = nn.Linear(2, 2)
    model.b = model.a  # the same module registered twice
    with pytest.raises(PlanError, match="'x'.*'y'|'y'.*'x'"):
        ParamGroups(model, {"x": "a.*", "y": "b.*"})
    assert ParamGroups(model, {"x": ["a.*", "b.*"]}).param_names("x") == ("a.weight", "a.bias")


def test_untied_model_allows_separate_groups() -> None:
    groups = ParamGroups(TinyLM(tied=False), {"embed": "emb.*", "head": "lm_head.*"})
    assert groups.param_names("head") == ("lm_head.weight",)


# -- invalid input --------------------------------------------------------------------------------


def _not_a_submodule(lm: TinyLM) -> dict:
    return {"a": nn.Linear(4, 4)}


BAD_SPECS = [
    pytest.param(lambda lm: {}, ["`groups`", "{}", "non-empty mapping"], id="empty-mapping"),
    pytest.param(lambda lm: ["emb.*"], ["`groups`", "['emb.*']"], id="not-a-mapping"),
    pytest.param(lambda lm: {"": "emb.*"}, ["group names", "''"], id="empty-name"),
    pytest.param(lambda lm: {3: "emb.*"}, ["group names", "3"], id="int-name"),
    pytest.param(lambda lm: {"a": 3}, ["'a'", "3", "glob pattern", "submodule"], id="int-spec"),
    pytest.param(lambda lm: {"a": ["emb.*", 2.5]}, ["'a'", "2.5", "re:"], id="bad-item"),
    pytest.param(lambda lm: {"a": {"emb.*"}}, ["'a'", "set", "list/tuple"], id="set-spec"),
    pytest.param(lambda lm: {"a": []}, ["'a'", "empty"], id="empty-group"),
    pytest.param(lambda lm: {"a": lm.norm.weight}, ["'a'", "Parameter of shape (4,)", "name"], id="parameter-spec"),
    pytest.param(lambda lm: {"a": "encoder.*"}, ["'a'", "'encoder.*'", "'emb.weight'"], id="no-match"),
    pytest.param(lambda lm: {"a": "re:emb.("}, ["'a'", "'re:emb.('", "regex"], id="bad-regex"),
    pytest.param(_not_a_submodule, ["'a'", "Linear", "not a submodule"], id="foreign-module"),
    pytest.param(lambda lm: {"a": lm.act}, ["'a'", "'act'", "no parameters"], id="no-params"),
    pytest.param(
        lambda lm: {"a": "layers.*", "b": "layers.1.*"},
        ["'layers.1.weight'", "'a'", "'b'"],
        id="overlap",
    ),
    pytest.param(
        lambda lm: {"a": lm.layers, "b": "re:layers\\.0\\..*"},
        ["'layers.0.weight'", "'a'", "'b'"],
        id="overlap-module-pattern",
    ),
]


@pytest.mark.parametrize(("make_spec", "expected"), BAD_SPECS)
def test_invalid_specs_raise_plan_error_naming_the_value(lm: TinyLM, make_spec, expected) -> None:
    with pytest.raises(PlanError) as err:
        ParamGroups(lm, make_spec(lm))
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


def test_bad_ungrouped_policy(lm: TinyLM) -> None:
    with pytest.raises(
        PlanError, match=re.escape("`ungrouped` must be one of ['frozen', 'trainable', 'error'], got 'freeze'")
    ):
        ParamGroups(lm, {"a": "emb.*"}, ungrouped="freeze")  # type: ignore[arg-type]


def test_not_a_module() -> None:
    with pytest.raises(PlanError, match="`module`.*dict"):
        ParamGroups({"w": 1}, {"a": "w"})  # type: ignore[arg-type]


# -- ungrouped policies ---------------------------------------------------------------------------


def test_ungrouped_frozen_is_excluded_from_trainable(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"norm": "norm.*", "l0": "layers.0.*"})
    assert groups.trainable_param_names(["norm"]) == frozenset({"norm.weight", "norm.bias"})
    assert groups.trainable_param_names([]) == frozenset()


def test_ungrouped_trainable_trains_in_every_phase(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"norm": "norm.*", "l0": "layers.0.*"}, ungrouped="trainable")
    ungrouped = set(groups.ungrouped_names())
    assert ungrouped == {"emb.weight", "layers.1.weight", "layers.1.bias", "layers.2.weight", "layers.2.bias"}
    assert groups.trainable_param_names(["l0"]) == frozenset(ungrouped | {"layers.0.weight", "layers.0.bias"})
    assert groups.trainable_param_names([]) == frozenset(ungrouped)


def test_ungrouped_error_lists_parameters(lm: TinyLM) -> None:
    with pytest.raises(PlanError) as err:
        ParamGroups(lm, {"norm": "norm.*"}, ungrouped="error")
    assert "'emb.weight'" in str(err.value) and "'layers.0.weight'" in str(err.value)
    assert "7 parameter(s)" in str(err.value)
    everything = ParamGroups(lm, {"all": "*"}, ungrouped="error")
    assert everything.ungrouped_names() == ()


def test_unknown_group_names_are_rejected(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"norm": "norm.*", "emb": "emb.*"})
    with pytest.raises(
        PlanError, match=re.escape("`trainable_groups` names unknown group(s) ['head']; known groups: ['norm', 'emb']")
    ):
        groups.trainable_param_names(["norm", "head"])
    with pytest.raises(PlanError, match=re.escape("`resident` names unknown group(s) ['x', 'y']")):
        groups.check_names(["emb", "x", "y"], argument="resident")
    groups.check_names(["emb", "norm"], argument="resident")  # no error
    with pytest.raises(PlanError, match="'head'.*known groups"):
        groups.param_names("head")
    with pytest.raises(PlanError, match="'module.norm.weight'"):
        groups.group_of("module.norm.weight")


# -- reporting ------------------------------------------------------------------------------------


def test_summary_counts_bytes_and_trainable_share() -> None:
    model = nn.Module()
    model.big = nn.Linear(512, 512)  # 262,656 params = 1.00 MiB in float32
    model.small = nn.Linear(8, 8)  # 72 params = 288 B
    model.rest = nn.Linear(2, 2)  # 6 params, ungrouped
    groups = ParamGroups(model, {"big": model.big, "small": "small.*"})
    text = groups.summary()
    assert "trainable" not in text
    big_row = next(line for line in text.splitlines() if line.startswith("big"))
    assert "262,656" in big_row and "1.00 MiB" in big_row
    small_row = next(line for line in text.splitlines() if line.startswith("small"))
    assert "72" in small_row and "288 B" in small_row
    loose = next(line for line in text.splitlines() if line.startswith("<ungrouped: frozen>"))
    assert loose.split()[2] == "6" and "24 B" in loose
    total = next(line for line in text.splitlines() if line.startswith("total"))
    assert f"{262_656 + 72 + 6:,}" in total

    with_trainable = groups.summary(["small"])
    lines = with_trainable.splitlines()
    assert lines[0].endswith("trainable")
    assert next(line for line in lines if line.startswith("small")).endswith("yes")
    assert next(line for line in lines if line.startswith("big")).endswith("no")
    share = 100 * 72 / (262_656 + 72 + 6)
    assert lines[-1] == f"trainable: 72 of {262_656 + 72 + 6:,} params ({share:.2f}%)"


def test_summary_counts_ungrouped_when_trainable_and_tied_once(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"embed": ["emb.*", "lm_head.*"], "norm": "norm.*"}, ungrouped="trainable")
    total = _numel(list(lm.parameters()))
    assert total == 40 + 60 + 8
    assert groups.summary(["norm"]).splitlines()[-1] == f"trainable: 68 of {total} params ({100 * 68 / total:.2f}%)"
    with pytest.raises(PlanError, match="`trainable`.*'bogus'"):
        groups.summary(["bogus"])


def test_print_summary_and_repr(lm: TinyLM, capsys: pytest.CaptureFixture[str]) -> None:
    groups = ParamGroups(lm, {"norm": "norm.*"})
    groups.print_summary(["norm"])
    assert capsys.readouterr().out.strip() == groups.summary(["norm"])
    assert repr(groups) == "ParamGroups(norm: 2; ungrouped=7 frozen)"


# -- other constructors ---------------------------------------------------------------------------


def test_rebind_onto_a_copy(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"embed": ["emb.*", "lm_head.*"], "l": lm.layers}, ungrouped="trainable")
    fresh = copy.deepcopy(lm)
    again = groups.rebind(fresh)
    assert again.module is fresh and again.names == groups.names and again.ungrouped == "trainable"
    for name in groups.names:
        assert again.param_names(name) == groups.param_names(name)
        assert all(p is dict(fresh.named_parameters())[n] for n, p in again.named_params(name))
    assert again.params("embed")[0] is fresh.lm_head.weight  # still tied in the copy


def test_rebind_names_missing_parameters(lm: TinyLM) -> None:
    groups = ParamGroups(lm, {"norm": "norm.*", "l0": "layers.0.*"})
    smaller = TinyLM()
    del smaller.norm
    with pytest.raises(PlanError, match="'norm.weight', 'norm.bias'"):
        groups.rebind(smaller)


@pytest.mark.parametrize(
    ("per", "expected"),
    [
        (1, {"layer0": 0, "layer1": 1, "layer2": 2}),
        (2, {"layer0": (0, 1), "layer1": (2,)}),
        (3, {"layer0": (0, 1, 2)}),
        (5, {"layer0": (0, 1, 2)}),
    ],
)
def test_from_layers(lm: TinyLM, per: int, expected: dict) -> None:
    for layers in ("layers", lm.layers):
        groups = ParamGroups.from_layers(lm, layers, per=per, extra={"head": "norm.*"})
        assert groups.names == (*expected, "head")
        for name, idx in expected.items():
            idx = idx if isinstance(idx, tuple) else (idx,)
            assert groups.param_names(name) == tuple(f"layers.{i}.{p}" for i in idx for p in ("weight", "bias"))
        assert groups.param_names("head") == ("norm.weight", "norm.bias")


def test_from_layers_prefix_and_policy(lm: TinyLM) -> None:
    groups = ParamGroups.from_layers(lm, "layers", prefix="block", ungrouped="trainable")
    assert groups.names == ("block0", "block1", "block2") and groups.ungrouped == "trainable"


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"layers": "layers", "per": 0}, ["`per`", "got 0"]),
        ({"layers": "layers", "per": "2"}, ["`per`", "'2'"]),
        ({"layers": "layers", "per": True}, ["`per`", "True"]),
        ({"layers": "norm"}, ["`layers`", "LayerNorm", "ModuleList"]),
        ({"layers": "encoder.layer"}, ["`layers`", "'encoder.layer'"]),
        ({"layers": nn.ModuleList()}, ["`layers`", "empty"]),
        ({"layers": "layers", "extra": {"layer1": "norm.*"}}, ["`extra`", "'layer1'"]),
    ],
)
def test_from_layers_rejects_bad_arguments(lm: TinyLM, kwargs: dict, expected: list[str]) -> None:
    with pytest.raises(PlanError) as err:
        ParamGroups.from_layers(lm, **kwargs)
    for part in expected:
        assert part in str(err.value), (part, str(err.value))


def test_from_modules(lm: TinyLM) -> None:
    groups = ParamGroups.from_modules(lm, {"low": [lm.layers[0], lm.layers[1]], "top": lm.layers[2]})
    assert groups.param_names("top") == ("layers.2.weight", "layers.2.bias")
    assert len(groups.param_names("low")) == 4
    with pytest.raises(PlanError, match="'low'.*'layers.0.\\*'"):
        ParamGroups.from_modules(lm, {"low": [lm.layers[0], "layers.0.*"]})  # type: ignore[list-item]


def test_ddp_wrapper_is_unwrapped(lm: TinyLM) -> None:
    # A DistributedDataParallel instance without a process group: enough for the isinstance check.
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = lm
    groups = ParamGroups(ddp, {"norm": "norm.*"})
    assert groups.module is lm
    assert groups.param_names("norm") == ("norm.weight", "norm.bias")
    layered = ParamGroups.from_layers(ddp, "layers", per=3)
    assert layered.param_names("layer0")[0] == "layers.0.weight"
