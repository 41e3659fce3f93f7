"""One rank of ``check``: train a set-up under ``PhasedAccelerator`` and record what it measured.

The loop is the stock Accelerate loop (``prepare``, then per optimizer step
``accumulate``, forward, ``backward``, the set-up's ``before_step``,
``optimizer.step()``, ``zero_grad``) on the user's devices and process group,
DDP or FSDP2 as Accelerate is configured (``--fsdp2``: FSDP2 also on CPU ranks,
where Accelerate would run DDP; the model is then sharded one ``fully_shard``
unit per group, :func:`~hf_altparams.engine.shard_by_groups`), or DeepSpeed ZeRO
(``--deepspeed``: Accelerate's ``DeepSpeedPlugin``, :mod:`.zero`; the update and
the switch then run inside the sync-boundary ``backward``, so ``before_step``
comes after the update there). Around it, each rank records:

* before ``prepare``: whether the ranks built the same weights
  (:func:`.weights.differing_at_start`); under DDP, whose constructor copies
  rank 0's weights to every rank, the check makes that copy itself first;
* the precision: Accelerate's mixed precision and the dtypes of the weights;
* per optimizer step: the phase, the bytes its gradients hold (what DDP must
  all-reduce), the bytes the counting comm hook saw all-reduced (or
  reduce-scattered; under ZeRO every collective DeepSpeed ran, against what the
  strategy declares for the phase's trainable bytes: their reduction, once per
  micro-batch where it reduces each, and the all-gather of the updated
  partitions), the memory held at the end of the step (weights, gradients and
  optimizer state, activations gone; read from a step post-hook, or under ZeRO
  once the sync-boundary ``backward`` returned) and the step's seconds;
* per switch: the switch's seconds, the memory held after it, the memory
  model's prediction for the new phase (``expected_peak``), and the optimizer
  state that idle groups whose policy is ``drop`` (or, on a GPU, ``offload``)
  still hold on the training device, read from the optimizer itself (under ZeRO
  from its owner's census: optimizer state and fp32 partition per group);
* per phase visit: the peak memory, activations included;
* the weights compared across ranks after every switch and at the end (the
  switch's drift check, ``drift_check="switch"``), and each idle group's
  weights on this rank against their reading when it went idle
  (:class:`.weights.IdleWatch`; idle includes a group the phase trains whose
  flags code outside the schedule turned off);
* at the end: what the memory held is made of (:func:`_census`) and what the
  device has left (:func:`_available`);
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
from typing import Any, Callable, Optional, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn
from torch.optim import Optimizer

from ..engine import memory_report, shard_by_groups
from ..engine.collective import is_collective_failure
from ..engine.memory import StatePolicy, optimizer_of
from ..engine.strategies import Collective, Gather, StepBoundary, Strategy, is_registered, strategy_named
from ..errors import AltParamsError, AltParamsWarning, Cause, PlanError
from ..plan import ParamGroups, Schedule
from .readings import MemoryGauge, live_tensor_bytes, storage_keys
from .weights import IdleChange, IdleWatch, copy_rank0, differing_at_start, frozen_groups
from .workload import CheckSetup
from .zero import CPU_ENV, complete, copied

__all__ = ["CheckOptions", "Failure", "IdleChange", "RankResult", "StepRow", "SwitchRow", "run_rank"]

#: The idle changes one rank keeps (the first ones; ``RankResult.idle_changed`` counts them all).
_KEPT_CHANGES = 20

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
        deepspeed: the DeepSpeed config to train under (Accelerate's
            ``DeepSpeedPlugin``; :mod:`.zero`), ``None`` for none; on CPU ranks
            too, where the process environment lacks ``ACCELERATE_USE_CPU``.
    """

    steps: int = 60
    fsdp2: bool = False
    timeout: float = 120.0
    deepspeed: Optional[dict[str, Any]] = None


