"""Memory as ``check`` reads it: the device's allocator on a GPU, the process's resident set on a CPU.

Three readings, each taken after a full garbage collection and, on a CPU, after
the C heap returned its free pages to the OS (``malloc_trim``), so that what is
read is what is held, not what was freed and kept for reuse:

* :meth:`MemoryGauge.level`: what the process holds now (CUDA
  ``memory_allocated``; CPU resident set minus the :meth:`MemoryGauge.start`
  baseline: the process once the model is built, less the model's tensors);
* :meth:`MemoryGauge.peak_since_reset`: the highest level since
  :meth:`MemoryGauge.reset_peak` (CUDA ``max_memory_allocated``; CPU the kernel's
  high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` where Linux
  allows it). Activations included.
* the level at the end of an optimizer step (taken from a step post-hook, when
  weights, gradients and optimizer state are all present and the activations
  are gone): the figure the memory model predicts (``expected_peak``).

On a CPU the resident set also counts code and library pages touched for the
first time (a new kernel, gloo's buffers), so the readings of the first steps
are warm-up; the judge (:mod:`.verdict`) compares readings after it.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Optional

import torch

from ..engine import release_memory, rss_bytes

__all__ = ["MemoryGauge"]

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
