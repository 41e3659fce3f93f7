"""One rank of ``check``: train a set-up under ``PhasedAccelerator`` and record what it measured.

The loop is the stock Accelerate loop (``prepare``, forward, ``backward``,
``optimizer.step()``, ``zero_grad``) on the user's devices and process group,
DDP or FSDP2 as Accelerate is configured (``--fsdp2``: FSDP2 also on CPU ranks,
where Accelerate would run DDP). Around it, each rank records:

* per optimizer step: the phase, the bytes its gradients hold (what DDP must
  all-reduce), the bytes the counting comm hook saw all-reduced (or
  reduce-scattered), the memory held at the end of the step (weights, gradients
  and optimizer state, activations gone; read from a step post-hook) and the
  step's seconds;
* per switch: the switch's seconds, the memory held after it, the memory
  model's prediction for the new phase (``expected_peak``), and the optimizer
  state that idle groups whose policy is ``drop`` (or, on a GPU, ``offload``)
  still hold on the training device, read from the optimizer itself;
* per phase visit: the peak memory, activations included;
* the weights compared across ranks after every switch and at the end (the
  switch's drift check, ``drift_check="switch"``);
* what went wrong, if anything: the stage, the exception and its cause (the
  :class:`~hf_altparams.errors.Cause` a library error carries; out of memory and
  a lost rank told by the exception's type), the library's warnings with the
  causes the :class:`~hf_altparams.errors.AltParamsWarning` among them carry,
  and the idle-state summary the first idle switch logs.

Nothing here judges: :mod:`.verdict` does, from every rank's :class:`RankResult`.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, TypeVar

import torch
from torch import nn
from torch.optim import Optimizer

from ..engine.collective import is_collective_failure
from ..engine.memory import StatePolicy
from ..engine.strategies import Collective
from ..errors import AltParamsError, AltParamsWarning, Cause
from ..plan import ParamGroups, Schedule
from .readings import MemoryGauge
from .workload import CheckSetup

__all__ = ["CheckOptions", "Failure", "RankResult", "StepRow", "SwitchRow", "run_rank"]

T = TypeVar("T")


@dataclass(frozen=True)
class CheckOptions:
    """How long and how ``check`` trains.

    Attributes:
        steps: optimizer steps (each one micro-batch).
        fsdp2: shard with FSDP2 (Accelerate's plugin, ``fsdp_version=2``); on CPU
            ranks too, where Accelerate would otherwise run plain DDP.
        timeout: seconds a rank waits for the others in a collective before it
            reports them lost.
    """

    steps: int = 60
    fsdp2: bool = False
    timeout: float = 120.0


@dataclass
class StepRow:
    """One optimizer step on one rank (bytes in bytes, memory in bytes above the baseline)."""

    step: int
    phase: str
    grad_bytes: int
    reduced_bytes: Optional[int]
    expected_reduced: Optional[int]
    held: Optional[int]
    seconds: float


@dataclass
class SwitchRow:
    """One switch (the first phase, applied at ``prepare``, is not one).

    ``idle_held``: bytes of optimizer state that idle groups whose policy sends it
    away still hold on the training device (``idle_held_groups`` names them).
    """

    step: int
    phase: str
    seconds: float
    level: int
    predicted: int
    idle_held: int = 0
    idle_held_groups: list[str] = field(default_factory=list)
    idle_checked: int = 0


@dataclass
class Failure:
    """What stopped a rank: where (``setup``, ``prepare``, ``step``, ``final``), what, and why.

    ``cause`` is a :class:`~hf_altparams.errors.Cause` id (``None`` in results
    written before causes were recorded).
    """

    stage: str
    step: Optional[int]
    kind: str
    message: str
    where: str = ""
    cause: Optional[str] = None

    @classmethod
    def from_error(cls, stage: str, step: Optional[int], err: BaseException) -> "Failure":
        """The failure ``err`` is, raised at ``stage`` (and ``step``), with its cause.

        The cause: the one a library error carries (one of no particular cause,
        raised before training, refused the set-up); for other exceptions, their
        type's (:func:`_cause`).

        Example:
            >>> from hf_altparams.errors import DriftError
            >>> Failure.from_error("step", 4, DriftError("the ranks hold different weights")).cause
            'ranks_drift'
        """
        frames = traceback.extract_tb(err.__traceback__)
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""
        return cls(stage=stage, step=step, kind=type(err).__name__, message=str(err)[:4000], where=where,
                   cause=_cause(stage, err).value)


@dataclass
class RankResult:
    """Everything one rank measured (JSON-ready through :meth:`as_dict`)."""

    rank: int
    world: int
    device: str
    parallel: str
    memory_source: str
    description: str = ""
    steps: list[StepRow] = field(default_factory=list)
    switches: list[SwitchRow] = field(default_factory=list)
    peaks: list[tuple[str, Optional[int]]] = field(default_factory=list)
    first_prediction: Optional[int] = None
    trainable_everything: Optional[int] = None
    weights_compared: int = 0
    warnings: list[str] = field(default_factory=list)
    warning_causes: list[tuple[str, str]] = field(default_factory=list)
    idle_state: list[str] = field(default_factory=list)
    bf16: Optional[dict[str, Any]] = None
    failure: Optional[Failure] = None
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankResult":
        """The inverse of :meth:`as_dict` (results read back from a rank's JSON file)."""
        values = dict(data)
        values["steps"] = [StepRow(**row) for row in data.get("steps", [])]
        values["switches"] = [SwitchRow(**row) for row in data.get("switches", [])]
        values["peaks"] = [tuple(p) for p in data.get("peaks", [])]
        values["warning_causes"] = [tuple(w) for w in data.get("warning_causes", [])]
        values["failure"] = Failure(**data["failure"]) if data.get("failure") else None
        return cls(**values)


class _LogCapture(logging.Handler):
    """Collects the library's INFO lines (the idle-state summary of the first idle switch)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _accelerator(options: CheckOptions) -> Any:
    """A ``PhasedAccelerator`` that counts bytes, compares weights after every switch, and times out."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    from ..integrations.accelerate import PhasedAccelerator
    from ..integrations.accelerate_internals import run_fsdp_state

    kwargs: dict[str, Any] = {"kwargs_handlers": [InitProcessGroupKwargs(
        timeout=datetime.timedelta(seconds=options.timeout))]}
    plugin = None
    if options.fsdp2:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        kwargs["fsdp_plugin"] = plugin
    acc = PhasedAccelerator(count_comm=True, log_switches=False,
                            switcher_options={"drift_check": "switch", "collective_timeout": options.timeout},
                            **kwargs)
    if plugin is not None and acc.num_processes > 1 and acc.distributed_type != DistributedType.FSDP:
        run_fsdp_state(acc, plugin)  # CPU ranks: Accelerate chose plain DDP; run its FSDP2 code instead
    return acc


def _parallel(acc: Any) -> str:
    if acc.num_processes == 1:
        return "none (one process: Accelerate wraps no DDP)"
    return "FSDP2" if acc.is_fsdp2 else "DDP"


def _grad_bytes(params: list[nn.Parameter]) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.requires_grad and p.grad is not None)


def _bf16(model: nn.Module, device: torch.device) -> Optional[dict[str, Any]]:
    if not any(p.dtype == torch.bfloat16 for p in model.parameters()):
        return None
    from ..planner.hardware import bf16_speed

    speed = bf16_speed(device)
    return {**speed.as_dict(), "warning": speed.warning()}


#: The stages before the first training step: a library error there is a refused set-up.
_BEFORE_TRAINING = ("accelerator", "setup", "prepare")


def _cause(stage: str, err: BaseException) -> Cause:
    """Why ``err`` stopped the rank: the cause a library error carries, else told by the exception's type.

    A library error of no particular cause raised before training refused the
    set-up. torch's CPU allocator raises a plain ``RuntimeError`` (torch 2.13), so
    only ``torch.OutOfMemoryError`` (a GPU's) and ``MemoryError`` are out of memory.
    """
    if isinstance(err, AltParamsError):
        if err.cause is Cause.ERROR and stage in _BEFORE_TRAINING:
            return Cause.SETUP_REFUSED
        return err.cause
    if isinstance(err, (torch.OutOfMemoryError, MemoryError)):
        return Cause.OUT_OF_MEMORY
    if is_collective_failure(err):  # torch.distributed's errors: DistError, gloo's timeouts and closed pairs
        return Cause.RANK_LOST
    return Cause.ERROR


def run_rank(make_setup: Callable[[], CheckSetup], options: CheckOptions, finish: Callable[[RankResult], T],
             progress: Optional[Callable[[str, int], None]] = None) -> T:
    """Train ``make_setup()`` for ``options.steps`` steps on this rank, record it, return ``finish(result)``.

    Every rank of the job calls it; a failure is recorded, not raised, so that
    every rank can report. ``finish`` runs while the process group is still up
    (to gather the results); then the accelerator ends (and the process group).
    ``progress(stage, steps_done)``, where given, is told each stage as it
    starts (``setup``, ``prepare``, ``final``) and each step as it ends
    (``step``), so that a watcher can say how far a rank got.

    Example::

        result = run_rank(lambda: builtin_setup("lisa"), CheckOptions(steps=30), finish=lambda r: r)
        result.failure, len(result.switches)
    """
    started = time.perf_counter()
    capture = _LogCapture()
    logger = logging.getLogger("hf_altparams")
    logger.addHandler(capture)
    level = logger.level
    logger.setLevel(logging.INFO)
    acc: Any = None
    result = RankResult(rank=int(os.environ.get("RANK", 0)), world=int(os.environ.get("WORLD_SIZE", 1)),
                        device="?", parallel="?", memory_source="?")
    stage, step = "accelerator", None
    told = progress or (lambda stage, steps: None)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                acc = _accelerator(options)
                gauge = MemoryGauge(acc.device)
                result.device, result.parallel, result.memory_source = str(acc.device), _parallel(acc), gauge.source
                stage = "setup"
                told(stage, 0)
                setup = make_setup()
                result.description = setup.description
                stage = "prepare"
                told(stage, 0)
                _train(acc, setup, options, gauge, result, told)
                stage, step = "final", None
                told(stage, len(result.steps))
                acc.switcher.check_weights("at the end of the check")
                result.weights_compared += 1
            except Exception as err:  # recorded for the report: every rank reports what stopped it
                stage, step = _stage_of(result, stage)
                result.failure = Failure.from_error(stage, step, err)
        result.warnings = _unique(f"{w.category.__name__}: {w.message}" for w in caught)
        result.warning_causes = list(dict.fromkeys(
            (w.message.cause.value, str(w.message)[:2000]) for w in caught if isinstance(w.message, AltParamsWarning)))
    finally:
        logger.removeHandler(capture)
        logger.setLevel(level)
        result.idle_state = capture.lines
        result.seconds = time.perf_counter() - started
    try:
        return finish(result)
    finally:
        try:
            if acc is not None:
                acc.end_training()
        except Exception:  # the process group may be broken by a lost rank; the result stands
            pass


def _stage_of(result: RankResult, stage: str) -> tuple[str, Optional[int]]:
    if stage == "prepare" and result.steps:
        return "step", result.steps[-1].step + 1
    if stage == "prepare" and result.first_prediction is not None:
        return "step", 0
    return stage, None


def _unique(lines: Any) -> list[str]:
    seen: dict[str, None] = {}
    for line in lines:
        seen.setdefault(str(line)[:2000])
    return list(seen)


def _train(acc: Any, setup: CheckSetup, options: CheckOptions, gauge: MemoryGauge, result: RankResult,
           told: Callable[[str, int], None]) -> None:
    """The stock loop, with the readings of the module docstring."""
    groups: ParamGroups = setup.groups
    schedule: Schedule = setup.schedule
    acc.set_phases(schedule, groups=groups)
    model = setup.model
    gauge.start(model)
    raw = setup.make_optimizer(model)
    result.bf16 = _bf16(model, acc.device)
    held: list[Optional[int]] = [None]
    hook_seconds = [0.0]

    def read_held(*_: Any) -> None:
        began = time.perf_counter()
        held[0] = gauge.level()
        hook_seconds[0] += time.perf_counter() - began

    handle = raw.register_step_post_hook(read_held)
    prepared, optimizer = acc.prepare(model, raw)
    switcher = acc.switcher
    params = [p for p in model.parameters()]
    result.first_prediction = switcher.expected_peak(switcher.current)
    result.trainable_everything = sum(p.numel() * p.element_size() for p in params)
    last = switcher.history.last
    phase_started = acc.phase.name
    gauge.reset_peak()
    try:
        for step in range(options.steps):
            current = acc.phase
            phase = current.name
            if setup.on_step is not None:
                setup.on_step(acc.unwrap_model(prepared), step)
            batch = setup.make_batch(step, acc.process_index, acc.device)
            hook_seconds[0], held[0] = 0.0, None
            began = time.perf_counter()
            loss = setup.compute_loss(prepared(**batch))
            acc.backward(loss)
            grad_bytes = _grad_bytes(params)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - began - hook_seconds[0]
            counter = acc.comm_counter
            reduced = counter.history[-1] if counter is not None and counter.history else None
            # what the strategy feeds its collective: a reduce-scatter the padded trainable gradients (the
            # switch's figure), an all-reduce the gradients themselves
            expected = None if counter is None else (
                switcher.reduced_bytes(current) if switcher.strategy.pricing.collective is Collective.REDUCE_SCATTER
                else grad_bytes)
            result.steps.append(StepRow(step=step, phase=phase, grad_bytes=grad_bytes, reduced_bytes=reduced,
                                        expected_reduced=expected, held=held[0], seconds=seconds))
            told("step", step + 1)
            record = switcher.history.last
            if record is not last:
                last = record
                result.peaks.append((phase_started, gauge.peak_since_reset()))
                held_bytes, held_groups, checked = _idle_state_on_device(switcher, raw, acc.device)
                result.switches.append(SwitchRow(step=step + 1, phase=record.phase, seconds=record.seconds,
                                                 level=gauge.level(),
                                                 predicted=switcher.expected_peak(switcher.current),
                                                 idle_held=held_bytes, idle_held_groups=held_groups,
                                                 idle_checked=checked))
                result.weights_compared += 1  # the switch compared every rank's weights (drift_check="switch")
                phase_started = record.phase
                gauge.reset_peak()
        result.peaks.append((phase_started, gauge.peak_since_reset()))
    finally:
        handle.remove()



def _idle_state_on_device(switcher: Any, optimizer: Optimizer, device: torch.device) -> tuple[int, list[str], int]:
    """``(bytes, groups, groups checked)``: optimizer state idle groups hold on ``device`` against their policy.

    Read from the optimizer itself (its ``state``, or each inner optimizer's of a
    ``GroupedOptimizer``), for the idle groups whose policy sends their state
    away: ``drop`` everywhere, ``offload`` where the host is another device.
    """
    current = switcher.current
    if current is None:
        return 0, [], 0
    leaving = {StatePolicy.DROP} | ({StatePolicy.OFFLOAD} if device.type != "cpu" else set())
    policies = switcher.idle_state_policies
    inner = getattr(optimizer, "inner", None)
    held, names, checked = 0, [], 0
    for group in switcher.groups.names:
        if group in current.trainable or policies.get(group) not in leaving:
            continue
        checked += 1
        owner = inner.get(group) if isinstance(inner, dict) else optimizer
        if owner is None:
            continue
        found = sum(t.numel() * t.element_size() for p in switcher.groups.params(group)
                    for t in (owner.state.get(p) or {}).values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type == device.type)
        if found:
            held += found
            names.append(group)
    return held, names, checked
