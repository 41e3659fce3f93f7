"""The fence around torch's private names that the engine uses outside its DDP and FSDP2 backends.

The DDP reducer surgery and the FSDP2 state have their own fences
(:mod:`hf_altparams.engine.ddp`, :mod:`hf_altparams.engine.fsdp2`). Three more
private torch names are read elsewhere, each for a reason public torch does not
cover; they are named here, and only here:

* ``Tensor._version`` (:func:`version_counter`): the in-place version counter,
  which tells whether a prefetched copy of a tensor is still current
  (:class:`~hf_altparams.engine.memory.TensorMover`);
* ``torch.nn.modules.batchnorm._NormBase`` (:data:`NORM_BASE`): the base class of
  the norm layers with running statistics (BatchNorm, SyncBatchNorm's parent,
  InstanceNorm), whose buffers a forward updates (:mod:`hf_altparams.engine.buffers`);
* ``torch.nn.modules.dropout._DropoutNd`` (:data:`DROPOUT_BASE`): the base class of
  every dropout layer (the frozen-prefix cache refuses a prefix that drops out).

:data:`PRIVATE_TORCH_NAMES` lists them; :func:`missing_private_names` is run at
import (an absent name raises a clear error naming it and the tested torch
range) and by ``tests/engine/test_torch_fences.py``.

Example:
    >>> import torch
    >>> t = torch.zeros(2); before = version_counter(t); _ = t.add_(1)
    >>> version_counter(t) == before + 1
    True
"""

from __future__ import annotations

import torch
from torch import nn

from .._compat import TESTED_TORCH
from ..errors import AltParamsError

__all__ = ["DROPOUT_BASE", "NORM_BASE", "PRIVATE_TORCH_NAMES", "missing_private_names", "version_counter"]

#: Every private torch name this module reads, as ``(owner, name)``.
PRIVATE_TORCH_NAMES: tuple[tuple[str, str], ...] = (
    ("torch.Tensor", "_version"),
    ("torch.nn.modules.batchnorm", "_NormBase"),
    ("torch.nn.modules.dropout", "_DropoutNd"),
)


def missing_private_names() -> list[str]:
    """The names of :data:`PRIVATE_TORCH_NAMES` this torch lacks (empty on a tested torch)."""
    owners = {
        "torch.Tensor": torch.zeros(0),
        "torch.nn.modules.batchnorm": nn.modules.batchnorm,
        "torch.nn.modules.dropout": nn.modules.dropout,
    }
    return [f"{owner}.{name}" for owner, name in PRIVATE_TORCH_NAMES if not hasattr(owners[owner], name)]


_missing = missing_private_names()
if _missing:  # pragma: no cover - only on an untested torch
    raise AltParamsError(
        f"this torch ({torch.__version__}) lacks {_missing}, which hf_altparams reads; use a torch from the tested "
        f"range {TESTED_TORCH[0]}..{TESTED_TORCH[1]}"
    )

#: Norm layers with running statistics (``BatchNorm*``, ``InstanceNorm*``; ``SyncBatchNorm`` too).
NORM_BASE: type[nn.modules.batchnorm._NormBase] = nn.modules.batchnorm._NormBase
#: Every dropout layer (``Dropout``, ``Dropout1d/2d/3d``, ``AlphaDropout``, ...).
DROPOUT_BASE: type[nn.modules.dropout._DropoutNd] = nn.modules.dropout._DropoutNd


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor``'s in-place version counter (bumped by every in-place write)."""
    return int(tensor._version)
