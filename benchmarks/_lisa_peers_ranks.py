"""What every rank of ``lisa_peers.py`` runs: the job, the four ways of training it, the meter.

Launched by ``benchmarks/lisa_peers.py`` (``torchrun``, gloo on the CPU); each
rank writes ``RANKS_DIR/rank{r}.json``. The variants, the job and what is
measured are described in ``lisa_peers.py``; this file holds the code that
trains and measures:

* :class:`NaiveLisa`: LISA written the single-GPU way (our own, from the
  method's description: freeze the decoder layers, flip ``requires_grad`` on
  the drawn ones every ``every`` steps).
* :class:`Meter`: per optimizer step, the digests all-gathered, the bytes the
  Trainer's DDP wrapper all-reduced, the trainable bytes, the optimizer state
  held per group, the wall and CPU time of the step.
* :func:`run_variant`: one Trainer run; a run that raises is recorded with its
  error and step, and its DDP wrapper freed before the next one starts.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional, Sequence

import accelerate
import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.nn.parallel import DistributedDataParallel
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from hf_altparams import (
    AlternatingFreeze,
    CommCounter,
    ParamGroups,
    Schedule,
    grouped_optimizer,
    lisa,
    register_comm_counter,
)
from hf_altparams.engine import shutdown
from hf_altparams.testing import write_rank_result

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lisa_peers import EXTRA_GROUPS, REFERENCE, RUN_ORDER, Job, parse  # noqa: E402  (the driver: stdlib only)
from tests.support.digests import param_sha  # noqa: E402  (lisa_peers put the repository root on sys.path)

# --------------------------------------------------------------------------- the job


def build_model(job: Job) -> LlamaForCausalLM:
    """The decoder, random weights from ``job.seed`` (equal on every rank and in every variant)."""
    config = LlamaConfig(
        vocab_size=job.vocab,
        hidden_size=job.hidden,
        intermediate_size=job.intermediate,
        num_hidden_layers=job.layers,
        num_attention_heads=job.heads,
        num_key_value_heads=job.heads,
        max_position_embeddings=max(job.seq, 64),
        tie_word_embeddings=False,
    )
    torch.manual_seed(job.seed)
    return LlamaForCausalLM(config)


class CountingTokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Sequences counting up from a random start by a random stride (mod the vocabulary): learnable."""

    def __init__(self, job: Job, n: int) -> None:
        gen = torch.Generator().manual_seed(job.seed + 1)
        start = torch.randint(0, job.vocab, (n, 1), generator=gen)
        stride = torch.randint(1, 8, (n, 1), generator=gen)
        self.ids = (start + stride * torch.arange(job.seq)) % job.vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def lisa_schedule(job: Job) -> Schedule:
    return lisa(job.group_names(), k=job.k, every=job.every, always=("emb", "head"), seed=job.seed)


