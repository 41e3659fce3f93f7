"""Many per-step switches through ``PhasedAccelerator``: does memory stay flat?

Two groups alternate every optimizer step (``Alternating``, ``keep`` policy) for
``--switches`` steps on 2 ranks (gloo on CPU by default; ``--device cuda`` uses
NCCL and one GPU per rank). Each rank measures:

* on CPU: RSS (after ``gc.collect()`` and ``malloc_trim``) after ``--warmup``
  switches and at the end; the growth in between must stay under 1 MiB;
* on CUDA: ``torch.cuda.memory_allocated`` right after every switch; after
  the warm-up it must be back to the same value for every switch into the same
  phase (no leak per switch, not even a small one);
* the switch history: records kept (bounded) against switches done, and the
  mean switch time from its running totals.

Run::

    python benchmarks/long_run.py                         # 100,000 switches, CPU
    python benchmarks/long_run.py --switches 2000 --device cuda --out results/   # on a GPU machine

The driver launches the ranks (``hf_altparams.testing.launch``), prints a
markdown line per rank and writes ``long_run_{device}.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from _machine import machine  # noqa: E402  (benchmarks/ is the script's folder)

MIB = 2**20


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from hf_altparams.engine import GroupedOptimizer, rss_bytes
    from hf_altparams.engine.memory import malloc_trim
    from hf_altparams.integrations.accelerate import PhasedAccelerator
    from hf_altparams.plan import Alternating, ParamGroups
    from hf_altparams.testing.launch import write_rank_result

    cuda = args.device == "cuda"
    accelerator = PhasedAccelerator(Alternating(["a", "b"]), cpu=not cuda, log_switches=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
    optimizer = GroupedOptimizer(groups, lambda params: torch.optim.Adam(params, lr=1e-4), state_policy="keep")
    model, optimizer = accelerator.prepare(model, optimizer)
    gen = torch.Generator().manual_seed(accelerator.process_index)
    x = torch.randn(8, 32, generator=gen).to(accelerator.device)
    allocated: dict[str, list[int]] = {"a": [], "b": []}
    rss: dict[str, int] = {}

    def settle_rss() -> int:
        gc.collect()
        malloc_trim()
        return rss_bytes()

    started = time.perf_counter()
    for step in range(args.switches):
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()  # the switch happens here
        if cuda:
            phase = accelerator.phase.name  # type: ignore[union-attr]
            allocated[phase].append(torch.cuda.memory_allocated())
        if step + 1 == args.warmup:
            rss["warm"] = settle_rss()
    elapsed = time.perf_counter() - started
    rss["end"] = settle_rss()
    history = accelerator.switch_history
    assert history is not None
    after_warmup = {p: sorted(set(v[args.warmup :])) for p, v in allocated.items()}
    write_rank_result(
        args.result,
        {
            "rank": accelerator.process_index,
            "switches": history.count,
            "records_kept": len(accelerator.switch_records),
            "window": history.window,
            "switch_seconds_total": history.seconds,
            "seconds_total": elapsed,
            "rss_warm": rss["warm"],
            "rss_end": rss["end"],
            "rss_growth": rss["end"] - rss["warm"],
            "cuda_allocated_after_warmup": after_warmup if cuda else None,
        },
    )
    del model, optimizer
    accelerator.free_memory()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_driver(args: argparse.Namespace) -> None:
    import tempfile

    from hf_altparams.testing.launch import launch, rank_results

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(args.ranks)))
    env = {"CUDA_VISIBLE_DEVICES": visible} if args.device == "cuda" else None
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        launch(
            __file__,
            "--worker",
            "--result",
            tmp,
            "--switches",
            str(args.switches),
            "--warmup",
            str(args.warmup),
            "--device",
            args.device,
            nproc=args.ranks,
            launcher="accelerate" if args.device == "cpu" else "torchrun",
            env=env,
            timeout=args.timeout,
        )
        ranks = rank_results(tmp, nproc=args.ranks)
    load = (load_before, os.getloadavg()[0])
    lines = [
        f"### {machine(args.device, args.ranks)}; {args.switches} per-step switches through "
        f"PhasedAccelerator, warm-up {args.warmup}; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after",
        "",
        "| rank | switches | records kept | RSS growth after warm-up | mean switch | mean iteration |"
        + (" memory_allocated values per phase after warm-up |" if args.device == "cuda" else ""),
        "|---|---|---|---|---|---|" + ("---|" if args.device == "cuda" else ""),
    ]
    for r in ranks:
        line = (
            f"| {r['rank']} | {r['switches']} | {r['records_kept']} | {r['rss_growth'] / MIB:+.3f} MiB "
            f"| {1e3 * r['switch_seconds_total'] / r['switches']:.3f} ms "
            f"| {1e3 * r['seconds_total'] / args.switches:.3f} ms |"
        )
        if args.device == "cuda":
            line += f" {r['cuda_allocated_after_warmup']} |"
        lines.append(line)
    table = "\n".join(lines)
    print(table)
    (out_dir / f"long_run_{args.device}.json").write_text(
        json.dumps(
            {"machine": machine(args.device, args.ranks), "args": vars(args), "load_average": load, "ranks": ranks},
            indent=1,
        )
    )
    (out_dir / f"long_run_{args.device}.md").write_text(table + "\n")
    worst = max(r["rss_growth"] for r in ranks)
    ok = worst <= MIB and all(r["records_kept"] <= r["window"] for r in ranks)
    if args.device == "cuda":
        ok = ok and all(len(v) == 1 for r in ranks for v in r["cuda_allocated_after_warmup"].values())
    print(
        f"target (RSS growth <= 1 MiB, bounded history{', memory_allocated constant' if args.device == 'cuda' else ''}):"
        f" {'met' if ok else 'MISSED'}"
    )


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=100_000, help="optimizer steps, one switch each")
    parser.add_argument("--warmup", type=int, default=5_000, help="switches before the first RSS reading")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.switches:
        parser.error(f"--warmup ({args.warmup}) must be between 0 and --switches ({args.switches})")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    run_worker(args) if args.worker else run_driver(args)


if __name__ == "__main__":
    main()
