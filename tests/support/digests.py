"""sha256 digests of weights, to compare ranks or runs in the check scripts (exact, host-side, slow)."""

from __future__ import annotations

import hashlib
from typing import Iterable

import torch
from torch import nn

from hf_altparams.plan import ParamGroups

__all__ = ["group_digests", "param_sha", "state_sha"]


def _sha(tensors: Iterable[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def state_sha(model: nn.Module) -> str:
    """One digest of the whole ``state_dict`` (parameters and buffers), in key order."""
    return _sha(value for _, value in sorted(model.state_dict().items()))


def param_sha(model: nn.Module) -> str:
    """One digest of ``model.parameters()`` in their order (buffers left out)."""
    return _sha(model.parameters())


def group_digests(groups: ParamGroups) -> dict[str, str]:
    """A digest per group of ``groups``."""
    return {name: _sha(groups.params(name)) for name in groups.names}
