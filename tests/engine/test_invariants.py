"""Reality against the phase before every optimizer step (``hf_altparams.engine.invariants``).

One process: a gloo group of one rank and a real DDP wrapper, so the checks
run exactly as on N ranks (the 2-rank runs are in the Accelerate and Trainer
tests). What a user would notice: a step that would apply a gradient DDP never
reduced is refused before any weight changes, naming the parameters, the phase
and the usual causes; flags changed behind the schedule's back with no
gradient yet are put back with one warning; the refusal for a trainable
parameter without a gradient gives the fix for each cause.
"""

from __future__ import annotations

import functools
import warnings
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
from hf_altparams.errors import AltParamsError, Cause, SwitchError
from hf_altparams.plan import Alternating, ParamGroups


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 1)
        self.spare = nn.Linear(4, 1)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.b(torch.tanh(self.a(x)))
        return out + self.spare(x) if self.use_spare else out


@pytest.fixture
def world(gloo_world_1: dist.ProcessGroup) -> Iterator[None]:
    yield


def _setup(
    plain_optimizer: bool = True, ddp: bool = True, groups_spec: dict | None = None, refuse_missing_grads: bool = False
) -> tuple[Net, nn.Module, torch.optim.Optimizer, PhaseSwitcher]:
    net = Net()
    groups = ParamGroups(net, groups_spec or {"a": "a.*", "b": ["b.*", "spare.*"]})
    opt: torch.optim.Optimizer = (
        torch.optim.SGD(net.parameters(), lr=0.1)
        if plain_optimizer
        else GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    )
    switcher = PhaseSwitcher(
        groups, Alternating(["a", "b"], every=4), optimizer=opt, refuse_missing_grads=refuse_missing_grads
    )
    switcher.step_to(0)
    wrapped: nn.Module = DDP(net) if ddp else net
    switcher.attach(wrapped)
    return net, wrapped, opt, switcher


def _step(wrapped: nn.Module, opt: torch.optim.Optimizer) -> None:
    wrapped(torch.ones(3, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_an_idle_group_unfrozen_behind_the_schedule_is_refused_before_the_step(world: None) -> None:
    net, ddp, opt, switcher = _setup()
    _step(ddp, opt)
    net.requires_grad_(True)  # a helper "making sure everything trains" (or peft's set_adapter)
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    ddp(torch.ones(3, 4)).pow(2).mean().backward()
    with pytest.raises(AltParamsError) as err:
        opt.step()
    message = str(err.value)
    assert "outside phase 'a' hold gradients" in message and "'b.weight'" in message
    assert "requires_grad_(True)" in message and "set_adapter" in message and "step was not applied" in message
    assert all(torch.equal(before[n], p) for n, p in net.named_parameters())  # nothing stepped


def test_a_flag_changed_without_a_gradient_is_put_back_with_one_warning(world: None) -> None:
    net, ddp, opt, switcher = _setup()
    reference, ref_ddp, ref_opt, _ = _setup()
    _step(ddp, opt)
    _step(ref_ddp, ref_opt)
    ddp(torch.ones(3, 4)).pow(2).mean().backward()
    ref_ddp(torch.ones(3, 4)).pow(2).mean().backward()
    net.b.requires_grad_(True)  # after the backward: no gradient reached it
    with pytest.warns(UserWarning, match=r"no longer matched phase 'a'.*flags were put back"):
        opt.step()
    ref_opt.step()
    assert not net.b.weight.requires_grad
    opt.zero_grad(set_to_none=True)
    ref_opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), reference.parameters()))
    net.b.requires_grad_(True)
    ddp(torch.ones(3, 4)).pow(2).mean()  # forward only: still no gradient
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same parameters: warned once
        opt.step()


def test_a_trainable_parameter_without_a_gradient_gets_advice_for_each_cause(world: None) -> None:
    net, ddp, opt, switcher = _setup(
        groups_spec={"a": ["a.*", "spare.*"], "b": "b.*"}, refuse_missing_grads=True
    )  # what the integrations set: refused at the step
    ddp(torch.ones(3, 4)).pow(2).mean().backward()  # `spare` trains in phase "a" but the forward skips it
    with pytest.raises(AltParamsError) as err:
        opt.step()
    message = str(err.value)
    assert "'spare.weight'" in message and "phase 'a' got no gradient" in message
    assert "find_unused_parameters=True" in message and "wrong branch, task or adapter" in message
    assert "move them out of its groups" in message
    assert err.value.cause is Cause.TRAINABLE_PARAM_UNUSED


def test_a_bare_switcher_refuses_it_at_the_next_switch_with_the_same_advice(world: None) -> None:
    net, ddp, opt, switcher = _setup(groups_spec={"a": ["a.*", "spare.*"], "b": "b.*"})
    ddp(torch.ones(3, 4)).pow(2).mean().backward()  # `spare` trains in phase "a" but the forward skips it
    opt.step()  # a bare switcher does not refuse it here (plain DDP would at its next forward)
    opt.zero_grad(set_to_none=True)
    with pytest.raises(SwitchError) as err:
        switcher.step_to(4)  # the switch to "b" comes first: refused, naming each cause's fix
    message = str(err.value)
    assert "'spare.weight'" in message and "wrong branch, task or adapter" in message
    assert "find_unused_parameters=True" in message and "leave them out of its groups" in message
    assert err.value.cause is Cause.TRAINABLE_PARAM_UNUSED  # the refusal's cause, through the switch


def test_without_ddp_a_stray_gradient_is_not_a_divergence_and_the_flags_come_back(world: None) -> None:
    net, plain, opt, switcher = _setup(ddp=False)
    net.b.requires_grad_(True)
    plain(torch.ones(3, 4)).pow(2).mean().backward()
    with pytest.warns(UserWarning, match="flags were put back"):
        opt.step()  # one process: nothing to reduce, nothing diverges
    assert not net.b.weight.requires_grad


def test_the_check_runs_inside_a_grouped_optimizer_too_and_stops_with_the_switcher(world: None) -> None:
    net, ddp, opt, switcher = _setup(plain_optimizer=False)
    _step(ddp, opt)
    net.requires_grad_(True)
    ddp(torch.ones(3, 4)).pow(2).mean().backward()
    with pytest.raises(AltParamsError, match="outside phase 'a' hold gradients"):
        opt.step()
    switcher.close()
    opt.step()  # the run is over: its checks are gone
