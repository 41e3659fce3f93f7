"""PhasedAccelerator with FSDP2: Accelerate's own FSDP2 path on 2 gloo CPU ranks, refusals, GPU run.

On CPU Accelerate would pick MULTI_CPU and ignore the FSDP plugin, so the check
script sets the distributed type to FSDP after construction
(``hf_altparams.testing.fsdp2.use_accelerate_fsdp2``): ``prepare`` then runs
Accelerate's ``fsdp2_prepare_model`` (``fully_shard`` on CPU) and
``save_state`` / ``load_state`` its DCP sharded checkpoints. On a GPU the same
script runs Accelerate's FSDP2 for real (the ``cuda`` test, ``benchmarks/gpu.sh``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.errors import AltParamsError, Cause
from hf_altparams.plan import Alternating
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path


def _check(results: list[dict[str, Any]]) -> None:
    rank0 = results[0]
    assert rank0["sharded_units"] >= 4  # one unit per Linear and the root
    for r in results:
        # same parameters as one process running the schedule on the concatenated batch
        assert r["max_diff"] < 1e-5, r["max_diff"]
        assert len(set(r["expected"])) == 3  # three phases, three different amounts
        assert r["reduce_scatter_first"] >= r["trainable_bytes_first"] > 0  # in the switch log
        if len(results) > 1:
            # bytes each rank fed to reduce-scatter per step == the phase's trainable (padded) bytes
            assert r["counted"] == r["expected"]
        else:  # one GPU: FSDP2 calls no reduce-scatter at all (seen on an H100, torch 2.11)
            assert set(r["counted"]) == {0}
        # a run resumed from Accelerate's sharded (DCP) checkpoint mid-run ends bitwise equal
        assert (r["loaded_step"], r["loaded_phase"]) == (3, "c")
        assert r["resume_bitwise_equal"], r["resume_max_diff"]
        assert {"optimizer_0", "pytorch_model_fsdp_0", "hf_altparams_state.json"} <= set(r["ckpt_files"])
        # one optimizer per group (prepare(model, opt_a, opt_b, opt_c)) under FSDP2: same as the reference
        assert r["per_group_max_diff"] < 1e-5, r["per_group_max_diff"]
        # the groups the accelerator was given no longer hold the parameters from before fully_shard
        assert r["pre_shard_alive"] == 0
        # mixed_precision="bf16" (Accelerate's bf16 MixedPrecisionPolicy): groups frozen at the first
        # forward train once unfrozen; fp32 master parameters; bf16 reduce-scatter, counted == expected
        bf16 = r["bf16"]
        assert bf16["changed"] == ["a", "b", "c"] and bf16["param_dtypes"] == ["torch.float32"]
        a, b, c = r["expected"][0], r["expected"][2], r["expected"][3]  # the fp32 run's phases a, a, b, c, ...
        # the engine's figure counts the bf16 reduce dtype: phases a, b, c, a at half the bytes
        assert bf16["expected"] == [a // 2, b // 2, c // 2, a // 2]
        if len(results) > 1:
            assert bf16["counted"] == bf16["expected"]
        else:  # one GPU: no reduce-scatter in bf16 either (the GPU run counted [0, 0, 0, 0])
            assert set(bf16["counted"]) == {0}
    assert len({r["bf16"]["digest"] for r in results}) == 1


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """One 2-rank launch for the Trainer's and PhasedAccelerator's checks."""
    out = tmp_path_factory.mktemp("fsdp2_integrations")
    launch(
        script_path("trainer_fsdp2_check.py"),
        str(out),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return rank_results(out, nproc=2)


@pytest.mark.distributed
def test_accelerate_fsdp2_matches_reference_counts_bytes_and_resumes_exactly(ranks: list[dict[str, Any]]) -> None:
    results = [r["accelerate"] for r in ranks]
    assert all(r["forced_fsdp2"] for r in results)  # on CPU ranks Accelerate ignores the FSDP plugin
    _check(results)


@pytest.mark.cuda
def test_accelerate_and_trainer_fsdp2_on_a_gpu_for_real(tmp_out: Path) -> None:
    launch(
        script_path("trainer_fsdp2_check.py"),
        str(tmp_out),
        nproc=1,
        launcher="torchrun",
        env={"CUDA_VISIBLE_DEVICES": "0"},
        timeout=300,
    )
    results = rank_results(tmp_out, nproc=1)
    accelerate = [r["accelerate"] for r in results]
    # One GPU: Accelerate runs a single process without FSDP (distributed type NO), so the script
    # switches it to FSDP2 as on CPU ranks; fully_shard, NCCL and the CUDA device are real.
    assert accelerate[0]["device"].startswith("cuda")
    _check(accelerate)
    _check_trainer([r["trainer"] for r in results])


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_fsdp1_plugin_is_refused_naming_fsdp2() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    with pytest.raises(AltParamsError, match=r"FullyShardedDataParallelPlugin\(fsdp_version=2") as info:
        PhasedAccelerator(Alternating(["a", "b"]), cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    assert info.value.cause is Cause.STRATEGY_REFUSED


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_deepspeed_is_refused_at_prepare_naming_fsdp2_and_ddp() -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    from hf_altparams.engine import GroupedOptimizer
    from hf_altparams.integrations.accelerate import PhasedAccelerator
    from hf_altparams.plan import ParamGroups

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    AcceleratorState().distributed_type = DistributedType.DEEPSPEED  # as `accelerate launch` with a DS config
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = GroupedOptimizer(ParamGroups(model, {"a": "0.*", "b": "2.*"}), lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(AltParamsError, match=r"DeepSpeed without ZeRO.*zero_stage=1.*--multi_gpu") as info:
        acc.prepare(model, opt)  # no DeepSpeed plugin: no ZeRO stage
    assert "cannot drive DeepSpeed" in str(info.value)  # the setting named (not a distributed_type value)
    assert info.value.cause is Cause.STRATEGY_REFUSED
    assert all(p.requires_grad for p in model.parameters())  # refused before any phase was applied


# --------------------------------------------------------------------------- the Trainer
def _check_trainer(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["sharded"]  # the Trainer's prepare ran fully_shard
        # the same schedule through the Trainer's DDP gives the same parameters
        assert r["max_diff_to_ddp"] < 1e-5, r["max_diff_to_ddp"]
        assert r["phases"] == ["head", "head+layer1", "layer0", "head+layer1"]
        assert len(set(r["expected"])) == 3
        assert r["counted"] == r["expected"] if len(results) > 1 else set(r["counted"]) == {0}
        # each step changed exactly the groups of its phase
        changed = [{g for g in after if after[g] != before[g]} for before, after in zip(r["sums"], r["sums"][1:])]
        assert changed == [
            {"head"},
            {"head", "layer1"},
            {"head", "layer1"},
            {"layer0"},
            {"layer0"},
            {"head", "layer1"},
            {"head", "layer1"},
        ]
        assert r["resume_bitwise_equal"], r[
            "resume_max_diff"
        ]  # the Trainer's FSDP2 checkpoint at step 3: layer0 not trained yet
    assert len({r["digest"] for r in results}) == 1  # ranks hold the same full parameters


@pytest.mark.distributed
def test_trainer_fsdp2_follows_the_schedule_like_ddp_and_resumes_exactly(ranks: list[dict[str, Any]]) -> None:
    _check_trainer([r["trainer"] for r in ranks])


@pytest.mark.parametrize("version", [1, 2])
def test_trainer_accepts_fsdp2_and_refuses_fsdp1_naming_fsdp2(tmp_path: Path, version: int) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from hf_altparams.integrations.trainer import AlternatingFreeze

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.fsdp, args.fsdp_plugin_args = True, {"fsdp_version": version}  # as `fsdp_config={"version": n}`
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Linear(1, 1))
    freeze = AlternatingFreeze({"a": "0.*", "b": "2.*"}, Alternating(["a", "b"]))
    if version == 1:
        with pytest.raises(AltParamsError, match=r"FSDP1.*FullyShardedDataParallelPlugin\(fsdp_version=2") as info:
            freeze.on_init_end(args, TrainerState(), TrainerControl(), model=model)
        assert info.value.cause is Cause.STRATEGY_REFUSED
        return
    freeze.on_init_end(args, TrainerState(), TrainerControl(), model=model)
    # FSDP2: the parameters the schedule never trains are frozen before the optimizer exists
    assert [p.requires_grad for p in model.parameters()] == [True, True, True, True, False, False]


# --------------------------------------------------------------------------- rebinding, no process group
def _grouped() -> tuple[nn.Module, Any]:
    from hf_altparams.engine import GroupedOptimizer
    from hf_altparams.plan import ParamGroups

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
    return model, GroupedOptimizer(groups, lambda p: torch.optim.SGD(p, lr=0.1))


def test_rebind_follows_replaced_parameters_and_refuses_an_unswapped_optimizer() -> None:
    from hf_altparams.integrations.fsdp2 import rebind_groups, rebind_optimizer

    model, opt = _grouped()
    old = opt.groups
    model[2].weight = nn.Parameter(model[2].weight.detach().clone())  # as fully_shard replaces parameters
    new = rebind_groups(old, model)
    assert new.params("b")[0] is model[2].weight and old.params("b")[0] is not model[2].weight
    with pytest.raises(AltParamsError, match=r"1 parameter\(s\) of the optimizer are not the model's sharded"):
        rebind_optimizer(opt, old, new)  # the optimizer still holds the replaced parameter
    opt.inner["b"].param_groups[0]["params"][0] = model[2].weight  # what Accelerate's swap does
    rebind_optimizer(opt, old, new)
    assert opt.groups is new


def test_rebind_names_the_parameters_a_sharded_model_lacks() -> None:
    from hf_altparams.integrations.fsdp2 import rebind_groups

    model, opt = _grouped()
    with pytest.raises(AltParamsError, match=r"no parameter named \['2.weight', '2.bias'\]"):
        rebind_groups(opt.groups, nn.Sequential(nn.Linear(4, 8)))


def test_trainer_refuses_to_checkpoint_a_grouped_optimizer_under_fsdp2() -> None:
    from types import SimpleNamespace

    from hf_altparams.integrations.fsdp2 import shard_trainer_groups

    model, opt = _grouped()
    state = SimpleNamespace(global_step=0)
    with pytest.raises(AltParamsError, match=r"cannot checkpoint a GroupedOptimizer.*`save_strategy='no'`"):
        shard_trainer_groups(opt.groups, model, opt, SimpleNamespace(save_strategy="steps"), state, set())
    rebound = shard_trainer_groups(opt.groups, model, opt, SimpleNamespace(save_strategy="no"), state, set())
    assert rebound.names == ("a", "b")
