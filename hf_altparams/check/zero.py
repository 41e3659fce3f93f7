"""What ``check --deepspeed`` runs: a DeepSpeed config, refused or completed before it trains.

``--deepspeed`` takes a DeepSpeed config file (JSON) or a ZeRO stage; ``--strategy
zero1`` / ``zero2`` (any registered ZeRO strategy) is the same as its stage
(:func:`deepspeed_config`). Before any rank starts, the library's refusal table
(:mod:`hf_altparams.integrations.refusals`) judges the config as
``PhasedAccelerator`` would (:func:`refusal`): ZeRO-3, stage 0, offload, an
``optimizer`` section ... are refused with their reason, as cause
``strategy_refused``. On each rank the config becomes Accelerate's
``DeepSpeedPlugin`` and, once the set-up is known, is completed for the check's
loop (:func:`complete`): the check feeds no dataloader to ``prepare``, so the
batch sizes DeepSpeed books are set here.

DeepSpeed runs on CPU ranks too, under a plain ``torchrun`` environment:
``ACCELERATE_USE_CPU`` (which the check sets for DDP on CPU ranks) makes
Accelerate drop DeepSpeed, so the check's own launch leaves it out
(:data:`CPU_ENV` is what it removes) and a rank refuses to train when
Accelerate did not start DeepSpeed anyway.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Mapping, MutableMapping, Optional

from ..engine.strategies import strategy_named
from ..errors import PlanError
from ..integrations.refusals import ACCELERATE, Configuration, message

__all__ = [
    "CPU_ENV",
    "complete",
    "copied",
    "deepspeed_config",
    "refusal",
    "stage_of",
    "strategy_config",
    "strategy_name",
]

#: The variable that makes Accelerate run each CPU rank without DeepSpeed (the check sets it for DDP on CPU).
CPU_ENV = "ACCELERATE_USE_CPU"

#: What the check books as DeepSpeed's micro-batch when the config leaves it to Accelerate (``"auto"``
#: or absent): the check's batches are its own (``CheckSetup.batch``), and DeepSpeed reads this figure
#: only to check its batch arithmetic and to report throughput.
_MICRO_BATCH = 1


def strategy_config(stage: int) -> dict[str, Any]:
    """The config the check trains a ZeRO ``stage`` with (``--deepspeed 2``, ``--strategy zero2``).

    Example:
        >>> strategy_config(2)["zero_optimization"]
        {'stage': 2}
    """
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": int(stage)},
    }


def deepspeed_config(value: str) -> dict[str, Any]:
    """The DeepSpeed config ``--deepspeed VALUE`` names: a stage (``1``, ``2``, ...) or a JSON file.

    Raises:
        PlanError: neither a stage nor a readable JSON file holding an object, naming the value.

    Example:
        >>> deepspeed_config("1")["zero_optimization"]["stage"]
        1
        >>> deepspeed_config("zero.json")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `--deepspeed` takes a ZeRO stage (1, 2) or a DeepSpeed config file (JSON); 'zero.json' is neither ...
    """
    text = str(value).strip()
    if text.isdigit():
        return strategy_config(int(text))
    path = Path(text)
    if not path.is_file():
        raise PlanError(
            f"`--deepspeed` takes a ZeRO stage (1, 2) or a DeepSpeed config file (JSON); {value!r} is neither "
            "(no such file)"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise PlanError(f"`--deepspeed` {value!r} is not a DeepSpeed config file (JSON): {err}") from err
    if not isinstance(config, dict):
        raise PlanError(
            f"`--deepspeed` {value!r} holds a JSON {type(config).__name__}, not a DeepSpeed config (an object)"
        )
    return config


def stage_of(config: Mapping[str, Any]) -> int:
    """The ZeRO stage ``config`` trains (``zero_optimization.stage``; 0 when absent, -1 when unreadable)."""
    return Configuration(ACCELERATE, deepspeed=True, deepspeed_config=config).zero_stage


def refusal(config: Mapping[str, Any]) -> Optional[str]:
    """Why ``PhasedAccelerator`` refuses ``config`` (the refusal table's message), or ``None``: it drives it.

    Example:
        >>> refusal(strategy_config(2)) is None
        True
        >>> "ZeRO-3 all-gathers every weight" in refusal(strategy_config(3))
        True
    """
    return message(Configuration(ACCELERATE, deepspeed=True, deepspeed_config=config))


def strategy_name(config: Mapping[str, Any]) -> str:
    """The registered strategy ``config`` runs (``zero2``), as the refusal table names it."""
    name = Configuration(ACCELERATE, deepspeed=True, deepspeed_config=config).strategy_name
    assert name is not None
    return strategy_named(name).name


def complete(config: MutableMapping[str, Any], accumulation: int, world: int) -> int:
    """Fill in, in place, what DeepSpeed books and the check's loop leaves open; the micro-batches per step.

    Without a dataloader in ``prepare`` Accelerate cannot size DeepSpeed's
    batches: ``train_micro_batch_size_per_gpu`` left to it (``"auto"`` or
    absent) becomes 1 (DeepSpeed only checks and reports it; the check's batches
    are its own); ``gradient_accumulation_steps`` left to it becomes the set-up's
    ``accumulation``; ``train_batch_size`` left to it becomes their product times
    ``world``, the ranks of the job (on CPU Accelerate counts one process per
    rank, so it would book one rank's). A figure the config gives stays, and the
    config's accumulation is the one trained.

    Example:
        >>> config = strategy_config(2)
        >>> complete(config, accumulation=2, world=4), config["train_batch_size"]
        (2, 8)
    """
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = _MICRO_BATCH
    if config.get("gradient_accumulation_steps", "auto") == "auto":
        config["gradient_accumulation_steps"] = int(accumulation)
    steps = config["gradient_accumulation_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise PlanError(
            f"the DeepSpeed config's `gradient_accumulation_steps` must be a positive integer, got {steps!r}"
        )
    if config.get("train_batch_size", "auto") == "auto":
        config["train_batch_size"] = int(config["train_micro_batch_size_per_gpu"]) * steps * int(world)
    return steps


def copied(config: Optional[Mapping[str, Any]]) -> Optional[dict[str, Any]]:
    """A deep copy of ``config`` (the rank completes its own), ``None`` for none."""
    return None if config is None else copy.deepcopy(dict(config))
