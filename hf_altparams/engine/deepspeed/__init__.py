"""FENCE: DeepSpeed ZeRO under phases: the private names (:mod:`._surface`), checked, and what is built on them.

* :class:`ZeroBackend`: a ``DeepSpeedEngine`` at ZeRO-1/2 as the switch
  drives it; :class:`ZeroStateOwner`: idle groups' fp32 partitions and
  optimizer state kept, offloaded or dropped (:mod:`._backend`);
* :mod:`.layout`: the optimizer split per library group that ZeRO needs
  before ``deepspeed.initialize`` (pure torch; the integrations use it);
* :func:`is_deepspeed_engine`, :func:`engine_stage`, :func:`optimizer_chain`;
  :func:`count_zero_comm` (every collective DeepSpeed runs, counted);
  :func:`skip_shm_comm_build` (no C++ build at ``init_distributed`` on CPU).

deepspeed is optional: importing this package does not import it.

Example:
    >>> import torch
    >>> is_deepspeed_engine(torch.nn.Linear(2, 2))
    False
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..comm import CommCounter
from ._backend import ZeroBackend, ZeroStateOwner
from ._surface import TESTED_DEEPSPEED, USES, count_collectives, engine_class, missing_names, skip_shm_comm_build
from .layout import GROUP_TAG, is_split, split_optimizer_class, split_param_groups

__all__ = [
    "GROUP_TAG",
    "TESTED_DEEPSPEED",
    "USES",
    "ZeroBackend",
    "ZeroStateOwner",
    "count_zero_comm",
    "engine_stage",
    "is_deepspeed_engine",
    "is_split",
    "missing_names",
    "optimizer_chain",
    "skip_shm_comm_build",
    "split_optimizer_class",
    "split_param_groups",
]


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a ``DeepSpeedEngine`` (``False`` whenever deepspeed was never imported)."""
    cls = engine_class()
    return cls is not None and isinstance(model, cls)


def engine_stage(engine: nn.Module) -> int:
    """The ZeRO stage the engine runs (0: no ZeRO); public ``DeepSpeedEngine.zero_optimization_stage()``."""
    return int(getattr(engine, "zero_optimization_stage")())


def optimizer_chain(optimizer: Any) -> list[Any]:
    """``optimizer`` and every object reached through ``.optimizer`` from it (Accelerate's wrapper, ZeRO's, torch's)."""
    chain: list[Any] = []
    while optimizer is not None and all(optimizer is not seen for seen in chain) and len(chain) < 8:
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def count_zero_comm(counter: Optional[CommCounter] = None) -> CommCounter:
    """A :class:`~hf_altparams.engine.comm.CommCounter` fed by every collective DeepSpeed runs from now on.

    The full tensor each collective works on (all-reduce: the tensor;
    reduce-scatter: its input; all-gather: its output): at ZeRO-1/2 a step's
    gradient reduction plus the all-gather of the updated partitions.
    """
    counter = counter if counter is not None else CommCounter()
    count_collectives(counter)
    return counter
