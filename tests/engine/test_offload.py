"""Idle optimizer state: re-applied after the state comes back, and prefetched on schedule.

On the CPU, ``offload`` moves no bytes (the state is already on the CPU), so
the CPU tests use what a user can observe everywhere: ``drop`` (state that a
load brought back is gone again), the bookkeeping of what is offloaded, and
when the switcher asks for a prefetch. The CUDA tests at the end check the
bytes on the host (skipped without a GPU).
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, expected_peak_bytes, reapply_state_policy
from hf_altparams.plan import Alternating, ParamGroups, PhaseSequence


def build(policy: Any = "drop", sizes: tuple[int, int] = (8, 8)) -> tuple[nn.Sequential, GroupedOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, sizes[0]), nn.Linear(sizes[0], sizes[1]))
    groups = ParamGroups(model, {"a": "0.*", "b": "1.*"})
    return model, GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-2), state_policy=policy)


def step_all(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    device = next(model.parameters()).device  # the cuda tests move the model; the input follows it
    model(torch.randn(3, 4, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def state_tensors(opt: GroupedOptimizer, group: str) -> list[torch.Tensor]:
    return [v for p in opt.groups.params(group) for v in opt.inner[group].state.get(p, {}).values()]


class WrappedOptimizer:
    """Stands in for Accelerate's AcceleratedOptimizer: holds the real one in `.optimizer`."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def load_inner_state(self, group: str, state: dict[str, Any]) -> None:
        # Something that restores state behind GroupedOptimizer's back.
        self.optimizer.inner[group].load_state_dict(state)  # type: ignore[attr-defined]


def test_load_state_dict_reapplies_drop() -> None:
    model, opt = build()
    step_all(model, opt)  # both groups active: both have state
    saved = copy.deepcopy(opt.state_dict())
    assert state_tensors(opt, "b")
    opt.set_active({"a"})
    assert state_tensors(opt, "b") == []  # dropped when idle
    opt.load_state_dict(saved)  # the checkpoint holds b's state ...
    assert state_tensors(opt, "b") == []  # ... which the policy drops again
    assert len(state_tensors(opt, "a")) == 3 * 2  # a's state came back (step, exp_avg, exp_avg_sq)


class WrappedAsOptimizer(WrappedOptimizer, torch.optim.Optimizer):
    """The same, itself a torch Optimizer (as AcceleratedOptimizer is)."""


@pytest.mark.parametrize("wrap", [WrappedOptimizer, WrappedAsOptimizer])
def test_reapply_state_policy_unwraps_and_drops_again(wrap: type[WrappedOptimizer]) -> None:
    model, opt = build()
    step_all(model, opt)
    inner_b = copy.deepcopy(opt.inner["b"].state_dict())
    opt.set_active({"a"})
    wrapper = wrap(opt)
    wrapper.load_inner_state("b", inner_b)
    came_back = sum(t.numel() * t.element_size() for t in state_tensors(opt, "b"))
    assert came_back > 0
    assert reapply_state_policy(wrapper) == came_back
    assert state_tensors(opt, "b") == []
    assert len(state_tensors(opt, "a")) == 6  # the active group is untouched


def test_reapply_state_policy_leaves_other_optimizers_alone() -> None:
    model = nn.Linear(2, 2)
    plain = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    plain.step()
    before = {k: v.clone() for k, v in plain.state[model.weight].items()}
    assert reapply_state_policy(WrappedOptimizer(plain)) == 0
    assert all(torch.equal(before[k], v) for k, v in plain.state[model.weight].items())


