"""GroupedOptimizer and GroupedLRScheduler, without a process group."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_altparams.engine import GroupedLRScheduler, GroupedOptimizer, PhaseSwitcher
from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups

ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def model_and_groups(seed: int = 0) -> tuple[nn.Sequential, ParamGroups]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    return model, ParamGroups(model, {"a": "0.*", "b": "2.*"})


def backward(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 2, generator=gen)
    F.mse_loss(model(x), y).backward()


def clone(tensors: Any) -> list[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


def alternate(model: nn.Module, opt: torch.optim.Optimizer, switcher: PhaseSwitcher, steps: range) -> None:
    for step in steps:
        switcher.step_to(step)
        backward(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- stepping
def test_step_updates_only_active_groups_even_if_idle_ones_have_grads() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, SGD, active=["a"])
    a0, b0 = clone(groups.params("a")), clone(groups.params("b"))
    backward(model, 0)  # every parameter requires grad: b gets gradients too
    assert all(p.grad is not None for p in model.parameters())
    opt.step()
    assert all(not torch.equal(p, q) for p, q in zip(groups.params("a"), a0))
    assert all(torch.equal(p, q) for p, q in zip(groups.params("b"), b0))
    assert opt.state_bytes("b") == {}  # the idle optimizer never ran


def test_param_groups_are_the_inner_optimizers_dicts() -> None:
    _, groups = model_and_groups()
    opt = GroupedOptimizer(groups, {"a": SGD, "b": ADAM})
    inner = [g for o in opt.inner.values() for g in o.param_groups]
    assert len(opt.param_groups) == 2 and all(x is y for x, y in zip(opt.param_groups, inner))
    with pytest.raises(PlanError, match="ParamGroups"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})


# ---------------------------------------------------------------- state dict
def test_state_dict_keyed_by_names_resumes_identically_in_a_fresh_model() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, {"a": ADAM, "b": SGD})
    switcher = PhaseSwitcher(groups, Alternating({"a": 2, "b": 1}), optimizer=opt)
    alternate(model, opt, switcher, range(5))
    saved = copy.deepcopy(opt.state_dict())
    saved_model = copy.deepcopy(model.state_dict())
    assert sorted(saved["groups"]["a"]["state"]) == ["0.bias", "0.weight"]
    assert sorted(saved["groups"]["b"]["state"]) == ["2.bias", "2.weight"]

    # A freshly built copy (other initial weights), groups rebound; group order swapped on purpose.
    fresh, _ = model_and_groups(seed=123)
    fresh.load_state_dict(saved_model)
    fresh_groups = ParamGroups(fresh, {"b": "2.*", "a": "0.*"})
    fresh_opt = GroupedOptimizer(fresh_groups, {"a": ADAM, "b": SGD})
    fresh_opt.load_state_dict(saved)
    fresh_switcher = PhaseSwitcher(fresh_groups, Alternating({"a": 2, "b": 1}), optimizer=fresh_opt)

    alternate(model, opt, switcher, range(5, 11))
    alternate(fresh, fresh_opt, fresh_switcher, range(5, 11))
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def decay_split(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The usual factory: biases without weight decay, listed first (torch numbers them first)."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0},
            {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
        ],
        lr=1e-2,
    )


def test_state_dict_names_follow_the_factorys_parameter_order() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, decay_split)
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    saved = opt.state_dict()
    named = dict(model.named_parameters())
    for group in ("a", "b"):
        for param_name, state in saved["groups"][group]["state"].items():
            assert state["exp_avg"].shape == named[param_name].shape, param_name
        no_decay = saved["groups"][group]["param_groups"][0]
        assert no_decay["weight_decay"] == 0.0 and all(n.endswith("bias") for n in no_decay["params"])

    twin = copy.deepcopy(model)
    twin_opt = GroupedOptimizer(groups.rebind(twin), decay_split)
    twin_opt.load_state_dict(copy.deepcopy(saved))
    for m, o in ((model, opt), (twin, twin_opt)):
        backward(m, 1)
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_rebind_gives_groups_for_a_copy() -> None:
    model, groups = model_and_groups()
    twin = copy.deepcopy(model)
    rebound = groups.rebind(twin)
    assert rebound.params("a")[0] is twin[0].weight
    assert rebound.param_names("b") == groups.param_names("b")


def test_load_state_dict_refuses_a_foreign_dict() -> None:
    _, groups = model_and_groups()
    opt = GroupedOptimizer(groups, SGD)
    with pytest.raises(PlanError, match="`format`"):
        opt.load_state_dict(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1).state_dict())


# ---------------------------------------------------------------- idle-state policies
def test_keep_policy_keeps_idle_state() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, ADAM, state_policy="keep")
    backward(model, 0)
    opt.step()
    opt.zero_grad()
    before = {k: v.clone() for k, v in opt.inner["b"].state[groups.params("b")[0]].items()}
    opt.set_active(["a"])
    after = opt.inner["b"].state[groups.params("b")[0]]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_drop_policy_reinitialises_state_adam_step_restarts() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, ADAM, state_policy="drop")
    for step in range(3):
        backward(model, step)
        opt.step()
        opt.zero_grad()
    b0 = groups.params("b")[0]
    assert float(opt.inner["b"].state[b0]["step"]) == 3
    opt.set_active(["a"])
    assert opt.state_bytes("b") == {} and b0 not in opt.inner["b"].state
    assert float(opt.inner["a"].state[groups.params("a")[0]]["step"]) == 3  # active: kept
    opt.set_active(["b"])
    backward(model, 3)
    opt.step()
    assert float(opt.inner["b"].state[b0]["step"]) == 1  # fresh Adam state


def test_offload_policy_trains_exactly_like_keep() -> None:
    runs = []
    for policy in ("keep", "offload"):
        model, groups = model_and_groups()
        opt = GroupedOptimizer(groups, ADAM, state_policy=policy)
        alternate(model, opt, PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt), range(6))
        runs.append(clone(model.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_offload_of_cpu_state_moves_nothing() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, ADAM, state_policy="offload")
    backward(model, 0)
    opt.step()
    state_bytes = opt.state_bytes("b")
    assert state_bytes["cpu"] > 0
    assert opt.offload("b") == 0  # already on the CPU
    opt.set_active(["a"])
    assert opt.state_bytes("b") == state_bytes


@pytest.mark.cuda
def test_offload_policy_moves_idle_state_to_cpu_and_back() -> None:
    model, groups = model_and_groups()
    model.cuda()
    opt = GroupedOptimizer(groups, ADAM, state_policy="offload")
    F.mse_loss(model(torch.randn(5, 4, device="cuda")), torch.randn(5, 2, device="cuda")).backward()
    opt.step()
    opt.zero_grad()
    on_device = opt.state_bytes("b")["cuda"]
    values = {k: v.cpu() for k, v in opt.inner["b"].state[groups.params("b")[0]].items()}
    opt.set_active(["a"])
    assert opt.state_bytes("b").get("cuda", 0) == 0 and opt.state_bytes("b")["cpu"] >= on_device
    opt.set_active(["b"])
    assert opt.state_bytes("b")["cuda"] == on_device
    restored = opt.inner["b"].state[groups.params("b")[0]]
    assert all(torch.equal(restored[k].cpu(), values[k]) for k in values)


def test_load_state_dict_reapplies_the_policy_for_idle_groups() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, ADAM, state_policy="drop")
    backward(model, 0)
    opt.step()
    saved = opt.state_dict()  # both groups hold state
    assert saved["groups"]["b"]["state"]
    other = GroupedOptimizer(groups, ADAM, state_policy="drop", active=["a"])
    other.load_state_dict(saved)
    assert other.state_bytes("b") == {}  # b is idle here: its loaded state is dropped again
    assert other.state_bytes("a")["cpu"] == opt.state_bytes("a")["cpu"]


# ---------------------------------------------------------------- LR schedulers
def test_torch_lr_scheduler_on_the_composite_changes_every_group() -> None:
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, {"a": SGD, "b": ADAM}, active=["a"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    backward(model, 0)
    opt.step()
    sched.step()
    assert opt.inner["a"].param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.inner["b"].param_groups[0]["lr"] == pytest.approx(5e-3)  # idle, changed all the same
    # Still true after a load_state_dict (torch replaces the inner param_group dicts).
    opt.load_state_dict(opt.state_dict())
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.1)
    assert sched2.get_last_lr() == [pytest.approx(0.01), pytest.approx(1e-3)]
    assert opt.inner["a"].param_groups[0]["lr"] == pytest.approx(0.01)


@pytest.mark.parametrize("advance_idle", [False, True])
def test_grouped_lr_scheduler_idle_groups_pause_unless_advance_idle(advance_idle: bool) -> None:
    """By default an idle group's schedule pauses (resumes where it stopped); advance_idle=True runs it on."""
    model, groups = model_and_groups()
    opt = GroupedOptimizer(groups, SGD, active=["a"])
    sched = GroupedLRScheduler(
        opt, lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.5**s), advance_idle=advance_idle
    )
    for step in range(3):
        backward(model, step)
        opt.step()
        opt.zero_grad()
        sched.step()
    lr_a, lr_b = sched.get_last_lr()
    assert lr_a == pytest.approx(0.1 * 0.5**3)
    assert lr_b == pytest.approx(0.1 * 0.5**3 if advance_idle else 0.1)
    opt.set_active(["b"])
    sched.step()
    assert sched.get_last_lr()[1] == pytest.approx(0.1 * 0.5 ** (4 if advance_idle else 1))


