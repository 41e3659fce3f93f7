"""The planner's DeepSpeed ZeRO pricing against what DeepSpeed holds and sends, for the benchmark's job.

``benchmarks/deepspeed_lisa.py`` measures issue 37's job (an 8-layer Llama,
LISA with 2 layers every 5 steps, embeddings and head always on, 2 ranks, fp32,
AdamW) under ZeRO-1/2/3: the optimizer state each rank holds, read from the
DeepSpeed optimizer's tensors, and every ``deepspeed.comm`` collective per
step (``benchmarks/RESULTS.md``, "LISA under the Trainer with DeepSpeed
ZeRO-1/2/3"). The figures below are derived from the model's parameter counts
the way DeepSpeed lays the job out, which is what that run measured:

* state per rank: 1/world of AdamW's two fp32 moments and of the fp32 copy
  (partition) DeepSpeed keeps of every parameter it steps, 12 bytes per
  trainable element / world under ``drop`` (full fine-tuning: every element);
  under ``keep`` the fp32 partitions of every group from the start and the
  moments of every group trained so far;
* bytes per step, whole tensors: ZeRO-1/2 all-reduce the trainable gradients
  and all-gather the updated trainable partitions after the step (4 + 4 bytes
  per trainable element); ZeRO-3 reduce-scatters the trainable gradients and
  all-gathers every weight for the forward (4 per trainable element + 4 per
  element).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterable

import pytest
from torch import nn

from hf_altparams import planner
from hf_altparams.plan import ParamGroups, Schedule
from hf_altparams.planner import plan_cost

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "deepspeed_lisa.py"
WORLD = 2
FP32 = 4


def _benchmark() -> ModuleType:
    """``benchmarks/deepspeed_lisa.py`` (the driver imports only the standard library at module level)."""
    name = "benchmarks_deepspeed_lisa"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARK)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its dataclass looks its module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def job() -> tuple[nn.Module, ParamGroups, Schedule, int]:
    """The benchmark's model on meta, its groups, its LISA schedule and its steps."""
    bench = _benchmark()
    job = bench.Job()
    model = bench.meta_model(job)
    groups = ParamGroups.from_layers(model, "model.layers", extra=bench.EXTRA_GROUPS)
    return model, groups, bench.lisa_schedule(job), job.steps


def _numel(groups: ParamGroups, names: Iterable[str]) -> int:
    return sum(p.numel() for g in names for p in groups.params(g))


def _every_dim0_even(model: nn.Module) -> bool:
    return all(p.shape[0] % WORLD == 0 for p in model.parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_state_per_rank_is_the_moments_and_fp32_partitions_of_the_trainable_share(
    job: tuple[nn.Module, ParamGroups, Schedule, int], stage: int
) -> None:
    model, groups, schedule, steps = job
    assert _every_dim0_even(model)  # so a rank's shard is exactly 1/world: no padding to allow for
    plan = plan_cost(model, groups, schedule, world_size=WORLD, steps=steps, backend=f"zero{stage}")
    assert plan.state_policy == "drop"  # lisa's default, what AlternatingFreeze runs in the benchmark
    for row in plan.phases:
        active = _numel(groups, row.trainable_groups)
        assert row.optimizer_bytes == 2 * FP32 * active // WORLD, row.phase  # AdamW's moments, sharded
        assert row.master_bytes == FP32 * active // WORLD, row.phase  # DeepSpeed's fp32 partitions, sharded
    everything = plan.everything
    total = _numel(groups, groups.names)
    assert everything.optimizer_bytes + everything.master_bytes == 3 * FP32 * total // WORLD


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_keep_holds_every_fp32_partition_from_the_start(
    job: tuple[nn.Module, ParamGroups, Schedule, int], stage: int
) -> None:
    model, groups, schedule, steps = job
    plan = plan_cost(
        model, groups, schedule, world_size=WORLD, steps=steps, backend=f"zero{stage}", state_policy="keep"
    )
    total = _numel(groups, groups.names)
    trained: set[str] = set()
    for start, end, phase in schedule.segments(steps):
        trained |= set(phase.trainable)
        row = plan.row(phase.name)
        assert row.master_bytes == FP32 * total // WORLD, phase.name  # made for every group when the engine is built
        assert row.optimizer_bytes >= 2 * FP32 * _numel(groups, trained) // WORLD, phase.name  # moments once trained
    last = plan.row(schedule.phase_at(steps - 1).name)
    assert last.optimizer_bytes == 2 * FP32 * _numel(groups, trained) // WORLD


@pytest.mark.parametrize("stage", [1, 2])
def test_zero12_bytes_per_step_are_the_gradients_reduced_and_the_updated_partitions_gathered(
    job: tuple[nn.Module, ParamGroups, Schedule, int], stage: int
) -> None:
    model, groups, schedule, steps = job
    plan = plan_cost(model, groups, schedule, world_size=WORLD, steps=steps, backend=f"zero{stage}")
    for row in plan.phases:
        active = _numel(groups, row.trainable_groups)
        assert row.allreduce_bytes == FP32 * active, row.phase
        assert row.gather_bytes == FP32 * active, row.phase
        assert row.wire_bytes == FP32 * active + (WORLD - 1) * FP32 * active // WORLD  # ring all-reduce + gather
    total = _numel(groups, groups.names)
    assert plan.everything.allreduce_bytes + plan.everything.gather_bytes == 2 * FP32 * total


def test_zero3_gathers_every_weight_for_the_forward(job: tuple[nn.Module, ParamGroups, Schedule, int]) -> None:
    model, groups, schedule, steps = job
    plan = plan_cost(model, groups, schedule, world_size=WORLD, steps=steps, backend="zero3")
    total = _numel(groups, groups.names)
    for row in plan.phases:
        assert row.allreduce_bytes == FP32 * _numel(groups, row.trainable_groups), row.phase  # reduce-scattered
        assert row.gather_bytes == FP32 * total, row.phase  # frozen layers too
        assert row.param_bytes == FP32 * total // WORLD  # a partition of every weight between uses


def test_the_ddp_comparison_keeps_ddps_own_figures(job: tuple[nn.Module, ParamGroups, Schedule, int]) -> None:
    """ZeRO's fp32 masters and gathers are its own: the DDP device bytes beside it are DDP's plan's."""
    model, groups, schedule, steps = job
    zero = plan_cost(model, groups, schedule, world_size=WORLD, steps=steps, backend="zero2")
    ddp = plan_cost(model, groups, schedule, world_size=WORLD, steps=steps, backend="ddp")
    assert zero.ddp_device_bytes == {
        **{r.phase: r.device_bytes for r in ddp.phases},
        "train everything": ddp.everything.device_bytes,
    }
    assert all(r.master_bytes == 0 and r.gather_bytes == 0 for r in [*ddp.phases, ddp.everything])


def test_plan_strategy_zero_prints_the_gathers_and_masters(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        planner.main(
            [
                "--model",
                "tests.support.models:llama_decoder",
                "--layers",
                "model.layers",
                "--group",
                "emb=model.embed_tokens.*",
                "--group",
                "head=model.norm.*,lm_head.*",
                "--schedule",
                "lisa",
                "--k",
                "1",
                "--every",
                "2",
                "--always",
                "emb,head",
                "--world-size",
                "2",
                "--strategy",
                "zero2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "all-gather/step" in out and "optim+master" in out and "fp32 masters of every optimized parameter" in out
