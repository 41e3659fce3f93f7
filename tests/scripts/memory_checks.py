"""Multi-process checks of residency and buffer sync (every rank runs this script).

Usage::

    python -m torch.distributed.run --nproc_per_node 2 memory_checks.py OUT_DIR [--only NAME ...]

Each rank writes ``OUT_DIR/rank{r}.json``; ``tests/engine/test_residency.py``
and ``tests/engine/test_buffers.py`` read them. The module is also imported by
the tests (by path): :func:`train_tasks` with ``distributed=False`` is the
single-process reference a 2-rank run must reproduce (a reference step sees the
concatenation of the ranks' batches with a mean loss, which is what DDP's
gradient average computes).

Scenarios:

* ``residency``: a shared trunk and three task heads under ``PerTaskCycle``.
  Rank 1 starts with different values in every tensor, so what DDP's
  constructor broadcasts (resident groups) and what it must not (non-resident
  heads) is visible; per step the bytes all-reduced, DDP's ignore list, the
  buffer bytes broadcast, the guard's error and each head's hash when it
  leaves and when it returns.
* ``buffers``: a model without buffers, and a BatchNorm model under the default
  policy, under ``buffer_sync="auto"`` with ``frozen_norms="eval"``, and with
  the norm layer trainable; per forward the bytes DDP really broadcast.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, register_comm_counter
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import SwitchError
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle, PhaseSequence, Schedule

DIM = 8
TASKS = 3
EVERY = 2
STEPS = 14  # two full cycles and a bit: every head leaves and comes back
BATCH = 4


class Head(nn.Module):
    """A task head owning its parameters and a constant buffer directly."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, dim) / dim**0.5)
        self.bias = nn.Parameter(torch.zeros(1))
        self.register_buffer("scale", torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) * self.scale


class MultiTask(nn.Module):
    def __init__(self, tasks: int = TASKS, dim: int = DIM) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.heads = nn.ModuleList(Head(dim) for _ in range(tasks))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


def build_model() -> MultiTask:
    torch.manual_seed(0)
    return MultiTask()


def make_groups(model: nn.Module) -> ParamGroups:
    specs = {"trunk": "trunk.*", **{f"t{i}": f"heads.{i}.*" for i in range(TASKS)}}
    return ParamGroups(model, specs, ungrouped="error")


def make_schedule() -> PerTaskCycle:
    return PerTaskCycle(["trunk"], [f"t{i}" for i in range(TASKS)], every=EVERY)


def make_optimizer(groups: ParamGroups) -> GroupedOptimizer:
    return GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=0.05, weight_decay=0.01))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIM, generator=gen)
    return x, x.sum(dim=1, keepdim=True).sin()


def task_of(switcher: PhaseSwitcher) -> int:
    assert switcher.current is not None
    assert switcher.current.task is not None  # PerTaskCycle names the task: "t0", "t1", ...
    return int(switcher.current.task.removeprefix("t"))


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def head_digest(model: MultiTask, task: int) -> str:
    return digest([*model.heads[task].parameters(), *model.heads[task].buffers()])


def count_broadcasts(ddp: DDP) -> list[int]:
    """Spy on the bytes DDP broadcasts for buffers (a test-only instrument)."""
    sent: list[int] = []
    original = ddp._distributed_broadcast_coalesced

    def spy(tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        sent.append(sum(t.numel() * t.element_size() for t in tensors))
        return original(tensors, *args, **kwargs)

    ddp._distributed_broadcast_coalesced = spy  # type: ignore[method-assign]
    return sent


def train_tasks(distributed: bool, rank: int = 0, world: int = 2) -> tuple[MultiTask, dict[str, Any]]:
    """Train the multi-task model; with ``distributed`` on this rank's half batches under DDP."""
    model = build_model()
    if distributed and rank != 0:
        with torch.no_grad():  # rank-local values: only a broadcast can make them equal
            for tensor in [*model.parameters(), *model.buffers()]:
                tensor.add_(0.25 * rank)
    groups = make_groups(model)
    opt = make_optimizer(groups)
    switcher = PhaseSwitcher(groups, make_schedule(), optimizer=opt)
    log: dict[str, Any] = {"steps": []}
    switcher.step_to(0)
    wrapped: nn.Module = model
    counter = None
    sent: list[int] = []
    if distributed:
        wrapped = DDP(model)
        counter = register_comm_counter(wrapped)
        sent = count_broadcasts(wrapped)
        switcher.attach(wrapped)
        log["ignore_at_wrap"] = sorted(wrapped.parameters_to_ignore)
        log["heads_after_wrap"] = [head_digest(model, t) for t in range(TASKS)]
    left: dict[int, str] = {}
    for step in range(STEPS):
        task = task_of(switcher)
        entry: dict[str, Any] = {"step": step, "task": task}
        if task in left:  # the head came back: was it kept bit-identical while away?
            entry["returned_identical"] = head_digest(model, task) == left.pop(task)
        x, y = (
            batch(step, rank)
            if distributed
            else (
                torch.cat([batch(step, r)[0] for r in range(world)]),
                torch.cat([batch(step, r)[1] for r in range(world)]),
            )
        )
        sent.clear()
        F.mse_loss(wrapped(x, task), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if distributed:
            assert counter is not None
            entry["allreduced"] = counter.end_step()
            entry["expected_allreduce"] = sum(
                p.numel() * p.element_size() for p in [*model.trunk.parameters(), *model.heads[task].parameters()]
            )
            entry["broadcast"] = list(sent)
            entry["ignore"] = sorted(wrapped.parameters_to_ignore)  # type: ignore[union-attr]
        record = switcher.step_to(step + 1)
        if record is not None:
            left[task] = head_digest(model, task)
            entry["record"] = record.as_log(prefix="")
        log["steps"].append(entry)
    # The guard: a forward through a head that is not resident now.
    absent = next(t for t in range(TASKS) if t != task_of(switcher))
    try:
        with torch.no_grad():
            wrapped(batch(0, rank)[0], absent)
        log["guard_error"] = None
    except SwitchError as exc:
        log["guard_error"] = str(exc)
    log["guard_absent_task"] = absent
    log["phase_at_end"] = switcher.current.name if switcher.current else None
    with torch.no_grad(), switcher.residency.visiting([f"t{absent}"]):
        log["visiting_output_shape"] = list(model(batch(0, rank)[0], absent).shape)
    log["params"] = {n: p.detach().tolist() for n, p in model.named_parameters()}
    log["digest"] = digest(list(model.parameters()))
    return model, log


def run_residency(rank: int, world: int) -> dict[str, Any]:
    _, log = train_tasks(distributed=True, rank=rank, world=world)
    return log


# -- buffers -----------------------------------------------------------------------------------


def bn_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.BatchNorm1d(DIM), nn.Linear(DIM, 1))


def mlp_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, 1))


