"""The 🤗 Trainer integration: AlternatingFreeze under DDP (2 gloo ranks), alone, and on bad input.

The multi-process scenarios run once, in one launch of
``tests/scripts/trainer_phases.py`` (see its docstring), and
the tests below read its per-rank results. Single-process runs and error
cases run in this process on the same tiny BERT.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from hf_altparams.errors import AltParamsError, PlanError
from hf_altparams.integrations.trainer import AlternatingFreeze, grouped_optimizer
from hf_altparams.plan import TrainShareWarning
from hf_altparams.plan.groups import ParamGroups
from hf_altparams.plan.schedules import Alternating, GradualUnfreeze, PhaseSequence
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2
ROOT = Path(__file__).resolve().parents[2]


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trainer_phases", script_path("trainer_phases.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("trainer_phases", module)
    spec.loader.exec_module(module)
    return module


S = _load_script()

#: Trainable groups at each optimizer step of each launched scenario (mirrors the script).
EXPECTED_PHASES: dict[str, list[set[str]]] = {
    "main": [set(g) for g, n in S.MAIN_PHASES for _ in range(n)],
    "bf16_gc": [{"layer1"}, {"head"}, {"layer1"}, {"head"}],
    "grouped": [{"layer0"}, {"head"}, {"head"}, {"layer0"}],
    "bf16_fp32_wire": [{"layer0"}, {"head"}, {"head"}, {"layer0"}],
}
EXPECTED_PHASES["resume"] = EXPECTED_PHASES["main"][S.SAVE_STEPS :]
CHECKED = ["main", "resume", "bf16_gc", "grouped", "bf16_fp32_wire"]
#: bytes all-reduced per trainable byte: bf16 parameters whose gradients are all-reduced in fp32 send 2
WIRE_PER_BYTE = {"bf16_fp32_wire": 2}


def changed_groups(sums: list[dict[str, str]]) -> list[set[str]]:
    """Groups whose checksum changed across each optimizer step."""
    return [{g for g in before if before[g] != after[g]} for before, after in zip(sums, sums[1:])]


#: every ``Trainer.train()`` runs a full collection: see the fixture in ``tests/conftest.py``
pytestmark = pytest.mark.usefixtures("imports_frozen")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Any:
    """In-process Trainers leave Accelerate's process-wide state behind; other tests get a clean one."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("trainer_phases")
    launch(script_path("trainer_phases.py"), str(out), nproc=NPROC, launcher="forked", timeout=300)
    return rank_results(out, nproc=NPROC)


# ------------------------------------------------------------------------- 2 ranks, DDP


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", CHECKED)
def test_ranks_end_bit_identical(ranks: list[dict[str, Any]], scenario: str) -> None:
    finals = [r["scenarios"][scenario]["final"] for r in ranks]
    assert all(f == finals[0] for f in finals), f"{scenario}: ranks' parameters differ"


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", CHECKED)
def test_each_group_changes_only_in_its_phases(ranks: list[dict[str, Any]], scenario: str) -> None:
    for r in ranks:
        changed = changed_groups(r["scenarios"][scenario]["sums"])
        assert changed == EXPECTED_PHASES[scenario], f"{scenario} rank {r['rank']}"


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", CHECKED)
def test_bytes_allreduced_per_step_equal_trainable_bytes(ranks: list[dict[str, Any]], scenario: str) -> None:
    for r in ranks:
        result = r["scenarios"][scenario]
        expected = [
            WIRE_PER_BYTE.get(scenario, 1) * sum(result["group_bytes"][g] for g in phase)
            for phase in EXPECTED_PHASES[scenario]
        ]
        assert result["comm"] == expected, f"{scenario} rank {r['rank']}: counted by the comm hook"


@pytest.mark.distributed
def test_resume_from_mid_phase_checkpoint_equals_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    # Bitwise on CPU: same data order, optimizer and scheduler state, and phase.
    for r in ranks:
        assert r["scenarios"]["resume"]["final"] == r["scenarios"]["main"]["final"], f"rank {r['rank']}"
    resumed = ranks[0]["scenarios"]["resume"]["records"]
    assert resumed[0]["step"] == S.SAVE_STEPS and resumed[0]["phase"] == "head+layer1"
    assert (
        resumed[1]["rebuilt_ddp"]
        and resumed[1]["allreduce_bytes_per_step"] == ranks[0]["scenarios"]["resume"]["comm"][0]
    )


