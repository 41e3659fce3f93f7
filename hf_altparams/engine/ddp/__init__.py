"""The DDP backend: the same ``DistributedDataParallel`` wrapper re-bucketed in place at every switch.

DDP decides in its constructor which parameters it all-reduces; a switch
rebuilds the wrapper's reducer in place for the new trainable set
(:func:`rebuild_reducer`), optionally keeping idle phases' reducers for
switches back. :class:`DDPBackend` is what the switch transaction asks of it;
:func:`free_reducer` ends a wrapper's training life before its process group goes.

This package is the fence around DDP's private attributes: its modules are the
only ones in hf_altparams that touch them (listed in
``_surgery.PRIVATE_DDP_ATTRIBUTES``, checked with the torch version before a
switch changes anything), and the rest of the library uses the names below.
"""

from ._backend import DDPBackend, backend_of, free_reducer
from ._reducer_cache import check_keep_reducers
from ._surgery import (
    comm_hook_states,
    ddp_settings,
    ignored_before_wrap,
    is_ddp,
    mark_ignored_before_wrap,
    rebuild_reducer,
    reduced_parameters,
    reducer_parameter_names,
    unwrap,
)

__all__ = [
    "DDPBackend",
    "backend_of",
    "check_keep_reducers",
    "comm_hook_states",
    "ddp_settings",
    "free_reducer",
    "ignored_before_wrap",
    "is_ddp",
    "mark_ignored_before_wrap",
    "rebuild_reducer",
    "reduced_parameters",
    "reducer_parameter_names",
    "unwrap",
]
