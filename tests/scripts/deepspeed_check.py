"""Check script: phases under DeepSpeed ZeRO-1/2 through the Trainer and Accelerate, on 2 CPU ranks (gloo).

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``, final weights to ``OUT_DIR/<run>.pt``)::

    python -m torch.distributed.run --nproc_per_node 2 deepspeed_check.py OUT_DIR [EXTENSIONS_DIR]

Plain ``torchrun`` (or its ranks forked by ``launch(..., launcher="forked")``,
as the test does): no ``ACCELERATE_USE_CPU`` (it makes the Trainer drop DeepSpeed
silently); the DDP reference runs ask for CPU themselves (``use_cpu=True`` /
``cpu=True``). DeepSpeed's shared-memory comm op is not built
(:func:`hf_altparams.engine.deepspeed.skip_shm_comm_build`); ``EXTENSIONS_DIR``
becomes ``TORCH_EXTENSIONS_DIR``, where a C++ op would be built (the test checks
that it stays empty; given as an argument, not in the environment, so that the
forked ranks come from the suite's usual server).

Before the runs the objects of the imported modules are moved out of the
garbage collector's sight (``gc.freeze()``): the Trainer and Accelerate call
``gc.collect()`` for every run (``free_memory``), and a full collection walks
every object of torch, transformers and DeepSpeed, about half a CPU-second each
time; the runs' own objects are still collected.

The job: a 4-layer Llama from a config (hidden 32), sequences of 16 tokens,
AdamW with ``adam_epsilon=1e-3`` (so that fp32 round-off is not amplified into
sign-like steps: the comparison with DDP is then to round-off), weight decay,
clipping 1.0. On CPU, Accelerate (hence the Trainer) gives each rank of a
DeepSpeed run a one-process state, so every rank reads every batch; the DDP
references are fed each batch once per rank (:class:`RankCopies`) so that both
train on the same global batches.

Runs (one after another, in the same process group), each recorded per step:
the trainable groups, a digest per group of the weights and of this rank's fp32
partitions, the optimizer state per group on this rank, the bytes of every
DeepSpeed collective (``count_comm=True``), the loss:

* Trainer: ``zero{1,2}_{lisa,badam,alternating}`` (alternating: ZeRO-1 with the
  default idle policy, state kept and fp32 partitions offloaded; ZeRO-2 with
  ``idle_state="keep"``) and ``zero{1,2}_full`` (every
  group at every step: the bytes and state of full fine-tuning), ``ddp_{lisa,
  badam,alternating}`` (the references), ``zero2_lisa_resumed`` (resumed from
  ``zero2_lisa``'s DeepSpeed checkpoint-3);
* Accelerate (``PhasedAccelerator``; ZeRO-1 from a DeepSpeed config file in the
  environment, as ``accelerate launch`` with a DeepSpeed accelerate config
  passes it; ZeRO-2 from a ``DeepSpeedPlugin``): ``acc_zero{1,2}_{lisa,badam,alternating}``,
  gradient accumulation 2, ``acc_zero2_lisa_bf16`` (DeepSpeed's bf16: bf16 weights and
  gradients, fp32 partitions), ``save_state`` after step 3 of ``acc_zero2_lisa``,
  ``acc_zero2_lisa_resumed`` (``load_state`` in the same process after the run),
  and ``acc_ddp_{lisa,badam,alternating}`` (the references);
* ``refusals``: what is refused before any step, and the message.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_altparams.engine.deepspeed import skip_shm_comm_build
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.trainer import AlternatingFreeze, grouped_optimizer
from hf_altparams.plan import Alternating, ParamGroups, badam, lisa
from hf_altparams.testing.launch import write_rank_result

LAYERS, HIDDEN, VOCAB, SEQ, BATCH = 4, 32, 128, 16, 2
EXTRA = {"emb": "model.embed_tokens.*", "head": ["model.norm.*", "lm_head.*"]}
GROUP_NAMES = ["emb", *[f"layer{i}" for i in range(LAYERS)], "head"]
LR, WEIGHT_DECAY, EPS = 1e-3, 0.01, 1e-3
SCHEDULES: dict[str, tuple[Callable[[], Any], int]] = {  # kind -> (schedule, steps)
    "lisa": (lambda: lisa([f"layer{i}" for i in range(LAYERS)], k=2, every=2, always=("emb", "head"), seed=3), 6),
    "badam": (lambda: badam(GROUP_NAMES, steps_per_block=1, order="ascending"), 4),
    "alternating": (lambda: Alternating([("emb", "layer0", "layer1"), ("layer2", "layer3", "head")], every=1), 4),
    "full": (lambda: Alternating([tuple(GROUP_NAMES)], every=1), 2),
}


def model_() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    return LlamaForCausalLM(config)


def groups_of(model: Any) -> ParamGroups:
    return ParamGroups.from_layers(model, "model.layers", extra=EXTRA)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, count: int) -> None:
        generator = torch.Generator().manual_seed(1)
        self.rows = torch.randint(0, VOCAB, (count, SEQ), generator=generator)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


class RankCopies(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``base`` with every batch repeated once per rank: sharded in sequence, each rank reads batch k at step k."""

    def __init__(self, base: Tokens, world: int) -> None:
        self.base, self.world = base, world

    def __len__(self) -> int:
        return len(self.base) * self.world

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.base[(i // BATCH // self.world) * BATCH + i % BATCH]


def sha(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().float().clone().contiguous().numpy().tobytes())  # a copy: numpy() pins storages
    return digest.hexdigest()[:16]


def world() -> int:
    return dist.get_world_size()


class Recorder:
    """What a run did per step (see the module docstring); shared by the Trainer's and Accelerate's runs."""

    def __init__(self, groups: ParamGroups) -> None:
        self.groups = groups
        self.steps: list[dict[str, Any]] = []
        self.trainable: list[str] = []
        self.initial: Optional[dict[str, str]] = None

    def weights(self) -> dict[str, str]:
        return {g: sha(self.groups.params(g)) for g in self.groups.names}

    def begin(self, trainable: list[str]) -> None:
        if self.initial is None:
            self.initial = self.weights()
        self.trainable = trainable

    def end(self, step: int, owner: Any, comm: Any, loss: Optional[float], after: list[str]) -> None:
        weights = self.weights()
        everyone: list[Any] = [None] * world()
        dist.all_gather_object(everyone, weights)
        entry: dict[str, Any] = {
            "step": step,
            "trainable": self.trainable,
            "after": after,
            "weights": weights,
            "ranks_identical": all(e == weights for e in everyone),
            "loss": loss,
        }
        if owner is not None and hasattr(owner, "census"):
            entry["census"] = owner.census()
            entry["fp32"] = {g: sha(owner.master_partitions(g)) for g in self.groups.names}
        if comm is not None and comm.history:
            entry["comm_bytes"] = comm.history[-1]
        entry["trainable_bytes"] = sum(
            p.numel() * p.element_size() for g in self.trainable for p in self.groups.params(g)
        )
        self.steps.append(entry)

    def result(self, seconds: float) -> dict[str, Any]:
        return {
            "initial": self.initial,
            "steps": self.steps,
            "seconds": seconds,
            "group_bytes": {
                g: sum(p.numel() * p.element_size() for p in self.groups.params(g)) for g in self.groups.names
            },
        }


# ------------------------------------------------------------------------------------------------ the Trainer
class Meter(TrainerCallback):
    def __init__(self, freeze: AlternatingFreeze, recorder: Recorder) -> None:
        self.freeze, self.recorder, self.loss = freeze, recorder, None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.freeze.phase is not None
        self.recorder.begin(sorted(self.freeze.phase.trainable))

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        switcher = self.freeze.switcher
        assert switcher is not None
        assert self.freeze.phase is not None
        self.recorder.end(
            state.global_step, switcher.state_owner, self.freeze.comm, None, sorted(self.freeze.phase.trainable)
        )


def trainer_run(
    name: str, out: Path, kind: str, mode: str, *, stage: int = 0, save: int = 0, resume: Optional[str] = None
) -> dict[str, Any]:
    make, steps = SCHEDULES[kind]
    schedule = make()
    model = model_()
    common: dict[str, Any] = dict(
        output_dir=str(out / name),
        max_steps=steps,
        per_device_train_batch_size=BATCH,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        optim="adamw_torch",
        adam_epsilon=EPS,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",
        save_strategy="steps" if save else "no",
        save_steps=save or 500,
    )
    base = Tokens(steps * BATCH)
    if mode == "ds":
        config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
            "zero_optimization": {"stage": stage},
        }
        args = TrainingArguments(deepspeed=config, **common)
        data: Any = base
    else:
        from accelerate.state import AcceleratorState

        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)  # set by the DeepSpeed runs' TrainingArguments
        AcceleratorState._reset_state(True)
        args = TrainingArguments(use_cpu=True, ddp_find_unused_parameters=False, **common)
        data = RankCopies(base, world())
    options = {"idle_state": "keep"} if (kind, stage) == ("alternating", 2) else None
    freeze = AlternatingFreeze(groups_of, schedule, count_comm=mode == "ds", switcher_options=options)
    recorder = Recorder(groups_of(model))
    optimizers: Any = (None, None)
    if mode == "ddp":  # the library's DDP path with the same decay split and idle-state policy
        groups = groups_of(model)
        optimizers = (
            grouped_optimizer(
                groups,
                torch.optim.AdamW,
                lr=LR,
                eps=EPS,
                weight_decay=WEIGHT_DECAY,
                state_policy=schedule.idle_state if kind != "alternating" else "keep",
            ),
            None,
        )
        freeze = AlternatingFreeze(groups, schedule)
        recorder = Recorder(groups)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, optimizers=optimizers, callbacks=[freeze, Meter(freeze, recorder)]
    )
    recorder.groups = freeze.groups if freeze.groups is not None else recorder.groups
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume)
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out / f"{name}.pt")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result = recorder.result(seconds)
    result["losses"] = losses
    result["switches"] = len(freeze.records)
    return result


