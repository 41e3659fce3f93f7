"""The phase switch in one process: no process group, a plain module, and world-size-1 DDP."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, register_comm_counter, rss_bytes
from hf_altparams.errors import PlanError, SwitchError
from hf_altparams.plan import Alternating, ParamGroups, Phase, PhaseSequence

ADAM = functools.partial(torch.optim.Adam, lr=1e-2)


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def groups_of(model: nn.Module) -> ParamGroups:
    return ParamGroups(model, {"a": "0.*", "b": "2.*"})


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)


def train_with_switcher(model: nn.Module, steps: int, wrap: bool = False) -> PhaseSwitcher:
    groups = groups_of(model)
    opt = GroupedOptimizer(groups, ADAM)
    switcher = PhaseSwitcher(groups, Alternating({"a": 2, "b": 1}), optimizer=opt)
    switcher.step_to(0)
    wrapped = DDP(model) if wrap else model
    switcher.attach(wrapped)
    for step in range(steps):
        x, y = data(step)
        F.mse_loss(wrapped(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        switcher.step_to(step + 1)
    return switcher


def train_by_hand(model: nn.Sequential, steps: int) -> None:
    """The loop users write without the library: two optimizers, requires_grad toggled by hand."""
    opts = {"a": ADAM(model[0].parameters()), "b": ADAM(model[2].parameters())}
    for step in range(steps):
        active = "a" if step % 3 < 2 else "b"
        for p in model[0].parameters():
            p.requires_grad_(active == "a")
        for p in model[2].parameters():
            p.requires_grad_(active == "b")
        x, y = data(step)
        F.mse_loss(model(x), y).backward()
        opts[active].step()
        opts[active].zero_grad(set_to_none=True)


# ---------------------------------------------------------------- no process group, plain module
def test_plain_module_without_process_group_trains_like_the_hand_written_loop() -> None:
    assert not dist.is_initialized()
    model, manual = two_layers(), two_layers()
    switcher = train_with_switcher(model, steps=9)
    train_by_hand(manual, steps=9)
    for (name, p), q in zip(model.named_parameters(), manual.parameters()):
        assert torch.equal(p, q), name
    assert [r.phase for r in switcher.records] == ["a", "b", "a", "b", "a", "b", "a"]
    assert all(not r.rebuilt_ddp and r.allreduce_bytes_per_step == 0 for r in switcher.records)


def test_step_to_switches_only_when_the_phase_changes() -> None:
    model = two_layers()
    switcher = PhaseSwitcher(groups_of(model), Alternating({"a": 2, "b": 1}))
    first = switcher.step_to(0)
    assert first is not None and first.phase == "a"
    assert switcher.step_to(1) is None  # still "a": nothing to do
    record = switcher.step_to(2)
    assert record is not None and record.trainable_groups == ("b",)
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    assert record.trainable_params == 8 * 3 + 3
    assert record.trainable_bytes == (8 * 3 + 3) * 4
    log = record.as_log()
    assert log["altparams/phase"] == "b" and log["altparams/trainable_groups"] == "b"
    assert all(isinstance(v, (int, float, str)) for v in log.values())


def test_attach_plain_module_is_a_no_op_and_a_foreign_one_is_refused() -> None:
    model = two_layers()
    switcher = PhaseSwitcher(groups_of(model), Alternating(["a", "b"]))
    assert switcher.attach(model) is None and switcher.ddp is None
    with pytest.raises(SwitchError, match="`model`"):
        switcher.attach(two_layers())


def test_pending_gradients_refused_without_process_group() -> None:
    model = two_layers()
    switcher = PhaseSwitcher(groups_of(model), Alternating(["a", "b"]))
    switcher.step_to(0)
    x, y = data(0)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(SwitchError, match="pending gradients") as info:
        switcher.step_to(1)
    assert "zero_grad(set_to_none=True)" in str(info.value)
    assert switcher.current == Phase(["a"]) and model[0].weight.requires_grad  # nothing changed


def test_pending_sparse_gradients_refused_too() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    switcher = PhaseSwitcher(ParamGroups(model, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
    switcher.step_to(0)
    model(torch.tensor([1, 2])).sum().backward()
    assert model[0].weight.grad.is_sparse
    with pytest.raises(SwitchError, match="pending gradients"):
        switcher.step_to(1)
    model[0].weight.grad = None
    assert switcher.step_to(1) is not None


def test_zero_filled_gradients_are_not_pending_and_are_cleared() -> None:
    model = two_layers()
    switcher = PhaseSwitcher(groups_of(model), Alternating(["a", "b"]))
    switcher.step_to(0)
    x, y = data(0)
    F.mse_loss(model(x), y).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()  # zero_grad(set_to_none=False)
    assert switcher.step_to(1) is not None
    assert all(p.grad is None for p in model.parameters())  # no stale tensor pins memory


def test_switcher_state_dict_round_trip_and_mismatch() -> None:
    model = two_layers()
    switcher = PhaseSwitcher(groups_of(model), Alternating({"a": 2, "b": 1}))
    switcher.step_to(2)
    state = switcher.state_dict()
    assert state["phase"] == ["b"]
    PhaseSwitcher(groups_of(model), Alternating({"a": 2, "b": 1})).load_state_dict(state)
    with pytest.raises(PlanError, match="durations"):
        PhaseSwitcher(groups_of(model), Alternating({"a": 3, "b": 1})).load_state_dict(state)


def test_rss_bytes_reads_this_process() -> None:
    assert rss_bytes() > 10 * 2**20


# ---------------------------------------------------------------- DDP at world size 1
def test_world_size_one_ddp_matches_the_plain_module(gloo_world_1: dist.ProcessGroup) -> None:
    wrapped_model, plain_model = two_layers(), two_layers()
    switcher = train_with_switcher(wrapped_model, steps=8, wrap=True)
    train_with_switcher(plain_model, steps=8)
    assert switcher.ddp is not None
    for p, q in zip(wrapped_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    b_bytes = sum(p.numel() * p.element_size() for p in wrapped_model[2].parameters())
    assert switcher.current == Phase(["b"]) and switcher.allreduce_bytes_per_step() == b_bytes


def test_world_size_one_counts_trainable_bytes_and_frees_buckets(gloo_world_1: dist.ProcessGroup) -> None:
    model = two_layers()
    groups = groups_of(model)
    opt = GroupedOptimizer(groups, ADAM, state_policy="drop")
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model, gradient_as_bucket_view=True)
    switcher.attach(ddp)
    counter = register_comm_counter(ddp)
    layer_bytes = {g: sum(p.numel() * p.element_size() for p in model[i].parameters()) for g, i in (("a", 0), ("b", 2))}
    for step in range(4):
        x, y = data(step)
        F.mse_loss(ddp(x), y).backward()
        ref = StorageWeakRef(next(p.grad for p in model.parameters() if p.grad is not None).untyped_storage())
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert counter.end_step() == layer_bytes["ab"[step % 2]]
        assert not ref.expired()
        switcher.step_to(step + 1)
        # gloo's worker thread drops its reference to the bucket it all-reduced a moment
        # after completing the future (ProcessGroupGloo's run loop resets its work in
        # progress after marking it done): under load that outlasts the switch, so wait
        # for it (no training step runs), bounded; a reference the switch kept would stay.
        deadline = time.monotonic() + 2.0
        while not ref.expired() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ref.expired()


def test_world_size_one_empty_phase_is_a_pass_through(gloo_world_1: dist.ProcessGroup) -> None:
    model = two_layers()
    groups = groups_of(model)
    opt = GroupedOptimizer(groups, ADAM)
    schedule = PhaseSequence([("a", 1), (Phase([]), 2), ("b", 2)], allow_empty=True)
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model)
    switcher.attach(ddp)
    counter = register_comm_counter(ddp)
    record = switcher.step_to(1)
    assert record is not None and record.allreduce_bytes_per_step == 0
    x, y = data(0)
    with torch.no_grad():
        out = ddp(x)
    assert not ddp(x).requires_grad and out.shape == (5, 3)  # a grad-enabled forward works too
    assert counter.end_step() == 0
    before = [p.detach().clone() for p in model[2].parameters()]
    switcher.step_to(3)
    F.mse_loss(ddp(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert counter.end_step() == sum(p.numel() * p.element_size() for p in model[2].parameters())
    assert all(not torch.equal(p, b) for p, b in zip(model[2].parameters(), before))


def test_comm_hook_state_holding_the_ddp_is_refused_before_any_change(gloo_world_1: dist.ProcessGroup) -> None:
    model = two_layers()
    switcher = PhaseSwitcher(groups_of(model), Alternating(["a", "b"]))
    switcher.step_to(0)
    ddp = DDP(model)
    switcher.attach(ddp)

    class HoldsDDP:
        def __init__(self, ddp: DDP) -> None:
            self.ddp = ddp

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(HoldsDDP(ddp), hook)
    reducer = ddp.reducer
    with pytest.raises(SwitchError, match="refused.*weakref") as info:
        switcher.step_to(1)
    assert "unusable" not in str(info.value)
    assert ddp.reducer is reducer and model[0].weight.requires_grad and not model[2].weight.requires_grad
