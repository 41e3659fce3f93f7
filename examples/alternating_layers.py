"""Train two big layers in turn under DDP, and compare with training one of them alone.

Run it (two CPU processes; on GPUs drop ACCELERATE_USE_CPU and pick the count)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/alternating_layers.py

The network has two layers, ``layer1`` and ``layer2`` (16 MiB of weights each by
default; ``--width`` changes that). The script trains it twice, one run after
the other, on the same random regression data:

1. ``alternating``: :class:`PhasedAccelerator` with ``Alternating(["layer1",
   "layer2"])``: one layer trains per optimizer step, each with its own AdamW
   inside one :class:`GroupedOptimizer`. Only the active layer is in DDP's
   reducer, so only its gradients are all-reduced.
2. ``single``: a stock ``Accelerator`` training ``layer1`` alone (``layer2``
   frozen before ``prepare``): the figures the alternating run should match.

It prints, for both runs, the peak memory (CUDA: ``max_memory_allocated``; CPU:
the growth of the process RSS over the run, sampled after every backward and
step) and the bytes DDP all-reduced per step, counted by a comm hook.

Both runs share one process, so on CPU two things would blur RSS: the first
training run in a process pays one-time costs (gloo buffers, autograd threads),
and glibc keeps freed blocks of one run for the next (it raises its mmap
threshold after a big block is freed). So the script pins that threshold to
1 MiB (big tensors are mmapped and returned to the OS when freed, and RSS
follows live memory; the order of the runs then no longer matters) and starts
with a short, unreported warm-up run of the baseline.

What to expect: the same bytes per step as training one layer (a ratio of 1.00;
a DDP over both layers would all-reduce 2x). Memory: the idle layer's AdamW
state is extra. With ``--state-policy offload`` (default) it moves to host
memory, so on a GPU the peak is close to the single-layer run; on CPU, host
memory *is* the device, so expect about two extra copies of a layer (its AdamW
moments) over the single-layer figure.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import math
import time
from typing import Any, Optional

import torch
from accelerate import Accelerator
from torch import nn

from hf_altparams.engine import GroupedOptimizer, register_comm_counter
from hf_altparams.engine.memory import malloc_trim, rss_bytes
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups

MiB = 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048,
                        help="layer width (2048: 16 MiB of fp32 weights per layer)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    parser.add_argument("--max-steps", type=int, default=30, help="optimizer steps of each run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of the unreported warm-up run")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--state-policy", choices=["keep", "offload", "drop"], default="offload",
                        help="what happens to the idle layer's AdamW state")
    parser.add_argument("--mode", choices=["both", "alternating", "single"], default="both")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class TwoLayerNet(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer1 = nn.Linear(width, width)
        self.layer2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.relu(self.layer1(x)))


class RandomRegression(torch.utils.data.Dataset):
    """Sample i is drawn from its own seeded generator: no data set held in memory, same data every run."""

    def __init__(self, size: int, width: int, seed: int) -> None:
        self.size, self.width, self.seed = size, width, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn(self.width, generator=gen)
        return x, 0.5 * x.roll(1)  # a target two linear layers can learn


def pin_mmap_threshold(nbytes: int = MiB) -> None:
    """glibc: serve blocks >= `nbytes` with mmap, always (a fixed threshold turns off its dynamic raise)."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # -3 is M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc: RSS figures are then rougher
        pass