# ------------------------------------------------------------------------------------------------ Accelerate
def accelerate_run(
    name: str,
    out: Path,
    kind: str,
    mode: str,
    *,
    stage: int = 0,
    save_after: int = 0,
    load: Optional[str] = None,
    bf16: bool = False,
) -> dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DeepSpeedPlugin

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    make, steps = SCHEDULES[kind]
    accumulation = 2
    model = model_()
    groups = groups_of(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=WEIGHT_DECAY)
    if mode == "ds":
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        # On CPU Accelerate counts one process per DeepSpeed rank (each reads every batch): the global batch
        # DeepSpeed checks against its world is given, not derived from Accelerate's count.
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": accumulation,
            "train_batch_size": BATCH * accumulation * world(),
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": stage},
            "bf16": {"enabled": bf16},
        }
        plugin: Optional[DeepSpeedPlugin] = DeepSpeedPlugin(hf_ds_config=config)
        if stage == 1:  # as `accelerate launch` with a DeepSpeed config passes it: the environment, a config file
            path = out / f"ds_config_zero1_rank{dist.get_rank()}.json"  # one each: no rank reads a half-written one
            path.write_text(json.dumps(config))
            os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(path)
            plugin = None
        acc = PhasedAccelerator(
            make(),
            groups=groups,
            deepspeed_plugin=plugin,
            count_comm=True,
            gradient_accumulation_steps=accumulation,
            mixed_precision="bf16" if bf16 else "no",
        )
        os.environ.pop("ACCELERATE_DEEPSPEED_CONFIG_FILE", None)
        rows = Tokens(steps * BATCH * accumulation)
    else:
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        acc = PhasedAccelerator(make(), groups=groups, cpu=True, gradient_accumulation_steps=accumulation)
        rows = RankCopies(Tokens(steps * BATCH * accumulation), world())  # type: ignore[assignment]
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH, shuffle=False)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    recorder = Recorder(groups)
    started = time.perf_counter()
    batches: Any = loader
    if load is not None:
        acc.load_state(load)  # the saved position and phase, then DeepSpeed's own checkpoint
        batches = acc.skip_first_batches(loader, acc.schedule_step * accumulation)
    micro = 0
    for batch in batches:
        if acc.schedule_step >= steps:
            break
        if micro % accumulation == 0:
            assert acc.phase is not None
            recorder.begin(sorted(acc.phase.trainable))
        micro += 1
        with acc.accumulate(model):
            loss = model(**batch).loss
            acc.backward(loss)
            if mode == "ddp" and acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        if acc.sync_gradients:
            assert acc.switcher is not None
            recorder.end(
                acc.schedule_step,
                acc.switcher.state_owner,
                acc.comm_counter,
                float(loss.detach()),
                sorted(acc.phase.trainable) if acc.phase is not None else [],
            )
            if save_after and acc.schedule_step == save_after:
                acc.save_state(str(out / f"{name}_state_{save_after}"))
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        unwrapped = acc.unwrap_model(model)
        torch.save({n: p.detach().clone() for n, p in unwrapped.named_parameters()}, out / f"{name}.pt")
    result = recorder.result(seconds)
    acc.free_memory()
    return result


