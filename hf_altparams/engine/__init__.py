"""The engine: phase switches under torch.distributed (DDP re-bucketing, optimizers, memory)."""

from .fsdp2 import shard_by_groups
from .backend import Backend, LocalBackend
from .buffers import BufferPlan, BufferSync, plan_buffer_sync
from .comm import CommCounter, counting_allreduce_hook, register_comm_counter
from .config import SwitchConfig
from .drift import DriftCheck, check_drift
from .memory import HostHeap, host_heap, mmap_large_host_allocations, release_memory, rss_bytes
from .optim import DynamicLossScale, GroupedLRScheduler, GroupedOptimizer, PrecisionOptimizer, reapply_state_policy
from .driver import PhaseDriver
from .records import SwitchHistory, SwitchRecord

from .memory import MemoryReport, ResidencyManager, expected_peak_bytes, memory_report, non_resident_groups
from .shutdown import shutdown
from .switch import PhaseSwitcher

__all__ = [
    "Backend",
    "BufferPlan",
    "BufferSync",
    "CommCounter",
    "DriftCheck",
    "DynamicLossScale",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "HostHeap",
    "LocalBackend",
    "MemoryReport",
    "PhaseDriver",
    "PhaseSwitcher",
    "PrecisionOptimizer",
    "ResidencyManager",
    "SwitchConfig",
    "SwitchHistory",
    "SwitchRecord",
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
    "release_memory",
    "rss_bytes",
    "shard_by_groups",
    "shutdown",
]