@dataclass
class StepRow:
    """One optimizer step on one rank (bytes in bytes, memory in bytes above the baseline).

    ``reduced_slack``: bytes the count may exceed ``expected_reduced`` by without
    a finding: 0 where the counter sees the gradients' collective alone (DDP's
    comm hook, FSDP2's reduce-scatter); under DeepSpeed, whose counter sees
    every collective it runs, less than the smallest group's bytes (its scalar
    collectives, a gradient norm per param group and an overflow flag, and the
    padding of its flat partitions: any group's gradients or partition crossing
    the network exceed it).
    """

    step: int
    phase: str
    grad_bytes: int
    reduced_bytes: Optional[int]
    expected_reduced: Optional[int]
    held: Optional[int]
    seconds: float
    reduced_slack: int = 0


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
    def from_error(cls, stage: str, step: Optional[int], err: BaseException) -> Failure:
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
        return cls(
            stage=stage,
            step=step,
            kind=type(err).__name__,
            message=str(err)[:4000],
            where=where,
            cause=_cause(stage, err).value,
        )


@dataclass
class RankResult:
    """Everything one rank measured (JSON-ready through :meth:`as_dict`).

    Beyond the rows: ``model_class`` (the trained model's class), ``precision``
    (``mixed_precision``: Accelerate's; ``dtypes``: the weights' dtypes and their
    share of the parameters), ``start_differs`` (the groups whose weights differed
    between the ranks before ``prepare``) and ``start_equalized`` (whether
    something made them equal before training: DDP's copy from rank 0),
    ``idle_changes`` (the first changes of idle groups; ``idle_changed`` counts
    them all), ``census`` (bytes at the end, by what holds them), ``available``
    (bytes the device has left for this rank at the end) and ``accumulation``
    (micro-batches per optimizer step).
    """

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
    model_class: str = ""
    precision: dict[str, Any] = field(default_factory=dict)
    start_differs: list[str] = field(default_factory=list)
    start_equalized: bool = False
    idle_changes: list[IdleChange] = field(default_factory=list)
    idle_changed: int = 0
    census: dict[str, int] = field(default_factory=dict)
    available: Optional[int] = None
    accumulation: int = 1

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankResult:
        """The inverse of :meth:`as_dict` (results read back from a rank's JSON file)."""
        values = dict(data)
        values["steps"] = [StepRow(**row) for row in data.get("steps", [])]
        values["switches"] = [SwitchRow(**row) for row in data.get("switches", [])]
        values["peaks"] = [tuple(p) for p in data.get("peaks", [])]
        values["warning_causes"] = [tuple(w) for w in data.get("warning_causes", [])]
        values["failure"] = Failure(**data["failure"]) if data.get("failure") else None
        values["idle_changes"] = [IdleChange(**row) for row in data.get("idle_changes", [])]
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

    kwargs: dict[str, Any] = {
        "kwargs_handlers": [InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=options.timeout))]
    }
    plugin = None
    if options.fsdp2:
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        kwargs["fsdp_plugin"] = plugin
    if options.deepspeed is not None:
        from accelerate.utils import DeepSpeedPlugin

        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(hf_ds_config=copied(options.deepspeed))
    if options.deepspeed is not None or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        if not torch.cuda.is_available():
            from ..engine.deepspeed import skip_shm_comm_build

            skip_shm_comm_build()  # else DeepSpeed compiles a C++ op at its first init_distributed (minutes)
    acc = PhasedAccelerator(
        count_comm=True,
        log_switches=False,
        switcher_options={"drift_check": "switch", "collective_timeout": options.timeout},
        **kwargs,
    )
    if plugin is not None and acc.num_processes > 1 and acc.distributed_type != DistributedType.FSDP:
        run_fsdp_state(acc, plugin)  # CPU ranks: Accelerate chose plain DDP; run its FSDP2 code instead
    if options.deepspeed is not None and acc.distributed_type != DistributedType.DEEPSPEED:
        raise PlanError(
            f"`--deepspeed`: Accelerate did not start DeepSpeed (distributed_type {acc.distributed_type.value}): "
            f"{CPU_ENV}={os.environ.get(CPU_ENV)!r} is set, and with it Accelerate drops DeepSpeed. Leave "
            f"{CPU_ENV} out of the environment of DeepSpeed ranks (plain `torchrun`), also on CPU ranks"
        )
    return acc


def _configured(acc: Any) -> Optional[Strategy]:
    """The registered strategy Accelerate is configured to run, where it names one (FSDP2, DeepSpeed ZeRO)."""
    from ..integrations.accelerate import configuration

    name = configuration(acc).strategy_name
    return strategy_named(name) if name is not None and is_registered(name) else None


