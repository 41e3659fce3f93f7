"""The check's pre-flight: will the run fit in this machine's memory? Priced before any rank starts.

The built-in model or ``--model`` is built on the ``meta`` device (no memory, as
``python -m hf_altparams plan`` does) with the groups and schedule the ranks
will build, and priced per rank:

* **the model as each rank builds it**, before ``prepare``: every parameter and
  buffer in the dtype it is built in (a ``--dtype`` cast comes after the build),
  whole on every rank, even under FSDP2 (it shards at ``prepare``);
* **the plan's worst phase**: :func:`~hf_altparams.planner.plan_cost`'s largest
  device figure over the check's steps (parameters, gradients, optimizer state,
  DDP buckets; sharded under ``--fsdp2``, as ZeRO shards it under ``--deepspeed``;
  no DDP for one process);
* **the process itself**: this process's resident set now (the interpreter,
  torch and the libraries every rank also loads).

On a CPU the ranks on this host hold ``process + max(model, worst phase)``
each, against the host memory available (``psutil``; swap not counted). On
GPUs the model is built in host memory (``process + model`` per rank) and each
GPU holds its rank's worst phase, against that GPU's free memory (read in a
short-lived subprocess, so this process holds no CUDA context while the ranks
run). Activations and temporaries come on top: a run priced to fit can still
run out of memory; a run priced not to fit cannot fit, and is refused
(``wont_fit``) with the figures and the ways out. A ``--setup`` builds its own
model in user code and cannot be priced before it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import psutil
import torch
from torch import nn

from ..plan import ParamGroups, Schedule
from ..plan.groups import format_bytes
from ..planner import plan_cost
from ..planner.model import dtype_from_name
from .workload import build_user_model, builtin_model, layer_groups, schedule_for

__all__ = ["Price", "gpu_free_bytes", "meta_model", "price", "price_check", "rank_device"]


@dataclass(frozen=True)
class Price:
    """What each rank will hold, against what this machine has (bytes).

    Attributes:
        ranks: the processes the launch starts on this host.
        device: ``"cpu"`` or ``"cuda"``: where the ranks train.
        built: the model as each rank builds it, before ``prepare`` (and before a ``--dtype`` cast).
        worst: the plan's largest device figure per rank, in ``worst_phase``.
        worst_phase: that phase's name.
        process: this process's resident set (what every rank holds before its model).
        host_available: host memory available now (``psutil``; swap not counted), of ``host_total``.
        host_total: the host's memory.
        gpu_free: each GPU's free memory (CUDA only; empty where unread).

    Example:
        >>> p = Price(ranks=2, device="cpu", built=3 << 30, worst=4 << 30, worst_phase="layer0", process=1 << 30,
        ...           host_available=8 << 30, host_total=16 << 30)
        >>> p.per_rank, p.host_need, p.fits
        (5368709120, 10737418240, False)
    """

    ranks: int
    device: str
    built: int
    worst: int
    worst_phase: str
    process: int
    host_available: int
    host_total: int
    gpu_free: tuple[int, ...] = ()

    @property
    def per_rank(self) -> int:
        """Host bytes each rank holds at least: the process, and its model (on a CPU: the larger of model and plan)."""
        return self.process + (max(self.built, self.worst) if self.device == "cpu" else self.built)

    @property
    def host_need(self) -> int:
        """Host bytes the ranks on this host hold at least, together."""
        return self.ranks * self.per_rank

    def short_gpus(self) -> list[int]:
        """The GPUs (by index) whose free memory is below the worst phase."""
        return [i for i, free in enumerate(self.gpu_free[: self.ranks]) if free < self.worst]

    @property
    def fits(self) -> bool:
        """Whether the priced bytes fit in the memory available (host, and each GPU where read)."""
        return self.host_need <= self.host_available and not self.short_gpus()

    def summary(self) -> str:
        """One phrase for the report: ``"2 ranks x 1.20 GiB of host memory (...)"``."""
        text = (
            f"{self.ranks} rank{'s' if self.ranks > 1 else ''} x {format_bytes(self.per_rank)} of host memory "
            f"(process {format_bytes(self.process)}, model as built {format_bytes(self.built)}, plan's worst "
            f"phase {self.worst_phase!r} {format_bytes(self.worst)})"
        )
        if self.device == "cuda":
            text += f", and {format_bytes(self.worst)} on each GPU"
        return text

    def line(self) -> str:
        """The pre-flight's line: the price, what is available, and whether it fits."""
        text = (
            f"pre-flight: {self.summary()} = {format_bytes(self.host_need)} against "
            f"{format_bytes(self.host_available)} available of {format_bytes(self.host_total)}"
        )
        if self.device == "cuda":
            text += (
                "; GPU free: " + ", ".join(format_bytes(f) for f in self.gpu_free[: self.ranks])
                if self.gpu_free
                else "; GPU free memory unread"
            )
        return text + ("; fits (activations come on top)" if self.fits else "; does NOT fit")

    def refusal(self, *, dtype: Optional[str], fsdp2: bool) -> str:
        """Why it cannot fit, with the figures and the ways out."""
        reasons = []
        if self.host_need > self.host_available:
            reasons.append(
                f"the {self.ranks} rank(s) on this host hold at least {format_bytes(self.host_need)} "
                f"({self.summary()}), and {format_bytes(self.host_available)} of "
                f"{format_bytes(self.host_total)} host memory is available (swap not counted)"
            )
        for gpu in self.short_gpus():
            reasons.append(
                f"rank {gpu} holds at least {format_bytes(self.worst)} on GPU {gpu} (phase "
                f"{self.worst_phase!r}), which has {format_bytes(self.gpu_free[gpu])} free"
            )
        ways = []
        fitting = self.host_available // self.per_rank if self.per_rank else 0
        if self.ranks > 1 and 1 <= fitting < self.ranks and not self.short_gpus():
            ways.append(f"--ranks {fitting}")
        if dtype not in ("bf16", "fp16"):
            ways.append(
                "--dtype bf16 (halves an fp32 model once built; the build itself is priced at "
                f"{format_bytes(self.built)})"
            )
        if not fsdp2 and self.ranks > 1:
            ways.append(
                "--fsdp2 (shards what each rank holds after prepare; every rank still builds the whole model first)"
            )
        ways += ["a smaller model", "--no-preflight to start it anyway"]
        return "; ".join(reasons) + ". Activations come on top. Ways out: " + ", ".join(ways)


