"""The FSDP2 (``fully_shard``) backend: phases on a sharded model, and sharding by groups.

FSDP2 reduce-scatters only the parameters that have a gradient and reads
``requires_grad`` at every all-gather, so a switch rebuilds nothing; the backend
(:class:`FSDP2Backend`) re-initialises mixed-precision dtypes and moves shards
with FSDP2's own storage. :func:`shard_by_groups` shards a model one unit per
parameter group. Every private FSDP2 / DTensor name this package relies on is
fenced in :mod:`._backend`.
"""

from ._backend import FSDP2Backend, check_fsdp2_supported
from ._dtensor import dtensor_with_local, fsdp2_units, is_dtensor, is_fsdp2, local_tensor, set_data, unit_params
from ._units import mixed_units, shard_by_groups

__all__ = [
    "FSDP2Backend",
    "check_fsdp2_supported",
    "dtensor_with_local",
    "fsdp2_units",
    "is_dtensor",
    "is_fsdp2",
    "local_tensor",
    "mixed_units",
    "set_data",
    "shard_by_groups",
    "unit_params",
]
