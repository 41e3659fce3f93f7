"""The memory report: its categories add up to the real tensors, per device."""

from __future__ import annotations

import functools
from typing import Iterable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, expected_peak_bytes, memory_report
from hf_altparams.engine.report import CATEGORIES
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    seen: dict[int, torch.Tensor] = {id(t): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in seen.values())


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def setup(policy: str = "keep", **switcher_options: object) -> tuple[nn.Sequential, GroupedOptimizer, PhaseSwitcher]:
    model = net()
    groups = ParamGroups(model, {"a": ["0.*", "1.*"], "b": "2.*"})
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-2), state_policy=policy)
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt, **switcher_options)  # type: ignore[arg-type]
    return model, opt, switcher


def train_step(model: nn.Module, opt: torch.optim.Optimizer, wrapped: nn.Module | None = None) -> None:
    (wrapped or model)(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()


def real_bytes(model: nn.Module, opt: GroupedOptimizer) -> int:
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return nbytes([*model.parameters(), *model.buffers(), *grads, *state])


def test_categories_add_up_to_the_real_tensors() -> None:
    model, opt, switcher = setup()
    switcher.step_to(0)
    train_step(model, opt)  # grads and AdamW state of group "a" exist now
    report = memory_report(switcher)
    assert report.total() == real_bytes(model, opt)
    assert set(report.by_device) == {"cpu"}
    totals = report.totals
    assert totals["params_trainable"] == nbytes([*model[0].parameters(), *model[1].parameters()])
    assert totals["params_frozen"] == nbytes(model[2].parameters())
    assert totals["buffers"] == nbytes(model.buffers())
    assert totals["grads"] == nbytes(p.grad for p in model.parameters() if p.grad is not None)
    assert totals["optimizer_state"] > 0 and totals["optimizer_state_offloaded"] == 0
    assert totals["ddp_buckets"] == 0


def test_idle_offloaded_state_has_its_own_category() -> None:
    model, opt, switcher = setup(policy="offload")
    switcher.step_to(0)
    train_step(model, opt)
    opt.zero_grad(set_to_none=True)
    switcher.step_to(1)  # "a" idle: its state is offloaded
    report = memory_report(switcher)
    state_a = [v for p in opt.groups.params("a") for v in opt.inner["a"].state[p].values()]
    assert report.totals["optimizer_state_offloaded"] == nbytes(state_a)
    assert report.totals["optimizer_state"] == 0
    assert report.total() == real_bytes(model, opt)


def test_non_resident_parameters_are_counted_as_offloaded() -> None:
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": nn.Linear(8, 8), "t0": nn.Linear(8, 2), "t1": nn.Linear(8, 3)})
    groups = ParamGroups(model, {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"})
    switcher = PhaseSwitcher(groups, PerTaskCycle(["trunk"], ["t0", "t1"], every=1))
    switcher.step_to(0)
    report = memory_report(switcher)
    assert report.totals["params_offloaded"] == nbytes(model["t1"].parameters())
    assert report.totals["params_trainable"] == nbytes([*model["trunk"].parameters(), *model["t0"].parameters()])
    # Device peak of a task phase excludes the other task entirely.
    peak, everything = report.expected_peak_bytes, report.expected_peak_all_bytes
    assert peak < everything


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_expected_peak_before_any_state_exists(policy: str) -> None:
    model, opt, switcher = setup(policy=policy)
    switcher.step_to(0)
    a = nbytes([*model[0].parameters(), *model[1].parameters()])
    b = nbytes(model[2].parameters())
    total, buffers = a + b, nbytes(model.buffers())
    peak, everything = expected_peak_bytes(switcher)
    # AdamW keeps two moments per parameter. Phase "a": its gradients and state. The idle
    # group "b" has not trained yet, so it has no state to keep: none during a's first steps.
    assert peak == total + buffers + a * (1 + 2)
    assert everything == total + buffers + total * (1 + 2)
    train_step(model, opt)
    moments = [v for s in opt.state.values() for v in s.values() if v.dim() > 0]  # not Adam's 0-d step counters
    assert nbytes(moments) == 2 * a  # measured at a's first step: no state of "b"
    opt.zero_grad(set_to_none=True)
    switcher.step_to(1)
    train_step(model, opt)
    opt.zero_grad(set_to_none=True)
    switcher.step_to(2)  # "a" again: "b" has trained, its state stays on the device under "keep" only
    idle_state = 2 * b if policy == "keep" else 0
    assert expected_peak_bytes(switcher) == (total + buffers + a * (1 + 2) + idle_state, everything)


def test_as_log_is_flat_numbers() -> None:
    model, opt, switcher = setup()
    switcher.step_to(0)
    train_step(model, opt)
    log = memory_report(switcher).as_log()
    assert all(isinstance(v, (int, float)) for v in log.values())
    assert {f"altparams/memory/{c}" for c in CATEGORIES} <= set(log)
    assert log["altparams/memory/device/cpu"] == real_bytes(model, opt)
    assert "expected peak" in memory_report(switcher).table()


@pytest.mark.parametrize("bucket_view", [False, True])
def test_ddp_buckets_are_counted_once(gloo_world_1: dist.ProcessGroup, bucket_view: bool) -> None:
    model, opt, switcher = setup()
    switcher.step_to(0)
    ddp = DDP(model, gradient_as_bucket_view=bucket_view)
    switcher.attach(ddp)
    trainable = nbytes(p for p in model.parameters() if p.requires_grad)

    before = memory_report(switcher)
    assert before.totals["ddp_buckets"] == trainable  # allocated with the reducer, no grads yet
    assert before.by_device["cpu"]["ddp_buckets"] == trainable

    ddp(torch.randn(8, 16)).pow(2).mean().backward()
    during = memory_report(switcher)
    grads = nbytes(p.grad for p in model.parameters() if p.grad is not None)
    assert during.totals["grads"] == grads == trainable
    # With bucket views the gradients ARE the buckets: nothing more to count.
    assert during.totals["ddp_buckets"] == (0 if bucket_view else trainable)
    state_free = during.total() - during.totals["ddp_buckets"]
    assert state_free == real_bytes(model, opt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    switcher.step_to(1)
    after = memory_report(switcher)
    assert after.totals["ddp_buckets"] == nbytes(model[2].parameters())
