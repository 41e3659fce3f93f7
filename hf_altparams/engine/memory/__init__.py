"""Memory of a phased run: where idle groups live, when memory is released, and what is held.

* residency (:class:`ResidencyManager`): the groups a phase does not keep
  resident live off the device, out of DDP, guarded against a forward;
* placement and transfer: how parameters and optimizer state move between the
  device and the host (pinned, asynchronous, prefetched);
* release (:func:`release_memory`, the ``release`` policy of a switch) and the
  host heap (glibc's ``malloc_trim`` and mmap threshold);
* the memory model (:mod:`.model`: bytes per group and category under each
  :class:`StatePolicy`, shared with the planner), the census
  (:func:`memory_report`) and the expected peak of a phase.
"""

from ._host import (
    MAX_MMAP_THRESHOLD,
    HostHeap,
    host_heap,
    malloc_trim,
    mmap_large_host_allocations,
    release_memory,
    rss_bytes,
)
from .model import StatePolicy
from ._report import CATEGORIES, MemoryReport, expected_footprint, expected_peak_bytes, memory_report
from ._residency import DeviceLike, ResidencyManager, non_resident_groups

__all__ = [
    "CATEGORIES",
    "DeviceLike",
    "HostHeap",
    "MAX_MMAP_THRESHOLD",
    "MemoryReport",
    "ResidencyManager",
    "StatePolicy",
    "expected_footprint",
    "expected_peak_bytes",
    "host_heap",
    "malloc_trim",
    "memory_report",
    "mmap_large_host_allocations",
    "non_resident_groups",
    "release_memory",
    "rss_bytes",
]
