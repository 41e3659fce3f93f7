"""One memory scenario, one fresh process per rank: the worker of ``benchmarks/memory.py``.

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 2 memory_peak.py OUT_DIR --scenario alt_drop
    python -m torch.distributed.run --nproc_per_node 1 memory_peak.py OUT_DIR --scenario alt_offload --device cuda

Peak memory *growth* is measured from a baseline taken after the model is
built (and, for the two-halves model, placed on the device) and before DDP is
constructed, so it holds what training adds: gradients, DDP buckets, optimizer
state, activations, and whatever a switch leaves behind. On CPU it is the
process's peak RSS (``VmHWM``, reset at the baseline through
``/proc/self/clear_refs``) minus the baseline RSS; on CUDA
``max_memory_allocated`` minus the baseline allocation (the absolute
``max_memory_allocated`` is reported too).

Scenarios on the two-halves model (``--size-mib`` per half, AdamW):

* ``alone_a`` / ``alone_b``: one half trained alone, the other frozen.
* ``naive``: DDP over everything, one AdamW per half, alternating which one steps.
* ``alt_keep`` / ``alt_drop`` / ``alt_offload``: :class:`PhaseSwitcher` +
  :class:`GroupedOptimizer` with that idle-state policy, alternating every ``--every`` steps.
* ``alt_offload_prefetch`` / ``alt_offload_auto``: ``alt_offload`` with
  ``prefetch=True`` / ``prefetch="auto"``.

Scenarios on the multi-task model (a trunk of ``--trunk-mib`` and ``--tasks``
heads of ``--head-mib``):

* ``tasks``: ``PerTaskCycle``: only the trunk and the current head are resident.
* ``tasks_resident``: the same cycle with every head resident (no residency).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, memory_report
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle, PhaseSequence
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.meters import PeakMemory  # noqa: E402
from tests.support.models import TwoHalves  # noqa: E402

MIB = 2**20
HALF_SCENARIOS = (
    "alone_a",
    "alone_b",
    "naive",
    "alt_keep",
    "alt_drop",
    "alt_offload",
    "alt_offload_prefetch",
    "alt_offload_auto",
)
TASK_SCENARIOS = ("tasks", "tasks_resident")
AdamW = functools.partial(torch.optim.AdamW, lr=1e-4)


class MultiTask(nn.Module):
    def __init__(self, trunk_mib: float, head_mib: float, tasks: int) -> None:
        super().__init__()
        width = int((trunk_mib * MIB / 4) ** 0.5)
        out = max(1, int(head_mib * MIB / 4 / width))
        self.trunk = nn.Linear(width, width)
        self.heads = nn.ModuleList(nn.Linear(width, out) for _ in range(tasks))

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](torch.tanh(self.trunk(x)))


def _step(
    model: nn.Module,
    x: torch.Tensor,
    opt: torch.optim.Optimizer,
    *args: Any,
    zero: tuple[torch.optim.Optimizer, ...] = (),
) -> None:
    model(x, *args).pow(2).mean().backward()
    opt.step()
    for o in (opt, *zero):
        o.zero_grad(set_to_none=True)


def run_halves(
    args: argparse.Namespace, device: torch.device, ddp_kwargs: dict[str, Any], memory: PeakMemory, rank: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TwoHalves(args.size_mib, names=("a", "b")).to(device)
    width = model.a.in_features
    x = torch.randn(args.batch, width, device=device, generator=None)
    memory.mark_baseline()
    out: dict[str, Any] = {"group_bytes": sum(p.numel() * p.element_size() for p in model.a.parameters())}
    s = args.scenario
    started = time.perf_counter()
    if s in ("alone_a", "alone_b"):
        trained = model.a if s == "alone_a" else model.b
        (model.b if s == "alone_a" else model.a).requires_grad_(False)
        ddp = DDP(model, **ddp_kwargs)
        opt = AdamW(trained.parameters())
        for _ in range(args.steps):
            _step(ddp, x, opt)
    elif s == "naive":
        ddp = DDP(model, **ddp_kwargs)
        opts = [AdamW(model.a.parameters()), AdamW(model.b.parameters())]
        for step in range(args.steps):
            active = (step // args.every) % 2
            _step(ddp, x, opts[active], zero=(opts[1 - active],))
    else:
        policy = {"alt_keep": "keep", "alt_drop": "drop"}.get(s, "offload")
        prefetch: Any = {"alt_offload_prefetch": True, "alt_offload_auto": "auto"}.get(s, False)
        groups = ParamGroups(model, {"a": "a.*", "b": "b.*"})
        opt = GroupedOptimizer(groups, AdamW, state_policy=policy)
        switcher = PhaseSwitcher(groups, Alternating(["a", "b"], every=args.every), optimizer=opt, prefetch=prefetch)
        switcher.step_to(0)
        ddp = DDP(model, **ddp_kwargs)
        switcher.attach(ddp)
        for step in range(args.steps):
            _step(ddp, x, opt)
            switcher.step_to(step + 1)
        out["report"] = memory_report(switcher).as_log(prefix="")
        out["switch_ms"] = [round(r.seconds * 1e3, 3) for r in switcher.records]
    out["seconds"] = time.perf_counter() - started
    return out


def run_tasks(
    args: argparse.Namespace, device: torch.device, ddp_kwargs: dict[str, Any], memory: PeakMemory, rank: int
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MultiTask(args.trunk_mib, args.head_mib, args.tasks)  # built on the CPU
    width = model.trunk.in_features
    x = torch.randn(args.batch, width, device=device)
    memory.mark_baseline()
    names = [f"t{i}" for i in range(args.tasks)]
    groups = ParamGroups(model, {"trunk": "trunk.*", **{n: f"heads.{i}.*" for i, n in enumerate(names)}})
    opt = GroupedOptimizer(groups, AdamW, state_policy=args.policy)
    if args.scenario == "tasks":
        schedule: Any = PerTaskCycle(["trunk"], names, every=args.every)
    else:
        schedule = PhaseSequence([(["trunk", n], args.every) for n in names], repeat=True)
        model.to(device)
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt, device=device)
    switcher.step_to(0)  # residency: the trunk and task 0 go to the device, the rest stays
    ddp = DDP(model, **ddp_kwargs)
    switcher.attach(ddp)
    started = time.perf_counter()
    for step in range(args.steps):
        task = (
            names.index(switcher.current.task)
            if args.scenario == "tasks"
            else names.index(sorted(switcher.current.trainable - {"trunk"})[0])
        )
        _step(ddp, x, opt, task)
        switcher.step_to(step + 1)
    head = model.heads[0]
    return {
        "head_bytes": sum(p.numel() * p.element_size() for p in head.parameters()),
        "trunk_bytes": sum(p.numel() * p.element_size() for p in model.trunk.parameters()),
        "report": memory_report(switcher).as_log(prefix=""),
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--scenario", required=True, choices=HALF_SCENARIOS + TASK_SCENARIOS)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--size-mib", type=float, default=32.0, help="MiB of fp32 weights per half")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=1, help="steps per phase")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--trunk-mib", type=float, default=32.0)
    parser.add_argument("--head-mib", type=float, default=16.0)
    parser.add_argument(
        "--policy", default="keep", choices=["keep", "offload", "drop"], help="idle-state policy of the task groups"
    )
    args = parser.parse_args()
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
        ddp_kwargs: dict[str, Any] = {"device_ids": [local_rank]}
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        ddp_kwargs = {}
    rank, world = dist.get_rank(), dist.get_world_size()
    memory = PeakMemory(device)
    run: Callable[..., dict[str, Any]] = run_tasks if args.scenario in TASK_SCENARIOS else run_halves
    result = run(args, device, ddp_kwargs, memory, rank)
    peak = memory.peak()
    result.update(
        {
            "scenario": args.scenario,
            "device": device.type,
            "world_size": world,
            "baseline_bytes": memory.baseline,
            "peak_bytes": peak,
            "peak_growth_bytes": peak - memory.baseline,
            "args": {k: str(v) for k, v in vars(args).items()},
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
        }
    )
    write_rank_result(args.out_dir, result, rank=rank)
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


if __name__ == "__main__":
    main()
