"""What ``check`` reads of the weights, in one process: idle groups that change, and copying rank 0's weights."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
from torch import nn

from hf_altparams.check import CheckOptions, judge
from hf_altparams.check.rank import run_rank
from hf_altparams.check.weights import IdleChange, IdleWatch, differing_at_start
from hf_altparams.integrations import accelerate_internals
from hf_altparams.plan import ParamGroups, Phase
from tests.check import setups


def _net() -> tuple[nn.Module, ParamGroups]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 1))
    return net, ParamGroups(net, {"a": "0.*", "b": "1.*"})  # "2.*" ungrouped: frozen for the whole run


def test_a_change_to_an_idle_group_is_seen_at_the_next_boundary_and_a_trained_one_is_not() -> None:
    net, groups = _net()
    watch = IdleWatch(groups, Phase({"a"}))
    with torch.no_grad():
        net[0].weight.add_(1.0)  # "a" trains: its changes are the optimizer's
        net[1].weight.mul_(1 - 1e-3)  # "b" is idle
    assert watch.boundary(3, Phase({"b"})) == [IdleChange("b", "a", 0, 3)]
    with torch.no_grad():
        net[1].weight.add_(1.0)  # "b" trains now
    assert watch.boundary(5, None) == []


def test_ungrouped_parameters_never_change() -> None:
    net, groups = _net()
    watch = IdleWatch(groups, Phase({"a"}))
    with torch.no_grad():
        net[2].bias.add_(1e-6)
    assert watch.boundary(2, None) == [IdleChange("(ungrouped)", "a", 0, 2)]


def test_one_process_has_nothing_to_compare_at_the_start() -> None:
    _, groups = _net()
    assert differing_at_start(groups, None) == []


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    accelerate_internals.fresh_accelerator_state(partial=True)
    yield
    accelerate_internals.fresh_accelerator_state(partial=True)


@pytest.mark.usefixtures("accelerate_state")
@pytest.mark.parametrize("setup", ["optimizer_decays_idle_groups", "decays_every_weight_per_step", "ema_written_back"])
def test_each_way_of_changing_idle_groups_fails_naming_them(setup: str) -> None:
    """The three set-ups the user tried, each through one rank of the check (``run_rank``, as the launched ranks
    run it) and its verdict: every rank changes them alike, so only the idle watch sees it."""
    result = run_rank(getattr(setups, setup), CheckOptions(steps=6), finish=lambda r: r)
    assert result.failure is None and result.idle_changed > 0
    verdict = judge([result])
    assert verdict.causes == ["idle_group_changed"], verdict.failures
    assert "changed while not training" in verdict.failures[0]["detail"]
