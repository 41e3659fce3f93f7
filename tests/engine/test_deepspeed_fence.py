"""The DeepSpeed fence (hf_altparams.engine.deepspeed): every private name present, each use that runs without an
engine exercised here; the uses on a live engine run in tests/integrations/test_deepspeed.py (2 CPU ranks)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_altparams.engine.deepspeed import (
    GROUP_TAG,
    USES,
    ZeroBackend,
    is_deepspeed_engine,
    is_split,
    missing_names,
    optimizer_chain,
    skip_shm_comm_build,
    split_optimizer_class,
    split_param_groups,
)
from hf_altparams.errors import AltParamsError, PlanError
from hf_altparams.plan import ParamGroups

deepspeed = pytest.importorskip("deepspeed")


def _net() -> tuple[nn.Module, ParamGroups]:
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 1))
    return net, ParamGroups(net, {"a": "0.*", "b": ["1.*", "2.weight"]})


def test_deepspeed_has_every_name_the_fence_lists() -> None:
    assert missing_names() == []
    assert set(USES) == {
        "partitions",
        "relink_views",
        "all_gather_filter",
        "refusals",
        "count_collectives",
        "skip_shm_comm_build",
    }


def test_the_shared_memory_op_is_not_built_after_skip_shm_comm_build() -> None:
    from deepspeed.comm.torch import build_shm_op

    skip_shm_comm_build()
    assert build_shm_op() is None  # deepspeed.init_distributed then uses torch.distributed's gloo only


def test_the_split_keeps_each_param_groups_settings_and_order() -> None:
    net, groups = _net()
    decay = [net[0].weight, net[1].weight, net[2].weight]
    rest = [net[0].bias, net[1].bias, net[2].bias]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=0.5)
    assert split_param_groups(opt, groups) == 5  # bias of 2 is in no group: an untagged group of its own
    assert [(g[GROUP_TAG], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
        ("a", 0.1, 1),
        ("b", 0.1, 2),
        ("a", 0.0, 1),
        ("b", 0.0, 1),
        (None, 0.0, 1),
    ]
    assert all(g["lr"] == 0.5 for g in opt.param_groups) and is_split(opt)
    assert split_param_groups(opt, groups) == 5  # split already: unchanged


def test_ungrouped_parameters_frozen_for_the_run_are_left_out_of_the_split() -> None:
    """``AdamW(model.parameters())`` over a model whose final norm is in no group (frozen): ZeRO's
    ``initialize`` stopped with an IndexError on the param group of nothing to optimize."""
    net, groups = _net()
    net[2].bias.requires_grad_(False)  # in no group, frozen for the run (ungrouped="frozen")
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)
    assert split_param_groups(opt, groups) == 2
    assert [g[GROUP_TAG] for g in opt.param_groups] == ["a", "b"] and is_split(opt)
    assert all(p is not net[2].bias for g in opt.param_groups for p in g["params"])


def test_an_optimizer_that_stepped_is_not_split() -> None:
    net, groups = _net()
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    opt.step()
    with pytest.raises(PlanError, match="has stepped already"):
        split_param_groups(opt, groups)


def test_the_split_class_builds_the_class_itself_split() -> None:
    net, groups = _net()
    opt = split_optimizer_class(torch.optim.AdamW, groups)(net.parameters(), lr=0.1)
    assert type(opt) is torch.optim.AdamW  # DeepSpeed checks the exact class against the ones it supports
    assert [g[GROUP_TAG] for g in opt.param_groups] == ["a", "b", None]


def test_an_engine_is_recognised_only_when_it_is_one() -> None:
    assert not is_deepspeed_engine(nn.Linear(2, 2))
    inner = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    class Wrapper:
        optimizer = inner

    wrapper = Wrapper()
    assert optimizer_chain(wrapper) == [wrapper, inner]


def test_an_engine_without_zero_12s_optimizer_is_refused_naming_the_class() -> None:
    class Engine(nn.Module):
        optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)

    with pytest.raises(AltParamsError, match="optimizer is a SGD, not ZeRO-1/2's DeepSpeedZeroOptimizer"):
        ZeroBackend(Engine())
