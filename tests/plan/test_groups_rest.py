"""``ParamGroups.with_rest``: the parameters no group claims, as a named group."""

from __future__ import annotations

import pytest
from torch import nn

from hf_altparams.errors import PlanError
from hf_altparams.plan import ParamGroups


def model() -> nn.Module:
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
    net[2].weight = net[0].weight  # tied: one object under two names
    return net


def test_the_rest_group_holds_exactly_the_ungrouped_parameters_and_keeps_the_others() -> None:
    groups = ParamGroups(model(), {"head": "2.bias", "mid": "1.*"}, ungrouped="trainable")
    full = groups.with_rest("base")

    assert full.names == ("head", "mid", "base")
    assert full.param_names("base") == groups.ungrouped_names() == ("0.weight", "0.bias")
    assert full.param_names("head") == groups.param_names("head") and full.param_names("mid") == ("1.weight", "1.bias")
    assert full.ungrouped_names() == () and full.ungrouped == "trainable"
    assert full.group_of("2.weight") == "base"  # the tied alias follows its parameter
    assert full.module is groups.module


def test_the_rest_group_refuses_a_taken_an_empty_or_a_bad_name() -> None:
    groups = ParamGroups(model(), {"head": "2.bias", "mid": "1.*"})
    with pytest.raises(PlanError, match=r"rest group 'mid' is already a group; known groups: \['head', 'mid'\]"):
        groups.with_rest("mid")
    with pytest.raises(PlanError, match=r"must be a non-empty str, got ''"):
        groups.with_rest("")
    every = groups.with_rest("base")
    with pytest.raises(PlanError, match=r"rest group 'more' would be empty: every parameter is in one of the groups"):
        every.with_rest("more")
