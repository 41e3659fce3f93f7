"""Releasing memory: when a switch gives freed memory back (:class:`ReleasePolicy`), how (:func:`release_memory`),
and the host heap it comes from (glibc).

**When.** Releasing (a gc pass, ``torch.cuda.empty_cache``, ``malloc_trim``)
gives memory the old phase freed back to the device or the OS. It pays only
when the memory is not needed again soon: on CPU ``malloc_trim`` costs 10-50 ms
for tens of MiB and the next step page-faults the same pages back; on CUDA the
next step re-allocates through ``cudaMalloc`` what ``empty_cache`` returned.
``release="auto"`` (the default) decides per switch from the schedule and the
phases' expected footprints (:func:`~hf_altparams.engine.expected_peak_bytes`,
activations excluded):

* release when the coming phase's expected footprint is smaller than the one
  held so far (by at least ``1/32`` of it and 1 MiB) **and** the coming phase
  lasts at least ``min_steps`` steps (or any whole epoch), so the release is
  amortised;
* skip it otherwise: a phase as large as the last one (equal-sized groups
  alternating) reuses the freed memory at once, and a short smaller phase gives
  it back one or few steps later.

``True`` releases at every switch, ``False`` never. The decision and its reason
go into the switch's :class:`~hf_altparams.engine.SwitchRecord`
(``released``, ``release_reason``).

**The host heap.** On CPU, training memory comes from the C library's
``malloc``. glibc serves a block from ``mmap`` (returned to the OS when freed)
once it is at least its *mmap threshold*, and from its heap (kept for reuse,
returned only by ``malloc_trim`` or from the top) below it. The threshold
starts at 128 KiB and rises, after each mmapped block is freed, to that
block's size, up to 32 MiB on 64-bit. Per-step alternation of two equal groups
frees and re-creates tensors of the same size every step, so after the first
switch they all come from the heap, which fragments: the process holds free
heap that no live tensor uses. :func:`host_heap` shows it;
:func:`mmap_large_host_allocations` is the opt-in that stops it.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import numbers
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from ...errors import AltParamsError, SwitchError
from ...plan.phase import Phase
from ...plan.schedules import Schedule

__all__ = [
    "MAX_MMAP_THRESHOLD",
    "HostHeap",
    "ReleasePolicy",
    "ReleaseSetting",
    "check_release",
    "host_heap",
    "malloc_trim",
    "mmap_large_host_allocations",
    "release_memory",
    "rss_bytes",
]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
#: The largest threshold :func:`mmap_large_host_allocations` accepts: the cap of
#: glibc's dynamic threshold (``DEFAULT_MMAP_THRESHOLD_MAX``: 32 MiB on 64-bit
#: platforms, 512 KiB on 32-bit ones), which glibc before 2.35 also enforced in
#: ``mallopt``. A larger fixed threshold would serve more from the heap than
#: glibc's default does.
MAX_MMAP_THRESHOLD: int = 4 * 2**20 * ctypes.sizeof(ctypes.c_long) if sys.maxsize > 2**32 else 512 * 2**10


@functools.cache
def _glibc() -> Optional[ctypes.CDLL]:
    """The process's glibc, or None (not Linux, or another C library such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "gnu_get_libc_version") else None


