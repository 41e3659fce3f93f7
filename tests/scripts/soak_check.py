"""Soak: thousands of switches of a random schedule through :class:`PhasedAccelerator` on 2 ranks.

Usage (every rank runs it; ``benchmarks/soak.py`` is the driver, the test suite
runs a short version)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 soak_check.py OUT_DIR \\
        --switches 10000 --warmup 2000 --sample-every 500

A tiny model (a trunk, four blocks, two task heads) trains under a schedule
that draws, at every step and from the step alone (equal on every rank), either
a :class:`RandomBlocks` phase (two of the four blocks and the trunk train, every
group resident) or a :class:`PerTaskCycle` phase (trunk, blocks and one task
head train; the other head is not resident: off the device, out of DDP,
guarded). The optimizer's idle-state policy differs per group (``keep``,
``offload``, ``drop``). It runs until ``--switches`` switches are done.

Each rank writes ``OUT_DIR/rank{r}.json``: a digest of its parameters, buffers
and optimizer state at the end (equal on every rank, or the ranks drifted), the
switch count and the records the bounded history kept, and its RSS (after
``gc.collect()`` and ``malloc_trim``) at the end of the warm-up and every
``--sample-every`` switches after it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer, rss_bytes
from hf_altparams.engine.memory import malloc_trim
from hf_altparams.engine.optim import StatePolicy
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import FnSchedule, ParamGroups, PerTaskCycle, Phase, RandomBlocks
from hf_altparams.testing.launch import write_rank_result

BLOCKS = ["b0", "b1", "b2", "b3"]
SPECS = {"trunk": "trunk.*", **{b: f"blocks.{b[1]}.*" for b in BLOCKS}, "t0": "t0.*", "t1": "t1.*"}
POLICY: dict[str, StatePolicy] = {
    "trunk": "keep",
    "b0": "offload",
    "b1": "drop",
    "b2": "offload",
    "b3": "drop",
    "t0": "offload",
    "t1": "drop",
}


class SoakNet(nn.Module):
    """A trunk, four blocks and one head per task; the caller says which head runs."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in BLOCKS)
        self.t0, self.t1 = nn.Linear(width, 1), nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return getattr(self, task)(h)


def random_schedule(seed: int, per_task_share: float = 0.3) -> FnSchedule:
    """Each step a fresh draw (from ``seed`` and the step only): a RandomBlocks or a PerTaskCycle phase."""
    blocks = RandomBlocks(BLOCKS, k=2, every=1, seed=seed, always=["trunk"])
    per_task = PerTaskCycle(["trunk", *BLOCKS], ["t0", "t1"], every=1)

    def pick(step: int, epoch: int) -> Phase:
        source = per_task if random.Random(f"{seed}:{step}").random() < per_task_share else blocks
        return source.phase_at(step, epoch)

    return FnSchedule(pick, groups=list(SPECS), name=f"soak-{seed}")


def digest(*objects: Any) -> str:
    """SHA-256 over tensors (bytes, dtype, shape) and plain values, walking dicts in key order."""
    h = hashlib.sha256()

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous().reshape(-1)
            h.update(f"{t.dtype}{tuple(obj.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, dict):
            for key in sorted(obj, key=str):
                h.update(repr(key).encode())
                walk(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        else:
            h.update(repr(obj).encode())

    for obj in objects:
        walk(obj)
    return h.hexdigest()


def settled_rss() -> int:
    gc.collect()
    malloc_trim()
    return rss_bytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--switches", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    acc = PhasedAccelerator(random_schedule(args.seed), log_switches=False)
    torch.manual_seed(0)
    model = SoakNet()
    opt = GroupedOptimizer(
        ParamGroups(model, SPECS), functools.partial(torch.optim.AdamW, lr=1e-3), state_policy=POLICY
    )
    ddp, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(1000 + acc.process_index)  # each rank its own data
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(16)]
    history = acc.switch_history
    assert history is not None
    kinds: Counter[str] = Counter()
    rss: list[tuple[int, int]] = []
    steps, started = 0, time.perf_counter()
    next_sample = args.warmup
    while history.count < args.switches:
        phase = acc.phase
        assert phase is not None
        kinds["per_task" if phase.task else "random_blocks"] += 1
        x, y = batches[steps % len(batches)]
        acc.backward(nn.functional.mse_loss(ddp(x, phase.task or "t0"), y))
        opt.step()
        opt.zero_grad()  # the switch, when the phase changes, happens here
        steps += 1
        if history.count >= next_sample:
            rss.append((history.count, settled_rss()))
            next_sample += args.sample_every
    seconds = time.perf_counter() - started
    if not rss or rss[-1][0] != history.count:
        rss.append((history.count, settled_rss()))
    write_rank_result(
        Path(args.out),
        {
            "digest": digest(model.state_dict(), opt.state_dict()),
            "steps": steps,
            "switches": history.count,
            "records_kept": len(acc.switch_records),
            "window": history.window,
            "phase_kinds_per_step": dict(kinds),
            "switch_seconds_total": history.seconds,
            "seconds_total": seconds,
            "rss_samples": rss,
            "rss_growth_after_warmup": rss[-1][1] - rss[0][1],
        },
        rank=acc.process_index,
    )
    acc.end_training()


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
