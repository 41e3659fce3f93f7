"""Is bf16 arithmetic fast here? A verdict per device, with its reason and the figures behind it.

bf16 storage halves the memory of the weights, but it only pays where the
device computes in bf16 at least as fast as in fp32. Many CPUs do not: where
torch reports the CPU capability ``AVX2`` (no AVX-512 bf16 instructions, no
AMX), oneDNN has no bf16 kernels and torch falls back to a generic loop, about
100x slower than an fp32 matmul (a 256x2048 @ 2048x5632 matmul: 161 ms in fp32,
16,205 ms in bf16 on a 2-core AMD EPYC). A training step there takes hours.

:func:`bf16_speed` answers for one device:

* **CPU**: a short timed probe, the same matmul in fp32 and in bf16 on one
  thread (the best of a few repeats, well under a second), next to torch's CPU
  capability (``torch.backends.cpu.get_cpu_capability()``). bf16 counts as slow
  when the probe takes more than :data:`SLOW_RATIO` times as long in bf16 as in
  fp32. One thread, because on a loaded machine a multi-threaded matmul waits
  for its slowest thread: timed on 2 threads of a 2-core machine running other
  work, the fp32 probe took anything from 0.4 to 44 ms, on one thread
  0.67-0.84 ms.
* **CUDA**: the device's compute capability: 8.0 (Ampere) or newer computes
  bf16 in its tensor cores; older GPUs emulate it.

The verdict is measured once per process and device, then cached. The
environment variable :data:`BF16_ENV` (``HF_ALTPARAMS_BF16=fast`` or ``slow``)
overrides it for every device, for a user who knows better than a probe on a
loaded machine (or a test that must not depend on timing).

:func:`cpu_verdict` and :func:`cuda_verdict` hold the decision on given figures
(pure functions: no timing, no device), which :func:`bf16_speed` calls with
what it measured.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import torch

from ..errors import PlanError

__all__ = [
    "BF16_ENV",
    "PROBE_SHAPE",
    "SLOW_RATIO",
    "Bf16Speed",
    "Probe",
    "bf16_speed",
    "cpu_verdict",
    "cuda_verdict",
    "time_matmul",
]

#: The environment variable that forces the verdict: ``fast`` or ``slow`` (any case).
BF16_ENV = "HF_ALTPARAMS_BF16"
#: bf16 is slow on a CPU when the probe matmul takes more than this many times as long in bf16 as in fp32.
SLOW_RATIO = 2.0
#: The probe: an (m, k) @ (k, n) matmul (0.07 GFLOP: under 1 ms in fp32 on one modern core).
PROBE_SHAPE = (128, 512, 512)
_REPEATS = 3  # the probe's timing is the best of this many runs, after one warm-up run

#: A probe: the seconds one probe matmul takes in the given dtype.
Probe = Callable[[torch.dtype], float]


@dataclass(frozen=True)
class Bf16Speed:
    """Whether ``device`` computes bf16 fast, why, and the figures the verdict rests on.

    Attributes:
        device: the device judged (``"cpu"``, ``"cuda:0"``).
        fast: ``True`` when bf16 arithmetic runs at least about as fast as fp32 there.
        reason: one sentence naming the figures (or the override) the verdict rests on.
        source: ``"probe"`` (a timed CPU matmul), ``"cuda"`` (the compute capability)
            or ``"environment"`` (:data:`BF16_ENV`).
        capability: torch's CPU capability (``"AVX512"``, ``"AVX2"``, ...) or the
            GPU's compute capability (``"8.0"``).
        fp32_seconds: the probe matmul in fp32 (CPU probe only).
        bf16_seconds: the same in bf16 (CPU probe only).

    Example:
        >>> speed = cpu_verdict("AVX2", fp32_seconds=0.000161, bf16_seconds=0.016205)
        >>> speed.fast, round(speed.slowdown or 0)
        (False, 101)
    """

    device: str
    fast: bool
    reason: str
    source: str
    capability: Optional[str] = None
    fp32_seconds: Optional[float] = None
    bf16_seconds: Optional[float] = None

    @property
    def slowdown(self) -> Optional[float]:
        """bf16 time over fp32 time of the probe (``None`` without a probe)."""
        if self.fp32_seconds is None or self.bf16_seconds is None or self.fp32_seconds <= 0:
            return None
        return self.bf16_seconds / self.fp32_seconds

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, the slowdown included."""
        return {**asdict(self), "slowdown": self.slowdown}

    def warning(self) -> Optional[str]:
        """``None`` where bf16 is fast; else the reason, what it costs and the way out, in one paragraph.

        Example:
            >>> print(cpu_verdict("AVX2", fp32_seconds=0.0002, bf16_seconds=0.02).warning())
            bf16 is slow on this CPU: a 128x512 @ 512x512 matmul took 20.00 ms in bf16 against 0.20 ms in fp32 (100.0x; torch's CPU capability: AVX2). Computing in bf16 there is slow (each matmul about 100x slower than in fp32). The way out: keep the weights in fp32 there, or train where bf16 is native (a CPU with AVX-512 bf16 or AMX, a GPU of compute capability 8.0+). HF_ALTPARAMS_BF16=fast or slow overrides this check.
        """
        if self.fast:
            return None
        slower = "" if self.slowdown is None else f" (each matmul about {self.slowdown:.0f}x slower than in fp32)"
        return (
            f"{self.reason}. Computing in bf16 there is slow{slower}. The way out: keep the weights in fp32 "
            "there, or train where bf16 is native (a CPU with AVX-512 bf16 or AMX, a GPU of compute "
            f"capability 8.0+). {BF16_ENV}=fast or slow overrides this check."
        )