def _world(acc: Any) -> int:
    """The ranks of the job: torch.distributed's (Accelerate counts one process per DeepSpeed rank on CPU)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(acc.num_processes)


def _rank(acc: Any) -> int:
    """This rank's index in the job (the batches differ per rank, as a sharded loader gives)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(acc.process_index)


def _steps_in_backward(acc: Any) -> bool:
    """Whether the update (and the switch) run inside the sync-boundary ``backward`` (DeepSpeed's engine)."""
    strategy = _configured(acc)
    return strategy is not None and strategy.capabilities.step_boundary is StepBoundary.BACKWARD


def _parallel(acc: Any) -> str:
    strategy = _configured(acc)
    if strategy is not None and not acc.is_fsdp2:  # DeepSpeed ZeRO: one Accelerate process per rank on CPU
        return strategy.label
    if acc.num_processes == 1:
        return "none (one process: Accelerate wraps no DDP)"
    return "FSDP2" if acc.is_fsdp2 else "DDP"


def _grad_bytes(params: list[nn.Parameter]) -> int:
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.requires_grad and p.grad is not None)


def _precision(model: nn.Module, acc: Any) -> dict[str, Any]:
    """Accelerate's mixed precision and the weights' dtypes (each with its share of the parameters)."""
    counts: dict[str, int] = {}
    for param in model.parameters():
        name = str(param.dtype).replace("torch.", "")
        counts[name] = counts.get(name, 0) + param.numel()
    total = sum(counts.values()) or 1
    return {
        "mixed_precision": str(acc.mixed_precision),
        "dtypes": {name: round(n / total, 4) for name, n in sorted(counts.items(), key=lambda kv: -kv[1])},
    }


def _bf16(model: nn.Module, device: torch.device, mixed_precision: str) -> Optional[dict[str, Any]]:
    """The planner's verdict on bf16 here, where the run computes in bf16 (bf16 weights, or autocast to bf16)."""
    weights = any(p.dtype == torch.bfloat16 for p in model.parameters())
    if not weights and mixed_precision != "bf16":
        return None
    from ..planner.hardware import bf16_speed

    speed = bf16_speed(device)
    warning = speed.warning()
    if warning and not weights:  # autocast: the weights are not what to change
        warning = (
            f"Accelerate's mixed_precision='bf16' runs the forward and backward in bf16 (autocast), and "
            f"{speed.reason[0].lower()}{speed.reason[1:]}: each step pays it. The way out here: "
            "mixed_precision 'no' (your Accelerate config, or ACCELERATE_MIXED_PRECISION=no), or train where "
            "bf16 is native (a CPU with AVX-512 bf16 or AMX, a GPU of compute capability 8.0+)."
        )
    return {**speed.as_dict(), "warning": warning, "autocast": mixed_precision == "bf16"}


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


def run_rank(
    make_setup: Callable[[], CheckSetup],
    options: CheckOptions,
    finish: Callable[[RankResult], T],
    progress: Optional[Callable[[str, int], None]] = None,
) -> T:
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
    result = RankResult(
        rank=int(os.environ.get("RANK", 0)),
        world=int(os.environ.get("WORLD_SIZE", 1)),
        device="?",
        parallel="?",
        memory_source="?",
    )
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
                if _train(acc, setup, options, gauge, result, told):
                    stage, step = "final", None
                    told(stage, len(result.steps))
                    acc.switcher.check_weights("at the end of the check")
                    result.weights_compared += 1
            except Exception as err:  # recorded for the report: every rank reports what stopped it
                stage, step = _stage_of(result, stage)
                result.failure = Failure.from_error(stage, step, err)
        result.warnings = _unique(f"{w.category.__name__}: {w.message}" for w in caught)
        result.warning_causes = list(
            dict.fromkeys(
                (w.message.cause.value, str(w.message)[:2000])
                for w in caught
                if isinstance(w.message, AltParamsWarning)
            )
        )
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


def _own_fsdp2(acc: Any, options: CheckOptions) -> bool:
    """Whether the check shards the model itself: ``--fsdp2`` (its own plugin), on several ranks."""
    return options.fsdp2 and acc.is_fsdp2 and acc.num_processes > 1


