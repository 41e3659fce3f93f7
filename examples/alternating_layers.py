"""Train two big layers in turn under DDP, four ways side by side, and see what each costs.

Run it (two CPU processes; on GPUs drop ACCELERATE_USE_CPU and pick the count)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/alternating_layers.py

The network has two layers, ``layer1`` and ``layer2`` (16 MiB of weights each by
default; ``--width`` changes that), each with its own AdamW, trained in turn:
one layer per optimizer step. The script trains it four times, one run after
the other, on the same random regression data:

1. ``naive``: the loop people write first: every step, unwrap the DDP, flip
   ``requires_grad``, wrap a new ``DistributedDataParallel`` (DDP picks the
   parameters it reduces in its constructor), step that layer's AdamW.
2. ``find_unused``: one DDP over both layers with ``find_unused_parameters=True``,
   ``requires_grad`` flipped every step: it works, but DDP keeps buckets for
   both layers and all-reduces both every step (zeros for the frozen one).
3. ``hf_altparams``: :class:`PhasedAccelerator` with ``Alternating(["layer1",
   "layer2"])`` and one :class:`GroupedOptimizer` holding the two AdamWs: the
   same DDP wrapper is re-bucketed in place at each switch, so only the active
   layer is in DDP's reducer and all-reduced.
4. ``hf_drop``: the same with ``state_policy="drop"``: the idle layer's AdamW
   state is freed (so that layer's Adam restarts at each of its phases).
5. ``single``: a stock ``Accelerator`` training ``layer1`` alone (``layer2``
   frozen before ``prepare``): the floor every other run is compared with.

It prints, for each run, the peak memory (CUDA: ``max_memory_allocated``; CPU:
the growth of the process RSS over the run, sampled after every backward and
step), its ratio to ``single``, the bytes DDP all-reduced per step (counted by
a comm hook), the bytes DDP's constructor broadcast over the run (counted by a
spy on its broadcast: once at ``prepare``, but the naive loop re-sends the
whole model at every re-wrap), and the time per step; for the hf_altparams runs
also the idle layer's AdamW state at the end, counted from its tensors (how much,
and on which device).

What to expect on CPU: every loop all-reduces one layer per step except
``find_unused`` (both); the three loops that keep both AdamWs lose the same
loss curve; ``naive`` also broadcasts the whole model every step; memory above
``single`` is mostly the idle layer's AdamW moments, which ``naive``,
``find_unused`` and ``hf_altparams`` all hold (``hf_drop`` frees them).

The idle layer's AdamW state: ``--state-policy auto`` (default) keeps it where
it is on CPU (host memory *is* the device there, so "offloading" it would only
copy it within the same RAM and cost time) and offloads it to host memory on a
GPU, where that takes two layer-sized moments off the device. ``drop`` frees it
(the layer's Adam restarts at each of its phases).

All runs share one process, so on CPU two things would blur RSS: the first
training run in a process pays one-time costs (gloo buffers, autograd threads),
and glibc keeps freed blocks of one run for the next (it raises its mmap
threshold after a big block is freed). So the script pins that threshold to
1 MiB (``mmap_large_host_allocations``: big tensors are mmapped and returned to the OS when freed, and RSS
follows live memory; the order of the runs then no longer matters) and starts
with a short, unreported warm-up run of the baseline.
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs
from torch import nn

from hf_altparams.engine import (
    CommCounter,
    GroupedOptimizer,
    counting_allreduce_hook,
    mmap_large_host_allocations,
    register_comm_counter,
)
from hf_altparams.engine.memory import malloc_trim, rss_bytes
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups

MiB = 2**20
RUNS = ("naive", "find_unused", "hf_altparams", "hf_drop", "single")
LAYERS = ("layer1", "layer2")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=2048, help="layer width (2048: 16 MiB of fp32 weights per layer)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    parser.add_argument("--max-steps", type=int, default=20, help="optimizer steps of each run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of the unreported warm-up run")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--state-policy",
        choices=["auto", "keep", "offload", "drop"],
        default="auto",
        help="what happens to the idle layer's AdamW state in hf_altparams (auto: keep on CPU, offload on a GPU)",
    )
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS), help="which runs, in this order")
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


class BroadcastSpy:
    """Counts the bytes ``torch.distributed._broadcast_coalesced`` sends (DDP's constructor uses it)."""

    def __init__(self) -> None:
        self.sent = 0
        self._original: Any = None

    def __enter__(self) -> BroadcastSpy:
        self._original = dist._broadcast_coalesced

        def spy(group: Any, tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
            self.sent += sum(t.numel() * t.element_size() for t in tensors)
            return self._original(group, tensors, *args, **kwargs)

        dist._broadcast_coalesced = spy
        return self

    def __exit__(self, *exc: Any) -> None:
        dist._broadcast_coalesced = self._original


def make_accelerator(mode: str, policy: str) -> Accelerator:
    if mode in ("hf_altparams", "hf_drop"):
        return PhasedAccelerator(Alternating(list(LAYERS)), count_comm=True)
    if mode == "find_unused":
        return Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
    return Accelerator()


def run(mode: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    """Train for `steps` optimizer steps; return peak memory, bytes per step and losses."""
    accelerator = make_accelerator(mode, args.state_policy)
    policy = args.state_policy
    if policy == "auto":
        policy = "offload" if accelerator.device.type == "cuda" else "keep"
    if mode == "hf_drop":
        policy = "drop"
    memory = PeakMemory(accelerator.device)
    distributed = accelerator.num_processes > 1

    torch.manual_seed(args.seed)
    model = TwoLayerNet(args.width)
    adamw = functools.partial(torch.optim.AdamW, lr=args.lr)
    data = RandomRegression(steps * args.batch_size * accelerator.num_processes, args.width, args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size)
    counter: Optional[CommCounter] = None
    wrapped: nn.Module
    spy = BroadcastSpy()
    if mode in ("hf_altparams", "hf_drop"):
        groups = ParamGroups(model, {name: f"{name}.*" for name in LAYERS})
        grouped = GroupedOptimizer(groups, adamw, state_policy=policy)
        with spy:
            wrapped, optimizer, loader = accelerator.prepare(model, grouped, loader)
        counter = accelerator.comm_counter  # type: ignore[attr-defined]
        optimizers = {name: optimizer for name in LAYERS}  # one optimizer; it steps the active layer
    elif mode == "single":
        model.layer2.requires_grad_(False)  # layer1 alone, frozen layer2 left out of DDP
        with spy:
            wrapped, opt1, loader = accelerator.prepare(model, adamw(model.layer1.parameters()), loader)
        optimizers = {"layer1": opt1}
        if distributed:
            counter = register_comm_counter(wrapped)  # type: ignore[arg-type]
    else:  # the user's two optimizers, one per layer
        opt1, opt2 = adamw(model.layer1.parameters()), adamw(model.layer2.parameters())
        if mode == "find_unused":
            with spy:
                wrapped, opt1, opt2, loader = accelerator.prepare(model, opt1, opt2, loader)
            if distributed:
                counter = register_comm_counter(wrapped)  # type: ignore[arg-type]
        else:  # naive: the model is wrapped anew at every step below
            opt1, opt2, loader = accelerator.prepare(opt1, opt2, loader)
            model.to(accelerator.device)
            counter = CommCounter() if distributed else None
        optimizers = {"layer1": opt1, "layer2": opt2}

    losses, started = [], time.perf_counter()
    for step, (x, y) in enumerate(loader):
        active = LAYERS[step % 2] if mode != "single" else "layer1"
        if mode in ("naive", "find_unused"):
            for name in LAYERS:
                getattr(model, name).requires_grad_(name == active)
        if mode == "naive" and distributed:
            with spy:  # a new reducer for this step's layer; the constructor broadcasts the whole model
                wrapped = nn.parallel.DistributedDataParallel(model)
            wrapped.register_comm_hook(counter, counting_allreduce_hook)
        elif mode == "naive":
            wrapped = model
        loss = nn.functional.mse_loss(wrapped(x), y)
        accelerator.backward(loss)
        memory.sample()
        optimizers[active].step()
        optimizers[active].zero_grad()
        memory.sample()
        if mode not in ("hf_altparams", "hf_drop") and counter is not None:
            counter.end_step()  # PhasedAccelerator closes its counter's steps itself
        losses.append(loss.item())
        if step + 1 >= steps:
            break
    seconds = time.perf_counter() - started

    peak, kind = memory.result()
    history = list(counter.history) if counter is not None else []
    idle_state: dict[str, int] = {}  # the idle layer's AdamW state at the end, counted from its tensors
    if mode in ("hf_altparams", "hf_drop"):
        idle = next(name for name in LAYERS if name not in accelerator.phase.trainable)  # type: ignore[attr-defined]
        idle_state = grouped.state_bytes(idle)
    result = {
        "peak_mib": peak,
        "memory_kind": kind,
        "bytes_per_step": history,
        "losses": losses,
        "broadcast_bytes": spy.sent,
        "idle_state_bytes": idle_state,
        "step_seconds": seconds / max(len(losses), 1),
        "policy": policy,
        "switch_ms": [1000 * r.seconds for r in getattr(accelerator, "switch_records", [])[1:]],
    }
    accelerator.free_memory()
    del model, wrapped, optimizers, loader, accelerator
    return result


def mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def ratio(a: Optional[float], b: Optional[float]) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "n/a"


def main() -> None:
    args = parse_args()
    mmap_large_host_allocations(MiB)  # glibc: blocks >= 1 MiB from mmap, always (no-op elsewhere)
    if args.warmup_steps > 0:
        run("single", args, args.warmup_steps)  # pays the process's one-time costs; not reported
    results = {mode: run(mode, args, args.max_steps) for mode in args.runs}

    state = Accelerator()  # the process-wide state every run used: for printing on one process only
    layer_mib = args.width * (args.width + 1) * 4 / MiB
    policy = results["hf_altparams"]["policy"] if "hf_altparams" in results else args.state_policy
    kind = next(iter(results.values()))["memory_kind"]
    single = results.get("single")
    state.print(
        f"\n{state.num_processes} process(es) on {state.device.type}; two layers of {layer_mib:.2f} MiB, "
        f"one AdamW each, trained in turn; {args.max_steps} steps per run; hf_altparams idle-state "
        f"policy: {policy}"
    )
    state.print(
        f"{'run':<13} {'peak memory (MiB, ' + kind + ')':>30} {'vs single':>9} "
        f"{'all-reduced/step (MiB)':>23} {'wrap broadcasts (MiB)':>22} {'s/step':>7}   loss first -> last"
    )
    for mode, res in results.items():
        per_step = mean(res["bytes_per_step"])
        shown = f"{per_step / MiB:.2f}" if per_step is not None else "n/a"
        versus = ratio(res["peak_mib"], single["peak_mib"]) if single else "n/a"
        state.print(
            f"{mode:<13} {res['peak_mib']:>30.1f} {versus:>9} {shown:>23} "
            f"{res['broadcast_bytes'] / MiB:>22.2f} {res['step_seconds']:>7.3f}   "
            f"{res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}"
        )
    hf = results.get("hf_altparams")
    if hf is not None:
        by_layer = {name: mean(hf["bytes_per_step"][i::2]) for i, name in enumerate(LAYERS)}
        shown = [
            f"{name} {value / MiB:.2f} MiB" if value is not None else f"{name} n/a" for name, value in by_layer.items()
        ]
        state.print("hf_altparams, all-reduced per step by active layer: " + ", ".join(shown))
        if hf["switch_ms"]:
            state.print(
                f"hf_altparams phase switch: median {sorted(hf['switch_ms'])[len(hf['switch_ms']) // 2]:.2f} ms "
                f"over {len(hf['switch_ms'])} switches"
            )
        for other in ("naive", "find_unused", "single"):
            if other in results:
                res = results[other]
                state.print(
                    f"hf_altparams / {other}: peak memory {ratio(hf['peak_mib'], res['peak_mib'])}, "
                    f"bytes all-reduced per step {ratio(mean(hf['bytes_per_step']), mean(res['bytes_per_step']))}, "
                    f"time per step {ratio(hf['step_seconds'], res['step_seconds'])}"
                )
    for mode in ("hf_altparams", "hf_drop"):
        if mode in results:  # measured: where the idle layer's AdamW state was at the end, and how much
            held = results[mode]["idle_state_bytes"]
            where = ", ".join(f"{b / MiB:.1f} MiB on {device}" for device, b in held.items()) or "none"
            state.print(f"{mode}: the idle layer's AdamW state at the end (policy {results[mode]['policy']}): {where}")
    if hf is not None and single is not None:
        state.print(f"hf_altparams above single: {hf['peak_mib'] - single['peak_mib']:.1f} MiB (peak memory)")
    assert all(math.isfinite(v) for res in results.values() for v in res["losses"])
    # Exit cleanly: let the gloo threads finish, then destroy the group (hf_altparams.engine.shutdown).
    shutdown()


if __name__ == "__main__":
    main()