def time_matmul(
    dtype: torch.dtype, shape: tuple[int, int, int] = PROBE_SHAPE, device: str = "cpu", repeats: int = _REPEATS
) -> float:
    """Seconds one ``(m, k) @ (k, n)`` matmul takes in ``dtype`` on ``device``: the best of ``repeats`` runs.

    On a CPU it runs on one thread (torch's thread count is put back after).
    The default probe of :func:`bf16_speed` (under 1 ms in fp32; ~50 ms in bf16
    where it is emulated).

    Example:
        >>> time_matmul(torch.float32, (8, 8, 8), repeats=1) > 0
        True
    """
    m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(k, n, generator=generator).to(device=device, dtype=dtype)
    threads = torch.get_num_threads()
    best = float("inf")
    try:
        if a.device.type == "cpu":
            torch.set_num_threads(1)
        for run in range(repeats + 1):  # the first run warms up (kernel selection, oneDNN's JIT)
            started = time.perf_counter()
            torch.matmul(a, b)
            if a.device.type == "cuda":
                torch.cuda.synchronize(a.device)
            if run:
                best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return best


def cpu_verdict(capability: str, fp32_seconds: float, bf16_seconds: float, device: str = "cpu") -> Bf16Speed:
    """The CPU verdict on given probe timings: slow when bf16 takes over :data:`SLOW_RATIO` x fp32's time.

    Example:
        >>> cpu_verdict("AVX512", fp32_seconds=0.0004, bf16_seconds=0.0003).fast
        True
        >>> print(cpu_verdict("AVX2", fp32_seconds=0.0002, bf16_seconds=0.0136).reason)
        bf16 is slow on this CPU: a 128x512 @ 512x512 matmul took 13.60 ms in bf16 against 0.20 ms in fp32 (68.0x; torch's CPU capability: AVX2)
    """
    for value, name in ((fp32_seconds, "fp32_seconds"), (bf16_seconds, "bf16_seconds")):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise PlanError(f"`{name}` must be a time in seconds > 0, got {value!r}")
    ratio = bf16_seconds / fp32_seconds
    fast = ratio <= SLOW_RATIO
    m, k, n = PROBE_SHAPE
    figures = (
        f"a {m}x{k} @ {k}x{n} matmul took {1e3 * bf16_seconds:.2f} ms in bf16 against "
        f"{1e3 * fp32_seconds:.2f} ms in fp32 ({ratio:.1f}x; torch's CPU capability: {capability})"
    )
    reason = f"bf16 is {'fast' if fast else 'slow'} on this CPU: {figures}"
    return Bf16Speed(
        device=device,
        fast=fast,
        reason=reason,
        source="probe",
        capability=capability,
        fp32_seconds=float(fp32_seconds),
        bf16_seconds=float(bf16_seconds),
    )