def test_grouped_lr_scheduler_refuses_bad_arguments() -> None:
    model, groups = model_and_groups()
    with pytest.raises(PlanError, match="GroupedOptimizer"):
        GroupedLRScheduler(torch.optim.SGD(model.parameters(), lr=0.1), lambda o: None)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match=r"unknown groups \['c'\]"):
        GroupedLRScheduler(GroupedOptimizer(groups, SGD), {"c": lambda o: None})


# ---------------------------------------------------------------- a plain optimizer over all params
def test_plain_adamw_skips_frozen_params_weight_decay_included() -> None:
    model, groups = model_and_groups()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5)
    switcher = PhaseSwitcher(groups, Alternating({"a": 2, "b": 3}), optimizer=opt)
    frozen_b = None
    for step in range(5):
        switcher.step_to(step)
        if step == 0:
            frozen_b = clone(groups.params("b"))
        if step == 2:  # "b" starts training: "a" is frozen from here, its Adam state already exists
            frozen_a = clone(groups.params("a"))
            assert all(p.grad is None for p in groups.params("a"))
        backward(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == 1:
            assert all(torch.equal(p, q) for p, q in zip(groups.params("b"), frozen_b))
    assert all(torch.equal(p, q) for p, q in zip(groups.params("a"), frozen_a))
    assert not all(torch.equal(p, q) for p, q in zip(groups.params("b"), frozen_b))


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (
            {"optimizers": {"a": SGD, "b": SGD, "c": SGD}},
            r"`optimizers` names unknown groups \['c'\]; known groups: \['a', 'b'\]",
        ),
        ({"optimizers": {"a": SGD}}, r"`optimizers` has no entry for groups \['b'\]"),
        (
            {"optimizers": SGD, "state_policy": {"a": "keep", "z": "drop", "b": "keep"}},
            r"`state_policy` names unknown groups \['z'\]",
        ),
        ({"optimizers": SGD, "state_policy": {"a": "keep"}}, r"`state_policy` has no entry for groups \['b'\]"),
        (
            {"optimizers": SGD, "state_policy": "archive"},
            r"`state_policy` for group 'a' must be one of \['keep', 'offload', 'drop'\], got 'archive'",
        ),
        ({"optimizers": lambda params: params}, r"`optimizers` factory for group 'a' returned list"),
    ],
)
def test_bad_arguments_raise_plan_error_naming_value_and_accepted(kwargs: dict[str, Any], pattern: str) -> None:
    _, groups = model_and_groups()
    with pytest.raises(PlanError, match=pattern):
        GroupedOptimizer(groups, **kwargs)


