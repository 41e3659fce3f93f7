"""Releasing memory after a switch, and reading it back."""

from __future__ import annotations

import ctypes
import gc
import sys
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["release_memory", "rss_bytes", "malloc_trim"]


def malloc_trim() -> None:
    """Return freed heap pages to the OS (glibc only; a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:  # not glibc
            pass


def release_memory(
    barrier: bool = True,
    group: Optional[dist.ProcessGroup] = None,
    full_gc: bool = False,
    trim: bool = True,
) -> None:
    """Free what a switch left behind: a gc pass, a barrier, ``empty_cache``, ``malloc_trim``.

    Args:
        barrier: wait for every rank. The phase switch passes ``False``: its
            closing all-reduce (did any rank fail?) already synchronises the ranks.
        group: the process group for the barrier.
        full_gc: run a full ``gc.collect()`` instead of the young generations.
            A switch frees buckets, gradients and optimizer state by reference
            count, so the young generations (microseconds) catch what it leaves;
            a full collection costs 80-300 ms in a process that imported
            torch and transformers, too much for a per-step alternation.
        trim: return freed host heap pages to the OS (``malloc_trim``). It keeps
            host RSS at what the live tensors need, which matters when host memory
            is the limit (CPU training, offloaded state), but costs 10-50 ms for
            tens of MiB freed, and the next step faults the pages back in.
    """
    gc.collect() if full_gc else gc.collect(1)
    if barrier and dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if trim:
        malloc_trim()


def rss_bytes() -> int:
    """Resident set size of this process in bytes (Linux ``/proc``; 0 if unknown)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except OSError:
        return 0
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")
