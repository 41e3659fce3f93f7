"""Peak memory over a baseline, shared by the check scripts and the benchmarks."""

from __future__ import annotations

import gc
from typing import Optional

import torch

from hf_altparams.engine.memory import malloc_trim, rss_bytes

__all__ = ["ModelStateMeter", "PeakMemory", "total_state"]


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
        >>> now = meter.reset_peak()  # the peak restarts from the memory held now
        >>> meter.peak() >= now > 0
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

    def reset_peak(self) -> int:
        """Restart the peak from the memory held now, which is returned.

        CPU: the RSS high-water mark (VmHWM) restarts from the current RSS; CUDA:
        ``torch.cuda.reset_peak_memory_stats``. :meth:`peak` then reports the
        peak since this call (the baseline stays).
        """
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif self.hwm_reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        return self.current()

    def current(self) -> int:
        """Memory held now: the RSS on CPU, ``torch.cuda.memory_allocated()`` on CUDA."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated()
        return rss_bytes()

    def peak(self) -> int:
        """Absolute peak in bytes since the baseline was marked (or :meth:`reset_peak`)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        return _status_kib("VmHWM") * 1024 if self.hwm_reset else rss_bytes()

    def peak_growth(self) -> int:
        """Peak minus the baseline, in bytes."""
        return self.peak() - self.baseline


_STATE_KINDS = ("params", "buffers", "buckets", "grads", "optimizer", "masters", "step_counters")


class ModelStateMeter:
    """The model state held right now, by kind, each tensor storage counted once.

    Kinds: ``params`` and ``buffers`` of the model; ``buckets``: DDP bucket
    buffers noted by a comm hook (:meth:`note_bucket`); ``grads``: the
    parameters' and the masters' gradients not already in a bucket;
    ``optimizer``: optimizer state (every inner optimizer of a
    :class:`~hf_altparams.engine.GroupedOptimizer`, on the device or the host);
    ``masters``: a :class:`~hf_altparams.engine.PrecisionOptimizer`'s fp32
    masters (device and host); ``step_counters``: 0-d ``step`` tensors (Adam's),
    which the planner leaves out. :meth:`sample` (e.g. from an optimizer step
    post-hook) keeps the largest total seen.

    ``device_type`` counts only the tensors on that kind of device (``None``:
    all). On a GPU the model state compared with the device's allocation (and
    with the planner's device bytes) is ``device_type="cuda"``: idle fp32
    masters offloaded to the host (``master_policy="offload"``) are not on the
    device, and a second meter with ``device_type="cpu"`` says what the run
    keeps there. On CPU both are the same RAM and ``None`` counts them together.

    Example:
        >>> net = torch.nn.Linear(4, 2)
        >>> opt = torch.optim.AdamW(net.parameters())
        >>> net(torch.ones(1, 4)).sum().backward(); opt.step()
        >>> meter = ModelStateMeter(net, opt)
        >>> kinds = meter.measure(); kinds["params"], kinds["grads"], kinds["optimizer"], kinds["step_counters"]
        (40, 40, 80, 8)
        >>> total_state(ModelStateMeter(net, opt, device_type="cuda").measure())  # nothing of it on a GPU
        0
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        device_type: Optional[str] = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.device_type = device_type
        self.buckets: dict[int, torch.Tensor] = {}
        self.peak: dict[str, int] = dict.fromkeys(_STATE_KINDS, 0)

    def note_bucket(self, buffer: torch.Tensor) -> None:
        """Note a DDP bucket buffer (call from a comm hook; :meth:`forget_buckets` after a rebuild)."""
        self.buckets[buffer.untyped_storage().data_ptr()] = buffer

    def forget_buckets(self) -> None:
        self.buckets.clear()

    def measure(self) -> dict[str, int]:
        """Bytes by kind (see the class docstring) held now."""
        out = dict.fromkeys(_STATE_KINDS, 0)
        seen: set[tuple[int, str]] = set()

        def add(kind: str, tensor: Optional[torch.Tensor]) -> None:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                return
            if self.device_type is not None and tensor.device.type != self.device_type:
                return
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), str(tensor.device))
            if key not in seen and storage.nbytes():
                seen.add(key)
                out[kind] += storage.nbytes()

        for p in self.model.parameters():
            add("params", p)
        for b in self.model.buffers():
            add("buffers", b)
        for buffer in self.buckets.values():
            add("buckets", buffer)
        for p in self.model.parameters():
            add("grads", p.grad)
        inner = getattr(self.optimizer, "inner", None)
        optimizers = list(inner.values()) if isinstance(inner, dict) else [self.optimizer] if self.optimizer else []
        for masters in getattr(self.optimizer, "masters", {}).values():
            for master in masters.values():
                add("masters", master)
                add("grads", master.grad)
        for opt in optimizers:
            for group in opt.param_groups:
                for p in group["params"]:  # the masters, while a PrecisionOptimizer steps
                    add("grads", p.grad)
            for state in opt.state.values():
                for key, value in state.items():
                    small = isinstance(value, torch.Tensor) and value.dim() == 0 and key == "step"
                    add("step_counters" if small else "optimizer", value)
        return out

    def sample(self) -> dict[str, int]:
        """Measure; keep it as :attr:`peak` if its total (step counters left out) is the largest so far."""
        now = self.measure()
        if total_state(now) > total_state(self.peak):
            self.peak = now
        return now


def total_state(kinds: dict[str, int]) -> int:
    """Model-state bytes of a :meth:`ModelStateMeter.measure` result, step counters left out (as the planner)."""
    return sum(v for k, v in kinds.items() if k != "step_counters")