@pytest.mark.distributed
def test_switches_happen_at_phase_boundaries_and_rebuild_the_trainers_ddp(ranks: list[dict[str, Any]]) -> None:
    records = ranks[0]["scenarios"]["main"]["records"]
    boundaries = [0, *(sum(n for _, n in S.MAIN_PHASES[:i]) for i in range(1, len(S.MAIN_PHASES)))]
    assert [r["step"] for r in records if r["step"] is not None] == boundaries
    first_forward = [r for r in records if r["step"] is None]
    assert len(first_forward) == 1 and first_forward[0]["rebuilt_ddp"]
    assert all(r["rebuilt_ddp"] for r in records[1:])


@pytest.mark.distributed
def test_find_unused_parameters_both_settings(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["scenarios"]["main"]["find_unused_parameters"] is False
    assert ranks[0]["scenarios"]["bf16_gc"]["find_unused_parameters"] is True


@pytest.mark.distributed
def test_logs_describe_the_step_just_trained(ranks: list[dict[str, Any]]) -> None:
    result = ranks[0]["scenarios"]["main"]
    step_logs = [log for log in result["logs"] if "loss" in log]
    assert [log["step"] for log in step_logs] == list(range(1, S.MAIN_STEPS + 1))
    for log in step_logs:
        trained = EXPECTED_PHASES["main"][log["step"] - 1]
        assert log["altparams/phase"] == "+".join(sorted(trained))
        assert log["altparams/allreduce_bytes_per_step"] == sum(result["group_bytes"][g] for g in trained)
        assert log["altparams/allreduce_bytes_measured"] == log["altparams/allreduce_bytes_per_step"]
        assert log["altparams/switch_seconds"] >= 0
    total = sum(log["altparams/switch_seconds"] for log in step_logs)
    assert total == pytest.approx(sum(r["seconds"] for r in result["records"]))


@pytest.mark.distributed
def test_plain_freeze_unfreeze_callback_lets_ranks_diverge(ranks: list[dict[str, Any]]) -> None:
    """The bug AlternatingFreeze fixes (docs/design.md, fact 10), documented.

    The encoder is frozen before ``Trainer(...)``, so DDP leaves it out; a plain
    callback unfreezes it at step 2; its gradients are never all-reduced and
    the ranks drift apart, with no error.
    """
    finals = [r["scenarios"]["naive"]["final"] for r in ranks]
    differ = sorted(n for n in finals[0] if finals[0][n] != finals[1][n])
    assert any(n.startswith("bert.encoder.") for n in differ), "expected the unfrozen encoder to diverge"
    # The head's gradients are all-reduced, yet it diverges too: the encoder's local
    # gradients enter the global gradient-norm clip, whose factor then differs per rank.
    assert any(n.startswith("classifier.") for n in differ)


@pytest.mark.distributed
def test_training_without_a_ddp_wrapper_is_refused(ranks: list[dict[str, Any]]) -> None:
    # transformers 5.23 / accelerate 1.15: evaluate() before train() leaves the model unwrapped.
    for r in ranks:
        result = r["scenarios"]["eval_first"]
        assert result["wrapped"] == "BertForSequenceClassification"
        assert result["error"] and "did not wrap it in DistributedDataParallel" in result["error"]
        assert "`trainer.evaluate()`" in result["error"]


# ------------------------------------------------------------------------- one process


def test_single_process_run_follows_the_schedule(tmp_path: Path) -> None:
    schedule = Alternating({"layer0": 1, "head": 2})
    result = S.run("single", tmp_path, schedule=schedule, max_steps=4, gradient_accumulation_steps=1)
    assert changed_groups(result["sums"]) == [{"layer0"}, {"head"}, {"head"}, {"layer0"}]
    assert result["comm"] is None  # no DDP, nothing counted
    logs = [log for log in result["logs"] if "loss" in log]
    assert [log["altparams/phase"] for log in logs] == ["layer0", "head", "head", "layer0"]
    assert all(log["altparams/allreduce_bytes_per_step"] == 0 for log in logs)


def test_log_keys_reach_callbacks_listed_before_it_and_the_log_history(tmp_path: Path) -> None:
    """Reporters (TensorBoard, W&B) come before user callbacks; the keys must reach them."""
    from transformers import Trainer, TrainerCallback

    class Sink(TrainerCallback):  # stands in for a reporting callback
        def __init__(self) -> None:
            self.logs: list[dict[str, Any]] = []

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            self.logs.append(dict(logs))

    sink = Sink()
    freeze = AlternatingFreeze(S.groups_of, Alternating(["head", "layer1"]))
    trainer = Trainer(
        model=S.tiny_bert(),
        args=S.arguments(tmp_path, max_steps=2, gradient_accumulation_steps=1),
        train_dataset=S.TokenDataset(32),
        callbacks=[sink, freeze],
    )
    trainer.train()
    step_logs = [log for log in sink.logs if "loss" in log]
    assert [log["altparams/phase"] for log in step_logs] == ["head", "layer1"]
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["altparams/phase"] for h in history] == ["head", "layer1"]


