"""The engine: phase switches under torch.distributed (DDP re-bucketing, optimizers, memory).

The names below are the engine's public surface; ``docs/design.md`` maps its
modules and the path of an optimizer step to a switch.
"""

from .backend import Backend, LocalBackend, ModelsBackend
from .buffers import BufferPlan, BufferSync, plan_buffer_sync
from .comm import CommCounter, counting_allreduce_hook, register_comm_counter, register_reduce_scatter_counter
from .config import SwitchConfig
from .drift import DriftCheck, check_drift
from .driver import DriverState, PhaseDriver
from .fsdp2 import shard_by_groups
from .memory import (
    HostHeap,
    ResidencyManager,
    TensorMover,
    host_heap,
    mmap_large_host_allocations,
    non_resident_groups,
    release_memory,
    rss_bytes,
)
from .optim import DynamicLossScale, GroupedLRScheduler, GroupedOptimizer, PrecisionOptimizer, reapply_state_policy
from .records import SwitchHistory, SwitchRecord
from .report import MemoryReport, expected_peak_bytes, memory_report
from .shutdown import shutdown
from .switch import PhaseSwitcher

__all__ = [
    "Backend",
    "BufferPlan",
    "BufferSync",
    "CommCounter",
    "DriftCheck",
    "DriverState",
    "DynamicLossScale",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "HostHeap",
    "LocalBackend",
    "MemoryReport",
    "ModelsBackend",
    "PhaseDriver",
    "PhaseSwitcher",
    "PrecisionOptimizer",
    "ResidencyManager",
    "SwitchConfig",
    "SwitchHistory",
    "SwitchRecord",
    "TensorMover",
    "check_drift",
    "counting_allreduce_hook",
    "expected_peak_bytes",
    "host_heap",
    "memory_report",
    "mmap_large_host_allocations",
    "non_resident_groups",
    "plan_buffer_sync",
    "reapply_state_policy",
    "register_comm_counter",
    "register_reduce_scatter_counter",
    "release_memory",
    "rss_bytes",
    "shard_by_groups",
    "shutdown",
]
