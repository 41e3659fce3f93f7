"""FSDP2 memory per rank: alternating two groups vs training one group alone.

Each scenario runs in a fresh ``torchrun`` launch (nothing carries over) on a
model of two equal halves ``a`` and ``b`` (``--layers`` Linear layers of
``--width`` each), sharded one unit per group (:func:`hf_altparams.engine.shard_by_groups`,
bf16 ``MixedPrecisionPolicy`` with fp32 reduce), AdamW::

    python benchmarks/fsdp2_memory.py --device cuda --nproc 1     # 1 GPU, NCCL world size 1
    python benchmarks/fsdp2_memory.py --device cpu --width 256    # smoke run of the script (no figure)

Scenarios (``--steps`` steps each, peak measured over the steps after the first 2):

* ``alone_a`` / ``alone_b``: only that half trains (the other frozen from the
  start, out of the optimizer); the floor.
* ``alt_drop`` / ``alt_offload``: per-step alternation through
  :class:`~hf_altparams.engine.PhaseSwitcher` with a
  :class:`~hf_altparams.engine.GroupedOptimizer` whose idle half's state is
  dropped / offloaded to pinned host memory.
* ``alt_keep``: the same, idle state kept on the device (what alternation
  costs without a policy).

Criterion (CUDA): ``max_memory_allocated`` per rank of ``alt_offload`` and
``alt_drop`` <= 1.02 x the larger of ``alone_a`` / ``alone_b``. On CPU the
script runs (a check of the script itself) but reports no device figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _machine import machine  # noqa: E402  (benchmarks/ is the script's folder)
from _rank_env import rank_env  # noqa: E402
from hf_altparams.testing.launch import launch  # noqa: E402

SCENARIOS = ("alone_a", "alone_b", "alt_keep", "alt_drop", "alt_offload")
MIB = 2**20


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, shard_by_groups
    from hf_altparams.plan import Alternating, ParamGroups

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, device = dist.get_rank(), torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(2 * args.layers))).to(device)
    half = args.layers
    spec = {"a": [f"{i}.*" for i in range(half)], "b": [f"{i}.*" for i in range(half, 2 * half)]}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    groups = shard_by_groups(model, ParamGroups(model, spec), mp_policy=mp, per_module=True)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    scenario = args.worker
    switcher = None
    if scenario.startswith("alone_"):
        alone = scenario[-1]
        for name in groups.names:
            for param in groups.params(name):
                param.requires_grad_(name == alone)
        opt: Any = adamw(groups.params(alone))
    else:
        opt = GroupedOptimizer(groups, adamw, state_policy=scenario.split("_")[1])
        switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt, model=model)
    gen = torch.Generator(device=device).manual_seed(rank)
    peak = 0
    for step in range(args.steps):
        if switcher is not None:
            switcher.step_to(step)
        if cuda and step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        x = torch.randn(args.batch, args.width, device=device, generator=gen)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    result = {
        "rank": rank,
        "peak_bytes": peak,
        "param_bytes_per_rank": sum(p.to_local().nbytes for p in model.parameters()),
    }
    Path(args.out, f"{scenario}.rank{rank}.json").write_text(json.dumps(result))
    del model, opt, switcher
    dist.barrier()
    dist.destroy_process_group()


def run_scenario(scenario: str, args: argparse.Namespace, out: str) -> list[dict[str, Any]]:
    worker = [
        "--worker",
        scenario,
        "--out",
        out,
        "--device",
        args.device,
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
    ]
    proc = launch(__file__, *worker, nproc=args.nproc, env=rank_env(args.device), timeout=args.timeout)
    print(proc.stdout, end="", flush=True)  # the ranks' own lines, as a launch in this terminal would show them
    return [json.loads(Path(out, f"{scenario}.rank{r}.json").read_text()) for r in range(args.nproc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4, help="Linear layers per half")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    Path(args.out).mkdir(parents=True, exist_ok=True)
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for scenario in SCENARIOS:
            ranks = run_scenario(scenario, args, tmp)
            peaks[scenario] = max(r["peak_bytes"] for r in ranks)
            print(
                f"{scenario:12s} peak per rank {peaks[scenario] / MIB:9.1f} MiB "
                f"(parameters per rank {ranks[0]['param_bytes_per_rank'] / MIB:.1f} MiB)",
                flush=True,
            )
    floor = max(peaks["alone_a"], peaks["alone_b"])
    ratios = {s: (peaks[s] / floor if floor else None) for s in SCENARIOS}
    ok = all(ratios[s] is not None and ratios[s] <= 1.02 for s in ("alt_drop", "alt_offload"))  # type: ignore[operator]
    report = {
        "machine": machine(args.device, args.nproc),
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "peak_bytes": peaks,
        "ratio_to_alone": ratios,
        "criterion": "alt_drop, alt_offload <= 1.02 x max(alone_a, alone_b)",
        "passed": ok if args.device == "cuda" else None,
    }
    Path(args.out, f"fsdp2_memory_{args.device}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if args.device == "cuda" and not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
