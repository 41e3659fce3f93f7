"""The strategy registry: lookup, recognition, and a strategy registered by a test reaching the switcher.

The fake strategy (``tests/support/fake_strategy.py``) lives only in the
tests: registering it is all it takes for ``PhaseSwitcher.attach`` and the
planner to drive and price it (the proof that the seam works without touching
the library's other files).
"""

from __future__ import annotations

import functools
import logging
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
from hf_altparams.engine.memory import StatePolicy
from hf_altparams.engine.optim import PlainOptimizerState
from hf_altparams.engine.strategies import (
    Collective,
    Placement,
    StepBoundary,
    is_registered,
    local_strategy,
    register,
    registered,
    strategy_for,
    strategy_named,
    unregister,
)
from hf_altparams.errors import PlanError, SwitchError
from hf_altparams.plan import Alternating, ParamGroups
from tests.support.fake_strategy import FakeOwner, FakeStrategy, FakeWrapper
from tests.support.fake_strategy import registered as registered_fake


@pytest.fixture
def fake() -> Iterator[FakeStrategy]:
    with registered_fake(FakeStrategy()) as strategy:
        yield strategy


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


# ---------------------------------------------------------------------------- lookup
def test_the_registry_lists_every_strategy_the_fallback_last() -> None:
    assert [s.name for s in registered()] == ["fsdp2", "ddp", "zero1", "zero2", "zero3", "local"]
    assert registered()[-1] is local_strategy()
    assert strategy_named("ddp").label == "DDP" and strategy_named("FSDP2").name == "fsdp2"
    assert strategy_named("none") is local_strategy()  # an alias
    assert strategy_named("deepspeed-zero2") is strategy_named("zero2")
    assert is_registered("ddp") and is_registered("zero1") and not is_registered("deepspeed")


def test_an_unknown_name_is_refused_listing_the_registered_ones() -> None:
    with pytest.raises(
        PlanError,
        match=r"`backend` must be one of the registered strategies \['fsdp2', 'ddp', "
        r"'zero1', 'zero2', 'zero3', 'local'\].*got 'deepspeed'",
    ):
        strategy_named("deepspeed", argument="`backend`")


def test_each_strategy_declares_what_it_supports() -> None:
    ddp, fsdp2, local = (strategy_named(n) for n in ("ddp", "fsdp2", "local"))
    assert ddp.capabilities.rebuckets_at_switch and ddp.capabilities.kept_reducers
    assert ddp.capabilities.wraps_module and ddp.capabilities.wrapper_per_model
    assert fsdp2.capabilities.shards_parameters and fsdp2.capabilities.rebinds_parameters
    assert not fsdp2.capabilities.frozen_prefix and not fsdp2.capabilities.rebuckets_at_switch
    assert not local.capabilities.synchronises_gradients and not local.capabilities.counts_comm
    assert fsdp2.pricing.collective is Collective.REDUCE_SCATTER and fsdp2.pricing.sharded
    assert ddp.pricing.buckets and not ddp.pricing.sharded and local.pricing.collective is Collective.NONE


def test_each_zero_stage_shards_what_zero_shards_and_only_zero_1_2_train() -> None:
    sharded = {
        name: [
            category
            for category in ("parameters", "gradients", "optimizer_state", "masters")
            if getattr(strategy_named(name).pricing, category) is Placement.SHARDED
        ]
        for name in ("zero1", "zero2", "zero3")
    }
    assert sharded == {
        "zero1": ["optimizer_state", "masters"],
        "zero2": ["gradients", "optimizer_state", "masters"],
        "zero3": ["parameters", "gradients", "optimizer_state", "masters"],
    }
    assert strategy_named("zero3").pricing.collective is Collective.REDUCE_SCATTER
    assert all(strategy_named(n).pricing.compare_with == "ddp" for n in sharded)
    assert [strategy_named(n).capabilities.trains for n in sharded] == [True, True, False]
    caps = strategy_named("zero2").capabilities
    assert caps.owns_optimizer_state and caps.builds_with_every_group and caps.step_boundary is StepBoundary.BACKWARD
    assert not strategy_named("zero2").recognises(_net())


def test_registering_twice_or_an_alias_clash_is_refused(fake: FakeStrategy) -> None:
    with pytest.raises(PlanError, match=r"takes the name\(s\) \['fake', 'fake-zero'\]"):
        register(FakeStrategy())

    class Clash(FakeStrategy):
        name, aliases = "other", ("ddp",)

    with pytest.raises(PlanError, match=r"takes the name\(s\) \['ddp'\]"):
        register(Clash())
    with pytest.raises(PlanError, match=r"no removable registered strategy"):
        unregister("local")


