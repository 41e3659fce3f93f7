"""The one refusal table: each row names the setting, the reason and the way out in each integration's terms."""

from __future__ import annotations

from typing import Iterator

import pytest
from torch import nn

from hf_altparams.engine.backend import Backend
from hf_altparams.engine.strategies import Capabilities, Strategy, register, strategy_named, unregister
from hf_altparams.errors import AltParamsError, Cause, SwitchError
from hf_altparams.integrations.refusals import (ACCELERATE, REFUSALS, TRAINER, Configuration, capability_refusal,
                                                check, message, refusal_for)

#: One configuration per row, as each integration would recognise it.
CASES = {
    "deepspeed": {"deepspeed": True},
    "fsdp1": {"fsdp_version": 1},
    "megatron": {"megatron": True, "distributed_type": "MEGATRON_LM"},
    "xla": {"xla": True, "distributed_type": "XLA"},
    "tensor-parallel": {"tensor_parallel": True},
    "compiled": {"compiled": "dynamo_backend='EAGER'"},
    "compiled-model": {"compiled_model": "`prepare` argument #1"},
    "one-process-of-many": {"world_size": 2, "processes": 1},
    "unwrapped-of-many": {"world_size": 2, "processes": 2, "unwrapped": True},
}


def test_every_row_has_a_case_here() -> None:
    assert [row.name for row in REFUSALS] == list(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_each_row_refuses_its_configuration_naming_the_integration_and_what_is_supported(name: str) -> None:
    for integration in (ACCELERATE, TRAINER):
        config = Configuration(integration, **CASES[name])  # type: ignore[arg-type]
        row = refusal_for(config)
        assert row is not None and row.name == name
        text = message(config)
        assert text is not None and text.startswith(f"{integration} drives FSDP2, DDP and one process; it cannot "
                                                    "drive ")
        assert row.reason in text
        if integration in row.way_out:
            assert text.endswith(row.way_out[integration])
        with pytest.raises(AltParamsError, match="cannot drive") as info:
            check(config)
        assert info.value.cause is row.cause
        assert row.cause is Cause.STRATEGY_REFUSED or name in ("one-process-of-many", "unwrapped-of-many")


def test_the_way_out_is_in_each_integrations_terms() -> None:
    accelerate = message(Configuration(ACCELERATE, deepspeed=True))
    trainer = message(Configuration(TRAINER, deepspeed=True))
    assert accelerate is not None and "FullyShardedDataParallelPlugin(fsdp_version=2" in accelerate
    assert trainer is not None and "drop `deepspeed=` from TrainingArguments" in trainer


def test_a_refusal_at_the_first_forward_is_a_switch_error() -> None:
    unwrapped = r"did not wrap it in DistributedDataParallel.*`trainer.evaluate\(\)`"
    with pytest.raises(SwitchError, match=unwrapped) as info:
        check(Configuration(TRAINER, world_size=2, processes=2, unwrapped=True))
    assert info.value.cause is Cause.SETUP_REFUSED
    with pytest.raises(AltParamsError, match="ACCELERATE_USE_CPU=1") as info:
        check(Configuration(ACCELERATE, world_size=2, processes=1))
    assert info.value.cause is Cause.SETUP_REFUSED


@pytest.mark.parametrize("config", [Configuration(ACCELERATE), Configuration(ACCELERATE, fsdp_version=2),
                                    Configuration(TRAINER, world_size=4, processes=4),
                                    Configuration(ACCELERATE, unwrapped=True)])
def test_what_the_strategies_drive_passes(config: Configuration) -> None:
    assert refusal_for(config) is None
    check(config)


def test_the_strategy_a_configuration_asks_for() -> None:
    assert Configuration(ACCELERATE, deepspeed=True).strategy_name == "deepspeed"
    assert Configuration(ACCELERATE, fsdp_version=2).strategy_name == "fsdp2"
    assert Configuration(ACCELERATE, fsdp_version=1).strategy_name == "fsdp1"
    assert Configuration(ACCELERATE).strategy_name is None


class _Zero(Strategy):
    name, label = "deepspeed", "DeepSpeed ZeRO"
    capabilities = Capabilities(wraps_module=True, synchronises_gradients=True, owns_optimizer_state=True,
                                per_task_residency=False, frozen_prefix=False)

    def recognises(self, model: nn.Module) -> bool:
        return False

    def backend(self, wrapper: nn.Module) -> Backend:
        raise NotImplementedError


@pytest.fixture
def zero() -> Iterator[Strategy]:
    strategy = register(_Zero())
    try:
        yield strategy
    finally:
        unregister("deepspeed")


def test_deepspeed_is_driven_once_a_strategy_of_that_name_is_registered(zero: Strategy) -> None:
    assert refusal_for(Configuration(ACCELERATE, deepspeed=True)) is None
    text = message(Configuration(TRAINER, fsdp_version=1))
    assert text is not None and text.startswith("AlternatingFreeze drives FSDP2, DDP, DeepSpeed ZeRO and one process")


def test_a_feature_the_strategy_does_not_declare_is_refused(zero: Strategy) -> None:
    assert capability_refusal(zero, frozen_prefix=True) == (
        "`frozen_prefix` is not supported with DeepSpeed ZeRO (not verified); leave it out")
    text = capability_refusal(zero, per_task_residency=True)
    assert text is not None and "`offload_device=None`" in text
    assert capability_refusal(strategy_named("fsdp2"), per_task_residency=True, count_comm=True) is None
    assert capability_refusal(strategy_named("local"), count_comm=True) is None  # one process: nothing to count
    assert capability_refusal(zero, count_comm=True) is not None  # it synchronises, but declares no counter
