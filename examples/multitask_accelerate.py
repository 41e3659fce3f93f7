"""Multi-task training with Accelerate: a shared trunk, three task heads, one dataset per task.

Run it (two CPU processes; on GPUs drop ACCELERATE_USE_CPU and pick the count)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/multitask_accelerate.py

Three synthetic tasks share an input space: ``sine`` (regress a sine of a
projection), ``sign`` (classify the sign of a product) and ``norm`` (regress
the input's norm). Each has its own dataset, loss and head; the trunk is
shared. ``PerTaskCycle(["trunk"], ["sine", "sign", "norm"], every=...)`` trains
the trunk and one head at a time; the loop reads ``accelerator.task`` at the
top of each iteration and takes that task's next batch and loss. Only the trunk
and the current head are resident: the other heads are off the device (on a
GPU), out of DDP, and a forward through them is refused. The evaluation before
and after training reaches every head with ``accelerator.visiting([task])``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
from typing import Callable, Iterator

import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import ParamGroups, PerTaskCycle

DIM = 8
TASKS = ("sine", "sign", "norm")
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "sine": nn.functional.mse_loss,
    "sign": nn.functional.binary_cross_entropy_with_logits,
    "norm": nn.functional.mse_loss,
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=600, help="optimizer steps (all tasks together)")
    parser.add_argument("--every", type=int, default=10, help="steps per task before the next task")
    parser.add_argument("--batch-size", type=int, default=32, help="examples per process per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write per-rank parameter digests here (for the tests)")
    return parser.parse_args()


class MultiTask(nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.heads = nn.ModuleDict({task: nn.Linear(hidden, 1) for task in TASKS})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.trunk(x)).squeeze(-1)


def task_dataset(task: str, n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` examples of ``task`` (each task its own inputs and targets)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, DIM, generator=gen)
    if task == "sine":
        y = torch.sin(x[:, :4].sum(dim=1))
    elif task == "sign":
        y = (x[:, 0] * x[:, 1] > 0).float()
    else:
        y = x.norm(dim=1) / DIM**0.5
    return torch.utils.data.TensorDataset(x, y)


def forever(loader: torch.utils.data.DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The loader's batches, pass after pass."""
    while True:
        yield from loader


def evaluate(
    accelerator: PhasedAccelerator,
    model: nn.Module,
    data: dict[str, torch.utils.data.TensorDataset],
) -> dict[str, float]:
    """Each task's loss on its held-out set (every rank computes the same numbers)."""
    net = accelerator.unwrap_model(model)
    losses = {}
    for task in TASKS:
        x, y = (t.to(accelerator.device) for t in data[task].tensors)
        with torch.no_grad(), accelerator.visiting([task]):  # a non-resident head comes back for a while
            losses[task] = float(LOSSES[task](net(x, task), y))
    return losses


def digests(groups: ParamGroups) -> dict[str, str]:
    """A sha256 of each group's parameters (to compare ranks, and steps)."""
    out = {}
    for name in groups.names:
        h = hashlib.sha256()
        for p in groups.params(name):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def main() -> None:
    args = parse_args()
    accelerator = PhasedAccelerator(PerTaskCycle(["trunk"], list(TASKS), every=args.every))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = MultiTask()
    groups = ParamGroups(model, {"trunk": "trunk.*", **{task: f"heads.{task}.*" for task in TASKS}})
    optimizer = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=args.lr))
    loaders = [
        torch.utils.data.DataLoader(
            task_dataset(task, 4096, args.seed + i),
            batch_size=args.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(args.seed),
        )
        for i, task in enumerate(TASKS)
    ]
    model, optimizer, *loaders = accelerator.prepare(model, optimizer, *loaders)
    batches = {task: forever(loader) for task, loader in zip(TASKS, loaders)}
    held_out = {task: task_dataset(task, 512, args.seed + 100 + i) for i, task in enumerate(TASKS)}

    before_eval = evaluate(accelerator, model, held_out)
    trace: list[dict[str, object]] = []
    steps = dict.fromkeys(TASKS, 0)
    model.train()
    while accelerator.schedule_step < args.max_steps:
        task = accelerator.task  # the task this step trains: pick its data, head and loss
        before = digests(groups) if args.out else None
        x, y = next(batches[task])
        loss = LOSSES[task](model(x, task), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        steps[task] += 1
        if before is not None:
            after = digests(groups)
            trace.append({"task": task, "changed": sorted(g for g in before if before[g] != after[g])})

    after_eval = evaluate(accelerator, model, held_out)
    accelerator.print(
        f"{accelerator.schedule_step} steps on {accelerator.num_processes} process(es), {args.every} per task in turn"
    )
    accelerator.print(f"{'task':<6} {'steps':>5} {'held-out loss before':>20} {'after':>8}")
    for task in TASKS:
        accelerator.print(f"{task:<6} {steps[task]:>5} {before_eval[task]:>20.4f} {after_eval[task]:>8.4f}")
    if args.out:
        from hf_altparams.testing.launch import write_rank_result

        write_rank_result(
            args.out, {"final": digests(groups), "steps": trace, "eval": after_eval}, rank=accelerator.process_index
        )
    # Frees the DDP wrapper's reducer, lets the gloo threads finish, then destroys the group.
    accelerator.end_training()


if __name__ == "__main__":
    main()
