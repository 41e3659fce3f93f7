"""The free host heap glibc holds while two halves alternate every step, with and without the opt-in.

Two gloo CPU ranks train ``TwoHalves`` (``layer1`` / ``layer2``, ``--size-mib``
each) with ``PhaseSwitcher`` + ``GroupedOptimizer(state_policy=--policy)``,
switching every step with the default ``release="auto"`` (no release between
equal halves). After every step and switch, rank 0 reads its RSS and
:func:`~hf_altparams.engine.host_heap` (glibc's ``mallinfo2``). The run is
made twice in fresh processes: with glibc's default heap and with
:func:`~hf_altparams.engine.mmap_large_host_allocations` (``--threshold``)
called first. Output: one table per run on stdout, and
``results/heap_probe_cpu.json``::

    python benchmarks/heap_probe.py                      # 32 MiB halves, drop, 12 steps
    python benchmarks/heap_probe.py --policy keep --size-mib 8

Columns: RSS growth over the baseline (model built, nothing else), the heap in
use by live allocations, the free heap glibc holds (``free_bytes``: what the
opt-in gives back) and the live mmapped blocks.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, host_heap, mmap_large_host_allocations, rss_bytes  # noqa: E402
from hf_altparams.engine.memory import malloc_trim  # noqa: E402
from hf_altparams.engine.shutdown import shutdown  # noqa: E402
from hf_altparams.plan import Alternating, ParamGroups  # noqa: E402
from hf_altparams.testing import launch, rank_results, write_rank_result  # noqa: E402
from tests.support.models import TwoHalves  # noqa: E402

MIB = 2**20
HALVES = ("layer1", "layer2")


def run_worker(args: argparse.Namespace) -> None:
    applied = mmap_large_host_allocations(args.threshold) if args.threshold else None
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = TwoHalves(args.size_mib)
    x = torch.randn(args.batch, model.width)
    malloc_trim()
    baseline = rss_bytes()
    groups = ParamGroups(model, {h: f"{h}.*" for h in HALVES})
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.Adam, lr=1e-4), state_policy=args.policy)
    switcher = PhaseSwitcher(groups, Alternating(list(HALVES)), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model, gradient_as_bucket_view=args.bucket_view)
    switcher.attach(ddp)
    samples: list[dict[str, Any]] = []
    for step in range(args.steps):
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        switcher.step_to(step + 1)
        heap = host_heap()
        samples.append(
            {"step": step, "rss_growth": rss_bytes() - baseline, **(dataclasses.asdict(heap) if heap else {})}
        )
    if dist.get_rank() == 0:
        write_rank_result(args.worker, {"applied": applied, "samples": samples})
    dist.barrier()
    del ddp
    shutdown()


def table(title: str, samples: list[dict[str, Any]]) -> str:
    lines = [
        f"### {title}",
        "",
        "| after step | RSS growth | heap in use | free heap held | mmapped |",
        "|---|---|---|---|---|",
    ]
    for s in samples:
        lines.append(
            f"| {s['step']} | {s['rss_growth'] / MIB:.1f} MiB | {s.get('in_use_bytes', 0) / MIB:.1f} MiB "
            f"| {s.get('free_bytes', 0) / MIB:.1f} MiB | {s.get('mmapped_bytes', 0) / MIB:.1f} MiB |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=32.0, help="size of each half in MiB (fp32)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument("--policy", default="drop", choices=["keep", "offload", "drop"])
    parser.add_argument("--bucket-view", action="store_true", help="gradient_as_bucket_view=True")
    parser.add_argument(
        "--threshold", type=int, default=MIB, help="bytes passed to mmap_large_host_allocations in the second run"
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for the JSON")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    runs = {}
    for threshold in (0, args.threshold):
        with tempfile.TemporaryDirectory() as tmp:
            launch(
                __file__,
                "--worker",
                tmp,
                "--threshold",
                str(threshold),
                "--size-mib",
                str(args.size_mib),
                "--steps",
                str(args.steps),
                "--batch",
                str(args.batch),
                "--policy",
                args.policy,
                *(["--bucket-view"] if args.bucket_view else []),
                nproc=2,
                timeout=900,
            )
            runs[threshold] = rank_results(tmp, nproc=1)[0]
        name = f"mmap_large_host_allocations({threshold})" if threshold else "glibc's default heap"
        print(
            table(
                f"rank 0 of 2, {args.policy}, two halves of {args.size_mib:g} MiB: {name}", runs[threshold]["samples"]
            )
            + "\n",
            flush=True,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "heap_probe_cpu.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))
    print(f"wrote {out}/heap_probe_cpu.json")


if __name__ == "__main__":
    main()