def test_already_built_optimizers_one_per_group_step_like_factories() -> None:
    model, groups = model_and_groups()
    built = GroupedOptimizer(groups, {n: SGD(groups.params(n), lr=0.1) for n in groups.names})
    reference_model, reference_groups = model_and_groups()  # same seed: same weights
    reference = GroupedOptimizer(reference_groups, functools.partial(SGD, lr=0.1))
    for m, opt in ((model, built), (reference_model, reference)):
        backward(m, 0)
        opt.step()
    assert not torch.equal(model[0].weight, model_and_groups()[0][0].weight)  # it did step
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference_model.parameters()))


@pytest.mark.parametrize(
    ("make", "pattern"),
    [
        (
            lambda m, g: (g, {"a": SGD(g.params("b"), lr=0.1), "b": SGD(g.params("b"), lr=0.1)}),
            r"`optimizers\['a'\]` \(SGD\) must be built on exactly group 'a''s parameters; missing: \['0\.weight'",
        ),
        (
            lambda m, g: (g, {"a": SGD(list(m.parameters()), lr=0.1), "b": SGD(g.params("b"), lr=0.1)}),
            r"missing: \[\]; extra \(not in group 'a'\): \['2\.bias', '2\.weight'\]",
        ),
        (lambda m, g: (g, SGD(m.parameters(), lr=0.1)), r"`optimizers` got one built SGD for all groups \['a', 'b'\]"),
        (lambda m, g: (g, {"a": SGD, "b": 3}), r"`optimizers\['b'\]` is a int; accepted: a factory"),
        (lambda m, g: (g, "adam"), r"`optimizers` is a str; accepted: a factory"),
        (lambda m, g: (m, SGD), r"`groups` must be a ParamGroups, got Sequential"),
    ],
)
def test_wrong_optimizer_forms_raise_plan_error_naming_them(make: Any, pattern: str) -> None:
    model, groups = model_and_groups()
    with pytest.raises(PlanError, match=pattern):
        GroupedOptimizer(*make(model, groups))


