"""Buffer broadcast per phase: what DDP really sends at each forward, and the eval policy.

The bytes are counted on the wire (a spy on DDP's buffer broadcast in the
launched script), not taken from the plan, and compared with the buffers of
the model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.engine import BufferSync, plan_buffer_sync
from hf_altparams.errors import PlanError
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2


def bn_buffer_bytes() -> int:
    norm = nn.BatchNorm1d(8)
    return sum(b.numel() * b.element_size() for b in norm.buffers())


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("memory_buffers")
    launch(script_path("memory_checks.py"), str(out), "--only", "buffers", nproc=NPROC, launcher="forked", timeout=300)
    return [r["buffers"] for r in rank_results(out, nproc=NPROC)]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["no_buffers", "no_buffers_auto"])
def test_model_without_buffers_broadcasts_nothing(cases: list[dict[str, Any]], name: str) -> None:
    for rank in cases:
        case = rank[name]
        assert case["buffer_bytes"] == 0
        assert case["per_forward"] == [0, 0, 0, 0]
        assert not case["plan"]["broadcast"] and case["plan"]["bytes_per_forward"] == 0
        assert "no buffer" in case["plan"]["reason"]
        assert not case["will_sync"]


@pytest.mark.distributed
def test_batchnorm_model_keeps_broadcasting_by_default(cases: list[dict[str, Any]]) -> None:
    for rank in cases:
        case = rank["bn_default"]
        assert case["per_forward"] == [bn_buffer_bytes()] * 4
        assert case["plan"]["broadcast"] and case["plan"]["bytes_per_forward"] == bn_buffer_bytes()
        assert case["plan"]["saved_bytes_per_forward"] == 0
        assert case["norm_training_in_forward"] == [True] * 4  # today's semantics, untouched


@pytest.mark.distributed
def test_auto_with_frozen_norm_in_eval_stops_the_broadcast(cases: list[dict[str, Any]]) -> None:
    rank0, rank1 = cases[0]["bn_auto_eval"], cases[1]["bn_auto_eval"]
    for case in (rank0, rank1):
        assert case["per_forward"] == [0, 0, 0, 0]
        assert case["plan"]["eval_modules"] == ["1"]
        assert case["plan"]["saved_bytes_per_forward"] == bn_buffer_bytes()
        assert all(r["buffer_broadcast_saved_bytes"] == bn_buffer_bytes() for r in case["records"])
        # model.train() every step, yet the frozen norm ran in eval mode: its stats stay put
        assert case["norm_training_in_forward"] == [False] * 4
        assert case["stats_unchanged"]
    assert rank0["buffers_digest"] == rank1["buffers_digest"]
    assert rank0["params_digest"] == rank1["params_digest"]


@pytest.mark.distributed
def test_auto_keeps_broadcasting_while_a_norm_trains(cases: list[dict[str, Any]]) -> None:
    for rank in cases:
        case = rank["bn_auto_trainable"]
        assert case["per_forward"] == [bn_buffer_bytes()] * 4
        assert case["plan"]["broadcast"] and case["plan"]["eval_modules"] == []
        assert case["norm_training_in_forward"] == [True] * 4


# -- pure planning -----------------------------------------------------------------------------


def bn_net() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))


def test_plan_keep_never_changes_the_broadcast() -> None:
    net = bn_net()
    plan = plan_buffer_sync(net, {"0.weight", "0.bias"}, frozen_norms="eval")
    assert plan.broadcast  # frozen norm in eval, but policy "keep" leaves DDP alone
    assert plan.eval_modules == ("1",)


def test_plan_counts_ignored_buffers_as_saved() -> None:
    net = bn_net()
    plan = plan_buffer_sync(net, set(), ignore={"1.running_mean", "1.running_var", "1.num_batches_tracked"})
    assert not plan.broadcast and plan.bytes_per_forward == 0
    assert plan.saved_bytes_per_forward == sum(b.numel() * b.element_size() for b in net.buffers())


def test_plan_respects_a_wrapper_built_without_broadcast() -> None:
    plan = plan_buffer_sync(bn_net(), set(), user_broadcast=False, policy="auto")
    assert not plan.broadcast and plan.saved_bytes_per_forward == 0


def test_user_declared_updating_type_keeps_the_broadcast() -> None:
    class Ema(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("avg", torch.zeros(3))

    net = nn.Sequential(nn.Linear(3, 3), Ema())
    assert not plan_buffer_sync(net, {"0.weight"}, policy="auto").broadcast
    plan = plan_buffer_sync(net, {"0.weight"}, policy="auto", updating_types=[Ema])
    assert plan.broadcast and plan.updating_modules == ("1",)


def test_eval_hold_is_released_when_the_norm_trains_again() -> None:
    net = bn_net()
    sync = BufferSync(policy="auto", frozen_norms="eval")
    sync.apply(net, {"0.weight", "0.bias"})
    net.train()
    net(torch.randn(3, 4))
    assert not net[1].training
    sync.apply(net, {"1.weight", "1.bias"})
    assert net[1].training
    mean = net[1].running_mean.clone()
    net(torch.randn(3, 4))
    assert not torch.equal(mean, net[1].running_mean)  # updating again


def test_bad_policies_are_refused() -> None:
    with pytest.raises(PlanError, match="`buffer_sync`.*'always'"):
        BufferSync(policy="always")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="`frozen_norms`"):
        BufferSync(frozen_norms="freeze")  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="`updating_types`"):
        BufferSync(updating_types=[int])
