"""What ``check`` trains, and its flags: clear errors before any rank starts, the right groups and schedules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_altparams.check import CheckSetup, builtin_model
from hf_altparams.check.cli import main
from hf_altparams.check.workload import find_layers, layer_groups, load_setup, schedule_for, synthetic_batch
from hf_altparams.errors import PlanError
from hf_altparams.plan import SCHEDULES, Alternating, ParamGroups


@pytest.fixture(scope="module")
def small() -> nn.Module:
    return builtin_model(layers=4, hidden=64, vocab=128)


def test_layer_groups_find_the_layers_embeddings_and_head(small: nn.Module) -> None:
    groups = layer_groups(small)
    assert groups.names == ("layer0", "layer1", "layer2", "layer3", "emb", "head")
    assert groups.param_names("head") == ("lm_head.weight",)
    assert find_layers(small) == "model.layers"


def test_a_tied_head_trains_with_the_embeddings() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, tie_word_embeddings=True))
    assert layer_groups(tied).names == ("layer0", "layer1", "emb")


def test_a_model_without_layers_is_refused_naming_the_flag() -> None:
    with pytest.raises(PlanError, match="--layers"):
        find_layers(nn.Linear(2, 2))


@pytest.mark.parametrize("name, expected", [("lisa", "RandomBlocks"), ("badam", "Alternating"),
                                            ("alternating", "Alternating"), ("gradual", "GradualUnfreeze")])
def test_each_schedule_is_built_with_its_recipe_state_policy(small: nn.Module, name: str, expected: str) -> None:
    schedule = schedule_for(name, layer_groups(small), every=2)
    assert type(schedule).__name__ == expected
    assert schedule.idle_state == ("drop" if name in ("lisa", "badam") else "keep")
    schedule.validate(layer_groups(small))


@pytest.mark.parametrize("kwargs, match", [
    ({"k": 9}, r"`--k` must be an integer from 1 to 4"),
    ({"always": ["nope"]}, r"`--always` names \['nope'\]"),
    ({"every": 0}, r"`--every` must be a positive integer"),
])
def test_bad_schedule_options_are_refused(small: nn.Module, kwargs: dict, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        schedule_for("lisa", layer_groups(small), **kwargs)
    with pytest.raises(PlanError, match=r"`--schedule` is 'lora'; accepted: \[") as refused:
        schedule_for("lora", layer_groups(small))
    assert all(repr(kind) in str(refused.value) for kind in SCHEDULES)


def test_load_setup_accepts_a_pair_and_refuses_what_it_cannot_use() -> None:
    setup = load_setup("tests.check.setups:lisa_small")
    assert isinstance(setup, CheckSetup) and setup.description == "small Llama, lisa"
    with pytest.raises(PlanError, match="must be 'module:function'"):
        load_setup("tests.check.setups")
    with pytest.raises(PlanError, match="cannot be imported"):
        load_setup("tests.check.nowhere:setup")
    with pytest.raises(PlanError, match="not a function"):
        load_setup("tests.check.setups:KEPT")
    with pytest.raises(PlanError, match="returned int"):
        load_setup("builtins:int")


def test_a_setup_without_inputs_for_a_plain_module_is_refused() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    with pytest.raises(PlanError, match="give `batch=lambda step, rank"):
        CheckSetup(groups, Alternating(["a", "b"]))
    with pytest.raises(PlanError, match="`optimizer` must be callable"):
        CheckSetup(groups, Alternating(["a", "b"]), optimizer=3, batch=lambda s, r: {})  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="no `config.vocab_size`"):
        synthetic_batch(net, 0, 0)


def test_batches_differ_by_rank_and_step_and_repeat_exactly(small: nn.Module) -> None:
    a, b = synthetic_batch(small, 0, 0), synthetic_batch(small, 0, 1)
    assert not torch.equal(a["input_ids"], b["input_ids"])
    assert torch.equal(a["input_ids"], synthetic_batch(small, 0, 0)["input_ids"])
    assert torch.equal(a["labels"], a["input_ids"])


@pytest.mark.parametrize("argv, match", [
    (["--setup", "m:f", "--model", "x"], "exclude each other"),
    (["--weights"], "`--weights` loads the weights of `--model`"),
    (["--warmup", "-1"], "`--warmup` must be 0 or more"),
    (["--setup", "m:f", "--schedule", "badam", "--every", "2"],
     "`--setup` builds its own schedule: leave out --schedule, --every"),
    (["--schedule", "alternating", "--unit", "epoch"], "`--unit` 'epoch' is refused by `check`: it counts optimizer"),
    (["--schedule", "gradual", "--k", "2"], "`--k` '2' does not apply to `--schedule gradual`"),
    (["--schedule", "sequence"], "`--schedule sequence` needs at least one `--phase GROUP[+GROUP...]:DURATION`"),
    (["--schedule", "per-task", "--trunk", "emb"], "`--schedule per-task` is refused by `check`: its groups are"),
])
def test_conflicting_flags_exit_2_before_any_rank_starts(argv: list[str], match: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert match in capsys.readouterr().err