def test_a_registered_strategy_is_found_by_name_and_alias_and_tried_before_the_fallback(fake: FakeStrategy) -> None:
    assert strategy_named("fake-zero") is fake
    assert [s.name for s in registered()] == ["fsdp2", "ddp", "zero1", "zero2", "zero3", "fake", "local"]
    assert strategy_for(FakeWrapper(_net())) is fake
    assert strategy_for(_net()) is local_strategy()


# ---------------------------------------------------------------------------- recognition
def test_each_wrapper_is_recognised_by_its_strategy(gloo_world_1: dist.ProcessGroup) -> None:
    ddp = DistributedDataParallel(_net())
    sharded = _net()
    fully_shard(sharded)
    assert strategy_for(ddp).name == "ddp" and strategy_for(ddp).wrapped_module(ddp) is ddp.module
    assert strategy_for(sharded).name == "fsdp2"
    assert strategy_for(_net()).name == "local"


def test_attach_takes_the_strategy_of_the_wrapper(gloo_world_1: dist.ProcessGroup) -> None:
    net = _net()
    switcher = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
    switcher.step_to(0)
    ddp = DistributedDataParallel(net)
    switcher.attach(ddp)
    assert switcher.strategy.name == "ddp" and switcher.backend.kind == "ddp" and switcher.wrappers == [ddp]
    assert switcher.allreduce_bytes_per_step() == sum(p.numel() * 4 for p in net[0].parameters())
    switcher.release_wrappers()


# ---------------------------------------------------------------------------- a strategy from outside
def test_a_registered_strategy_drives_the_switcher_through_attach(fake: FakeStrategy) -> None:
    net = _net()
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]))
    switcher.step_to(0)
    wrapper = FakeWrapper(net)
    assert switcher.attach(wrapper) is None
    assert switcher.strategy is fake and fake.attached_to == [wrapper]
    backend = fake.backends[-1]
    assert switcher.backend is backend
    record = switcher.step_to(1)
    assert record is not None and record.phase == "b"
    assert backend.applied[-1] == set()  # adapted inside the transaction
    assert record.allreduce_bytes_per_step == sum(p.numel() * 4 for p in net[1].parameters())  # the trainable bytes
    assert switcher.wrappers == []  # it rebuilds no DDP reducer
    record = switcher.attach(wrapper, rebuild=True)  # built before the phase: re-applied as a transaction
    assert record is not None and record.phase == "b" and len(fake.backends) == 2