def rank_device() -> str:
    """Where self-launched ranks train: ``"cuda"`` when a GPU is visible and ``ACCELERATE_USE_CPU`` is not set."""
    forced_cpu = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in ("1", "true", "yes")
    return "cuda" if torch.cuda.is_available() and not forced_cpu else "cpu"


def gpu_free_bytes() -> tuple[int, ...]:
    """Each visible GPU's free memory, read in a subprocess (this process keeps no CUDA context); ``()`` if unread."""
    code = "import torch\nprint(' '.join(str(torch.cuda.mem_get_info(i)[0]) for i in range(torch.cuda.device_count())))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return tuple(int(word) for word in done.stdout.split()) if done.returncode == 0 else ()
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return ()


def _tensor_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def meta_model(
    model: Optional[str], *, model_class: Optional[str] = None, task: Optional[str] = None, dtype: Optional[str] = None
) -> tuple[nn.Module, int]:
    """The check's model on ``meta`` as the ranks train it, and the bytes each rank holds once it is built.

    ``model``: ``None`` for the built-in Llama, else ``--model`` (a config JSON or checkpoint folder),
    built with the head the ranks build (``--model-class``, else ``--task``'s or the config's:
    :func:`~hf_altparams.check.workload.build_user_model`).

    Example:
        >>> net, built = meta_model(None)
        >>> built == 4 * 7_475_456 + sum(b.numel() * b.element_size() for b in net.buffers())
        True
    """
    if model is None:
        with torch.device("meta"):
            built = builtin_model()
    else:
        built = build_user_model(model, model_class=model_class, task=task, device="meta")
    held = _tensor_bytes(built)
    if dtype is not None:
        built = built.to(dtype_from_name(dtype, "`--dtype`"))
    return built, held


def price(
    model: nn.Module,
    groups: ParamGroups,
    schedule: Schedule,
    *,
    built: int,
    ranks: int,
    fsdp2: bool,
    steps: int,
    device: str,
    gpu_free: Sequence[int] = (),
    strategy: Optional[str] = None,
) -> Price:
    """Price a run of ``ranks`` processes on this host (see the module docstring); ``model`` may be on ``meta``.

    ``strategy`` names the registered strategy the ranks run (``zero2``); default DDP, or FSDP2 with ``fsdp2``.
    """
    backend = "local" if ranks == 1 else (strategy or ("fsdp2" if fsdp2 else "ddp"))
    with warnings.catch_warnings():  # the schedule's share warning: the ranks give it, where it is read
        warnings.simplefilter("ignore")
        plan = plan_cost(model, groups, schedule, steps=steps, world_size=ranks, backend=backend, bf16_check=None)
    worst = max(plan.phases, key=lambda row: row.device_bytes)
    memory = psutil.virtual_memory()
    return Price(
        ranks=ranks,
        device=device,
        built=built,
        worst=worst.device_bytes,
        worst_phase=worst.phase,
        process=int(psutil.Process().memory_info().rss),
        host_available=int(memory.available),
        host_total=int(memory.total),
        gpu_free=tuple(gpu_free),
    )


def price_check(
    model: Optional[str],
    *,
    ranks: int,
    steps: int,
    fsdp2: bool,
    strategy: Optional[str] = None,
    model_class: Optional[str] = None,
    task: Optional[str] = None,
    dtype: Optional[str] = None,
    layers: Optional[str] = None,
    per: int = 1,
    schedule: Optional[str] = None,
    schedule_options: Optional[Mapping[str, Any]] = None,
) -> Price:
    """Price the check the flags describe (the built-in model, or ``--model``), on this machine.

    ``strategy``: the registered strategy the ranks run, where the flags name one
    other than DDP or FSDP2 (``zero2`` for ``--deepspeed 2``).
    ``schedule`` and ``schedule_options`` are the schedule flags given (``SCHEDULES.given(args)``),
    built as the ranks build them (:func:`~hf_altparams.check.workload.schedule_for`).

    Example:
        >>> p = price_check(None, ranks=2, steps=12, fsdp2=False)
        >>> p.built < p.worst and p.fits
        True
    """
    net, built = meta_model(model, model_class=model_class, task=task, dtype=dtype)
    groups = layer_groups(net) if model is None else layer_groups(net, layers, per)
    plan = schedule_for(schedule, groups, **(schedule_options or {}))
    device = rank_device()
    return price(
        net,
        groups,
        plan,
        built=built,
        ranks=ranks,
        fsdp2=fsdp2,
        strategy=strategy,
        steps=steps,
        device=device,
        gpu_free=gpu_free_bytes() if device == "cuda" else (),
    )