class PeakMemory:
    """Peak memory of one run: CUDA max allocated, or RSS growth over a baseline taken at start."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        gc.collect()
        malloc_trim()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        self.device, self.base, self.peak = device, rss_bytes(), 0

    def sample(self) -> None:
        if not self.cuda:
            self.peak = max(self.peak, rss_bytes() - self.base)

    def result(self) -> tuple[float, str]:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / MiB, "CUDA max allocated"
        return self.peak / MiB, "RSS growth"


def run(mode: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """Train for `steps` optimizer steps; return peak memory, bytes per step and losses."""
    if mode == "alternating":
        accelerator: Accelerator = PhasedAccelerator(Alternating(["layer1", "layer2"]), count_comm=True)
    else:
        accelerator = Accelerator()
    memory = PeakMemory(accelerator.device)

    torch.manual_seed(args.seed)
    model = TwoLayerNet(args.width)
    if mode == "alternating":
        groups = ParamGroups(model, {"layer1": "layer1.*", "layer2": "layer2.*"})
        adamw = functools.partial(torch.optim.AdamW, lr=args.lr)
        optimizer: torch.optim.Optimizer = GroupedOptimizer(groups, adamw, state_policy=args.state_policy)
    else:
        model.layer2.requires_grad_(False)  # the baseline: layer1 alone, frozen layer2 left out of DDP
        optimizer = torch.optim.AdamW(model.layer1.parameters(), lr=args.lr)

    data = RandomRegression(steps * args.batch_size * accelerator.num_processes, args.width, args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    counter = getattr(accelerator, "comm_counter", None)
    if mode == "single" and isinstance(model, nn.parallel.DistributedDataParallel):
        counter = register_comm_counter(model)

    losses, started = [], time.perf_counter()
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        memory.sample()
        optimizer.step()
        optimizer.zero_grad()
        memory.sample()
        if mode == "single" and counter is not None:
            counter.end_step()  # PhasedAccelerator closes its counter's steps itself
        losses.append(loss.item())
        if step + 1 >= steps:
            break
    seconds = time.perf_counter() - started

    peak, kind = memory.result()
    history = list(counter.history) if counter is not None else []
    result = {"peak_mib": peak, "memory_kind": kind, "bytes_per_step": history, "losses": losses,
              "step_seconds": seconds / max(len(losses), 1),
              "switch_ms": [1000 * r.seconds for r in getattr(accelerator, "switch_records", [])[1:]]}
    accelerator.free_memory()
    del model, optimizer, loader, accelerator
    return result


def mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def main() -> None:
    args = parse_args()
    pin_mmap_threshold()
    modes = ["alternating", "single"] if args.mode == "both" else [args.mode]
    if args.warmup_steps > 0:
        run("single", args, args.warmup_steps)  # pays the process's one-time costs; not reported
    results = {mode: run(mode, args, args.max_steps) for mode in modes}

    state = Accelerator()  # the process-wide state both runs used: for printing on one process only
    layer_mib = args.width * (args.width + 1) * 4 / MiB
    state.print(f"\n{state.num_processes} process(es) on {state.device.type}; two layers of {layer_mib:.2f} MiB; "
                f"{args.max_steps} steps per run; idle state policy: {args.state_policy}")
    state.print(f"{'run':<12} {'peak memory (MiB)':>18} {'all-reduced/step (MiB)':>23} {'s/step':>7}"
                "   loss first -> last")
    for mode, res in results.items():
        per_step = mean(res["bytes_per_step"])
        shown = f"{per_step / MiB:.2f}" if per_step is not None else "n/a"
        state.print(f"{mode:<12} {res['peak_mib']:>18.1f} {shown:>23} {res['step_seconds']:>7.3f}   "
                    f"{res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}")
    if "alternating" in results:
        alt = results["alternating"]
        by_layer = {name: mean(alt["bytes_per_step"][i::2]) for i, name in enumerate(["layer1", "layer2"])}
        shown = [f"{name} {value / MiB:.2f} MiB" if value is not None else f"{name} n/a"
                 for name, value in by_layer.items()]
        state.print("alternating, all-reduced per step by active layer: " + ", ".join(shown))
        if alt["switch_ms"]:
            state.print(f"phase switch time: median {sorted(alt['switch_ms'])[len(alt['switch_ms']) // 2]:.2f} ms "
                        f"over {len(alt['switch_ms'])} switches")
    if len(results) == 2:
        alt, single = results["alternating"], results["single"]
        ratio = f"{alt['peak_mib'] / single['peak_mib']:.2f}" if single["peak_mib"] > 0 else "n/a"
        state.print(f"peak memory ratio alternating/single ({alt['memory_kind']}): {ratio}")
        if state.device.type == "cpu" and args.state_policy != "drop":
            # Why the ratio is above 1 here: the idle layer's AdamW moments are kept
            # ("keep"), or moved to host memory ("offload"), which on CPU is the device.
            state.print(f"  (on CPU the idle layer's optimizer state under --state-policy {args.state_policy} "
                        "stays in the same RAM; on a GPU offload takes it off the device, and "
                        "--state-policy drop frees it here)")
        alt_bytes, single_bytes = mean(alt["bytes_per_step"]), mean(single["bytes_per_step"])
        if alt_bytes is not None and single_bytes:
            state.print(f"bytes all-reduced per step ratio alternating/single: {alt_bytes / single_bytes:.2f}")
        else:
            state.print("bytes all-reduced per step ratio alternating/single: n/a (one process, no DDP)")
    assert all(math.isfinite(v) for res in results.values() for v in res["losses"])
    # Tear the process group down before the interpreter exits: a live gloo group can
    # abort the process at exit ("terminate called without an active exception").
    state.end_training()


if __name__ == "__main__":
    main()
