"""The machine a benchmark ran on, in one line (both benchmark scripts name it in their results)."""

from __future__ import annotations

import os
import platform

import torch


def machine(device: str, nproc: int) -> str:
    """E.g. ``2 gloo ranks on 2 CPU cores (AMD EPYC ...), torch 2.13.0+cpu``."""
    if device == "cuda":
        return f"{nproc} x {torch.cuda.get_device_name(0)}, NCCL, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{nproc} gloo ranks on {os.cpu_count()} CPU cores ({cpu}), torch {torch.__version__}"
