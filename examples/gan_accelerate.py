"""A small GAN with Accelerate: five discriminator steps to one generator step, two losses.

Run it (two CPU processes; on GPUs drop ACCELERATE_USE_CPU and pick the count)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 examples/gan_accelerate.py

The data are 2-D points drawn around eight modes on a circle; the generator
maps 4-D noise to 2-D points and the discriminator scores points. Both live in
one module, in two parameter groups, and ``Alternating({"discriminator": 5,
"generator": 1})`` decides which one trains at each optimizer step. The loop
reads ``accelerator.phase`` at the top of each iteration and computes that
phase's loss: the discriminator's (real vs generated points) or the
generator's (fool the discriminator). The loop calls ``zero_grad()`` first, as
many GAN loops do; the phase it reads is the right one in that order too.

Under DDP only the trainable group is in the reducer, so a discriminator step
all-reduces the discriminator's gradients only, and a generator step (whose
backward goes *through* the frozen discriminator) the generator's only.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import math
from typing import Optional

import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups

NOISE, MODES, RADIUS, SPREAD = 4, 8, 2.0, 0.05


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=1200, help="optimizer steps (both players together)")
    parser.add_argument("--disc-steps", type=int, default=5, help="discriminator steps per generator step")
    parser.add_argument("--batch-size", type=int, default=64, help="real points per process per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write per-rank parameter digests here (for the tests)")
    return parser.parse_args()


class GAN(nn.Module):
    """Generator and discriminator in one module: one ``prepare``, one DDP wrapper."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.generator = nn.Sequential(
            nn.Linear(NOISE, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2)
        )
        self.discriminator = nn.Sequential(
            nn.Linear(2, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, hidden), nn.LeakyReLU(0.2), nn.Linear(hidden, 1)
        )

    def forward(self, noise: torch.Tensor, real: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, ...]:
        """Scores of generated points, and of ``real`` points when given (one DDP forward for both)."""
        fake_scores = self.discriminator(self.generator(noise))
        return (fake_scores,) if real is None else (fake_scores, self.discriminator(real))


def ring_points(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` points around ``MODES`` modes evenly spaced on a circle."""
    angles = 2 * math.pi * torch.randint(0, MODES, (n,), generator=generator) / MODES
    centres = RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)
    return centres + SPREAD * torch.randn(n, 2, generator=generator)


def mode_distance(points: torch.Tensor) -> float:
    """Mean distance from each point to its nearest mode (0 for a perfect generator)."""
    angles = 2 * math.pi * torch.arange(MODES) / MODES
    modes = RADIUS * torch.stack([angles.cos(), angles.sin()], dim=1)
    return float(torch.cdist(points, modes).min(dim=1).values.mean())


def digests(groups: ParamGroups) -> dict[str, str]:
    """A sha256 of each group's parameters (to compare ranks, and steps)."""
    out = {}
    for name in groups.names:
        h = hashlib.sha256()
        for p in groups.params(name):
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        out[name] = h.hexdigest()
    return out


def main() -> None:
    args = parse_args()
    schedule = Alternating({"discriminator": args.disc_steps, "generator": 1})
    accelerator = PhasedAccelerator(schedule)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GAN()
    groups = ParamGroups(model, {"generator": "generator.*", "discriminator": "discriminator.*"})
    adam = functools.partial(torch.optim.Adam, lr=args.lr, betas=(0.5, 0.999))
    optimizer = GroupedOptimizer(groups, {"generator": adam, "discriminator": adam})
    real_set = torch.utils.data.TensorDataset(ring_points(20_000, torch.Generator().manual_seed(args.seed)))
    loader = torch.utils.data.DataLoader(
        real_set,
        batch_size=args.batch_size,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(args.seed),
    )
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    bce = nn.BCEWithLogitsLoss()
    noise_gen = torch.Generator().manual_seed(args.seed + 1 + accelerator.process_index)  # per-rank noise
    probe = torch.randn(2000, NOISE, generator=torch.Generator().manual_seed(12345))  # fixed, for the summary
    with torch.no_grad():
        start_distance = mode_distance(accelerator.unwrap_model(model).generator(probe.to(accelerator.device)).cpu())
    trace: list[dict[str, object]] = []
    last = {"discriminator": float("nan"), "generator": float("nan")}
    counts = {"discriminator": 0, "generator": 0}
    model.train()
    while accelerator.schedule_step < args.max_steps:
        for (real,) in loader:
            phase = accelerator.phase.name  # "discriminator" or "generator": the step about to run
            before = digests(groups) if args.out else None
            optimizer.zero_grad()
            noise = torch.randn(real.shape[0], NOISE, generator=noise_gen).to(accelerator.device)
            if phase == "discriminator":  # real points -> 1, generated -> 0 (the generator is frozen)
                fake_scores, real_scores = model(noise, real)
                loss = bce(real_scores, torch.ones_like(real_scores)) + bce(fake_scores, torch.zeros_like(fake_scores))
            else:  # generated points -> 1, through the frozen discriminator
                (fake_scores,) = model(noise)
                loss = bce(fake_scores, torch.ones_like(fake_scores))
            accelerator.backward(loss)
            optimizer.step()
            last[phase], counts[phase] = loss.item(), counts[phase] + 1
            if before is not None:
                after = digests(groups)
                trace.append({"phase": phase, "changed": sorted(g for g in before if before[g] != after[g])})
            if accelerator.schedule_step >= args.max_steps:
                break

    with torch.no_grad():
        end_distance = mode_distance(accelerator.unwrap_model(model).generator(probe.to(accelerator.device)).cpu())
    accelerator.print(
        f"{accelerator.schedule_step} steps on {accelerator.num_processes} process(es): "
        f"{counts['discriminator']} discriminator, {counts['generator']} generator "
        f"({args.disc_steps}:1); last losses: discriminator {last['discriminator']:.3f}, "
        f"generator {last['generator']:.3f}\n"
        f"generated points, mean distance to the nearest mode: {start_distance:.3f} -> {end_distance:.3f}"
    )
    if args.out:
        from hf_altparams.testing.launch import write_rank_result

        write_rank_result(
            args.out, {"final": digests(groups), "steps": trace, "counts": counts}, rank=accelerator.process_index
        )
    # Frees the DDP wrapper's reducer, lets the gloo threads finish, then destroys the group.
    accelerator.end_training()


if __name__ == "__main__":
    main()
