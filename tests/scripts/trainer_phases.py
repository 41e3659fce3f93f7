"""Check script: the 🤗 Trainer with AlternatingFreeze on several ranks (gloo, CPU).

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 2 trainer_phases.py OUT_DIR

Scenarios, run one after another in the same processes (a tiny BERT built
from a config, no dropout, a synthetic data set):

``main``
    fp32, gradient accumulation 2, ``ddp_find_unused_parameters=False``, the
    :data:`MAIN_PHASES` schedule over 8 steps, a checkpoint every 3 steps,
    ``count_comm=True``.
``resume``
    the same run resumed from ``main``'s checkpoint-3 (mid-phase).
``bf16_gc``
    bf16 autocast, gradient checkpointing, ``ddp_find_unused_parameters=True``,
    a group switch at every step.
``grouped``
    ``optimizers=(grouped_optimizer(..., state_policy="offload"), None)``.
``bf16_fp32_wire``
    a model stored in bf16, ``grouped_optimizer(..., allreduce_dtype=torch.float32)``
    (a PrecisionOptimizer: fp32 masters, bf16 gradients all-reduced in fp32),
    gradient accumulation 2.
``naive``
    no AlternatingFreeze: the encoder frozen before ``Trainer(...)`` and
    unfrozen by a plain callback (docs/design.md, fact 10): the bug the callback fixes.
``eval_first``
    ``trainer.evaluate()`` before ``trainer.train()``: Accelerate then skips the
    DDP wrapper; AlternatingFreeze must refuse to train unsynchronised.

For each scenario a rank records the parameter checksums per group before
training and after every optimizer step, the final checksum of every
parameter, the bytes its comm counter saw per step, the logs, and the switch
records.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import SwitchError
from hf_altparams.integrations.trainer import AlternatingFreeze, grouped_optimizer
from hf_altparams.plan.groups import ParamGroups
from hf_altparams.plan.schedules import Alternating, PhaseSequence
from hf_altparams.testing.launch import write_rank_result

#: (trainable groups, steps) of the main schedule; resume checkpoint at step 3 is mid-phase.
MAIN_PHASES = [(["head"], 2), (["layer1", "head"], 2), (["layer0"], 2), (["emb", "layer0", "layer1", "head"], 2)]
MAIN_STEPS = 8
SAVE_STEPS = 3
EXTRA_GROUPS = {"emb": "bert.embeddings.*", "head": ["bert.pooler.*", "classifier.*"]}
SEQ_LEN = 12


def tiny_bert(layers: int = 2) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ_LEN,
        type_vocab_size=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences; the label says whether token 7 occurs (learnable, not trivial)."""

    def __init__(self, n: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 64, (n, SEQ_LEN), generator=gen)
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones(SEQ_LEN, dtype=torch.long),
            "labels": self.labels[i],
        }


