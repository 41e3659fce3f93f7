"""The one refusal table: each row names the setting, the reason and the way out in each integration's terms."""

from __future__ import annotations

from typing import Iterator

import pytest
from torch import nn

from hf_altparams.engine.backend import Backend
from hf_altparams.engine.strategies import Capabilities, Strategy, register, strategy_named, unregister
from hf_altparams.errors import AltParamsError, Cause, SwitchError
from hf_altparams.integrations.refusals import (
    ACCELERATE,
    REFUSALS,
    TRAINER,
    Configuration,
    capability_refusal,
    check,
    message,
    refusal_for,
)


#: One configuration per row, as each integration would recognise it.
def _ds(zero: dict, **sections: object) -> dict:
    return {"deepspeed": True, "deepspeed_config": {"zero_optimization": zero, **sections}}


CASES = {
    "deepspeed": _ds({"stage": "auto"}),  # a stage no registered strategy drives
    "deepspeed-no-zero": {"deepspeed": True},
    "deepspeed-zero3": _ds({"stage": 3}),
    "deepspeed-offload": _ds({"stage": 2, "offload_optimizer": {"device": "cpu"}}),
    "deepspeed-bf16-optimizer": _ds({"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}),
    "deepspeed-optimizer-section": _ds({"stage": 2}, optimizer={"type": "AdamW", "params": {"lr": 1e-3}}),
    "deepspeed-other-paths": _ds({"stage": 2}, compile={"deepcompile": True}),
    "fsdp1": {"fsdp_version": 1},
    "megatron": {"megatron": True, "distributed_type": "MEGATRON_LM"},
    "xla": {"xla": True, "distributed_type": "XLA"},
    "tensor-parallel": {"tensor_parallel": True},
    "compiled": {"compiled": "dynamo_backend='EAGER'"},
    "compiled-model": {"compiled_model": "`prepare` argument #1"},
    "one-process-of-many": {"world_size": 2, "processes": 1},
    "unwrapped-of-many": {"world_size": 2, "processes": 2, "unwrapped": True},
}


#: What the messages say is driven: every registered strategy that trains (ZeRO-3 is priced only).
DRIVEN = "FSDP2, DDP, DeepSpeed ZeRO-1, DeepSpeed ZeRO-2 and one process"


def test_every_row_has_a_case_here() -> None:
    assert [row.name for row in REFUSALS] == list(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_each_row_refuses_its_configuration_naming_the_integration_and_what_is_supported(name: str) -> None:
    for integration in (ACCELERATE, TRAINER):
        config = Configuration(integration, **CASES[name])  # type: ignore[arg-type]
        row = refusal_for(config)
        assert row is not None and row.name == name
        text = message(config)
        assert text is not None and text.startswith(f"{integration} drives {DRIVEN}; it cannot drive ")
        assert row.reason in text
        if integration in row.way_out:
            assert text.endswith(row.way_out[integration])
        with pytest.raises(AltParamsError, match="cannot drive") as info:
            check(config)
        assert info.value.cause is row.cause
        assert row.cause is Cause.STRATEGY_REFUSED or name in ("one-process-of-many", "unwrapped-of-many")


def test_the_way_out_is_in_each_integrations_terms() -> None:
    accelerate = message(Configuration(ACCELERATE, **_ds({"stage": 3})))  # type: ignore[arg-type]
    trainer = message(Configuration(TRAINER, **_ds({"stage": 3})))  # type: ignore[arg-type]
    assert accelerate is not None and "`DeepSpeedPlugin(zero_stage=2)`" in accelerate
    assert trainer is not None and "`zero_optimization.stage=2`" in trainer


def test_a_refusal_at_the_first_forward_is_a_switch_error() -> None:
    unwrapped = r"did not wrap it in DistributedDataParallel.*`trainer.evaluate\(\)`"
    with pytest.raises(SwitchError, match=unwrapped) as info:
        check(Configuration(TRAINER, world_size=2, processes=2, unwrapped=True))
    assert info.value.cause is Cause.SETUP_REFUSED
    with pytest.raises(AltParamsError, match="ACCELERATE_USE_CPU=1") as info:
        check(Configuration(ACCELERATE, world_size=2, processes=1))
    assert info.value.cause is Cause.SETUP_REFUSED


@pytest.mark.parametrize(
    "config",
    [
        Configuration(ACCELERATE),
        Configuration(ACCELERATE, fsdp_version=2),
        Configuration(ACCELERATE, **_ds({"stage": 1})),  # type: ignore[arg-type]
        # DeepSpeed on CPU: Accelerate counts one process per rank, the engine spans them
        Configuration(ACCELERATE, world_size=2, processes=1, **_ds({"stage": 2})),  # type: ignore[arg-type]
        Configuration(TRAINER, **_ds({"stage": 2}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})),
        Configuration(TRAINER, world_size=4, processes=4),
        Configuration(ACCELERATE, unwrapped=True),
    ],
)
def test_what_the_strategies_drive_passes(config: Configuration) -> None:
    assert refusal_for(config) is None
    check(config)


def test_the_strategy_a_configuration_asks_for() -> None:
    assert Configuration(ACCELERATE, deepspeed=True).strategy_name == "zero0"  # no ZeRO section: stage 0
    assert Configuration(ACCELERATE, **_ds({"stage": 2})).strategy_name == "zero2"  # type: ignore[arg-type]
    assert Configuration(ACCELERATE, fsdp_version=2).strategy_name == "fsdp2"
    assert Configuration(ACCELERATE, fsdp_version=1).strategy_name == "fsdp1"
    assert Configuration(ACCELERATE).strategy_name is None


class _Zero(Strategy):
    name, label = "zero2", "DeepSpeed ZeRO"
    capabilities = Capabilities(
        wraps_module=True,
        synchronises_gradients=True,
        owns_optimizer_state=True,
        per_task_residency=False,
        frozen_prefix=False,
    )

    def recognises(self, model: nn.Module) -> bool:
        return False

    def backend(self, wrapper: nn.Module) -> Backend:
        raise NotImplementedError


@pytest.fixture
def zero() -> Iterator[Strategy]:
    """The registered ZeRO-2 strategy replaced by a test-only one of the same name."""
    real = unregister("zero2")
    strategy = register(_Zero(), before="zero3")
    try:
        yield strategy
    finally:
        unregister("zero2")
        register(real, before="zero3")


def test_deepspeed_is_driven_at_a_stage_a_strategy_of_that_name_is_registered_for(zero: Strategy) -> None:
    stage2 = Configuration(ACCELERATE, **_ds({"stage": 2}))  # type: ignore[arg-type]
    assert refusal_for(stage2) is None
    unregister("zero2")
    try:
        row = refusal_for(stage2)
        assert row is not None and row.name == "deepspeed"
        text = message(Configuration(TRAINER, fsdp_version=1))
        assert text is not None and text.startswith("AlternatingFreeze drives FSDP2, DDP, DeepSpeed ZeRO-1 and one")
    finally:
        register(zero, before="zero3")
    text = message(Configuration(TRAINER, fsdp_version=1))
    assert text is not None and text.startswith(
        "AlternatingFreeze drives FSDP2, DDP, DeepSpeed ZeRO-1, DeepSpeed ZeRO and one process"
    )


def test_a_feature_the_strategy_does_not_declare_is_refused(zero: Strategy) -> None:
    assert capability_refusal(zero, frozen_prefix=True) == (
        "`frozen_prefix` is not supported with DeepSpeed ZeRO (not verified); leave it out"
    )
    text = capability_refusal(zero, per_task_residency=True)
    assert text is not None and "`offload_device=None`" in text
    assert capability_refusal(strategy_named("fsdp2"), per_task_residency=True, count_comm=True) is None
    assert capability_refusal(strategy_named("local"), count_comm=True) is None  # one process: nothing to count
    assert capability_refusal(zero, count_comm=True) is not None  # it synchronises, but declares no counter
