"""Memory as ``check`` reads it: the device's allocator on a GPU, the process's resident set on a CPU.

Three readings, each taken after a full garbage collection and, on a CPU, after
the C heap returned its free pages to the OS (``malloc_trim``), so that what is
read is what is held, not what was freed and kept for reuse:

* :meth:`MemoryGauge.level`: what the process holds now (CUDA
  ``memory_allocated``; CPU resident set minus the baseline, see below);
* :meth:`MemoryGauge.peak_since_reset`: the highest level since
  :meth:`MemoryGauge.reset_peak` (CUDA ``max_memory_allocated``; CPU the kernel's
  high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` where Linux
  allows it). Activations included.
* the level at the end of an optimizer step (taken from a step post-hook, when
  weights, gradients and optimizer state are all present and the activations
  are gone): the figure the memory model predicts (``expected_peak``).

On a CPU the resident set also counts what is not a tensor: the code and data
of every module imported, kernels and libraries touched for the first time,
communication buffers. ``prepare`` and a first step import and touch a lot
(Accelerate imports DeepSpeed where it is installed; FSDP2 and a plain
``nn.Module`` bring in ``torch._dynamo`` and sympy: 80-90 MiB), so the
baseline is taken twice:

* :meth:`MemoryGauge.start`, once the model is built: the process less the
  model's tensors (provisional, for the readings of ``prepare``);
* :meth:`MemoryGauge.rebase`, at the end of the first optimizer step: the
  process less every tensor alive then (:func:`live_tensor_bytes`, a census of
  the tensors Python can reach, deduplicated by storage) and less the tensors
  it cannot reach that the caller counts (DDP's buckets). What is left is the
  memory that is not tensors once the imports and first touches of a step are
  done; from then on a reading is every tensor the process holds (the model's,
  the optimizer's, and any that user code keeps) plus what non-tensor memory
  grew since.

What is still touched for the first time after that (a new phase's first
kernels, gloo's buffers for a larger message) is warm-up; the judge
(:mod:`.verdict`) compares readings after it.

A full collection looks at every object the process tracks: 0.1-0.3 s in a
process that imported torch and transformers, two or three times a step. So
:meth:`MemoryGauge.rebase` also freezes the objects alive then (``gc.freeze``:
the modules imported, the model, the optimizer, the accelerator), and each
later collection looks only at what was made since (microseconds). A frozen
object is still freed when its last reference goes; only a reference cycle
among objects alive at the end of the first step would wait for
:meth:`MemoryGauge.thaw`, which the rank calls before the census at the end.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Iterable, Optional

import torch

from ..engine import release_memory, rss_bytes
from ..engine.fsdp2 import local_tensor

__all__ = ["MemoryGauge", "live_tensor_bytes", "storage_keys"]

_HWM = "VmHWM:"


def _high_water_mark() -> Optional[int]:
    """The process's peak resident set (``VmHWM``) in bytes; ``None`` where ``/proc`` has none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(_HWM):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_high_water_mark() -> bool:
    """Reset ``VmHWM`` to the current resident set (Linux ``clear_refs`` value 5); whether it worked."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _storage_key(tensor: torch.Tensor, device_type: str) -> Optional[tuple[int, int]]:
    """``(address, bytes)`` of ``tensor``'s storage on ``device_type`` (a DTensor's local shard); ``None`` if none."""
    try:
        local = local_tensor(tensor)
        if local.device.type != device_type or local.is_sparse:
            return None
        storage = local.untyped_storage()
        size = storage.nbytes()
        return (storage.data_ptr(), size) if size else None
    except (RuntimeError, NotImplementedError, TypeError):  # a tensor without storage (meta, functional)
        return None


def storage_keys(tensors: Iterable[torch.Tensor], device_type: str = "cpu") -> dict[int, int]:
    """``{storage address: bytes}`` of ``tensors`` on ``device_type`` (each storage once, views folded in)."""
    out: dict[int, int] = {}
    for tensor in tensors:
        key = _storage_key(tensor, device_type)
        if key is not None:
            out[key[0]] = max(out.get(key[0], 0), key[1])
    return out


def live_tensor_bytes(device_type: str = "cpu") -> dict[int, int]:
    """Every tensor storage on ``device_type`` that Python can reach now: ``{address: bytes}``.

    A census through the garbage collector's list of objects (tensors are
    tracked objects), after a full collection; views and a DTensor's local shard
    count their storage once. Not seen: tensors only C++ holds (DDP's buckets,
    autograd's saved tensors of a graph still alive).

    Example:
        >>> held = torch.ones(1 << 20)  # 4 MiB
        >>> sum(live_tensor_bytes().values()) >= 4 << 20
        True
    """
    if gc.get_freeze_count():
        raise RuntimeError("live_tensor_bytes cannot see frozen objects: MemoryGauge.thaw() first")
    gc.collect()
    # type(), not isinstance(): isinstance reads ``__class__``, which some objects compute (a deprecated
    # torch.distributed name warns when read that way)
    return storage_keys((o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)), device_type)


class MemoryGauge:
    """Readings of the memory one rank holds, on its training device.

    Args:
        device: the rank's device (``cuda:N``: the allocator; anything else: the resident set).

    Example:
        >>> gauge = MemoryGauge(torch.device("cpu"))
        >>> gauge.start()  # no model: what the process holds now
        >>> held = torch.ones(16 << 20)  # 64 MiB, written: resident
        >>> gauge.level() >= 48 << 20
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._baseline = 0
        self.rebased = False
        self.frozen = False
        self.peak_resettable = True if self.cuda else _high_water_mark() is not None and _reset_high_water_mark()

    @property
    def source(self) -> str:
        """What is read: ``"torch.cuda.memory_allocated"`` or ``"RSS"``."""
        return "torch.cuda.memory_allocated" if self.cuda else "RSS"

    @property
    def baseline(self) -> int:
        """The reading :meth:`start` took (0 on a GPU)."""
        return self._baseline

    def _settle(self) -> None:
        if self.cuda:
            gc.collect()
            torch.cuda.synchronize(self.device)
        else:
            release_memory(barrier=False, full_gc=True, trim=True)

    def _raw(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.cuda else rss_bytes()

    def start(self, model: Optional[torch.nn.Module] = None) -> None:
        """Take the baseline: what the process holds now, less ``model``'s weights and buffers on this device.

        On a CPU, call it once the model is built: the pages of the libraries that
        building it imported are then part of the baseline, and its tensors are not.
        On a GPU the baseline is 0 (the allocator counts tensors only).
        """
        if self.cuda:
            self._baseline = 0
            return
        self._settle()
        tensors = [] if model is None else [*model.parameters(), *model.buffers()]
        self._baseline = self._raw() - sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")

    def rebase(self, unreachable: int = 0) -> None:
        """On a CPU, after the first optimizer step: the baseline becomes the process less every live tensor.

        ``unreachable``: bytes of tensors the census cannot reach (DDP's buckets)
        that are held now. On a GPU the baseline stays 0. Then, on either, the
        objects alive are frozen until :meth:`thaw` (see the module docstring). Objects frozen before (a
        process forked from a server that froze its imports) are unfrozen first, for the census to see them.
        """
        self.rebased = True
        if gc.get_freeze_count() and not self.frozen:
            gc.unfreeze()  # frozen before this process ran the check (a fork server's imports): refrozen below
        if not self.cuda:
            self._settle()
            self._baseline = self._raw() - sum(live_tensor_bytes("cpu").values()) - unreachable
        if not self.frozen:
            gc.freeze()
            self.frozen = True

    def thaw(self) -> None:
        """Give the objects :meth:`rebase` froze back to the garbage collector (a no-op when none are)."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    def level(self) -> int:
        """Bytes held now above the baseline, after a full collection (and a trim of the C heap on a CPU)."""
        self._settle()
        return self._raw() - self._baseline

    def reset_peak(self) -> None:
        """Start a new peak window."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.peak_resettable:
            _reset_high_water_mark()

    def peak_since_reset(self) -> Optional[int]:
        """The highest level since :meth:`reset_peak` (activations included); ``None`` where unreadable."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self._baseline
        if not self.peak_resettable:
            return None
        mark = _high_water_mark()
        return None if mark is None else mark - self._baseline
