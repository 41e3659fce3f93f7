"""The engine: phase switches under torch.distributed (DDP re-bucketing, optimizers, memory)."""

from .comm import CommCounter, counting_allreduce_hook, register_comm_counter
from .memory import release_memory, rss_bytes
from .optim import GroupedLRScheduler, GroupedOptimizer
from .switch import PhaseSwitcher, SwitchRecord

__all__ = [
    "CommCounter",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "PhaseSwitcher",
    "SwitchRecord",
    "counting_allreduce_hook",
    "register_comm_counter",
    "release_memory",
    "rss_bytes",
]
