"""peft adapters as groups, the active adapter following the phase, save/reload, and set_adapter refused.

Most tests run in this process on a tiny config-built BERT with a bare
``PhaseSwitcher``; one runs ``tests/scripts/peft_check.py`` on two gloo ranks
under ``PhasedAccelerator``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import BertConfig, BertForSequenceClassification  # noqa: E402

from hf_altparams.engine import PhaseSwitcher  # noqa: E402
from hf_altparams.errors import AltParamsError, PlanError, SwitchError  # noqa: E402
from hf_altparams.integrations.accelerate import PhasedAccelerator  # noqa: E402
from hf_altparams.integrations.peft import (  # noqa: E402
    PeftAdapters,
    adapter_groups,
    adapter_parameters,
    follow_phases,
)
from hf_altparams.plan import Alternating, FnSchedule, ParamGroups, PerTaskCycle, PhaseSequence  # noqa: E402
from hf_altparams.testing import launch, rank_results  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "peft_check.py"
VOCAB = 64


def base_model() -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def make_peft(task_type: Any = "SEQ_CLS", names: tuple[str, ...] = ("a", "b")) -> Any:
    def config() -> LoraConfig:
        return LoraConfig(
            task_type=task_type, r=2, target_modules=["query", "value", "word_embeddings"], init_lora_weights=False
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(base_model(), config(), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, config())
    return model


def ids() -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))


def trained_adapters(model: Any) -> set[str]:
    """The adapters whose parameters get a gradient from one forward and backward."""
    owned = adapter_parameters(model)
    params = dict(model.named_parameters())
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids()).logits.sum()
    if loss.requires_grad:  # else the forward reached no trainable parameter
        loss.backward()
    got = {a for a, names in owned.items() if any(params[n].grad is not None for n in names)}
    for p in model.parameters():
        p.grad = None
    return got


# ---------------------------------------------------------------- groups by adapter
def test_one_group_per_adapter_holds_all_its_parameters_and_base_holds_the_rest() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")

    assert groups.names == ("a", "b", "base")
    names = [n for n, _ in model.named_parameters()]
    for adapter in ("a", "b"):
        members = set(groups.param_names(adapter))
        # LoRA on linear layers and on the embedding, and the adapter's own copy of the classifier.
        expected = {
            n
            for n in names
            if re.search(rf"\.(lora_A|lora_B|modules_to_save)\.{adapter}\.", n)
            or re.search(rf"\.lora_embedding_[AB]\.{adapter}$", n)
        }
        assert members == expected
        assert any("lora_embedding_A" in n for n in members) and any("modules_to_save" in n for n in members)
    assert set(groups.param_names("base")) == set(names) - set(groups.param_names("a")) - set(groups.param_names("b"))
    assert "base_model.model.classifier.original_module.weight" in groups.param_names("base")
    assert groups.ungrouped_names() == ()


def test_chosen_adapters_and_extra_groups() -> None:
    model = make_peft(names=("a", "b", "c"))
    groups = adapter_groups(model, ["c", "a"], extra={"head": "base_model.model.classifier.original_module.*"})

    assert groups.names == ("c", "a", "head")
    assert set(groups.ungrouped_names()) >= set(adapter_parameters(model)["b"])


def test_groups_by_adapter_refuse_bad_input_naming_what_exists() -> None:
    with pytest.raises(PlanError, match=r"`model` must be a peft model .* got BertForSequenceClassification"):
        adapter_groups(base_model())
    model = make_peft()
    with pytest.raises(PlanError, match=r"unknown adapter\(s\) \['c'\]; the model's adapters are \['a', 'b'\]"):
        adapter_groups(model, ["a", "c"])
    with pytest.raises(PlanError, match=r"`extra` group 'a' has the name of an adapter group"):
        adapter_groups(model, extra={"a": "base_model.model.bert.pooler.*"})
    with pytest.raises(PlanError, match=r"claimed by two groups, 'a' and 'mine'"):
        adapter_groups(model, extra={"mine": "*.lora_A.a.*"})
    with pytest.raises(PlanError, match=r"rest group 'a' is already a group"):
        adapter_groups(model, base="a")


# ---------------------------------------------------------------- the phase hook
def test_the_hook_activates_the_adapter_each_phase_trains_and_the_schedule_owns_requires_grad() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, PerTaskCycle(["base"], ["a", "b"], every=1, train_trunk=False))
    adapters = PeftAdapters(model, groups).bind(switcher)  # before the first phase
    seen = []
    for step in range(4):
        switcher.step_to(step)
        trainable = groups.trainable_param_names(switcher.current.trainable)
        flags_ok = all(p.requires_grad == (n in trainable) for n, p in groups.all_named_params())
        seen.append((switcher.current.name, list(model.active_adapters), trained_adapters(model), flags_ok))
    assert seen == [("a", ["a"], {"a"}, True), ("b", ["b"], {"b"}, True)] * 2
    adapters.close()
    assert adapters not in switcher.phase_hooks


def test_follow_phases_after_the_first_phase_activates_it_at_once() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, Alternating(["b", "a"]))
    switcher.step_to(0)  # phase b applied while peft still has "a" active (its default)
    assert model.active_adapters == ["a"] and trained_adapters(model) == set()

    adapters = follow_phases(switcher)
    assert adapters.active == ("b",) and model.active_adapters == ["b"]
    assert trained_adapters(model) == {"b"}
    assert all(p.requires_grad == (groups.group_of(n) == "b") for n, p in groups.all_named_params())


def test_a_phase_training_no_adapter_is_refused_unless_a_fallback_is_given() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, Alternating(["a", "base"]))
    with pytest.raises(AltParamsError, match=r"phase 'base' trains no adapter .* pass `fallback=`"):
        follow_phases(switcher)  # a known pattern: refused before any step
    assert switcher.phase_hooks == ()

    # A user function has no known pattern: the switch into such a phase is refused and rolled back.
    schedule = FnSchedule(lambda step, epoch: ["a"] if step == 0 else ["base"], groups=["a", "base"])
    switcher = PhaseSwitcher(groups, schedule)
    follow_phases(switcher)
    switcher.step_to(0)
    with pytest.raises(SwitchError, match=r"phase 'base' trains no adapter .* pass `fallback=`"):
        switcher.step_to(1)
    assert switcher.current.name == "a" and model.active_adapters == ["a"]  # rolled back, peft's adapter too

    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, Alternating(["a", "base"]))
    follow_phases(switcher, fallback="b")
    switcher.step_to(1)
    assert model.active_adapters == ["b"]
    assert not any(p.requires_grad for p in groups.params("b")), "the fallback adapter stays frozen"
    with pytest.raises(PlanError, match=r"`fallback` names unknown adapter\(s\) \['z'\]"):
        PeftAdapters(model, groups, fallback="z")


def test_a_phase_over_two_adapters_activates_both_and_a_failed_switch_restores_the_adapter() -> None:
    model = make_peft(task_type=None)  # no modules_to_save: peft lets several adapters be active
    groups = adapter_groups(model)
    switcher = PhaseSwitcher(groups, PhaseSequence([(("a",), 1), (("a", "b"), 1)], repeat=True))
    follow_phases(switcher)
    switcher.step_to(1)
    assert sorted(model.active_adapters) == ["a", "b"]

    def fail(phase: Any) -> None:
        if "b" not in phase.trainable:
            raise RuntimeError("a later hook failed")

    switcher.add_phase_hook(fail)
    with pytest.raises(SwitchError, match="a later hook failed"):
        switcher.step_to(2)  # back to phase a: peft switched to "a", then the switch rolled back
    assert sorted(model.active_adapters) == ["a", "b"]

    seq_cls = make_peft()  # modules_to_save: peft allows one active adapter; refused at the switch
    groups = adapter_groups(seq_cls)
    switcher = PhaseSwitcher(groups, PhaseSequence([(("a", "b"), 1)]))
    follow_phases(switcher)
    with pytest.raises(SwitchError, match=r"peft refused to activate adapter\(s\) \['a', 'b'\] for phase 'a\+b'"):
        switcher.step_to(0)


def test_set_adapter_behind_the_schedule_is_refused_at_the_next_training_forward() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"], every=4))
    adapters = follow_phases(switcher)
    switcher.step_to(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.set_adapter("b")
    with pytest.raises(
        AltParamsError,
        match=(
            r"peft's active adapter\(s\) \['b'\] are not the adapter\(s\) phase 'a' "
            r"trains \(\['a'\]\): `set_adapter\(...\)` was called behind"
        ),
    ):
        model(input_ids=ids())
    with torch.no_grad():  # an evaluation may use another adapter
        model(input_ids=ids())
    adapters.restore()
    assert model.active_adapters == ["a"] and trained_adapters(model) == {"a"}


def test_disable_adapter_and_enable_adapter_layers_leave_the_phase_s_flags_with_groups_by_adapter() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]))
    follow_phases(switcher)
    switcher.step_to(1)
    with torch.no_grad(), model.disable_adapter():  # e.g. a reference forward without adapters
        model(input_ids=ids())
    model.disable_adapter_layers()
    model.enable_adapter_layers()
    assert all(p.requires_grad == (groups.group_of(n) == "b") for n, p in groups.all_named_params())
    assert trained_adapters(model) == {"b"}


def test_visiting_evaluates_another_adapter_without_gradients_and_puts_the_phase_back() -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(groups, PerTaskCycle(["base"], ["a", "b"], every=4, train_trunk=False))
    adapters = follow_phases(switcher)
    switcher.step_to(0)
    model.eval()
    with adapters.visiting("b"):  # "b" is not resident in phase a: it comes back for the block
        assert model.active_adapters == ["b"] and not torch.is_grad_enabled()
        visited = model(input_ids=ids()).logits
    with torch.no_grad(), switcher.visiting(["b"]):  # the same by hand
        model.set_adapter("b")
        direct = model(input_ids=ids()).logits
    adapters.restore()
    assert torch.equal(visited, direct)
    assert model.active_adapters == ["a"] and trained_adapters(model) == {"a"}
    with pytest.raises(PlanError, match=r"`adapters` names unknown adapter\(s\) \['x'\]"):
        with adapters.visiting("x"):
            pass


def test_follow_phases_needs_a_started_run_on_a_peft_model() -> None:
    class NotStarted:
        switcher = None

    with pytest.raises(AltParamsError, match=r"NotStarted has no switcher yet; call it after `accelerator.prepare"):
        follow_phases(NotStarted())
    plain = base_model()
    switcher = PhaseSwitcher(ParamGroups(plain, {"head": "classifier.*"}), Alternating(["head"]))
    with pytest.raises(PlanError, match=r"`model` must be a peft model"):
        follow_phases(switcher)
    model = make_peft()
    with pytest.raises(PlanError, match=r"`groups` were built on a BertForSequenceClassification"):
        PeftAdapters(model, ParamGroups(model.base_model.model, {"x": "classifier.*"}))


# ---------------------------------------------------------------- save_pretrained
def test_each_adapter_saved_after_a_phased_run_reloads_identical(tmp_path: Path) -> None:
    model = make_peft()
    groups = adapter_groups(model, base="base")
    switcher = PhaseSwitcher(
        groups,
        PerTaskCycle(["base"], ["a", "b"], every=2, train_trunk=False),
        optimizer=(opt := torch.optim.SGD(model.parameters(), lr=0.1)),
    )
    follow_phases(switcher)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(4):
        switcher.step_to(step)
        model(input_ids=ids(), labels=torch.tensor([0, 1])).loss.backward()
        opt.step()
        opt.zero_grad()
    owned = adapter_parameters(model)
    assert all(
        not torch.equal(start[n], p) for a in owned for n in owned[a] for p in [dict(model.named_parameters())[n]]
    )

    for name in ("a", "b"):
        model.save_pretrained(str(tmp_path), selected_adapters=[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reloaded = PeftModel.from_pretrained(base_model(), str(tmp_path / "a"), adapter_name="a")
        reloaded.load_adapter(str(tmp_path / "b"), adapter_name="b")
    mine, theirs = dict(model.named_parameters()), dict(reloaded.named_parameters())
    for adapter, names in owned.items():
        assert names and all(torch.equal(mine[n], theirs[n]) for n in names), adapter


def test_load_state_lands_on_the_saved_phase_s_adapter(tmp_path: Path) -> None:
    def run(load: bool) -> tuple[str, list[str]]:
        model = make_peft()
        groups = adapter_groups(model, base="base")
        accelerator = PhasedAccelerator(PerTaskCycle(["base"], ["a", "b"], every=2, train_trunk=False), groups=groups)
        prepared, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        follow_phases(accelerator)
        if load:
            accelerator.load_state(str(tmp_path / "checkpoint"))
        else:
            for _ in range(3):
                accelerator.backward(prepared(input_ids=ids(), labels=torch.tensor([0, 1])).loss)
                optimizer.step()
                optimizer.zero_grad()
            accelerator.save_state(str(tmp_path / "checkpoint"))
        seen = (accelerator.phase.name, list(model.active_adapters))
        accelerator.free_memory()
        return seen

    saved = run(load=False)
    assert saved == ("b", ["b"])
    assert run(load=True) == saved  # a fresh run starts on "a"; loading switches it, peft's adapter too


# ---------------------------------------------------------------- two ranks
@pytest.mark.distributed
def test_two_ranks_one_adapter_per_task(tmp_path: Path) -> None:
    launch(SCRIPT, str(tmp_path), nproc=2, launcher="forked", env={"ACCELERATE_USE_CPU": "1"}, timeout=420)
    rank0, rank1 = rank_results(tmp_path, nproc=2)
    assert rank0["world_size"] == 2
    phased = rank0["phased"]
    assert phased["digests"] == rank1["phased"]["digests"], "ranks must end bit-identical"

    group_names = phased["group_names"]
    for adapter, names in phased["adapter_param_names"].items():
        assert sorted(group_names[adapter]) == sorted(names)
    trace = phased["trace"]
    assert [s["task"] for s in trace] == ["a", "a", "b", "b"] * 2
    for entry, measured in zip(trace, phased["measured"]):
        assert entry["active"] == [entry["task"]], "the forward runs the adapter the phase trains"
        assert entry["changed"] == [entry["task"]], "only that adapter moves; base and the other stay"
        assert measured == entry["adapter_bytes"] > 0, "bytes all-reduced per step = the active adapter's bytes"
    assert len(phased["measured"]) == len(trace)

    visit = phased["visit"]
    assert visit["active"] == ["b"] and visit["grad_enabled"] is False
    assert visit["after_active"] == ["a"] and visit["after_flags_match_phase"] is True
    assert phased["reload_max_abs_diff"] == {"a": 0.0, "b": 0.0}
    assert visit["logits"] == phased["reloaded_idle_logits"], "visiting ran the saved adapter's weights"

    for rank in (rank0, rank1):
        unhooked = rank["behind_back"]
        assert unhooked["changed"] == [], "the refused step applied nothing"
        assert re.search(r"parameter\(s\) outside phase 'a' hold gradients \(e\.g\. \[.*lora_\w+\.b", unhooked["error"])
        assert "peft's `set_adapter(...)`" in unhooked["error"]
        assert "hf_altparams.integrations.peft" in unhooked["error"]
        hooked = rank["behind_back_hooked"]
        assert hooked["changed"] == []
        assert "peft's active adapter(s) ['b'] are not the adapter(s) phase 'a' trains" in hooked["error"]
        assert hooked["restored_active"] == ["a"] and hooked["steps_after_restore"] == 3
    assert rank0["behind_back_hooked"]["digests"] == rank1["behind_back_hooked"]["digests"]


# ---------------------------------------------------------------- the Trainer
def test_the_trainer_callback_makes_the_active_adapter_follow_the_phase(tmp_path: Path) -> None:
    """``AlternatingFreeze(..., on_start=follow_phases)``: every step trains the phase's adapter, through the Trainer."""
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_altparams.integrations.trainer import AlternatingFreeze

    class Ids(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            gen = torch.Generator().manual_seed(i)
            return {"input_ids": torch.randint(1, VOCAB, (6,), generator=gen), "labels": torch.tensor(i % 2)}

    seen: list[tuple[str, str]] = []

    class Watch(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            seen.append((freeze.phase.name, model.active_adapter))

    AcceleratorState._reset_state(reset_partial_state=True)
    model = make_peft()
    freeze = AlternatingFreeze(lambda m: adapter_groups(m), Alternating({"a": 2, "b": 1}), on_start=follow_phases)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=6,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
    )
    Trainer(model=model, args=args, train_dataset=Ids(), callbacks=[freeze, Watch()]).train()
    assert seen == [("a", "a"), ("a", "a"), ("b", "b"), ("a", "a"), ("a", "a"), ("b", "b")]
    with pytest.raises(PlanError, match="`on_start` must be a callable"):
        AlternatingFreeze({"a": "x"}, Alternating(["a"]), on_start="follow")  # type: ignore[arg-type]