def sha(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def groups_of(model: torch.nn.Module) -> ParamGroups:
    return ParamGroups.from_layers(model, "bert.encoder.layer", extra=EXTRA_GROUPS)


class Recorder(TrainerCallback):
    """Per-group checksums before training and after every optimizer step; the logs."""

    def __init__(self, groups: ParamGroups) -> None:
        self.groups = groups
        self.sums: list[dict[str, str]] = []
        self.logs: list[dict[str, Any]] = []

    def snapshot(self) -> dict[str, str]:
        return {g: sha(self.groups.params(g)) for g in self.groups.names}

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sums = [self.snapshot()]

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.sums.append(self.snapshot())

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.logs.append(
            {"step": state.global_step, **{k: v for k, v in (logs or {}).items() if isinstance(v, (int, float, str))}}
        )


class PlainUnfreeze(TrainerCallback):
    """What users write without hf_altparams: flip requires_grad at a step."""

    def __init__(self, model: torch.nn.Module, at_step: int) -> None:
        self.model, self.at_step = model, at_step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at_step:
            for p in self.model.parameters():
                p.requires_grad_(True)


def arguments(out: Path, **overrides: Any) -> TrainingArguments:
    names = {f.name for f in fields(TrainingArguments)}
    if overrides.pop("checkpointing", False):  # renamed in transformers 5.2x
        key = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
        overrides[key] = True
    base: dict[str, Any] = dict(
        output_dir=str(out),
        max_steps=MAIN_STEPS,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_find_unused_parameters=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    base.update(overrides)
    return TrainingArguments(**base)


def run(
    name: str,
    out_dir: Path,
    *,
    schedule: Any = None,
    resume: str | None = None,
    optimizer_fn: Any = None,
    naive_unfreeze_at: int | None = None,
    evaluate_first: bool = False,
    bf16_model: bool = False,
    **overrides: Any,
) -> dict[str, Any]:
    model = tiny_bert().to(torch.bfloat16) if bf16_model else tiny_bert()
    groups = groups_of(model)
    callbacks: list[TrainerCallback] = []
    freeze = None
    optimizers: Any = (None, None)
    if naive_unfreeze_at is not None:
        optimizers = (torch.optim.AdamW(model.parameters(), lr=1e-3), None)
        for n, p in model.named_parameters():
            p.requires_grad_(groups.group_of(n) == "head")
        callbacks.append(PlainUnfreeze(model, naive_unfreeze_at))
    else:
        freeze = AlternatingFreeze(groups, schedule, count_comm=True)
        callbacks.append(freeze)
        if optimizer_fn is not None:
            optimizers = (optimizer_fn(groups), None)
    recorder = Recorder(groups)
    callbacks.append(recorder)
    args = arguments(out_dir / name, **overrides)
    data = TokenDataset(64 * MAIN_STEPS)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        callbacks=callbacks,
        optimizers=optimizers,
        eval_dataset=TokenDataset(16, seed=1) if evaluate_first else None,
    )
    if evaluate_first:
        trainer.evaluate()
        try:
            trainer.train()
        except SwitchError as err:
            return {"error": str(err), "wrapped": type(trainer.model_wrapped).__name__}
        return {"error": None, "wrapped": type(trainer.model_wrapped).__name__}
    trainer.train(resume_from_checkpoint=resume)
    result: dict[str, Any] = {
        "sums": recorder.sums,
        "logs": recorder.logs,
        "final": {n: sha([p]) for n, p in model.named_parameters()},
        "group_bytes": {g: groups.nbytes(g) for g in groups.names},
    }
    if freeze is not None:
        result["comm"] = freeze.comm.history if freeze.comm is not None else None
        result["records"] = [
            {
                "step": r.step,
                "phase": r.phase,
                "rebuilt_ddp": r.rebuilt_ddp,
                "allreduce_bytes_per_step": r.allreduce_bytes_per_step,
                "seconds": r.seconds,
            }
            for r in freeze.records
        ]
        result["find_unused_parameters"] = freeze.find_unused_parameters
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    main_schedule = PhaseSequence([(g, n) for g, n in MAIN_PHASES])
    results["main"] = run("main", out_dir, schedule=main_schedule, save_strategy="steps", save_steps=SAVE_STEPS)
    dist.barrier()
    results["resume"] = run(
        "resume",
        out_dir,
        schedule=PhaseSequence([(g, n) for g, n in MAIN_PHASES]),
        resume=str(out_dir / "main" / f"checkpoint-{SAVE_STEPS}"),
        save_strategy="steps",
        save_steps=SAVE_STEPS,
    )
    results["bf16_gc"] = run(
        "bf16_gc",
        out_dir,
        schedule=Alternating(["layer1", "head"]),
        max_steps=4,
        gradient_accumulation_steps=1,
        bf16=True,
        checkpointing=True,
        ddp_find_unused_parameters=True,
    )
    results["grouped"] = run(
        "grouped",
        out_dir,
        schedule=Alternating({"layer0": 1, "head": 2}),
        max_steps=4,
        optimizer_fn=lambda g: grouped_optimizer(g, lr=1e-3, weight_decay=0.01, state_policy="offload"),
    )
    results["bf16_fp32_wire"] = run(
        "bf16_fp32_wire",
        out_dir,
        schedule=Alternating({"layer0": 1, "head": 2}),
        max_steps=4,
        bf16_model=True,
        optimizer_fn=lambda g: grouped_optimizer(g, lr=1e-3, allreduce_dtype=torch.float32),
    )
    results["naive"] = run("naive", out_dir, naive_unfreeze_at=2, max_steps=5)
    results["eval_first"] = run(
        "eval_first", out_dir, schedule=Alternating(["head", "layer1"]), max_steps=2, evaluate_first=True
    )
    write_rank_result(
        out_dir, {"world_size": dist.get_world_size(), "scenarios": results, "pid": os.getpid()}, rank=dist.get_rank()
    )
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


if __name__ == "__main__":
    main()
