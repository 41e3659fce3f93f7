"""What every rank of ``deepspeed_lisa.py`` runs: one row (a way of training under one ZeRO stage), measured.

Launched by ``benchmarks/deepspeed_lisa.py`` with plain ``torchrun`` (no
``ACCELERATE_USE_CPU``: with it the Trainer drops DeepSpeed without a word);
each rank writes ``RANKS_DIR/rank{r}.json``. The job, the ways and what is
measured are described in ``deepspeed_lisa.py``; this file holds the code that
trains and measures:

* :class:`CommMeter`: every collective that goes through ``deepspeed.comm``,
  counted with its bytes. Every ``deepspeed.comm`` function calls a method of
  one backend object (``deepspeed.comm.comm.cdb``); the meter replaces each
  collective method of that object by a counting one, so nothing DeepSpeed
  communicates escapes it, whoever calls it. The meter's own collectives (and
  hf_altparams' switch agreement) go through ``torch.distributed`` directly and
  are not in the count.
* :func:`state_census`: the optimizer state this rank holds, read from the
  DeepSpeed optimizer's own tensors: the inner torch optimizer's state (AdamW's
  moments) and the fp32 partitions DeepSpeed steps, each storage once, leaving
  out a partition that shares its storage with the weights (what an idle group's
  partition becomes when its state is dropped: nothing of its own is held).
* :class:`Meter`: per optimizer step, the comm count, the census, a digest per
  group of this rank's weights (the whole weight at ZeRO-1/2, this rank's
  partition at ZeRO-3), whether the ranks hold the same weights, the trainable
  bytes, the wall and CPU time of the step.
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import accelerate
import deepspeed
import torch
import torch.distributed as dist
import transformers
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hf_altparams import AlternatingFreeze, ParamGroups
from hf_altparams.engine import shutdown
from hf_altparams.testing import write_rank_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _lisa_peers_ranks import CountingTokens, NaiveLisa, build_model  # noqa: E402  (the same job, the same callback)
from deepspeed_lisa import EXTRA_GROUPS, Job, ds_config, lisa_schedule, parse  # noqa: E402  (the driver)

# --------------------------------------------------------------------------- counting deepspeed.comm

#: The collective methods of DeepSpeed's comm backend (deepspeed 0.19: ``deepspeed/comm/torch.py``). None of them
#: calls another of them through the backend object, so each call is counted once.
COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "inference_all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_base",
    "all_gather_coalesced",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def nbytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a list or tuple."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    return 0


def argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, *names: str) -> Any:
    """The argument at ``position`` or passed by one of ``names``."""
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return args[position] if len(args) > position else None


def full_bytes(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The bytes of the whole tensor a collective works on: an all-gather's output, a reduce-scatter's input,
    the tensor itself for the others."""
    if op in ("all_gather_into_tensor", "all_gather_base"):
        return nbytes(argument(args, kwargs, 0, "output_tensor"))
    if op in ("all_gather", "all_gather_coalesced"):
        return nbytes(argument(args, kwargs, 0, "tensor_list", "output_tensors"))
    if op == "reduce_scatter":
        return nbytes(argument(args, kwargs, 1, "input_list"))
    if op == "reduce_scatter_tensor":
        return nbytes(argument(args, kwargs, 1, "input_tensor"))
    return nbytes(argument(args, kwargs, 0, "tensor", "tensors", "object_list"))


