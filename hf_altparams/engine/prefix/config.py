"""The one option that turns the frozen-prefix cache on: :class:`FrozenPrefix`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from ...errors import PlanError

__all__ = ["FrozenPrefix", "as_frozen_prefix"]

GiB = 1 << 30


@dataclass
class FrozenPrefix:
    """How to treat the frozen prefix of the model (embeddings, then leading blocks).

    Args:
        blocks: dotted path of the model's block ``ModuleList`` (``"bert.encoder.layer"``);
            ``None``: the ``ModuleList`` holding the most parameters.
        embeddings: dotted path of the module whose output feeds the first block
            (``"bert.embeddings"``); ``None``: the parent of the input embeddings
            when its name ends in ``embeddings``, else the input embeddings.
        cache: keep the prefix's output per sample and start the forward from it.
            ``False`` still puts the frozen prefix in eval mode (the reference run).
        eval_frozen: put the frozen prefix in eval mode (no dropout) at every
            training forward. Opting out with ``cache=True`` is refused when the
            prefix holds a dropout: the cached output would replay one draw.
        index_key: the keyword of the model's forward that carries each sample's
            dataset index (an integer tensor of shape ``[batch]``); it is removed
            before the model sees the inputs.
        missing_index: a training batch without ``index_key`` while a prefix is
            frozen: ``"error"`` (default) or ``"recompute"`` (warn once, run the
            prefix, cache nothing).
        augmentation: declare that the data pipeline is random (augmentation,
            random crops, masking): the same index would not give the same input,
            so ``cache=True`` is refused.
        memory_budget_bytes: host memory for cached rows before they spill to a
            memory-mapped file (``None``: no limit).
        disk_dir: where that file goes (``None``: the temp dir); one file per process.
        check_layout: at the first computing batch of each prefix, check that the
            embeddings' output is the first block's input and each block's output
            the next one's input (the forward can then start from the cache).

    Example:
        >>> FrozenPrefix(blocks="bert.encoder.layer").cache
        True
        >>> FrozenPrefix(augmentation=True)
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `FrozenPrefix(augmentation=True)` with `cache=True`: ...
    """

    blocks: Optional[str] = None
    embeddings: Optional[str] = None
    cache: bool = True
    eval_frozen: bool = True
    index_key: str = "sample_index"
    missing_index: Literal["error", "recompute"] = "error"
    augmentation: bool = False
    memory_budget_bytes: Optional[int] = 4 * GiB
    disk_dir: Optional[str] = None
    check_layout: bool = True

    def __post_init__(self) -> None:
        for name in ("blocks", "embeddings", "disk_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise PlanError(f"`{name}` must be a str or None, got {value!r}")
        for name in ("cache", "eval_frozen", "augmentation", "check_layout"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"`{name}` must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.index_key, str) or not self.index_key:
            raise PlanError(f"`index_key` must be a non-empty str, got {self.index_key!r}")
        if self.missing_index not in ("error", "recompute"):
            raise PlanError(f"`missing_index` must be 'error' or 'recompute', got {self.missing_index!r}")
        budget = self.memory_budget_bytes
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise PlanError(f"`memory_budget_bytes` must be an int >= 0 or None, got {budget!r}")
        if self.cache and self.augmentation:
            raise PlanError(
                "`FrozenPrefix(augmentation=True)` with `cache=True`: ... a random data pipeline gives another "
                "input for the same sample index, so a cached prefix output would replay one view. Pass "
                "`cache=False` (the prefix still runs in eval mode) or make the pipeline deterministic."
            )


def as_frozen_prefix(
    value: Union[None, bool, FrozenPrefix, Any], argument: str = "frozen_prefix"
) -> Optional[FrozenPrefix]:
    """``None``/``False`` -> ``None``; ``True`` -> defaults; a :class:`FrozenPrefix` as is."""
    if value is None or value is False:
        return None
    if value is True:
        return FrozenPrefix()
    if isinstance(value, FrozenPrefix):
        return value
    raise PlanError(f"`{argument}` must be None, True, False or a FrozenPrefix, got {type(value).__name__}: {value!r}")