@pytest.mark.parametrize("policy", ["drop", "offload"])
def test_idle_policies_act_on_the_parameters_of_rebound_groups(policy: str) -> None:
    """After ``rebind`` (FSDP2's ``fully_shard`` gives the model new parameter objects), the idle policy acts on
    the new parameters' state, not on the parameters the optimizer was built with."""
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = GroupedOptimizer(ParamGroups(net, {"a": "0.*", "b": "1.*"}), ADAM, state_policy=policy)
    for i, layer in enumerate(net):  # new Parameter objects, swapped into the inner optimizers (as Accelerate does)
        for name in ("weight", "bias"):
            old = getattr(layer, name)
            new = nn.Parameter(old.detach().clone())
            setattr(layer, name, new)
            inner = opt.inner["ab"[i]]
            inner.param_groups[0]["params"] = [new if p is old else p for p in inner.param_groups[0]["params"]]
    opt.rebind(ParamGroups(net, {"a": "0.*", "b": "1.*"}))
    opt.set_active({"a", "b"})
    net(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    opt.set_active({"a"})
    held = {
        p.device.type
        for p in net[1].parameters()
        for t in opt.inner["b"].state.get(p, {}).values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    }
    assert held == (set() if policy == "drop" else {"cpu"})
    assert all(opt.inner["b"].state.get(p) for p in net[1].parameters()) == (policy == "offload")