def layer_draws(job: Job) -> list[list[int]]:
    """The layer indices LISA trains in each block of ``every`` steps (from the ``lisa`` schedule)."""
    schedule = lisa_schedule(job)
    blocks = -(-job.steps // job.every)
    return [
        sorted(int(g[len("layer") :]) for g in schedule.phase_at(b * job.every).trainable if g.startswith("layer"))
        for b in range(blocks)
    ]


# --------------------------------------------------------------------------- the naive callback


class NaiveLisa(TrainerCallback):
    """LISA written the single-GPU way: flip ``requires_grad`` on the drawn decoder layers.

    Every layer of ``layers`` (the model's decoder ``ModuleList``) is frozen
    when training starts; before a step ``s`` with ``s % every == 0`` the layers
    in ``draws[s // every]`` get ``requires_grad=True``, the others ``False``.
    The embeddings and head stay trainable. Nothing tells DDP, which fixed the
    parameters it reduces when the Trainer wrapped the model (before this
    callback's ``on_train_begin``, with every parameter trainable).
    """

    def __init__(self, layers: nn.ModuleList, draws: Sequence[Sequence[int]], every: int) -> None:
        self.layers, self.draws, self.every = layers, draws, every

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        for layer in self.layers:
            layer.requires_grad_(False)

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if state.global_step % self.every == 0:
            drawn = set(self.draws[state.global_step // self.every])
            for i, layer in enumerate(self.layers):
                layer.requires_grad_(i in drawn)


# --------------------------------------------------------------------------- the meter


@dataclass
class StepRecord:
    """What one rank measured over one optimizer step."""

    step: int
    trainable_bytes: int
    trained_groups: list[str]
    allreduce_bytes: Optional[int]
    state_bytes: int
    state_frozen_bytes: int
    state_by_group: dict[str, int]
    digest: str
    ranks_identical: bool
    max_abs_diff: float
    seconds: float
    cpu_seconds: float


@dataclass
class VariantRun:
    """One rank's run of one variant."""

    variant: str
    steps: list[StepRecord] = field(default_factory=list)
    losses: list[dict[str, float]] = field(default_factory=list)
    altparams_logs: list[dict[str, Any]] = field(default_factory=list)
    error: Optional[dict[str, Any]] = None
    completed_steps: int = 0


def tensor_bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def compare_ranks(model: nn.Module, group: dist.ProcessGroup) -> tuple[str, bool, float]:
    """This rank's parameter digest; whether every rank has it; the largest difference between ranks."""
    digest = param_sha(model)
    everyone: list[Optional[str]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digest, group=group)
    if len(set(everyone)) == 1:
        return digest, True, 0.0
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
    return digest, False, float((high - low).max())


class Meter(TrainerCallback):
    """Measures ``run`` at every optimizer step; listed after the variant's own callback.

    The step's time runs from the end of the meter's work at the previous step
    to the start of its work at this one, so it holds everything the Trainer and
    the variant do (a phase switch included) and nothing the meter does. The
    meter's collectives run on ``group``, a process group of their own.
    """

    def __init__(self, model: nn.Module, groups: ParamGroups, run: VariantRun, group: dist.ProcessGroup) -> None:
        self.model, self.run, self.group = model, run, group
        self.group_of = {id(p): g for g in groups.names for p in groups.params(g)}
        self.params = list(model.parameters())
        self.ddp: Optional[DistributedDataParallel] = None
        self.counter: Optional[CommCounter] = None
        self.handle: Any = None
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()
        self.step = 0
        self.trainable_bytes = 0
        self.trained: set[str] = set()

    def catch(self, module: nn.Module, _inputs: Any) -> None:
        """A global forward pre-hook: the Trainer's DDP wrapper at its first call gets the counting comm hook."""
        if isinstance(module, DistributedDataParallel) and module.module is self.model:
            self.handle.remove()
            self.ddp = module
            self.counter = register_comm_counter(module)  # the wrapper's counter if it has one already

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.handle = register_module_forward_pre_hook(self.catch)
        self.clock, self.cpu_clock = time.perf_counter(), time.process_time()

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.step = state.global_step + 1
        live = [p for p in self.params if p.requires_grad]
        self.trainable_bytes = sum(tensor_bytes(p) for p in live)
        self.trained = {self.group_of[id(p)] for p in live}

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Optional[torch.optim.Optimizer] = None,
        **kwargs: Any,
    ) -> None:
        seconds, cpu_seconds = time.perf_counter() - self.clock, time.process_time() - self.cpu_clock
        reduced = self.counter.end_step() if self.counter is not None else None
        by_group: dict[str, int] = {}
        for param, values in (optimizer.state if optimizer is not None else {}).items():
            name = self.group_of[id(param)]
            by_group[name] = by_group.get(name, 0) + sum(tensor_bytes(v) for v in values.values())
        digest, identical, diff = compare_ranks(self.model, self.group)
        self.run.steps.append(
            StepRecord(
                step=self.step,
                trainable_bytes=self.trainable_bytes,
                trained_groups=sorted(self.trained),
                allreduce_bytes=reduced,
                state_bytes=sum(by_group.values()),
                state_frozen_bytes=sum(b for g, b in by_group.items() if g not in self.trained),
                state_by_group=by_group,
                digest=digest,
                ranks_identical=identical,
                max_abs_diff=diff,
                seconds=seconds,
                cpu_seconds=cpu_seconds,
            )
        )
        self.run.completed_steps = self.step
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

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.handle is not None:
            self.handle.remove()


# --------------------------------------------------------------------------- one variant on one rank


def run_variant(
    variant: str, job: Job, draws: list[list[int]], work: Path, group: dist.ProcessGroup
) -> tuple[VariantRun, torch.Tensor]:
    """Train ``job`` the ``variant`` way on this rank; return its record and its final weights, flat."""
    model = build_model(job)
    groups = ParamGroups.from_layers(model, "model.layers", extra=EXTRA_GROUPS)
    args = TrainingArguments(
        output_dir=str(work / variant),
        max_steps=job.steps,
        per_device_train_batch_size=job.batch,
        learning_rate=job.lr,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=job.seed,
        disable_tqdm=True,
        dataloader_num_workers=0,
        ddp_find_unused_parameters=(variant == "naive_find_unused"),
    )
    run = VariantRun(variant)
    callbacks: list[TrainerCallback] = []
    optimizers: Any = (None, None)
    if variant in ("naive", "naive_find_unused"):
        callbacks.append(NaiveLisa(model.model.layers, draws, job.every))
    else:
        callbacks.append(AlternatingFreeze(groups, lisa_schedule(job)))
        if variant == "hf_altparams_drop":
            cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)  # the Trainer's default, per group
            kwargs.pop("weight_decay", None)
            optimizers = (
                grouped_optimizer(groups, cls, weight_decay=args.weight_decay, state_policy="drop", **kwargs),
                None,
            )
    meter = Meter(model, groups, run, group)
    callbacks.append(meter)
    data = CountingTokens(job, job.steps * job.batch * dist.get_world_size())
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks, optimizers=optimizers)
    try:
        trainer.train()
    except Exception as err:  # recorded: a failure is one of the outcomes compared
        run.error = {
            "type": type(err).__name__,
            "message": str(err),
            "step": meter.step,
            "traceback": traceback.format_exc(limit=4),
        }
    finally:
        wrappers = {id(w): w for w in (meter.ddp, trainer.model_wrapped) if w is not None}
        shutdown(*wrappers.values(), destroy=False)  # free the reducers; the group stays for the next variant
    return run, torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def round_order(round_: int, variants: Sequence[str]) -> list[str]:
    """The variants of round ``round_``: those that complete rotated by one each round, ``naive`` last."""
    completing = [v for v in RUN_ORDER if v in variants and v != "naive"]
    shift = round_ % len(completing) if completing else 0
    return completing[shift:] + completing[:shift] + (["naive"] if "naive" in variants else [])


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Every rank: run each variant ``--repeats`` times, write ``rank{r}.json`` to the ranks folder."""
    args, job = parse(argv)
    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=120))  # the meter's own collectives
    draws = layer_draws(job)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    finals: dict[str, torch.Tensor] = {}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.repeats):
            for variant in round_order(round_, args.variants):
                dist.barrier(group=group)
                run, flat = run_variant(variant, job, draws, Path(work), group)
                runs[variant].append(asdict(run))
                finals.setdefault(variant, flat)
    reference = finals.get(REFERENCE)
    vs_reference = {v: None if reference is None else float((f - reference).abs().max()) for v, f in finals.items()}
    write_rank_result(
        args.worker,
        {
            "runs": runs,
            "final_vs_reference": vs_reference,
            "draws": draws,
            "threads": torch.get_num_threads(),
            "model_bytes": sum(tensor_bytes(p) for p in build_model(job).parameters()),
            "versions": {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "accelerate": accelerate.__version__,
            },
        },
        rank=dist.get_rank(),
    )
    dist.barrier(group=group)
    shutdown()


if __name__ == "__main__":
    main()