def refusals(out: Path) -> dict[str, Any]:
    """What is refused before any step: each case's error type and message (``None``: not refused)."""
    from hf_altparams.engine import PhaseSwitcher
    from hf_altparams.errors import AltParamsError

    def trainer_with(config: dict[str, Any], **kwargs: Any) -> None:
        model = model_()
        args = TrainingArguments(
            output_dir=str(out / "refused"),
            max_steps=1,
            report_to=[],
            deepspeed=config,
            per_device_train_batch_size=BATCH,
        )
        freeze = AlternatingFreeze(groups_of, SCHEDULES["lisa"][0]())
        Trainer(model=model, args=args, train_dataset=Tokens(4), callbacks=[freeze], **kwargs)

    def unsplit_engine() -> None:  # deepspeed.initialize on an optimizer nobody split, attached by hand
        import deepspeed

        model = model_()
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=LR),
            config={"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 2}},
        )
        switcher = PhaseSwitcher(groups_of(model), SCHEDULES["lisa"][0]())
        switcher.step_to(0)
        switcher.attach(engine)

    base = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    cases: dict[str, Callable[[], None]] = {
        "optimizers_given": lambda: trainer_with(base, optimizers=(torch.optim.AdamW(model_().parameters()), None)),
        "optimizer_section": lambda: trainer_with({**base, "optimizer": {"type": "AdamW", "params": {"lr": LR}}}),
        "zero3": lambda: trainer_with({**base, "zero_optimization": {"stage": 3}}),
        "offload": lambda: trainer_with(
            {**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
        ),
        "unsplit_engine": unsplit_engine,
    }
    found: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            case()
            found[name] = None
        except AltParamsError as exc:
            found[name] = {"type": type(exc).__name__, "message": str(exc)}
    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    return found


def main(out: Path, extensions: Optional[Path]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if extensions is not None:  # read when an op would be built, not at import
        os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions)
    skip_shm_comm_build()
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    gc.collect()
    gc.freeze()  # the modules' objects: every run's gc.collect() walks only what the runs made (module docstring)
    only = set(os.environ.get("DS_CHECK_ONLY", "").split(",")) - {""}
    runs: dict[str, Callable[[], dict[str, Any]]] = {}
    for stage in (1, 2):
        for kind in ("lisa", "badam", "alternating", "full"):
            runs[f"zero{stage}_{kind}"] = lambda s=stage, k=kind: trainer_run(
                f"zero{s}_{k}", out, k, "ds", stage=s, save=3 if (s, k) == (2, "lisa") else 0
            )
    runs["zero2_lisa_resumed"] = lambda: trainer_run(
        "zero2_lisa_resumed", out, "lisa", "ds", stage=2, resume=str(out / "zero2_lisa" / "checkpoint-3")
    )
    for kind in ("lisa", "badam", "alternating"):
        runs[f"ddp_{kind}"] = lambda k=kind: trainer_run(f"ddp_{k}", out, k, "ddp")
    for stage in (1, 2):
        for kind in ("lisa", "badam", "alternating"):
            runs[f"acc_zero{stage}_{kind}"] = lambda s=stage, k=kind: accelerate_run(
                f"acc_zero{s}_{k}", out, k, "ds", stage=s, save_after=3 if (s, k) == (2, "lisa") else 0
            )
    runs["acc_zero2_lisa_bf16"] = lambda: accelerate_run("acc_zero2_lisa_bf16", out, "lisa", "ds", stage=2, bf16=True)
    runs["acc_zero2_lisa_resumed"] = lambda: accelerate_run(
        "acc_zero2_lisa_resumed", out, "lisa", "ds", stage=2, load=str(out / "acc_zero2_lisa_state_3")
    )
    for kind in ("lisa", "badam", "alternating"):
        runs[f"acc_ddp_{kind}"] = lambda k=kind: accelerate_run(f"acc_ddp_{k}", out, k, "ddp")
    runs["refusals"] = lambda: refusals(out)
    results: dict[str, Any] = {}
    for name, run in runs.items():
        if only and name not in only:
            continue
        try:
            results[name] = run()
        except Exception as exc:  # recorded for the tests to name; the next runs go on
            import traceback

            traceback.print_exc()
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        dist.barrier()
    write_rank_result(out, {"world_size": world(), "runs": results})
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
