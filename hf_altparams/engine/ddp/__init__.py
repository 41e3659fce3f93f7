"""The DDP backend: the same ``DistributedDataParallel`` wrapper re-bucketed in place at every switch.

DDP decides in its constructor which parameters it all-reduces; a switch
rebuilds the wrapper's reducer in place for the new trainable set
(:func:`rebuild_reducer`, the one place touching DDP's private attributes,
version-fenced), optionally keeping idle phases' reducers for switches back.
:class:`DDPBackend` is what the switch transaction asks of it;
:func:`free_reducer` ends a wrapper's training life before its process group goes.
"""

from ._backend import DDPBackend, backend_of, free_reducer
from ._surgery import is_ddp, rebuild_reducer, unwrap

__all__ = ["DDPBackend", "backend_of", "free_reducer", "is_ddp", "rebuild_reducer", "unwrap"]