def test_epoch_schedule_switches_at_epoch_boundaries(tmp_path: Path) -> None:
    model = S.tiny_bert()
    schedule = GradualUnfreeze(["layer0", "layer1"], every=1, unit="epoch", always=["head"])
    freeze = AlternatingFreeze(layers="bert.encoder.layer", extra=S.EXTRA_GROUPS, schedule=schedule)
    data = S.TokenDataset(16)  # 2 steps per epoch with batch 4 x accumulation 2
    args = S.arguments(tmp_path, max_steps=-1, num_train_epochs=3)
    from transformers import Trainer

    Trainer(model=model, args=args, train_dataset=data, callbacks=[freeze]).train()
    assert [(r.step, r.epoch, r.phase) for r in freeze.records] == [(0, 0, "head+layer1"), (2, 1, "head+layer0+layer1")]


def test_optimizer_missing_a_group_is_refused_before_training(tmp_path: Path) -> None:
    model = S.tiny_bert()
    head_only = torch.optim.AdamW([p for n, p in model.named_parameters() if n.startswith("classifier")])
    freeze = AlternatingFreeze(S.groups_of, PhaseSequence([("head", 2), (["layer1", "head"], 2)]))
    from transformers import Trainer

    trainer = Trainer(
        model=model,
        args=S.arguments(tmp_path, max_steps=4),
        train_dataset=S.TokenDataset(64),
        callbacks=[freeze],
        optimizers=(head_only, None),
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(PlanError, match=r"optimizer leaves out .*group\(s\) \['head', 'layer1'\].*`optimizers="):
        trainer.train()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "no step may run"


@pytest.mark.parametrize("optimizer_cls_and_kwargs", [None, (torch.optim.SGD, {"lr": 0.5})])
def test_trainer_built_optimizer_covers_groups_frozen_at_trainer_creation(
    tmp_path: Path, optimizer_cls_and_kwargs: Any
) -> None:
    model = S.tiny_bert()
    for p in model.parameters():  # a user who froze everything but the head beforehand
        p.requires_grad_(False)
    model.classifier.requires_grad_(True)
    freeze = AlternatingFreeze(S.groups_of, PhaseSequence([("head", 1), ("emb", 1)]))
    from transformers import Trainer

    trainer = Trainer(
        model=model,
        args=S.arguments(tmp_path, max_steps=2, gradient_accumulation_steps=1),
        train_dataset=S.TokenDataset(32),
        callbacks=[freeze],
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
    )
    emb = model.bert.embeddings.word_embeddings.weight.detach().clone()
    trainer.train()
    assert not torch.equal(emb, model.bert.embeddings.word_embeddings.weight), "emb must train at step 1"


def test_resume_with_another_schedule_is_refused(tmp_path: Path) -> None:
    from transformers import Trainer

    def trainer_with(schedule: Any, max_steps: int) -> Trainer:
        args = S.arguments(
            tmp_path, max_steps=max_steps, gradient_accumulation_steps=1, save_strategy="steps", save_steps=2
        )
        return Trainer(
            model=S.tiny_bert(),
            args=args,
            train_dataset=S.TokenDataset(64),
            callbacks=[AlternatingFreeze(S.groups_of, schedule)],
        )

    trainer_with(Alternating(["head", "layer1"]), 2).train()
    with pytest.raises(PlanError, match=r"another schedule.*`check_resume=False`"):
        trainer_with(Alternating(["head", "layer0"]), 4).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"deepspeed": {"zero_optimization": {"stage": 3}}}, r"cannot drive DeepSpeed ZeRO-3.*ZeRO-2.*FSDP2"),
        ({"deepspeed": {"zero_optimization": {"stage": 0}}}, r"cannot drive DeepSpeed without ZeRO.*plain DDP"),
        ({"fsdp": ["full_shard"]}, r"cannot drive FSDP version 1.*plain DDP"),
    ],
)
def test_deepspeed_and_fsdp_are_refused_with_the_way_out(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    for key, value in overrides.items():  # set after construction: no DeepSpeed install needed
        setattr(args, key, value)
    freeze = AlternatingFreeze(S.groups_of, Alternating(["head", "layer0"]))
    with pytest.raises(AltParamsError, match=message):
        freeze.on_init_end(args, TrainerState(), TrainerControl(), model=S.tiny_bert())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"groups": {"a": "x.*"}}, r"`schedule` must be an hf_altparams Schedule"),
        ({"schedule": Alternating(["a", "b"])}, r"exactly one of `groups`.*and `layers`"),
        ({"groups": {"a": "x.*"}, "layers": "enc", "schedule": Alternating(["a"])}, r"exactly one of"),
        ({"groups": {"a": "x.*"}, "schedule": Alternating(["a", "b"])}, r"unknown group\(s\) \['b'\]"),
        ({"groups": 3, "schedule": Alternating(["a"])}, r"`groups` must be a mapping"),
        (
            {"groups": {"a": "x.*"}, "schedule": Alternating(["a"]), "switcher_options": {"release": False}},
            r"`switcher_options` may not set \['release'\]",
        ),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        AlternatingFreeze(**kwargs)


