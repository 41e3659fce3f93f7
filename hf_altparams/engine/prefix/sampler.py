"""A sampler that keeps each rank's samples fixed across epochs: :class:`ShardSampler`.

The frozen-prefix cache is local to a rank. Under DDP with a globally shuffled
sampler (``DistributedSampler``, Accelerate's sharded loaders, the Trainer's)
a rank sees another half of the data every epoch, and a batch hits only when
every one of its samples was seen before on that rank: hits come slowly. With
a fixed shard per rank, shuffled inside it every epoch, the second epoch of a
phase hits on every batch.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler

from ...errors import PlanError

__all__ = ["ShardSampler"]


class ShardSampler(Sampler[int]):
    """Indices ``rank, rank + replicas, ...`` of a dataset, shuffled within that shard every epoch.

    Pass it as ``sampler=`` of a per-rank ``DataLoader`` that is *not* given to
    ``accelerator.prepare`` (which would shard it a second time). Short shards
    are padded with their first indices so every rank runs as many batches.

    Args:
        size: length of the dataset.
        num_replicas, rank: the world size and this process's rank.
        seed: the shuffle seed (the same on every rank).
        shuffle: shuffle within the shard (with ``seed + epoch``).

    Example:
        >>> s = ShardSampler(5, num_replicas=2, rank=1, shuffle=False)
        >>> list(s), len(s)
        ([1, 3, 1], 3)
        >>> s = ShardSampler(8, num_replicas=2, rank=0, seed=1); s.set_epoch(3)
        >>> sorted(s)
        [0, 2, 4, 6]
    """

    def __init__(self, size: int, num_replicas: int, rank: int, *, seed: int = 0, shuffle: bool = True) -> None:
        if not isinstance(size, int) or size < 1:
            raise PlanError(f"`size` must be an int >= 1, got {size!r}")
        if (
            not isinstance(num_replicas, int)
            or num_replicas < 1
            or not isinstance(rank, int)
            or not 0 <= rank < num_replicas
        ):
            raise PlanError(f"need 0 <= `rank` < `num_replicas`, got rank={rank!r}, num_replicas={num_replicas!r}")
        self.size, self.num_replicas, self.rank = size, num_replicas, rank
        self.seed, self.shuffle, self.epoch = int(seed), bool(shuffle), 0
        shard = list(range(rank, size, num_replicas))
        per_rank = -(-size // num_replicas)
        self._shard = (shard * per_rank)[:per_rank] if shard else [0] * per_rank

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order to give next (call on every rank at the top of each epoch)."""
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(self._shard)
        order = torch.randperm(len(self._shard), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter([self._shard[i] for i in order.tolist()])

    def __len__(self) -> int:
        return len(self._shard)
