"""Which backend drives a model: DDP, FSDP2, or none (:func:`backend_for`).

The one module that knows every backend; :mod:`.backend` holds only the
interface they implement, so neither backend imports the other.

Example:
    >>> import torch
    >>> backend_for(torch.nn.Linear(2, 2)).kind
    'local'
"""

from __future__ import annotations

from torch import nn

from .backend import Backend, LocalBackend
from .ddp._backend import DDPBackend
from .ddp._surgery import is_ddp
from .fsdp2._backend import FSDP2Backend
from .fsdp2._dtensor import is_fsdp2
from .shutdown import install_exit_hook

__all__ = ["backend_for"]


def backend_for(model: nn.Module) -> Backend:
    """The backend for ``model``: a ``fully_shard`` model gets FSDP2's, a DDP wrapper DDP's, anything else none."""
    if is_fsdp2(model):
        return FSDP2Backend(model)
    if is_ddp(model):
        install_exit_hook()  # a wrapper's last all-reduce must not race interpreter exit
        return DDPBackend(model)  # type: ignore[arg-type]
    return LocalBackend(model)