def test_groups_that_match_nothing_fail_at_trainer_creation(tmp_path: Path) -> None:
    freeze = AlternatingFreeze({"head": "classifier.*", "enc": "encoder.*"}, Alternating(["head", "enc"]))
    from transformers import Trainer

    with pytest.raises(PlanError, match=r"cannot build the groups on BertForSequenceClassification.*'encoder\.\*'"):
        Trainer(model=S.tiny_bert(), args=S.arguments(tmp_path), train_dataset=S.TokenDataset(8), callbacks=[freeze])


def test_grouped_optimizer_splits_weight_decay_like_the_trainer() -> None:
    model = S.tiny_bert()
    groups = ParamGroups.from_layers(model, "bert.encoder.layer", extra=S.EXTRA_GROUPS)
    opt = grouped_optimizer(groups, lr=1e-3, weight_decay=0.1, state_policy="offload")
    name_of = {id(p): n for n, p in model.named_parameters()}
    for group, inner in opt.inner.items():
        decayed, plain = inner.param_groups
        assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
        assert all(not re.search(r"bias|LayerNorm", name_of[id(p)]) for p in decayed["params"])
        assert all(re.search(r"bias|LayerNorm", name_of[id(p)]) for p in plain["params"])
        assert {id(p) for g in inner.param_groups for p in g["params"]} == {id(p) for p in groups.params(group)}


def test_grouped_optimizer_passes_the_allreduce_dtype_to_a_precision_optimizer() -> None:
    model = S.tiny_bert().to(torch.bfloat16)
    groups = ParamGroups.from_layers(model, "bert.encoder.layer", extra=S.EXTRA_GROUPS)
    opt = grouped_optimizer(groups, lr=1e-3, allreduce_dtype=torch.float32)
    # by name: pytest's --doctest-modules may import the module a second time
    assert type(opt).__name__ == "PrecisionOptimizer" and opt.allreduce_dtype == torch.float32  # type: ignore[attr-defined]