def malloc_trim() -> None:
    """Return freed heap pages to the OS (glibc only; a no-op elsewhere)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def mmap_large_host_allocations(threshold: int = 2**20) -> bool:
    """Serve every host allocation of ``threshold`` bytes or more from ``mmap`` (glibc), for good.

    Calls glibc's ``mallopt(M_MMAP_THRESHOLD, threshold)``, the run-time form of
    ``MALLOC_MMAP_THRESHOLD_=<threshold>`` in the environment. Large CPU tensors
    (parameters, gradients, DDP buckets, optimizer state, activations) are then
    mapped when created and unmapped when freed, so the process's RSS follows
    the live tensors: with two groups alternating every step under DDP on CPU,
    ``drop`` peaks at one group alone and ``keep`` at one group plus the idle
    group's optimizer state, instead of 1.1-1.4x above that (glibc's default
    heap keeps the freed blocks, fragmented; see ``docs/switch.md``).

    Side effects and costs:

    * **Process-wide, until the process ends**: every thread and every library
      of this process (not only torch) allocates this way from now on. It
      also turns off glibc's dynamic threshold (which would otherwise rise to
      32 MiB), and nothing turns that back on: a second call only sets
      another fixed value.
    * Only allocations made *after* the call: free heap glibc already holds
      is reused first. Call it first thing, before the model is built (each
      rank calls it for itself).
    * Each large tensor created pays page faults for fresh zeroed pages, and
      each free an ``munmap``: cheap when tensors live long, a cost per step
      when a switch re-creates them every step (``drop`` re-creating Adam
      state measured 1.4x the step time of one group alone on a loaded 2-core
      CPU, ``keep`` 1.0x). Use it where host memory is the limit.
    * GPU memory is not affected (torch's caching allocator); host tensors
      (offloaded optimizer state, CPU copies) are, on any machine.

    Args:
        threshold: size in bytes from which allocations are mmapped; ``1 <=
            threshold <=`` :data:`MAX_MMAP_THRESHOLD` (32 MiB on 64-bit).

    Returns:
        True when glibc took the setting; False (and nothing changed) on a
        platform without glibc (macOS, Windows, musl).

    Raises:
        AltParamsError: ``threshold`` is not an int, or out of range; raised
            before anything is changed.

    Example:
        >>> from hf_altparams.engine import mmap_large_host_allocations
        >>> mmap_large_host_allocations(1 << 20)  # first thing in each rank  # doctest: +SKIP
        True
    """
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Integral):
        raise AltParamsError(
            f"`threshold` is {threshold!r} ({type(threshold).__name__}); "
            f"accepted: an int number of bytes, 1 to {MAX_MMAP_THRESHOLD} (e.g. 1 << 20)"
        )
    threshold = int(threshold)
    if not 1 <= threshold <= MAX_MMAP_THRESHOLD:
        raise AltParamsError(
            f"`threshold` is {threshold} bytes; accepted: 1 to {MAX_MMAP_THRESHOLD} "
            f"(the cap of glibc's dynamic mmap threshold on "
            f"this platform), e.g. 1 << 20"
        )
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(threshold)))


@dataclass(frozen=True)
class HostHeap:
    """glibc's host heap, summed over its arenas (``mallinfo2``), in bytes.

    Attributes:
        arena_bytes: heap obtained from the OS (``brk`` and arena heaps), free or not.
        in_use_bytes: heap handed out to live allocations.
        free_bytes: heap glibc holds free (``arena_bytes - in_use_bytes``): the
            "free heap held". Pages of it that ``malloc_trim`` gave back
            (``madvise``) still count here but no longer in the RSS.
        mmapped_bytes: live allocations served by ``mmap`` (at or above the threshold).
    """

    arena_bytes: int
    in_use_bytes: int
    free_bytes: int
    mmapped_bytes: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def host_heap() -> Optional[HostHeap]:
    """Read glibc's heap statistics (read-only); None without glibc 2.33+ (``mallinfo2``).

    Example:
        >>> from hf_altparams.engine import host_heap
        >>> heap = host_heap()  # e.g. HostHeap(arena_bytes=..., in_use_bytes=..., free_bytes=..., ...)
        >>> heap is None or heap.in_use_bytes <= heap.arena_bytes
        True
    """
    libc = _glibc()
    mallinfo2: Any = getattr(libc, "mallinfo2", None) if libc is not None else None
    if mallinfo2 is None:
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return HostHeap(
        arena_bytes=info.arena, in_use_bytes=info.uordblks, free_bytes=info.fordblks, mmapped_bytes=info.hblkhd
    )


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
    return pages * os.sysconf("SC_PAGE_SIZE")


ReleaseSetting = Union[bool, str]
_MIB = 2**20


def check_release(setting: object) -> None:
    """Validate the ``release`` setting: ``"auto"``, ``True`` or ``False``."""
    if not (setting is True or setting is False or setting == "auto"):
        raise SwitchError(f"`release` is {setting!r}; accepted: 'auto', True or False")


class ReleasePolicy:
    """Decides, at each switch, whether to release the memory the old phase freed.

    Args:
        setting: ``"auto"``, ``True`` (always) or ``False`` (never).
        min_steps: with ``"auto"``, the shortest phase (in steps) worth a release.

    Example:
        >>> from hf_altparams.plan import Alternating, Phase
        >>> policy, schedule = ReleasePolicy(), Alternating(["a", "b"])
        >>> policy.decide(None, Phase({"a"}), 0, schedule, held=None, coming=864)
        (False, 'skipped: first phase, nothing freed')
        >>> policy.decide(Phase({"a"}), Phase({"b"}), 1, schedule, held=864, coming=864)
        (False, 'skipped: the coming phase needs as much memory as the last (864 B vs 864 B)')
    """

    def __init__(self, setting: ReleaseSetting = "auto", min_steps: int = 8) -> None:
        check_release(setting)
        self.setting = setting
        self.min_steps = min_steps
        self._held = 0  # the largest expected footprint since the last release

    def decide(
        self,
        previous: Optional[Phase],
        phase: Phase,
        step: Optional[int],
        schedule: Schedule,
        *,
        held: Optional[int],
        coming: int,
    ) -> tuple[bool, str]:
        """``(release now?, why)`` for a switch from ``previous`` to ``phase`` at ``step``.

        ``held`` and ``coming``: the expected footprints (device bytes,
        activations excluded) of ``previous`` and of ``phase``.
        """
        if self.setting is True:
            return True, "release=True"
        if self.setting is False:
            return False, "release=False"
        if previous is None or held is None:
            self._held = coming
            return False, "skipped: first phase, nothing freed"
        self._held = max(self._held, held)
        held = self._held
        if held - coming < max(_MIB, held // 32):
            return False, (
                f"skipped: the coming phase needs as much memory as the last ({_size(coming)} vs {_size(held)})"
            )
        lasts = self._lasts(schedule, step)
        if lasts is not None and lasts < self.min_steps:
            return False, (
                f"skipped: the coming phase is smaller ({_size(coming)} vs {_size(held)}) "
                f"but lasts {lasts} step(s) < {self.min_steps}"
            )
        self._held = coming
        return True, f"released: the coming phase needs {_size(coming)} of the {_size(held)} held"

    def _lasts(self, schedule: Schedule, step: Optional[int]) -> Optional[int]:
        """Steps the coming phase lasts (``None``: unknown or longer than the horizon, or epochs)."""
        if schedule.unit != "step" or step is None:
            return None
        change = schedule.next_change(step, horizon=self.min_steps)
        return None if change is None else change - step


def _size(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    return f"{n} B"