def own_bytes(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The bytes this rank puts in: an all-gather's input (its partition); the whole tensor for the others."""
    if op in ("all_gather_into_tensor", "all_gather_base"):
        return nbytes(argument(args, kwargs, 1, "input_tensor"))
    if op in ("all_gather", "all_gather_coalesced"):
        return nbytes(argument(args, kwargs, 1, "tensor", "input_tensors"))
    return full_bytes(op, args, kwargs)


class CommMeter:
    """Counts every collective DeepSpeed issues through ``deepspeed.comm``: calls and bytes, per operation."""

    def __init__(self) -> None:
        self.calls: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # op -> [calls, full bytes, own bytes]
        self.installed: list[str] = []

    def install(self) -> None:
        import deepspeed.comm.comm as ds_comm

        backend = ds_comm.cdb
        if backend is None:
            raise RuntimeError("deepspeed.comm has no backend yet: install the meter after deepspeed.initialize")
        for op in COLLECTIVES:
            method = getattr(backend, op, None)
            if method is not None and op not in self.installed:
                setattr(backend, op, self.counting(op, method))
                self.installed.append(op)

    def counting(self, op: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            entry = self.calls[op]
            entry[0] += 1
            entry[1] += full_bytes(op, args, kwargs)
            entry[2] += own_bytes(op, args, kwargs)
            return method(*args, **kwargs)

        return counted

    def take(self) -> dict[str, list[int]]:
        """The counts since the last call, per operation; the meter starts again from zero."""
        out = {op: list(entry) for op, entry in self.calls.items()}
        self.calls.clear()
        return out


# --------------------------------------------------------------------------- what the optimizer holds


def zero_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO optimizer behind the optimizer the Trainer hands its callbacks (Accelerate's wrapper)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None and hasattr(inner, "optimizer") else optimizer


def fp32_partitions(zero: Any) -> list[torch.Tensor]:
    """The fp32 partitions this rank's ZeRO optimizer steps (ZeRO-1/2 and ZeRO-3 name them differently)."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        found = getattr(zero, name, None)
        if found is not None:
            return [t for t in found if isinstance(t, torch.Tensor)]
    raise RuntimeError(f"{type(zero).__name__} has no fp32 partitions this benchmark knows how to read")


def local_weight(param: nn.Parameter) -> torch.Tensor:
    """This rank's copy of a weight: the whole weight at ZeRO-1/2, its partition at ZeRO-3 (``ds_tensor``)."""
    partition = getattr(param, "ds_tensor", None)
    return partition if isinstance(partition, torch.Tensor) else param.data


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def state_census(zero: Any, model: nn.Module) -> dict[str, int]:
    """Bytes this rank holds: the inner optimizer's state tensors, the fp32 partitions that are not the weights."""
    weights = {storage_key(local_weight(p)) for p in model.parameters()}
    seen: set[int] = set()
    moments = 0
    for values in zero.optimizer.state.values():
        for value in values.values():
            if isinstance(value, torch.Tensor) and value.numel() and storage_key(value) not in seen:
                seen.add(storage_key(value))
                moments += nbytes(value)
    masters = 0
    for partition in fp32_partitions(zero):
        key = storage_key(partition)
        if partition.numel() and key not in weights and key not in seen:
            seen.add(key)
            masters += nbytes(partition)
    return {"adam_state": moments, "fp32_partitions": masters}


# --------------------------------------------------------------------------- digests


def digest(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the tensors' bytes. Each is copied first: ``Tensor.numpy()`` would mark the storage it reads
    as not resizable, and the library may let go of a storage later."""
    h = hashlib.sha256()
    for t in tensors:
        copy = t.detach().reshape(-1).clone()
        h.update(copy.view(torch.uint8).numpy().tobytes() if copy.numel() else b"")
    return h.hexdigest()[:20]


def group_digests(groups: ParamGroups) -> dict[str, str]:
    return {g: digest([local_weight(p) for p in groups.params(g)]) for g in groups.names}


# --------------------------------------------------------------------------- the meter


@dataclass
class StepRecord:
    """What one rank measured over one optimizer step."""

    step: int
    trainable_bytes: int
    trained_groups: list[str]
    comm: dict[str, list[int]]
    comm_bytes: int
    comm_own_bytes: int
    state: dict[str, int]
    digests: dict[str, str]
    ranks_identical: Optional[bool]
    seconds: float
    cpu_seconds: float


@dataclass
class RowRun:
    """One rank's run of one row."""

    row: str
    stage: int
    way: str
    zero_optimizer: str = ""
    initial_digests: dict[str, str] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    losses: list[dict[str, float]] = field(default_factory=list)
    altparams_logs: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[dict[str, Any]] = None
    completed_steps: int = 0


class Meter(TrainerCallback):
    """Measures ``run`` at every optimizer step; listed after the row's own callback (so after its switch).

    A step's time runs from the end of the meter's work at the previous step to
    the start of its work at this one: everything the Trainer, DeepSpeed and
    the row's callback do, nothing the meter does. The meter's collectives run
    on ``group``, a gloo process group of its own, through ``torch.distributed``
    (not counted by the comm meter).
    """

    def __init__(self, model: nn.Module, groups: ParamGroups, run: RowRun, group: dist.ProcessGroup) -> None:
        self.model, self.groups, self.run, self.group = model, groups, run, group
        self.group_of = {id(p): g for g in groups.names for p in groups.params(g)}
        self.comm = CommMeter()
        self.zero: Any = None
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()
        self.step = 0
        self.trainable_bytes = 0
        self.trained: set[str] = set()

    def everyone(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, value, group=self.group)
        return out

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        self.zero = zero_optimizer(optimizer)
        self.run.zero_optimizer = type(self.zero).__name__
        self.comm.install()
        self.run.initial_digests = group_digests(self.groups)
        self.comm.take()  # what ran before the first step is not a step's
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.step = state.global_step + 1
        live = [p for p in self.model.parameters() if p.requires_grad]
        self.trainable_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in live)
        self.trained = {self.group_of[id(p)] for p in live if id(p) in self.group_of}

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        seconds, cpu_seconds = time.perf_counter() - self.clock, time.process_time() - self.cpu_clock
        calls = self.comm.take()
        census = state_census(self.zero, self.model)
        digests = group_digests(self.groups)
        # ZeRO-3: each rank holds other partitions, so only ZeRO-1/2 ranks can be compared
        identical = None if self.run.stage == 3 else len({str(d) for d in self.everyone(digests)}) == 1
        self.run.steps.append(
            StepRecord(
                step=self.step,
                trainable_bytes=self.trainable_bytes,
                trained_groups=sorted(self.trained),
                comm=calls,
                comm_bytes=sum(c[1] for c in calls.values()),
                comm_own_bytes=sum(c[2] for c in calls.values()),
                state=census,
                digests=digests,
                ranks_identical=identical,
                seconds=seconds,
                cpu_seconds=cpu_seconds,
            )
        )
        self.run.completed_steps = self.step
        dist.barrier(group=self.group)
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        logs = logs or {}
        if "loss" in logs:
            self.run.losses.append({"step": state.global_step, "loss": float(logs["loss"])})
        kept = {k: v for k, v in logs.items() if k.startswith("altparams/")}
        if kept:
            self.run.altparams_logs.append({"step": state.global_step, **kept})


# --------------------------------------------------------------------------- one row on one rank


def layer_draws(job: Job) -> list[list[int]]:
    """The layer indices LISA trains in each window of ``every`` steps (the ``lisa`` schedule's draws)."""
    schedule = lisa_schedule(job)
    windows = -(-job.steps // job.every)
    return [
        sorted(int(g[len("layer") :]) for g in schedule.phase_at(w * job.every).trainable if g.startswith("layer"))
        for w in range(windows)
    ]


def run_row(job: Job, stage: int, way: str, work: Path) -> RowRun:
    """Train ``job`` the ``way`` way under ZeRO-``stage`` on this rank; return what it measured."""
    model = build_model(job)  # before the arguments: built whole on every rank, then partitioned by DeepSpeed
    groups = ParamGroups.from_layers(model, "model.layers", extra=EXTRA_GROUPS)
    args = TrainingArguments(
        output_dir=str(work / f"z{stage}_{way}"),
        max_steps=job.steps,
        per_device_train_batch_size=job.batch,
        learning_rate=job.lr,
        weight_decay=job.weight_decay,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=job.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        deepspeed=ds_config(stage),
    )
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=300))  # the meter's own collectives
    run = RowRun(row=f"z{stage}_{way}", stage=stage, way=way)
    callbacks: list[TrainerCallback] = []
    if way == "naive":
        callbacks.append(NaiveLisa(model.model.layers, layer_draws(job), job.every))
    elif way == "altparams":
        callbacks.append(AlternatingFreeze(groups, lisa_schedule(job)))
    meter = Meter(model, groups, run, group)
    callbacks.append(meter)
    data = CountingTokens(job, job.steps * job.batch * dist.get_world_size())
    try:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
    except Exception as err:  # recorded: a refusal or a failure is one of the outcomes reported
        run.error = {
            "type": type(err).__name__,
            "message": str(err),
            "step": meter.step,
            "traceback": traceback.format_exc(limit=6),
        }
    return run


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Every rank: run the row, write ``rank{r}.json`` to the ranks folder."""
    args, job = parse(argv)
    with tempfile.TemporaryDirectory() as work:
        run = run_row(job, args.stage, args.way, Path(work))
    write_rank_result(
        args.worker,
        {
            "run": asdict(run),
            "draws": layer_draws(job),
            "threads": torch.get_num_threads(),
            "model_bytes": sum(nbytes(p) for p in build_model(job).parameters()),
            "group_bytes": {g: sum(nbytes(p) for p in ps) for g, ps in group_params(job).items()},
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "accelerate": accelerate.__version__,
                "deepspeed": deepspeed.__version__,
            },
        },
        rank=dist.get_rank(),
    )
    dist.barrier()
    shutdown()


def group_params(job: Job) -> dict[str, list[nn.Parameter]]:
    model = build_model(job)
    groups = ParamGroups.from_layers(model, "model.layers", extra=EXTRA_GROUPS)
    return {g: list(groups.params(g)) for g in groups.names}


if __name__ == "__main__":
    main()
