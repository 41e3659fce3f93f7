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

    tied = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            tie_word_embeddings=True,
        )
    )
    assert layer_groups(tied).names == ("layer0", "layer1", "emb")


def test_a_model_without_layers_is_refused_naming_the_flag() -> None:
    with pytest.raises(PlanError, match="--layers"):
        find_layers(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "name, expected",
    [
        ("lisa", "RandomBlocks"),
        ("badam", "Alternating"),
        ("alternating", "Alternating"),
        ("gradual", "GradualUnfreeze"),
    ],
)
def test_each_schedule_is_built_with_its_recipe_state_policy(small: nn.Module, name: str, expected: str) -> None:
    schedule = schedule_for(name, layer_groups(small), every=2)
    assert type(schedule).__name__ == expected
    assert schedule.idle_state == ("drop" if name in ("lisa", "badam") else "keep")
    schedule.validate(layer_groups(small))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"k": 9}, r"`--k` must be an integer from 1 to 4"),
        ({"always": ["nope"]}, r"`--always` names \['nope'\]"),
        ({"every": 0}, r"`--every` must be a positive integer"),
    ],
)
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


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--setup", "m:f", "--model", "x"], "exclude each other"),
        (["--weights"], "`--weights` loads the weights of `--model`"),
        (["--warmup", "-1"], "`--warmup` must be 0 or more"),
        (
            ["--setup", "m:f", "--schedule", "badam", "--every", "2"],
            "`--setup` builds its own schedule: leave out --schedule, --every",
        ),
        (
            ["--schedule", "alternating", "--unit", "epoch"],
            "`--unit` 'epoch' is refused by `check`: it counts optimizer",
        ),
        (["--schedule", "gradual", "--k", "2"], "`--k` '2' does not apply to `--schedule gradual`"),
        (["--schedule", "sequence"], "`--schedule sequence` needs at least one `--phase GROUP[+GROUP...]:DURATION`"),
        (["--schedule", "per-task", "--trunk", "emb"], "`--schedule per-task` is refused by `check`: its groups are"),
    ],
)
def test_conflicting_flags_exit_2_before_any_rank_starts(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert match in capsys.readouterr().err


def test_the_task_comes_from_the_flag_the_architectures_or_the_first_head_the_config_has() -> None:
    from transformers import BertConfig, T5Config

    from hf_altparams.check.workload import pick_task

    assert pick_task(T5Config(architectures=["T5ForConditionalGeneration"])) == "seq2seq-lm"
    assert pick_task(BertConfig(architectures=["BertForSequenceClassification"])) == "seq-classification"
    assert pick_task(BertConfig()) == "causal-lm"  # no architectures: the first of TASKS it has a head for
    assert pick_task(BertConfig(architectures=["BertForMaskedLM"]), "masked-lm") == "masked-lm"
    with pytest.raises(
        PlanError,
        match=r"no AutoModelForCausalLM head for a T5Config .* accepts \['seq2seq-lm', "
        r"'seq-classification'\]",
    ):
        pick_task(T5Config(), "causal-lm")
    with pytest.raises(PlanError, match=r"`--task` is 'translation'; accepted: \['causal-lm'"):
        pick_task(T5Config(), "translation")


def test_a_config_without_a_head_the_check_trains_is_refused_naming_the_heads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import CLIPVisionConfig

    from hf_altparams.check.workload import model_setup

    CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2).save_pretrained(
        tmp_path
    )
    with pytest.raises(PlanError, match=r"has none of the heads `check` trains: causal-lm \(AutoModelForCausalLM\)"):
        model_setup(tmp_path / "config.json")


def test_an_encoder_decoder_groups_both_stacks_and_gets_decoder_inputs() -> None:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(
        T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_heads=2, d_kv=8, decoder_start_token_id=0)
    )
    groups = layer_groups(model)
    assert groups.names == ("decoder0", "decoder1", "encoder0", "encoder1", "emb")
    batch = synthetic_batch(model, 3, 0)
    assert sorted(batch) == ["decoder_input_ids", "input_ids", "labels"]
    assert torch.equal(batch["decoder_input_ids"][:, 1:], batch["labels"][:, :-1])
    model(**batch).loss.backward()


def test_setup_options_are_checked_when_built() -> None:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})

    def make(**options) -> CheckSetup:  # type: ignore[no-untyped-def]
        return CheckSetup(groups, Alternating(["a", "b"]), batch=lambda s, r: {}, **options)

    assert make(ddp={"find_unused_parameters": True}).ddp.find_unused_parameters is True
    with pytest.raises(PlanError, match=r"`ddp` names \['find_unused'\], which DistributedDataParallelKwargs does"):
        make(ddp={"find_unused": True})
    with pytest.raises(PlanError, match="`ddp` sets comm_hook=.*counts the bytes all-reduced with a comm hook"):
        make(ddp={"comm_hook": "fp16"})
    with pytest.raises(PlanError, match="`accumulation` must be a positive integer"):
        make(accumulation=0)
    with pytest.raises(PlanError, match="`before_step` must be callable"):
        make(before_step="clip")


@pytest.mark.parametrize("config", ["bert-mlm", "llama-classifier"])
def test_a_masked_lm_and_a_decoder_classifier_train_on_their_synthetic_batches(tmp_path, config: str) -> None:  # type: ignore[no-untyped-def]
    """The two kinds the real runs leave out (they run a T5 and a BERT classifier): built, grouped, one step."""
    from transformers import BertConfig, LlamaConfig

    from hf_altparams.check.workload import model_setup

    small = {
        "vocab_size": 64,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
    }
    made = (
        BertConfig(architectures=["BertForMaskedLM"], **small)
        if config == "bert-mlm"
        else LlamaConfig(architectures=["LlamaForSequenceClassification"], **small)
    )  # no pad token
    made.save_pretrained(tmp_path)
    model, groups = model_setup(tmp_path / "config.json")
    setup = CheckSetup(groups, schedule_for("alternating", groups))
    assert "head" in groups.names if config != "bert-mlm" else groups.names == ("layer0", "layer1", "emb")
    setup.compute_loss(model(**setup.make_batch(0, 0, torch.device("cpu")))).backward()
    assert all(p.grad is not None for p in groups.params("layer0"))


def test_the_preflight_prices_the_model_with_the_head_the_ranks_build(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A T5 config is priced as the T5ForConditionalGeneration the ranks train (was: unpriced, AutoModelForCausalLM
    cannot build it); a config with none of the heads is refused before any rank starts, naming them."""
    from transformers import CLIPVisionConfig, T5Config

    from hf_altparams.check.preflight import meta_model, price_check

    T5Config(
        d_model=16,
        d_ff=32,
        num_layers=2,
        d_kv=8,
        num_heads=2,
        vocab_size=64,
        architectures=["T5ForConditionalGeneration"],
    ).save_pretrained(tmp_path / "t5")
    net, built = meta_model(str(tmp_path / "t5" / "config.json"))
    assert type(net).__name__ == "T5ForConditionalGeneration" and built > 0
    assert price_check(str(tmp_path / "t5"), ranks=2, steps=6, fsdp2=False, schedule="alternating").built == built
    CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2).save_pretrained(
        tmp_path / "clip"
    )
    with pytest.raises(PlanError, match="has none of the heads `check` trains"):
        meta_model(str(tmp_path / "clip"))
