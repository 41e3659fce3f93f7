"""Where a switch's time goes, in one process: median step and switch time, and a cProfile of the switches.

World size 1 (gloo, or NCCL with ``--device cuda``), so no all-reduce runs:
what is left is the switch's local work (flags, the DDP reducer rebuild and
freeing the old one, optimizer state policy, bookkeeping). Under ``torchrun
--nproc_per_node N`` it runs on N ranks (the switch's collective and the
gradients' all-reduce included) and rank 0 reports. Two halves
(``tests.support.models.TwoHalves``) alternate every step::

    python benchmarks/switch_profile.py                       # 32 MiB halves, keep, 50 switches
    python benchmarks/switch_profile.py --layers 8 --policy drop --sort tottime
    python benchmarks/switch_profile.py --breakdown   # median per part instead of cProfile
    python benchmarks/switch_profile.py --model bert --layers 12 --compare-inputs
    python benchmarks/switch_profile.py --model bert --layers 12 --check-cost   # the per-step check alone
    torchrun --nproc_per_node 2 benchmarks/switch_profile.py --model bert --layers 12 --compare-inputs

``--model bert`` alternates the lower and upper half of a BERT encoder built
from a config (``--layers`` layers, hidden size 128, no download): hundreds of
modules, as in a real model, where ``halves`` has a handful.
``--compare-inputs`` times the switches with the reducer's inputs built by
hf_altparams (``_inputs.reducer_inputs``, one walk of the module tree per wrapper)
and by DDP's own methods (``_inputs.fast_inputs = False``), alternating every two
switches in the same process, and prints both medians and their ratio.
``--compare-kept`` does the same for two copies of the model in one process,
one switched with ``keep_reducers=1`` (the idle half's reducer kept and
re-installed) and one with the default (a reducer built at every switch);
``--keep-reducers N`` sets the option for a plain run.
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
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

import _breakdown  # noqa: E402  (benchmarks/ is the script's folder)
from _machine import machine  # noqa: E402
from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher  # noqa: E402
from hf_altparams.engine.ddp import _inputs  # noqa: E402
from hf_altparams.engine.shutdown import shutdown  # noqa: E402
from hf_altparams.plan import Alternating, ParamGroups  # noqa: E402
from hf_altparams.testing.launch import free_port  # noqa: E402
from tests.support.models import TwoHalves  # noqa: E402


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["halves", "bert"], default="halves")
    parser.add_argument("--size-mib", type=float, default=32.0, help="--model halves: MiB per half")
    parser.add_argument("--layers", type=int, default=1, help="layers per half (halves) or in all (bert)")
    parser.add_argument("--policy", choices=["keep", "offload", "drop"], default="keep")
    parser.add_argument("--switches", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--sort", default="cumulative", help="pstats sort key")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time each part of the switches (benchmarks/_breakdown.py) instead of cProfile",
    )
    parser.add_argument(
        "--compare-inputs",
        action="store_true",
        help="time switches with hf_altparams' reducer inputs and with DDP's own methods",
    )
    parser.add_argument("--keep-reducers", type=int, default=0, help="PhaseSwitcher(keep_reducers=N)")
    parser.add_argument(
        "--compare-kept",
        action="store_true",
        help="time switches with keep_reducers=1 and 0 (two copies of the model, interleaved)",
    )
    parser.add_argument(
        "--check-cost",
        action="store_true",
        help="also time the per-step invariant check (PhaseSwitcher.check_before_step) alone",
    )
    args = parser.parse_args(argv)
    if args.compare_inputs and args.compare_kept:
        parser.error("--compare-inputs and --compare-kept are two separate runs")
    if args.model == "bert" and args.layers < 2:
        parser.error(f"--model bert needs --layers >= 2 (two halves to alternate), got {args.layers}")
    if args.breakdown:
        _breakdown.activate()

    cuda = args.device == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if "WORLD_SIZE" in os.environ:  # under torchrun: its ranks, and the switch's collective runs
        dist.init_process_group("nccl" if cuda else "gloo")
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    world, rank = dist.get_world_size(), dist.get_rank()
    # --compare-kept: run 0 builds a reducer at every switch, run 1 keeps the idle one.
    runs = [_setup(args, device, keep) for keep in ((0, 1) if args.compare_kept else (args.keep_reducers,))]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    profile = cProfile.Profile()
    steps, switches, other_way = [], [], []
    comparing = args.compare_inputs or args.compare_kept
    for i in range(args.warmup + args.switches):
        # Comparing: two switches (one of each phase) one way, the next two the other way.
        second = comparing and bool((i // 2) % 2)
        _inputs.fast_inputs = not (args.compare_inputs and second)
        other_way.append(second)
        ddp, switcher, opt, loss = runs[1 if args.compare_kept and second else 0]
        started = time.perf_counter()
        loss(ddp).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        steps.append(time.perf_counter() - started)
        measured = i >= args.warmup and not (args.breakdown or comparing)
        started = time.perf_counter()
        if measured:
            profile.enable()
        switcher.step_to(i + 1)
        sync()
        if measured:
            profile.disable()
        switches.append(time.perf_counter() - started)
    _inputs.fast_inputs = True
    if rank == 0:  # rank 0 reports (every rank ran the same loop)
        report(args, runs[0][0].module, device, world, steps, switches, other_way, profile)
    if args.check_cost:
        _check_cost(runs[0], rank, statistics.median(steps))
    # The switcher holds the wrapper too: free its reducer explicitly, let the gloo threads
    # finish, then destroy the group (a gloo thread alive at interpreter exit aborts it).
    shutdown(*(run[0] for run in runs))


def _check_cost(run: tuple[DDP, PhaseSwitcher, Any, Any], rank: int, step_s: float) -> None:
    """Median time of the invariant check every optimizer step runs, after a backward (gradients present)."""
    ddp, switcher, _, loss = run
    loss(ddp).backward()
    times = []
    for _ in range(2000):
        started = time.perf_counter()
        switcher.check_before_step()
        times.append(time.perf_counter() - started)
    ddp.zero_grad(set_to_none=True)
    if rank == 0:
        median = statistics.median(times)
        print(
            f"invariant check before each step: median {median * 1e6:.1f} us over 2000 calls "
            f"({100 * median / step_s:.2f} % of a step)"
        )


def _setup(args: argparse.Namespace, device: torch.device, keep: int) -> tuple[DDP, PhaseSwitcher, Any, Any]:
    """A model in DDP, attached to a switcher (``keep_reducers=keep``): ``(ddp, switcher, optimizer, loss)``."""
    model, groups, loss = _model(args, device)
    opt = GroupedOptimizer(groups, lambda params: torch.optim.Adam(params, lr=1e-4), state_policy=args.policy)
    switcher = PhaseSwitcher(groups, Alternating(list(groups.names)), optimizer=opt, keep_reducers=keep)
    switcher.step_to(0)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    switcher.attach(ddp)
    return ddp, switcher, opt, loss


def report(
    args: argparse.Namespace,
    model: nn.Module,
    device: torch.device,
    world: int,
    steps: list[float],
    switches: list[float],
    other_way: list[bool],
    profile: cProfile.Profile,
) -> None:
    """Print the medians (and the cProfile, the parts or the comparison) on rank 0."""
    print(f"{machine(device.type, world)}; 1-minute load {os.getloadavg()[0]:.2f}")
    measured = list(zip(switches[args.warmup :], other_way[args.warmup :], steps[args.warmup :]))
    ours = [t for t, other, _ in measured if not other]
    second_way = [t for t, other, _ in measured if other]
    step_ms = 1e3 * statistics.median(s for _, other, s in measured if not other)
    switch_ms = 1e3 * statistics.median(ours)
    what = (
        f"halves of {args.size_mib} MiB in {args.layers} layer(s)"
        if args.model == "halves"
        else f"BERT, {args.layers} layers, {sum(1 for _ in model.modules())} modules, "
        f"{sum(1 for _ in model.parameters())} parameters"
    )
    kept = "keep_reducers=0" if args.compare_kept else f"keep_reducers={args.keep_reducers}"
    print(
        f"{device.type}, {what}, {args.policy}, {kept}: median step "
        f"{step_ms:.2f} ms, median switch {switch_ms:.3f} ms ({100 * switch_ms / step_ms:.2f} % of a step"
        + (
            ", parts timed); median per part:"
            if args.breakdown
            else ")"
            if args.compare_inputs or args.compare_kept
            else "; the profiled switches run slower)"
        )
    )
    if args.compare_kept:
        kept_ms = 1e3 * statistics.median(second_way)
        kept_step = 1e3 * statistics.median(s for _, other, s in measured if other)
        print(
            f"  keep_reducers=1: median step {kept_step:.2f} ms, median switch {kept_ms:.3f} ms "
            f"({100 * kept_ms / kept_step:.2f} % of a step); kept / built: switch {kept_ms / switch_ms:.3f}x, "
            f"step {kept_step / step_ms:.3f}x ({len(ours)} and {len(second_way)} switches, interleaved)"
        )
    if args.compare_inputs:
        theirs = 1e3 * statistics.median(second_way)
        print(
            f"  reducer inputs by DDP's own methods: median switch {theirs:.3f} ms "
            f"({100 * theirs / step_ms:.2f} % of a step); hf_altparams' / DDP's = {switch_ms / theirs:.3f}x "
            f"({len(ours)} and {len(second_way)} switches, interleaved)"
        )
    if args.breakdown:
        switches_ = _breakdown.RECORDER.switches[args.warmup :]
        for part in list(_breakdown.PARTS) + ["switch"]:
            print(f"  {part:17s} {1e3 * statistics.median(e[part] for e in switches_):.3f} ms")
    elif not (args.compare_inputs or args.compare_kept):
        pstats.Stats(profile).sort_stats(args.sort).print_stats(args.top)


def _model(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, ParamGroups, Any]:
    """The model, its two groups (``low``, ``high`` for BERT) and ``loss(wrapper)``."""
    torch.manual_seed(0)
    if args.model == "halves":
        halves = TwoHalves(args.size_mib, layers=args.layers).to(device)
        x = torch.randn(16, halves.width, device=device)
        return (
            halves,
            ParamGroups(halves, {h: f"{h}.*" for h in ("layer1", "layer2")}),
            lambda wrapped: wrapped(x).pow(2).mean(),
        )
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=64,
    )
    bert = BertModel(config).to(device)
    half = args.layers // 2
    low = [r"re:embeddings\..*"] + [f"encoder.layer.{i}.*" for i in range(half)]
    high = [f"encoder.layer.{i}.*" for i in range(half, args.layers)] + ["pooler.*"]
    ids = torch.randint(0, config.vocab_size, (8, 32), device=device)
    return (bert, ParamGroups(bert, {"low": low, "high": high}), lambda wrapped: _bert_loss(wrapped(input_ids=ids)))


def _bert_loss(out: Any) -> torch.Tensor:
    # Every trainable parameter must get a gradient (the pooler too): with
    # find_unused_parameters=False an unused one leaves its bucket un-all-reduced,
    # which a switch refuses.
    return out.last_hidden_state.pow(2).mean() + out.pooler_output.pow(2).mean()


if __name__ == "__main__":
    main()