def run_buffer_case(
    rank: int, build: Callable[[], nn.Sequential], specs: dict[str, Any], schedule: Schedule, **options: Any
) -> dict[str, Any]:
    model = build()
    groups = ParamGroups(model, specs)
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt, **options)
    switcher.step_to(0)
    ddp = DDP(model)
    switcher.attach(ddp)
    sent = count_broadcasts(ddp)
    norm = next((m for m in model.modules() if isinstance(m, nn.BatchNorm1d)), None)
    mode_in_forward: list[bool] = []
    if norm is not None:
        norm.register_forward_pre_hook(lambda m, a: mode_in_forward.append(m.training))
    stats_before = digest(list(norm.buffers())) if norm is not None else None
    out: dict[str, Any] = {"per_forward": [], "records": []}
    for step in range(4):
        model.train()  # what a training loop (and the Trainer) does every step
        sent.clear()
        x, y = batch(step, rank)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["per_forward"].append(sum(sent))
        record = switcher.step_to(step + 1)
        if record is not None:
            out["records"].append(record.as_log(prefix=""))
    plan = switcher.buffer_sync.plan
    assert plan is not None
    out["plan"] = {
        "broadcast": plan.broadcast,
        "bytes_per_forward": plan.bytes_per_forward,
        "saved_bytes_per_forward": plan.saved_bytes_per_forward,
        "eval_modules": list(plan.eval_modules),
        "reason": plan.reason,
    }
    out["buffer_bytes"] = sum(b.numel() * b.element_size() for b in model.buffers())
    out["will_sync"] = bool(ddp.will_sync_module_buffers())
    out["norm_training_in_forward"] = mode_in_forward
    out["stats_unchanged"] = None if norm is None else digest(list(norm.buffers())) == stats_before
    out["buffers_digest"] = digest(list(model.buffers())) if list(model.buffers()) else None
    out["params_digest"] = digest(list(model.parameters()))
    return out


def run_buffers(rank: int, world: int) -> dict[str, Any]:
    mlp_specs = {"a": "0.*", "b": "2.*"}
    bn_specs = {"a": "0.*", "norm": "1.*", "b": "2.*"}
    ab = Alternating(["a", "b"])
    with_norm = PhaseSequence([(["a", "norm"], 1), (["b", "norm"], 1)], repeat=True)
    return {
        "no_buffers": run_buffer_case(rank, mlp_model, mlp_specs, ab),
        "no_buffers_auto": run_buffer_case(rank, mlp_model, mlp_specs, ab, buffer_sync="auto"),
        "bn_default": run_buffer_case(rank, bn_model, bn_specs, ab),
        "bn_auto_eval": run_buffer_case(rank, bn_model, bn_specs, ab, buffer_sync="auto", frozen_norms="eval"),
        "bn_auto_trainable": run_buffer_case(
            rank, bn_model, bn_specs, with_norm, buffer_sync="auto", frozen_norms="eval"
        ),
    }


SCENARIOS: dict[str, Callable[[int, int], Any]] = {
    "residency": run_residency,
    "buffers": run_buffers,
}


def main(argv: Optional[list[str]] = None) -> None:
    from hf_altparams.testing.launch import write_rank_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--only", nargs="*", default=None, help=f"scenarios (default all): {list(SCENARIOS)}")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict[str, Any] = {"world_size": world}
    for name, fn in SCENARIOS.items():
        if args.only is None or name in args.only:
            result[name] = fn(rank, world)
    write_rank_result(args.out_dir, result, rank=rank)
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


if __name__ == "__main__":
    main()
