"""Memory of a phased run: where idle groups live, how tensors move, when memory is released.

* :class:`ResidencyManager` (:mod:`.residency`): the groups a phase does not
  keep resident live off the device, out of DDP, guarded against a forward;
* :class:`TensorMover` (:mod:`.transfer`): the one mover of tensors between the
  device and the host (pinned, asynchronous, prefetched), used by residency and
  by the optimizers for idle state and fp32 masters;
* :mod:`.release`: when a switch releases memory (:class:`ReleasePolicy`), the
  release itself (:func:`release_memory`) and glibc's host heap;
* :mod:`.prefetch`: how much a coming phase may prefetch;
* :mod:`.model`: the memory model (bytes per group and category under each
  :class:`StatePolicy`, pure arithmetic shared with the planner and with
  :func:`hf_altparams.engine.memory_report`).

This package imports nothing from :mod:`hf_altparams.engine.optim` (the
optimizers build on it, not the other way round).
"""

from .model import StatePolicy, StatePolicyLike, run_idle_policies
from .prefetch import PhasePrefetch, PrefetchSetting, check_prefetch
from .release import (
    MAX_MMAP_THRESHOLD,
    HostHeap,
    ReleasePolicy,
    ReleaseSetting,
    check_release,
    host_heap,
    malloc_trim,
    mmap_large_host_allocations,
    release_memory,
    rss_bytes,
)
from .residency import DeviceLike, ResidencyManager, as_device, non_resident_groups
from .transfer import TensorMover, nbytes, optimizer_of, param_group_map, state_target_device, to_device, to_host

__all__ = [
    "MAX_MMAP_THRESHOLD",
    "DeviceLike",
    "HostHeap",
    "PhasePrefetch",
    "PrefetchSetting",
    "ReleasePolicy",
    "ReleaseSetting",
    "ResidencyManager",
    "StatePolicy",
    "StatePolicyLike",
    "TensorMover",
    "as_device",
    "check_prefetch",
    "check_release",
    "host_heap",
    "malloc_trim",
    "mmap_large_host_allocations",
    "nbytes",
    "non_resident_groups",
    "optimizer_of",
    "param_group_map",
    "release_memory",
    "rss_bytes",
    "run_idle_policies",
    "state_target_device",
    "to_device",
    "to_host",
]
