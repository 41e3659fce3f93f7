"""Have the frozen prefix's weights changed since its rows were computed? Checked before every training forward.

The cached rows are a function of the frozen stages' parameters (and, in eval
mode, their buffers: running statistics). Torch's version counter does not see
every write: ``p.data.copy_(...)`` (EMA and weight-loading code),
``p.detach().numpy()[...] = ...`` and other writes through a tensor that shares
the storage but not the counter leave it unchanged. So :class:`PrefixWeights`
compares, at every training forward:

* which tensors the stages hold now (their identity and storage address: a
  swapped ``nn.Parameter`` object or a moved tensor), read from the modules
  again each time, not from a list taken earlier;
* what they hold: an exact digest of their bytes (:mod:`hf_altparams.engine.digest`,
  one memory pass over the prefix's weights, small tensors concatenated).

Any difference drops the rows before the forward can serve one. The digest is
the cost of this guarantee, measured against a hit batch in
``benchmarks/RESULTS.md`` (and ``docs/frozen_prefix.md``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..digest import digest_many, digest_values

__all__ = ["PrefixWeights"]


class PrefixWeights:
    """The identity and the content of the frozen stages' weights, as last captured.

    Args:
        with_buffers: also cover the stages' buffers (for stages held in eval
            mode, whose buffers the forward reads and never updates).

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> weights = PrefixWeights(with_buffers=True)
        >>> weights.capture([net]); weights.changed([net])
        False
        >>> with torch.no_grad():
        ...     _ = net[0].weight.data.copy_(torch.ones(2, 2))  # no version bump
        >>> weights.changed([net])
        True
    """

    def __init__(self, with_buffers: bool) -> None:
        self.with_buffers = with_buffers
        self._identity: tuple[tuple[int, int], ...] = ()
        self._content: list[int] = []

    def _tensors(self, stages: Sequence[nn.Module]) -> list[torch.Tensor]:
        tensors: list[torch.Tensor] = []
        for stage in stages:
            tensors.extend(stage.parameters())
            if self.with_buffers:
                tensors.extend(stage.buffers())
        return tensors

    @staticmethod
    def _identity_of(tensors: list[torch.Tensor]) -> tuple[tuple[int, int], ...]:
        return tuple((id(t), t.data_ptr()) for t in tensors)

    @staticmethod
    def _content_of(tensors: list[torch.Tensor]) -> list[int]:
        return digest_values(digest_many(tensors))  # one host copy per device

    def capture(self, stages: Sequence[nn.Module]) -> None:
        """Remember the stages' weights as they are now (the rows about to be computed come from them)."""
        tensors = self._tensors(stages)
        self._identity, self._content = self._identity_of(tensors), self._content_of(tensors)

    def changed(self, stages: Sequence[nn.Module]) -> bool:
        """Whether the stages hold other tensors, or other bytes, than at the last :meth:`capture`."""
        tensors = self._tensors(stages)
        return self._identity_of(tensors) != self._identity or self._content_of(tensors) != self._content
