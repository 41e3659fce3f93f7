"""Frozen prefix, no recompute: the frozen leading layers run in eval mode and, cached, not at all.

Example:
    >>> from hf_altparams.engine.prefix import FrozenPrefix, FrozenPrefixCache
    >>> FrozenPrefix(blocks="bert.encoder.layer", memory_budget_bytes=1 << 30).index_key
    'sample_index'
"""

from ._store import ActivationStore
from .cache import FrozenPrefixCache, PrefixRecord, find_stages
from .config import FrozenPrefix, as_frozen_prefix
from .sampler import ShardSampler

__all__ = [
    "ActivationStore",
    "FrozenPrefix",
    "FrozenPrefixCache",
    "PrefixRecord",
    "ShardSampler",
    "as_frozen_prefix",
    "find_stages",
]