def _start_equal(acc: Any, setup: CheckSetup, options: CheckOptions, result: RankResult) -> bool:
    """Compare the ranks' weights as built; under DDP copy rank 0's (as its constructor will). Whether to train.

    Under FSDP2 nothing makes them equal unless Accelerate loads rank 0's
    weights into the shards (``cpu_ram_efficient_loading``), which it does not
    when the check shards the model itself: the run stops before training.
    """
    import torch.distributed as dist

    if _world(acc) == 1 or not dist.is_initialized():
        return True
    group = dist.new_group(backend="gloo")  # the model is still on the host: a group that carries CPU tensors
    result.start_differs = differing_at_start(setup.groups, group)
    if not result.start_differs:
        return True
    plugin = getattr(acc.state, "fsdp_plugin", None)
    broadcast = not acc.is_fsdp2 or (
        not _own_fsdp2(acc, options) and bool(getattr(plugin, "cpu_ram_efficient_loading", False))
    )
    if broadcast:
        copy_rank0(setup.model, group)
    result.start_equalized = broadcast
    return broadcast


def _shard(acc: Any, setup: CheckSetup) -> None:
    """``--fsdp2``: one ``fully_shard`` unit per group (then the root), with the plugin's settings."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    plugin = acc.state.fsdp_plugin
    kwargs: dict[str, Any] = {"reshard_after_forward": plugin.reshard_after_forward}
    if isinstance(plugin.mixed_precision_policy, MixedPrecisionPolicy):
        kwargs["mp_policy"] = plugin.mixed_precision_policy
    setup.groups = shard_by_groups(setup.model, setup.groups, **kwargs)


def _optimizer_tensors(optimizer: Optimizer) -> list[torch.Tensor]:
    """Every state tensor ``optimizer`` holds (each inner optimizer's for a ``GroupedOptimizer``)."""
    inner = optimizer_of(optimizer)
    nested = getattr(inner, "inner", None)
    owners = [o for o in nested.values() if o is not None] if isinstance(nested, dict) else [inner]
    return [t for o in owners for state in o.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def _census(model: nn.Module, optimizer: Optimizer, gauge: MemoryGauge) -> dict[str, int]:
    """What the memory held now is made of: the model's tensors, the optimizer's, other tensors, the rest."""
    gauge.thaw()  # the census sees every object
    where = gauge.device.type
    level = gauge.level()
    live = live_tensor_bytes(where)
    parts = {
        "weights and buffers": storage_keys([*model.parameters(), *model.buffers()], where),
        "gradients": storage_keys([p.grad for p in model.parameters() if p.grad is not None], where),
        "optimizer state": storage_keys(_optimizer_tensors(optimizer), where),
    }
    claimed: set[int] = set()
    out: dict[str, int] = {}
    for name, keys in parts.items():
        out[name] = sum(n for k, n in keys.items() if k not in claimed)
        claimed |= set(keys)
    out["other tensors"] = sum(n for k, n in live.items() if k not in claimed)
    out["rest"] = level - sum(out.values())  # no tensor Python holds: libraries, DDP buckets, the allocator
    return out


def _available(device: torch.device) -> Optional[int]:
    """Bytes the device has left for this rank: free GPU memory, or the host's available memory per local rank."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        import psutil

        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        return int(psutil.virtual_memory().available) // ranks
    except (RuntimeError, ValueError, ImportError, OSError):
        return None


def _train(
    acc: Any,
    setup: CheckSetup,
    options: CheckOptions,
    gauge: MemoryGauge,
    result: RankResult,
    told: Callable[[str, int], None],
) -> bool:
    """The stock loop, with the readings of the module docstring; ``False`` when it stopped before training."""
    model = setup.model
    result.model_class = type(model).__name__
    if acc.state.deepspeed_plugin is not None:  # no dataloader in `prepare`: the batch sizes DeepSpeed books
        setup.accumulation = complete(acc.state.deepspeed_plugin.deepspeed_config, setup.accumulation, _world(acc))
    result.accumulation = setup.accumulation
    acc.gradient_accumulation_steps = setup.accumulation
    in_backward = _steps_in_backward(acc)
    if setup.ddp is not None:
        acc.ddp_handler = setup.ddp
    if not _start_equal(acc, setup, options, result):
        return False
    if _own_fsdp2(acc, options):
        _shard(acc, setup)
    schedule: Schedule = setup.schedule
    acc.set_phases(schedule, groups=setup.groups)
    gauge.start(model)
    raw = setup.make_optimizer(model)
    result.precision = _precision(model, acc)
    result.bf16 = _bf16(model, acc.device, result.precision["mixed_precision"])
    held: list[Optional[int]] = [None]
    hook_seconds = [0.0]

    def read_held(*_: Any) -> None:
        began = time.perf_counter()
        if not result.steps and not gauge.rebased:  # the first step: its imports and first touches are done
            gauge.rebase(memory_report(acc.switcher).total("ddp_buckets"))
        held[0] = gauge.level()
        hook_seconds[0] += time.perf_counter() - began

    # the end of a step: the inner optimizer's step post-hook; where the update runs inside the sync-boundary
    # backward (DeepSpeed steps the inner optimizer once per param group), once that backward returned
    handle = None if in_backward else raw.register_step_post_hook(read_held)
    prepared, optimizer = acc.prepare(model, raw)
    switcher = acc.switcher
    groups: ParamGroups = switcher.groups
    setup.groups = groups  # after fully_shard: drop the check's hold on the parameters from before it
    params = [p for p in model.parameters()]
    result.first_prediction = switcher.expected_peak(switcher.current)
    result.trainable_everything = sum(p.numel() * p.element_size() for p in params)
    last = switcher.history.last
    phase_started = acc.phase.name
    watch = IdleWatch(groups, acc.phase)
    slack = _smallest_group(groups) - 1 if in_backward else 0  # see StepRow.reduced_slack
    gauge.reset_peak()
    try:
        for step in range(options.steps):
            current = acc.phase
            phase = current.name
            if setup.on_step is not None:
                setup.on_step(acc.unwrap_model(prepared), step)
            _note_idle(result, watch.flags(step, frozen_groups(groups, current)))
            hook_seconds[0], held[0] = 0.0, None
            began = time.perf_counter()
            grad_bytes, unused_bytes = _micro_batches(acc, setup, prepared, optimizer, params, step)
            seconds = time.perf_counter() - began - hook_seconds[0]
            if in_backward:
                read_held()
            counter = acc.comm_counter
            reduced = counter.history[-1] if counter is not None and counter.history else None
            if in_backward:  # the gradients are gone with the update: the phase's trainable bytes
                grad_bytes = _trainable_bytes(groups, current)
            expected = None if counter is None else _expected_bytes(switcher, current, grad_bytes + unused_bytes, setup)
            result.steps.append(
                StepRow(
                    step=step,
                    phase=phase,
                    grad_bytes=grad_bytes,
                    reduced_bytes=reduced,
                    expected_reduced=expected,
                    held=held[0],
                    seconds=seconds,
                    reduced_slack=slack,
                )
            )
            told("step", step + 1)
            record = switcher.history.last
            if record is not last:
                last = record
                result.peaks.append((phase_started, gauge.peak_since_reset()))
                _note_idle(result, watch.boundary(step + 1, acc.phase))
                held_bytes, held_groups, checked = _idle_state_on_device(switcher, raw, acc.device)
                result.switches.append(
                    SwitchRow(
                        step=step + 1,
                        phase=record.phase,
                        seconds=record.seconds,
                        level=gauge.level(),
                        predicted=switcher.expected_peak(switcher.current),
                        idle_held=held_bytes,
                        idle_held_groups=held_groups,
                        idle_checked=checked,
                    )
                )
                result.weights_compared += 1  # the switch compared every rank's weights (drift_check="switch")
                phase_started = record.phase
                gauge.reset_peak()
        result.peaks.append((phase_started, gauge.peak_since_reset()))
        _note_idle(result, watch.boundary(options.steps, None))
        result.census = _census(model, raw, gauge)
        result.available = _available(acc.device)
    finally:
        if handle is not None:
            handle.remove()
        gauge.thaw()
    return True


def _smallest_group(groups: ParamGroups) -> int:
    """The bytes of the smallest group's parameters (at least 1)."""
    sizes = [sum(p.numel() * p.element_size() for p in groups.params(g)) for g in groups.names]
    return max(1, min((n for n in sizes if n), default=1))


def _trainable_bytes(groups: ParamGroups, phase: Any) -> int:
    """Bytes of the parameters ``phase`` trains (their gradients' bytes, in the weights' dtype)."""
    return sum(p.numel() * p.element_size() for g in phase.trainable for p in groups.params(g))


def _expected_bytes(switcher: Any, phase: Any, trainable: int, setup: CheckSetup) -> int:
    """What the strategy declares it communicates in one optimizer step of ``phase`` (:class:`Pricing`).

    ``trainable``: the bytes of the phase's gradients (with DDP's unused ones).
    A reduce-scatter is fed the padded trainable gradients (the switch's figure);
    an all-reduce the gradients themselves, once per micro-batch where the
    strategy reduces each (ZeRO-2); plus what it all-gathers besides (ZeRO-1/2:
    the updated partitions, as many bytes again).
    """
    pricing = switcher.strategy.pricing
    if pricing.collective is Collective.REDUCE_SCATTER:
        fed = switcher.reduced_bytes(phase)
    else:
        fed = trainable * (setup.accumulation if pricing.reduces_per_micro_batch else 1)
    every = (
        sum(p.numel() * p.element_size() for p in switcher.groups.module.parameters())
        if pricing.gathers is Gather.EVERY
        else 0
    )
    return fed + pricing.gathers.gathered_bytes(trainable=trainable, every=every)


def _micro_batches(
    acc: Any, setup: CheckSetup, model: nn.Module, optimizer: Optimizer, params: list[nn.Parameter], step: int
) -> tuple[int, int]:
    """One optimizer step: ``setup.accumulation`` micro-batches under ``accumulate``.

    Returns the bytes of the gradients at the step, and of the trainable
    parameters without one that DDP all-reduces anyway (as zeros) when it runs
    with ``find_unused_parameters=True``.
    """
    grad_bytes = unused_bytes = 0
    finds_unused = bool(getattr(acc.switcher.ddp, "find_unused_parameters", False))
    for micro in range(setup.accumulation):
        batch = setup.make_batch(step * setup.accumulation + micro, _rank(acc), acc.device)
        with acc.accumulate(model):
            loss = setup.compute_loss(model(**batch))
            acc.backward(loss)
            if acc.sync_gradients:
                grad_bytes = _grad_bytes(params)
                if finds_unused:
                    unused_bytes = sum(
                        p.numel() * p.element_size() for p in params if p.requires_grad and p.grad is None
                    )
                if setup.before_step is not None:
                    setup.before_step(model, optimizer, step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return grad_bytes, unused_bytes


def _note_idle(result: RankResult, changes: list[IdleChange]) -> None:
    room = max(0, _KEPT_CHANGES - len(result.idle_changes))
    result.idle_changes += changes[:room]
    result.idle_changed += len(changes)


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
    owner = switcher.state_owner
    if isinstance(owner, _OwnerCensus):  # the wrapper keeps the state (DeepSpeed ZeRO): its owner counts it
        return _idle_held_by_census(owner, switcher, current, leaving)
    inner = getattr(optimizer, "inner", None)
    held, names, checked = 0, [], 0
    for group in switcher.groups.names:
        if group in current.trainable or policies.get(group) not in leaving:
            continue
        checked += 1
        owner = inner.get(group) if isinstance(inner, dict) else optimizer
        if owner is None:
            continue
        found = sum(
            t.numel() * t.element_size()
            for p in switcher.groups.params(group)
            for t in (owner.state.get(p) or {}).values()
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type == device.type
        )
        if found:
            held += found
            names.append(group)
    return held, names, checked


@runtime_checkable
class _OwnerCensus(Protocol):
    """A state owner that counts what it holds per group (DeepSpeed ZeRO's: optimizer state and fp32 partition)."""

    def census(self) -> dict[str, dict[str, int]]: ...


def _idle_held_by_census(
    owner: _OwnerCensus, switcher: Any, current: Any, leaving: set[StatePolicy]
) -> tuple[int, list[str], int]:
    """:func:`_idle_state_on_device` from the owner's census: each idle group's optimizer state (against the
    run's state policy) and fp32 partition (against its master policy) on this rank."""
    census = owner.census()
    policies = switcher.idle_state_policies
    master_policy = switcher.idle_policies()[1]
    held, names, checked = 0, [], 0
    for group in switcher.groups.names:
        if group in current.trainable:
            continue
        counted = census.get(group, {})
        state = counted.get("state", 0) if policies.get(group) in leaving else 0
        master = counted.get("master", 0) if master_policy in leaving else 0
        if policies.get(group) in leaving or master_policy in leaving:
            checked += 1
        if state or master:
            held += state + master
            names.append(group)
    return held, names, checked