# ------------------------------------------------------------------------- the example


@pytest.mark.distributed
def test_example_runs_under_accelerate_launch_and_reports_accuracy(tmp_path: Path) -> None:
    example = ROOT / "examples" / "trainer_gradual_unfreeze.py"
    result = launch(
        example,
        "--max-steps",
        "3",
        "--batch-size",
        "4",
        "--train-size",
        "24",
        "--eval-size",
        "8",
        "--output-dir",
        str(tmp_path),
        nproc=NPROC,
        launcher="accelerate",
        timeout=300,
    )
    before = re.findall(r"^accuracy before: (\d\.\d+)$", result.stdout, re.MULTILINE)
    after = re.findall(r"^accuracy after: (\d\.\d+)$", result.stdout, re.MULTILINE)
    assert len(before) == 1 and len(after) == 1, "printed once, by the main process"
    assert "world size 2" in result.stdout


def test_bf16_model_trains_with_fp32_masters_of_the_active_group_and_resumes_exactly(tmp_path: Path) -> None:
    """A model loaded in bf16 (`dtype=torch.bfloat16`): `grouped_optimizer` keeps fp32 masters."""
    from transformers import Trainer

    def run(out: Path, max_steps: int, resume: bool = False) -> tuple[torch.nn.Module, Any]:
        model = S.tiny_bert().to(torch.bfloat16)
        groups = S.groups_of(model)
        optimizer = grouped_optimizer(groups, lr=1e-3, master_policy="drop", state_policy="drop")
        # by name: pytest's --doctest-modules may import the module a second time
        assert type(optimizer).__name__ == "PrecisionOptimizer"
        freeze = AlternatingFreeze(groups, Alternating({"head": 2, "layer1": 2}))
        args = S.arguments(out, max_steps=max_steps, gradient_accumulation_steps=1, save_strategy="steps", save_steps=3)
        trainer = Trainer(
            model=model, args=args, train_dataset=S.TokenDataset(64), callbacks=[freeze], optimizers=(optimizer, None)
        )
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3") if resume else None)
        return model, optimizer

    model, optimizer = run(tmp_path / "plain", 5)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    head = sum(p.numel() for p in optimizer.groups.params("head"))  # the phase of step 4
    assert optimizer.master_bytes() == {"cpu": 4 * head}
    for state in optimizer.inner["head"].state.values():
        assert state["exp_avg"].dtype == torch.float32
    resumed, _ = run(tmp_path / "plain", 5, resume=True)  # from step 3, mid-phase (layer1 at 2-3)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_minilm_bf16_lisa_example_reports_accuracy_for_both_storages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The example as ``python examples/minilm_bf16_lisa.py`` runs it (``__main__``), in this process.

    Two steps of four sentences per storage: what is checked is that each storage gets its
    optimizer (bf16: a ``PrecisionOptimizer``, fp32: a ``GroupedOptimizer``), trains through the
    Trainer and reports its held-out accuracy; a bf16 step is slow on CPUs without native bf16.
    """
    import runpy

    example = ROOT / "examples" / "minilm_bf16_lisa.py"
    args = ["--max-steps", "2", "--batch-size", "4", "--train-size", "8", "--eval-size", "8"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(sys, "argv", [str(example), *args])
    monkeypatch.syspath_prepend(str(example.parent))  # as `python script.py` does: its sibling example imports
    monkeypatch.chdir(tmp_path)
    try:  # LISA's default always=("emb", "head") trains MiniLM's embeddings, half its parameters: the docstring's warning
        with pytest.warns(TrainShareWarning, match=r"'emb' 52\.\d%"):
            runpy.run_path(str(example), run_name="__main__")
    finally:
        sys.modules.pop("trainer_gradual_unfreeze", None)  # the sibling, imported from examples/ by the run
    out = capsys.readouterr().out
    lines = re.findall(r"^(\w+) storage \((\w+)\): before (\d\.\d+) after (\d\.\d+)$", out, re.MULTILINE)
    assert [(name, kind) for name, kind, _, _ in lines] == [
        ("bfloat16", "PrecisionOptimizer"),
        ("float32", "GroupedOptimizer"),
    ], out[-3000:]