def cuda_verdict(name: str, capability: tuple[int, int], device: str = "cuda:0") -> Bf16Speed:
    """The CUDA verdict on a compute capability: 8.0 (Ampere) or newer computes bf16 natively.

    Example:
        >>> cuda_verdict("NVIDIA H100", (9, 0)).fast, cuda_verdict("Tesla T4", (7, 5)).fast
        (True, False)
    """
    text = f"{capability[0]}.{capability[1]}"
    if capability >= (8, 0):
        reason = f"bf16 is fast on {device} ({name}, compute capability {text}: bf16 tensor cores)"
        return Bf16Speed(device=device, fast=True, reason=reason, source="cuda", capability=text)
    reason = (
        f"bf16 is slow on {device} ({name}, compute capability {text}: bf16 is emulated below 8.0; "
        "fp16 or fp32 compute natively there)"
    )
    return Bf16Speed(device=device, fast=False, reason=reason, source="cuda", capability=text)


_CACHE: dict[str, Bf16Speed] = {}


def bf16_speed(device: Union[str, torch.device] = "cpu", *, probe: Optional[Probe] = None) -> Bf16Speed:
    """Whether ``device`` computes bf16 fast: the verdict, its reason and the figures (see the module docstring).

    Args:
        device: ``"cpu"``, ``"cuda"`` (the current GPU), ``"cuda:N"`` or a ``torch.device``.
        probe: CPU only: ``probe(dtype) -> seconds`` replaces the timed matmul
            (:func:`time_matmul`); its verdict is not cached. For tests, and for
            timing a workload of your own.

    :data:`BF16_ENV` (``HF_ALTPARAMS_BF16=fast|slow``), when set, decides
    without measuring. Otherwise the first call per device measures (CPU: well
    under a second) and later calls return the cached verdict.

    Raises:
        PlanError: for a device type other than ``cpu`` and ``cuda``, a CUDA
            device that is not visible (or an index beyond them), or a value of :data:`BF16_ENV` other than
            ``fast`` and ``slow``.

    Example:
        >>> speed = bf16_speed("cpu")
        >>> speed.fast in (True, False) and speed.reason.startswith("bf16 is")
        True
    """
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise PlanError(f"`device` must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from err
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise PlanError(f"`device` {device!r}: no CUDA device is visible")
        where = torch.device("cuda", torch.cuda.current_device() if where.index is None else where.index)
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise PlanError(f"`device` {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    elif where.type != "cpu":
        raise PlanError(
            f"`device` must be 'cpu', 'cuda' or 'cuda:N', got {device!r} (bf16 speed is judged "
            f"on CPUs and CUDA GPUs; set {BF16_ENV}=fast or slow for other devices)"
        )
    name = str(where)
    forced = _forced(name)
    if forced is not None:
        return forced
    if probe is not None:
        if where.type != "cpu":
            raise PlanError(
                f"`probe` times a CPU matmul; a CUDA device is judged by its compute capability, got device {device!r}"
            )
        return cpu_verdict(torch.backends.cpu.get_cpu_capability(), probe(torch.float32), probe(torch.bfloat16))
    if name not in _CACHE:
        if where.type == "cuda":
            _CACHE[name] = cuda_verdict(
                torch.cuda.get_device_name(where), torch.cuda.get_device_capability(where), device=name
            )
        else:
            _CACHE[name] = cpu_verdict(
                torch.backends.cpu.get_cpu_capability(), time_matmul(torch.float32), time_matmul(torch.bfloat16)
            )
    return _CACHE[name]


def _forced(device: str) -> Optional[Bf16Speed]:
    """The verdict :data:`BF16_ENV` forces, if it is set."""
    value = os.environ.get(BF16_ENV, "").strip()
    if not value:
        return None
    if value.lower() not in ("fast", "slow"):
        raise PlanError(
            f"the environment variable {BF16_ENV} must be 'fast' or 'slow' (or unset: measured), got {value!r}"
        )
    fast = value.lower() == "fast"
    return Bf16Speed(
        device=device,
        fast=fast,
        source="environment",
        reason=f"bf16 is taken as {'fast' if fast else 'slow'} on {device}: set by {BF16_ENV}={value}",
    )