def test_a_wrapper_around_another_module_is_refused_naming_its_strategy(fake: FakeStrategy) -> None:
    switcher = PhaseSwitcher(ParamGroups(_net(), {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
    with pytest.raises(SwitchError, match=r"`model` is a FakeWrapper \(Fake\) around a different module"):
        switcher.attach(FakeWrapper(_net()))
    with pytest.raises(
        SwitchError,
        match=r"neither the grouped module nor a wrapper around it \(DDP, DeepSpeed ZeRO-1, DeepSpeed ZeRO-2, Fake\)",
    ):
        switcher.attach(_net())


def test_a_strategy_that_owns_the_optimizer_state_takes_it_over_at_attach(
    fake: FakeStrategy, caplog: pytest.LogCaptureFixture
) -> None:
    net = _net()
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    optimizer = torch.optim.AdamW(net.parameters())
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=optimizer)
    assert isinstance(switcher.state_owner, PlainOptimizerState)  # the library's, before any wrapper
    switcher.step_to(0)
    switcher.attach(FakeWrapper(net))
    owner = switcher.state_owner
    assert isinstance(owner, FakeOwner) and owner.entered == [frozenset({"a"})]
    assert switcher.idle_state_policies == {"a": StatePolicy.DROP, "b": StatePolicy.DROP}
    net(torch.ones(2, 3)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    with caplog.at_level(logging.INFO, logger="hf_altparams"):
        switcher.driver.stepped()  # the step trained "a"; the switch idles it: the owner's summary is logged
    assert owner.entered[-1] == frozenset({"b"})
    assert any("fake owner: ['a'] dropped inside the wrapper" in r.getMessage() for r in caplog.records)
    moved_before = owner.reapplied
    switcher.reapply_placement()
    assert owner.reapplied == moved_before + 1


def test_the_library_keeps_owning_a_grouped_optimizers_state_under_ddp() -> None:
    net = _net()
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    grouped = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=grouped)
    assert switcher.state_owner is grouped


# ---------------------------------------------------------------------------- the planner
def test_a_registered_strategy_is_priced_by_the_planner_from_its_declaration(fake: FakeStrategy) -> None:
    """A ZeRO-1-like pricing (optimizer state and masters sharded, the rest replicated) needs no planner change."""
    import math

    from hf_altparams.planner import plan_cost

    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(10, 7), nn.Linear(7, 3))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    schedule = Alternating(["a", "b"])
    plan = plan_cost(net, groups, schedule, backend="fake-zero", world_size=4, state_policy="drop", bf16_check=None)
    ddp = plan_cost(net, groups, schedule, backend="ddp", world_size=4, state_policy="drop", bf16_check=None)
    assert plan.backend == "fake" and plan.compared_with == "DDP" and plan.collective == "all-reduce"
    for row, ddp_row in zip(plan.phases, ddp.phases):
        trained = net[0] if row.phase == "a" else net[1]
        # AdamW: two fp32 moments of ceil(rows / 4) rows of each trained parameter
        sharded = sum(
            2 * 4 * math.ceil(p.shape[0] / 4) * (p[0].numel() if p.dim() > 1 else 1) for p in trained.parameters()
        )
        assert row.optimizer_bytes == sharded < ddp_row.optimizer_bytes
        assert (row.param_bytes, row.grad_bytes, row.bucket_bytes, row.allreduce_bytes) == (
            ddp_row.param_bytes,
            ddp_row.grad_bytes,
            ddp_row.bucket_bytes,
            ddp_row.allreduce_bytes,
        )
        assert plan.ddp_device_bytes[row.phase] == ddp_row.device_bytes  # DDP's figure beside its own
    assert "Fake over 4 ranks" in plan.table() and "vs DDP" in plan.table()


def test_the_planner_cli_takes_a_strategy_name_and_the_old_flag() -> None:
    from hf_altparams.planner.cli import plan_from_argv

    argv = [
        "--model",
        "torch.nn:PReLU",
        "--group",
        "slope=weight",
        "--schedule",
        "sequence",
        "--phase",
        "slope:10",
        "--device",
        "none",
    ]
    assert plan_from_argv(argv)[1].backend == "ddp"
    by_name, by_flag = plan_from_argv([*argv, "--strategy", "fsdp2"])[1], plan_from_argv([*argv, "--fsdp2"])[1]
    assert by_name.backend == by_flag.backend == "fsdp2" and by_name.as_dict() == by_flag.as_dict()
    assert plan_from_argv([*argv, "--strategy", "none"])[1].backend == "local"
    with pytest.raises(PlanError, match=r"`--fsdp2` and `--strategy ddp` disagree"):
        plan_from_argv([*argv, "--strategy", "ddp", "--fsdp2"])


def test_the_check_cli_takes_a_strategy_name_through_the_registry(capsys: pytest.CaptureFixture[str]) -> None:
    from hf_altparams.check.cli import main

    assert main(["--strategy", "deepspeed"]) == 2  # refused before any rank starts
    assert "`--strategy` must be one of the registered strategies" in capsys.readouterr().err
    assert main(["--strategy", "none"]) == 2
    refused = capsys.readouterr().err
    assert "the check sets up ['ddp', 'fsdp2', 'zero1', 'zero2', 'zero3'] through Accelerate" in refused
    assert "run local under your own launcher and config instead" in refused
    assert main(["--strategy", "ddp", "--fsdp2"]) == 2
    assert "`--fsdp2` and `--strategy ddp` disagree" in capsys.readouterr().err


def test_a_strategy_registered_before_another_is_tried_first() -> None:
    class Shadow(FakeStrategy):
        name, aliases, label = "shadow", (), "Shadow"

    with registered_fake(FakeStrategy()) as fake:
        shadow = register(Shadow(), before="fake")
        try:
            assert [s.name for s in registered()] == [
                "fsdp2",
                "ddp",
                "zero1",
                "zero2",
                "zero3",
                "shadow",
                "fake",
                "local",
            ]
            assert strategy_for(FakeWrapper(_net())) is shadow  # both recognise it: the earlier wins
        finally:
            unregister("shadow")
        assert strategy_for(FakeWrapper(_net())) is fake
    with pytest.raises(PlanError, match=r"`before` must name a registered strategy.*got 'local'"):
        register(Shadow(), before="local")
