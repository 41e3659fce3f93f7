"""What ``check`` reads of the weights, in one process: idle groups that change, and copying rank 0's weights."""

from __future__ import annotations

import torch
from torch import nn

from hf_altparams.check.weights import IdleChange, IdleWatch, differing_at_start
from hf_altparams.plan import ParamGroups, Phase


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
