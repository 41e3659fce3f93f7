"""Peak memory over a baseline, shared by the check scripts and the benchmarks."""

from __future__ import annotations

import gc

import torch

from ..engine.memory import malloc_trim, rss_bytes

__all__ = ["PeakMemory"]


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakMemory:
    """Peak memory since :meth:`mark_baseline`: CUDA allocator stats, or the RSS high-water mark on CPU.

    Example:
        >>> meter = PeakMemory(torch.device("cpu"))
        >>> meter.mark_baseline()
        >>> meter.peak() >= meter.baseline > 0
        True
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.baseline = 0
        self.hwm_reset = False

    def mark_baseline(self) -> None:
        """Collect, trim, and take the current memory as the baseline (resetting the peak)."""
        gc.collect()
        malloc_trim()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.baseline = torch.cuda.memory_allocated()
            return
        try:  # "5" resets the peak RSS (VmHWM) to the current RSS (Linux >= 4.0)
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm_reset = True
        except OSError:
            self.hwm_reset = False
        self.baseline = rss_bytes()

    def peak(self) -> int:
        """Absolute peak in bytes since the baseline was marked."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status_kib("VmHWM") * 1024 if self.hwm_reset else rss_bytes()

    def peak_growth(self) -> int:
        """Peak minus the baseline, in bytes."""
        return self.peak() - self.baseline
