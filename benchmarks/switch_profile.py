"""Where a switch's time goes, in one process: median step and switch time, and a cProfile of the switches.

World size 1 (gloo, or NCCL with ``--device cuda``), so no all-reduce runs:
what is left is the switch's local work (flags, the DDP reducer rebuild and
freeing the old one, optimizer state policy, bookkeeping). Two halves
(``hf_altparams.testing.models.TwoHalves``) alternate every step::

    python benchmarks/switch_profile.py                       # 32 MiB halves, keep, 50 switches
    python benchmarks/switch_profile.py --layers 8 --policy drop --sort tottime
    python benchmarks/switch_profile.py --breakdown   # median per part instead of cProfile
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

import _breakdown  # noqa: E402  (benchmarks/ is the script's folder)
from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher  # noqa: E402
from hf_altparams.plan import Alternating, ParamGroups  # noqa: E402
from hf_altparams.testing.launch import free_port  # noqa: E402
from hf_altparams.testing.models import TwoHalves  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=32.0)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--policy", choices=["keep", "offload", "drop"], default="keep")
    parser.add_argument("--switches", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sort", default="cumulative", help="pstats sort key")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--breakdown", action="store_true",
                        help="time each part of the switches (benchmarks/_breakdown.py) instead of cProfile")
    args = parser.parse_args(argv)
    if args.breakdown:
        _breakdown.activate()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    model = TwoHalves(args.size_mib, layers=args.layers).to(device)
    groups = ParamGroups(model, {h: f"{h}.*" for h in ("layer1", "layer2")})
    opt = GroupedOptimizer(groups, lambda params: torch.optim.Adam(params, lr=1e-4), state_policy=args.policy)
    switcher = PhaseSwitcher(groups, Alternating(["layer1", "layer2"]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model, device_ids=[0] if cuda else None)
    switcher.attach(ddp)
    x = torch.randn(16, model.width, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step(wrapped: DDP) -> None:
        wrapped(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    profile = cProfile.Profile()
    steps, switches = [], []
    for i in range(args.warmup + args.switches):
        started = time.perf_counter()
        step(ddp)
        steps.append(time.perf_counter() - started)
        measured = i >= args.warmup and not args.breakdown
        started = time.perf_counter()
        if measured:
            profile.enable()
        switcher.step_to(i + 1)
        sync()
        if measured:
            profile.disable()
        switches.append(time.perf_counter() - started)
    step_ms = 1e3 * statistics.median(steps[args.warmup:])
    switch_ms = 1e3 * statistics.median(switches[args.warmup:])
    print(f"{device.type}, halves of {args.size_mib} MiB in {args.layers} layer(s), {args.policy}: median step "
          f"{step_ms:.2f} ms, median switch {switch_ms:.3f} ms ({100 * switch_ms / step_ms:.2f} % of a step"
          + (", parts timed); median per part:" if args.breakdown else "; the profiled switches run slower)"))
    if args.breakdown:
        switches_ = _breakdown.RECORDER.switches[args.warmup:]
        for part in list(_breakdown.PARTS) + ["switch"]:
            print(f"  {part:17s} {1e3 * statistics.median(e[part] for e in switches_):.3f} ms")
    else:
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)
    del ddp
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
