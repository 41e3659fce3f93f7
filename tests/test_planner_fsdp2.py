"""The planner's FSDP2 mode: per-rank shards of parameters, gradients and state, next to DDP."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from hf_altparams import planner
from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle
from hf_altparams.planner import plan_cost


def _meta() -> tuple[nn.Module, ParamGroups]:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(10, 6), nn.Linear(6, 3))
    return net, ParamGroups(net, {"body": "0.*", "head": "1.*"})


def _shard_elems(module: nn.Module, world: int) -> int:
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) for p in module.parameters())


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_rows_are_padded_shards_per_rank_next_to_ddp(world: int) -> None:
    net, groups = _meta()
    plan = plan_cost(net, groups, Alternating(["body", "head"]), world_size=world, state_policy="drop", backend="fsdp2")
    ddp = plan_cost(net, groups, Alternating(["body", "head"]), world_size=world, state_policy="drop")
    body, head = _shard_elems(net[0], world) * 4, _shard_elems(net[1], world) * 4
    row = plan.row("head")
    assert row.param_bytes == body + head  # every resident parameter's shard
    assert row.grad_bytes == head  # only the trainable group's sharded gradients
    assert row.optimizer_bytes == 2 * head  # AdamW's two states, sharded; body's dropped
    assert row.bucket_bytes == 0  # no DDP buckets
    # each rank feeds the padded, unsharded trainable gradients to reduce-scatter
    assert row.allreduce_bytes == head * world
    assert row.allreduce_bytes >= ddp.row("head").allreduce_bytes  # == up to the padding of 3 rows
    assert row.wire_bytes == (world - 1) * row.allreduce_bytes // world
    assert row.trainable_params == ddp.row("head").trainable_params
    assert plan.ddp_device_bytes["head"] == ddp.row("head").device_bytes > row.device_bytes
    assert plan.unit_bytes == net[0].weight.numel() * 4 + net[0].bias.numel() * 4  # largest group unsharded
    table = plan.table()
    assert "FSDP2 (fully_shard) over" in table and "reduce-scatter/step" in table and "DDP device" in table
    json.dumps(plan.as_dict())


def test_fsdp2_residency_moves_non_resident_shards_to_the_host() -> None:
    with torch.device("meta"):
        net = nn.ModuleDict({"trunk": nn.Linear(8, 8), "t0": nn.Linear(8, 4), "t1": nn.Linear(8, 4)})
    groups = ParamGroups(net, {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"})
    plan = plan_cost(net, groups, PerTaskCycle(["trunk"], ["t0", "t1"], every=1), world_size=2, backend="fsdp2")
    row = plan.row(plan.phases[0].phase)
    t1 = _shard_elems(net["t1"], 2) * 4
    assert row.host_bytes == t1
    assert row.param_bytes == (_shard_elems(net["trunk"], 2) + _shard_elems(net["t0"], 2)) * 4


def test_fsdp2_backend_argument_and_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    net, groups = _meta()
    with pytest.raises(PlanError, match="`backend`.*'fsdp2'.*got 'fsdp1'"):
        plan_cost(net, groups, Alternating(["body", "head"]), backend="fsdp1")
    assert (
        planner.main(
            [
                "--model",
                "torch.nn:PReLU",
                "--group",
                "slope=weight",
                "--schedule",
                "sequence",
                "--phase",
                "slope:2",
                "--world-size",
                "4",
                "--fsdp2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "FSDP2 (fully_shard) over 4 ranks" in out and "vs DDP" in out