def test_offload_keeps_idle_state_intact_through_a_load() -> None:
    model, opt = build(policy="offload")
    step_all(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    opt.set_active({"a"})
    opt.load_state_dict(saved)
    loaded = state_tensors(opt, "b")
    assert loaded  # offload keeps the state (unlike drop), with the checkpoint's values
    wanted = saved["groups"]["b"]["state"]
    for name, param in opt.groups.named_params("b"):
        for key, value in wanted[name].items():
            assert torch.equal(opt.inner["b"].state[param][key], value)


class PrefetchSpy:
    def __init__(self, switcher: PhaseSwitcher, opt: GroupedOptimizer) -> None:
        self.calls: list[tuple[int, str, Any]] = []
        self.step = 0
        real_res, real_opt = switcher.residency.prefetch, opt.prefetch

        def res_prefetch(groups: Any, max_bytes: Any = None) -> int:
            return real_res(groups, max_bytes)

        def opt_prefetch(name: str, max_bytes: Any = None) -> int:
            self.calls.append((self.step, name, max_bytes))
            return real_opt(name, max_bytes)

        switcher.residency.prefetch = res_prefetch  # type: ignore[method-assign]
        opt.prefetch = opt_prefetch  # type: ignore[method-assign]


def run_with_spy(opt: GroupedOptimizer, model: nn.Module, schedule: Any, prefetch: Any, steps: int) -> PrefetchSpy:
    switcher = PhaseSwitcher(opt.groups, schedule, optimizer=opt, prefetch=prefetch)
    spy = PrefetchSpy(switcher, opt)
    switcher.step_to(0)
    for step in range(steps):
        step_all(model, opt)
        spy.step = step + 1
        switcher.step_to(step + 1)
    return spy


def test_prefetch_is_asked_for_during_the_last_step_of_a_phase() -> None:
    model, opt = build(policy="offload")
    spy = run_with_spy(opt, model, Alternating({"a": 3, "b": 1}), True, steps=8)
    # step_to(s) runs before step s: the last step of "a" is 2 (and 6), of "b" 3 (and 7).
    assert [(s, g) for s, g, _ in spy.calls] == [(2, "b"), (3, "a"), (6, "b"), (7, "a")]
    assert all(budget is None for _, _, budget in spy.calls)


def test_prefetch_off_by_default() -> None:
    model, opt = build(policy="offload")
    spy = run_with_spy(opt, model, Alternating({"a": 3, "b": 1}), False, steps=5)
    assert spy.calls == []


def test_prefetch_byte_budget_is_passed_on() -> None:
    model, opt = build(policy="offload")
    spy = run_with_spy(opt, model, Alternating({"a": 2, "b": 2}), 1000, steps=4)
    assert [(s, g, b) for s, g, b in spy.calls] == [(1, "b", 1000), (3, "a", 1000)]


def test_prefetch_auto_only_uses_headroom() -> None:
    # "b" is much larger than "a": during a's last step the device has room for some
    # of b's state below b's own expected peak; during b's last step there is none.
    model, opt = build(policy="offload", sizes=(2, 64))
    schedule = PhaseSequence([(["a"], 2), (["b"], 2)], repeat=True)
    switcher = PhaseSwitcher(opt.groups, schedule, optimizer=opt, prefetch="auto")
    peak_a = expected_peak_bytes(switcher, schedule.phase_at(0))[0]
    peak_b = expected_peak_bytes(switcher, schedule.phase_at(2))[0]
    assert peak_b > peak_a
    spy = run_with_spy(opt, model, schedule, "auto", steps=4)
    budgets = {(s, g): b for s, g, b in spy.calls}
    assert budgets[(1, "b")] > 0
    assert (3, "a") not in budgets  # no headroom: "a" is not prefetched during b's phase


# -- CUDA: the bytes really move -------------------------------------------------------------

cuda = pytest.mark.cuda


@cuda
def test_cuda_offload_is_pinned_and_reoffloaded_after_load_and_wrapper() -> None:
    model, opt = build(policy="offload")
    model.cuda()
    step_all(model, opt)
    saved = copy.deepcopy(opt.state_dict())
    opt.set_active({"a"})
    assert all(t.device.type == "cpu" for t in state_tensors(opt, "b"))
    assert all(t.is_pinned() for t in state_tensors(opt, "b") if t.dim() > 0)
    opt.load_state_dict(saved)  # torch puts b's state on the GPU; the policy takes it off again
    assert all(t.device.type == "cpu" for t in state_tensors(opt, "b"))
    inner_b = {k: v for k, v in opt.inner["b"].state_dict().items()}
    WrappedOptimizer(opt).load_inner_state(
        "b",
        {
            **inner_b,
            "state": {
                i: {k: (v.cuda() if k != "step" else v) for k, v in s.items()} for i, s in inner_b["state"].items()
            },
        },
    )
    assert any(t.is_cuda for t in state_tensors(opt, "b"))
    assert reapply_state_policy(WrappedOptimizer(opt)) > 0
    assert all(t.device.type == "cpu" for t in state_tensors(opt, "b"))
    opt.set_active({"a", "b"})
    assert all(t.is_cuda for t in state_tensors(opt, "b") if t.dim() > 0)


@cuda
def test_cuda_prefetched_state_equals_a_plain_restore() -> None:
    model, opt = build(policy="offload", sizes=(256, 256))
    model.cuda()
    switcher = PhaseSwitcher(opt.groups, Alternating({"a": 2, "b": 2}), optimizer=opt, prefetch=True)
    switcher.step_to(0)
    step_all(model, opt)
    switcher.step_to(1)
    step_all(model, opt)
    switcher.step_to(2)  # b active, a offloaded
    step_all(model, opt)
    expected = [t.clone() for t in state_tensors(opt, "a")]
    switcher.step_to(3)  # last step of b: a's state starts coming back
    assert opt.prefetched_bytes > 0
    step_all(model, opt)
    switcher.step_to(4)
    assert opt.prefetched_bytes == 0
    for got, want in zip(state_tensors(opt, "a"), expected):
        assert torch.equal(got.cpu(), want.cpu())
        assert got.is_cuda or got.dim() == 0
