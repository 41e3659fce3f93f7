"""Per-step ``drop`` alternation against one half alone, in the same ranks (the worker of ``test_host_heap.py``).

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 2 mmap_alternation.py OUT_DIR --mmap-threshold 1048576

Each rank calls :func:`~hf_altparams.engine.mmap_large_host_allocations` first
(unless ``--mmap-threshold 0``), trains ``a`` alone for two steps as a warm-up
that pays the process's one-time costs (gloo buffers, autograd threads), then
measures two scenarios, each on a fresh :class:`~tests.support.models.TwoHalves`
model built before its baseline: ``alt_drop`` (``a`` and ``b`` alternating
every step, ``GroupedOptimizer(state_policy="drop")``) and then ``alone_a``
(``b`` frozen). Peak memory growth is the process's peak RSS over the baseline
(:class:`~tests.support.meters.PeakMemory`). One launch measures both,
so the comparison costs one start of torch instead of two.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, host_heap, mmap_large_host_allocations
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.meters import PeakMemory  # noqa: E402
from tests.support.models import TwoHalves  # noqa: E402

AdamW = functools.partial(torch.optim.AdamW, lr=1e-4)


def _step(model: torch.nn.Module, x: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def alone_a(model: TwoHalves, x: torch.Tensor, steps: int) -> None:
    model.b.requires_grad_(False)
    ddp = DDP(model)
    opt = AdamW(model.a.parameters())
    for _ in range(steps):
        _step(ddp, x, opt)
    del ddp, opt


def alt_drop(model: TwoHalves, x: torch.Tensor, steps: int) -> None:
    groups = ParamGroups(model, {"a": "a.*", "b": "b.*"})
    opt = GroupedOptimizer(groups, AdamW, state_policy="drop")
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model)
    switcher.attach(ddp)
    for step in range(steps):
        _step(ddp, x, opt)
        switcher.step_to(step + 1)
    del ddp, opt, switcher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size-mib", type=float, default=32.0, help="MiB of fp32 weights per half")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20, help="bytes; 0: glibc's default")
    args = parser.parse_args()
    applied = mmap_large_host_allocations(args.mmap_threshold) if args.mmap_threshold else None
    dist.init_process_group("gloo")
    memory = PeakMemory(torch.device("cpu"))
    half_bytes: list[int] = []

    def measured(run: Callable[[TwoHalves, torch.Tensor, int], None], steps: int) -> int:
        torch.manual_seed(0)
        model = TwoHalves(args.size_mib, names=("a", "b"))
        x = torch.randn(args.batch, model.width)
        half_bytes[:] = [sum(p.numel() * p.element_size() for p in model.a.parameters())]
        memory.mark_baseline()
        run(model, x, steps)
        return memory.peak_growth()

    measured(alone_a, 2)  # warm-up, not reported
    growth = {"alt_drop": measured(alt_drop, args.steps), "alone_a": measured(alone_a, args.steps)}
    heap = host_heap()
    write_rank_result(
        args.out_dir,
        {
            "applied": applied,
            "peak_growth_bytes": growth,
            "half_bytes": half_bytes[0],
            "heap": dataclasses.asdict(heap) if heap else None,
        },
    )
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    main()
