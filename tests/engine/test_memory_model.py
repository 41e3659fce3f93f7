"""One memory model: the planner's rows, memory_report's expected peak and the measured model state agree.

A small model (an ungrouped frozen embedding, a BatchNorm's buffers, three groups) trains
under GroupedOptimizer (keep / offload / drop) and PrecisionOptimizer (bf16 storage, masters
keep / offload / drop), without DDP and under DDP (world size 1, separate buckets or bucket
views). At every step the report's expected footprint of the phase is compared with the
model state measured inside the optimizer step (every tensor storage counted once), and per
phase its largest value with the planner's row for the same positions, category by category.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_post_hook

from hf_altparams.engine import CommCounter, GroupedOptimizer, PhaseSwitcher, PrecisionOptimizer, memory_report
from hf_altparams.engine.comm import counting_allreduce_hook
from hf_altparams.engine.memory.model import StatePolicyLike
from hf_altparams.engine.report import expected_footprint, expected_peak_bytes
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.planner import plan_cost
from tests.support.meters import ModelStateMeter, total_state

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, foreach=False)
STEPS = 7  # a, b, c, a, b, c, a: every phase again after every group has trained


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, 12)  # in no group: frozen
        self.a = nn.Linear(12, 16)
        self.b = nn.Sequential(nn.BatchNorm1d(16), nn.Linear(16, 8))
        self.c = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(self.emb(ids).mean(1))))))


OPTIMIZERS: dict[str, tuple[Optional[torch.dtype], StatePolicyLike, Optional[StatePolicyLike]]] = {
    # name -> (storage dtype or None, state policy, master policy): the strings users pass
    "grouped-keep": (None, "keep", None),
    "grouped-offload": (None, "offload", None),
    "grouped-drop": (None, "drop", None),
    "bf16-state-keep-master-keep": (torch.bfloat16, "keep", "keep"),
    "bf16-state-drop-master-offload": (torch.bfloat16, "drop", "offload"),
    "bf16-state-offload-master-drop": (torch.bfloat16, "offload", "drop"),
}
WRAPPERS = ["no-ddp", "ddp", "ddp-bucket-views"]


def _run(kind: str, wrapper: str) -> tuple[Any, dict[str, list[Any]], list[tuple[int, int]], Any]:
    """Train STEPS steps; per phase the expected footprints before each step; per step (measured, expected)."""
    storage, state_policy, master_policy = OPTIMIZERS[kind]
    model = Net()
    groups = ParamGroups(model, {"a": "a.*", "b": "b.*", "c": "c.*"})
    schedule = Alternating(["a", "b", "c"])
    opt: GroupedOptimizer
    if storage is None:
        opt = GroupedOptimizer(groups, ADAMW, state_policy=state_policy)
    else:
        opt = PrecisionOptimizer(
            groups, ADAMW, storage_dtype=storage, state_policy=state_policy, master_policy=master_policy or "offload"
        )
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt)
    switcher.step_to(0)
    meter = ModelStateMeter(model, opt)
    net: nn.Module = model
    if wrapper != "no-ddp":
        net = DDP(model, gradient_as_bucket_view=wrapper == "ddp-bucket-views")

        def hook(state, bucket):  # type: ignore[no-untyped-def]  # no annotations: DDP checks real types
            meter.note_bucket(bucket.buffer())
            return counting_allreduce_hook(state, bucket)

        net.register_comm_hook(CommCounter(), hook)
        switcher.attach(net)  # type: ignore[arg-type]
    in_step: list[int] = []
    handle = register_optimizer_step_post_hook(lambda *_: in_step.append(total_state(meter.measure())))
    expected: dict[str, list[Any]] = {}
    per_step: list[tuple[int, int]] = []
    try:
        for step in range(STEPS):
            switcher.step_to(step)
            peak, _ = expected_footprint(switcher)
            assert expected_peak_bytes(switcher)[0] == memory_report(switcher).expected_peak_bytes == peak.device
            expected.setdefault(switcher.current.name, []).append(peak)  # type: ignore[union-attr]
            ids = torch.randint(0, 32, (6, 5), generator=torch.Generator().manual_seed(step))
            net(ids).pow(2).mean().backward()
            in_step.clear()
            opt.step()
            opt.zero_grad(set_to_none=True)
            meter.forget_buckets()  # a switch may rebuild them; the next backward notes them again
            per_step.append((max(in_step), peak.device + peak.host))
    finally:
        handle.remove()
    plan = plan_cost(
        model,
        groups,
        schedule,
        optimizer="adamw",
        state_policy=state_policy,
        steps=STEPS,
        world_size=1,
        storage_dtype=storage,
        master_policy=master_policy or "offload",
        bucket_as_view=wrapper == "ddp-bucket-views",
        backend="local" if wrapper == "no-ddp" else "ddp",
    )
    return plan, expected, per_step, switcher


def _categories(row: Any) -> tuple[int, ...]:
    return (
        row.param_bytes,
        row.buffer_bytes,
        row.grad_bytes,
        row.bucket_bytes,
        row.optimizer_bytes,
        row.master_bytes,
        row.host_bytes,
    )


@pytest.fixture(params=WRAPPERS)
def wrapper(request: pytest.FixtureRequest, gloo_world_1: Optional[dist.ProcessGroup]) -> str:
    return str(request.param)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_planner_report_and_measured_state_agree_to_the_byte(kind: str, wrapper: str) -> None:
    plan, expected, per_step, switcher = _run(kind, wrapper)
    # the report's footprint is what the step holds (device + host: one RAM on CPU), measured
    for step, (measured, footprint) in enumerate(per_step):
        assert measured == footprint, (step, measured, footprint)
    # the planner's row of a phase is the largest of its occurrences: the report's, per category
    assert {r.phase for r in plan.phases} == set(expected)
    for row in plan.phases:
        largest = max(expected[row.phase], key=lambda f: (f.device, f.host))
        got = (
            largest.params,
            largest.buffers,
            largest.grads,
            largest.buckets,
            largest.optimizer,
            largest.masters,
            largest.host,
        )
        assert got == _categories(row), (row.phase, got, _categories(row))
        assert largest.device == row.device_bytes
    # training everything: the same reference on both sides
    assert expected_peak_bytes(switcher)[1] == plan.everything.device_bytes


def test_the_old_disagreement_was_the_reports_masters_and_fp32_gradients() -> None:
    """bf16 storage: 2 B per parameter stored; per trainable parameter 4 B fp32 master, 4 B fp32 gradient, 8 B AdamW."""
    plan, expected, _, switcher = _run("bf16-state-drop-master-offload", "no-ddp")
    row = plan.row("a")
    trainable = row.trainable_params
    assert row.master_bytes == 4 * trainable and row.grad_bytes == 4 * trainable
    assert row.optimizer_bytes == 8 * trainable
    report = memory_report(switcher)  # after the last step, phase "a": masters of "a" on the device
    assert report.totals["masters"] == 4 * trainable
    assert report.totals["masters_offloaded"] == 4 * (plan.row("b").trainable_params + plan.row("c").trainable_params)
    assert report.expected_peak_bytes == row.device_bytes
