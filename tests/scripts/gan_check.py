"""Two models, two optimizers, one schedule: the most common GAN layout under ``PhasedAccelerator``.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 tests/scripts/gan_check.py OUT_DIR

A generator and a discriminator, separate modules, each with its own Adam,
prepared together (``gen, disc, opt_g, opt_d = accelerator.prepare(...)``)
with ``groups={"generator": gen, "discriminator": disc}``; the discriminator
trains 2 steps, then the generator 1. Each rank writes what a user would check:
the bytes all-reduced per step (counted by a comm hook on both wrappers) next to
the active model's trainable bytes, a digest of all its weights, and the
largest difference to one process running the same loop on the full batch.
"""

from __future__ import annotations

import hashlib
import sys

import torch
import torch.distributed as dist
from torch import nn

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating
from hf_altparams.testing import write_rank_result

STEPS, BATCH, NOISE = 9, 8, 4
SCHEDULE = {"discriminator": 2, "generator": 1}


def models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(NOISE, 16), nn.Tanh(), nn.Linear(16, 6))
    disc = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
    return gen, disc


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=gen) + 2, torch.randn(BATCH, NOISE, generator=gen)) for _ in range(STEPS)]


def d_loss(gen: nn.Module, disc: nn.Module, real: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    fake = gen(noise).detach()
    scores = disc(torch.cat([real, fake]))  # one forward of the wrapper per iteration
    target = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)])
    return nn.functional.binary_cross_entropy_with_logits(scores, target)


def g_loss(gen: nn.Module, disc: nn.Module, noise: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(disc(gen(noise)), torch.ones(len(noise), 1))


def reference() -> dict[str, torch.Tensor]:
    """One process, no DDP, the whole batch: the same alternation with plain Adams."""
    gen, disc = models()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-2), torch.optim.Adam(disc.parameters(), lr=1e-2)
    schedule = Alternating(SCHEDULE)
    for step, (real, noise) in enumerate(batches()):
        training_d = schedule.phase_at(step).name == "discriminator"
        gen.requires_grad_(not training_d)
        disc.requires_grad_(training_d)
        loss = d_loss(gen, disc, real, noise) if training_d else g_loss(gen, disc, noise)
        loss.backward()
        (opt_d if training_d else opt_g).step()
        opt_d.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)
    return {f"generator.{n}": p.detach().clone() for n, p in gen.named_parameters()} | {
        f"discriminator.{n}": p.detach().clone() for n, p in disc.named_parameters()
    }


def main() -> None:
    out = sys.argv[1]
    gen, disc = models()
    opt_g, opt_d = torch.optim.Adam(gen.parameters(), lr=1e-2), torch.optim.Adam(disc.parameters(), lr=1e-2)
    acc = PhasedAccelerator(count_comm=True)  # the accelerator line first, as GAN scripts have it
    acc.set_phases(Alternating(SCHEDULE), groups={"generator": gen, "discriminator": disc})
    gen, disc, opt_g, opt_d = acc.prepare(gen, disc, opt_g, opt_d)
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = []
    for real, noise in batches():
        phase = acc.phase.name
        real, noise = real.chunk(world)[rank], noise.chunk(world)[rank]
        if phase == "discriminator":
            acc.backward(d_loss(gen, disc, real, noise))
            opt_d.step()
        else:
            acc.backward(g_loss(gen, disc, noise))
            opt_g.step()
        opt_d.zero_grad()
        opt_g.zero_grad()
        model = acc.unwrap_model(disc if phase == "discriminator" else gen)
        steps.append(
            {
                "phase": phase,
                "reduced": acc.comm_counter.history[-1],
                "active_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            }
        )
    weights = {f"generator.{n}": p.detach() for n, p in acc.unwrap_model(gen).named_parameters()} | {
        f"discriminator.{n}": p.detach() for n, p in acc.unwrap_model(disc).named_parameters()
    }
    expected = reference()
    digest = hashlib.sha256(b"".join(weights[n].numpy().tobytes() for n in sorted(weights))).hexdigest()
    write_rank_result(
        out,
        {
            "steps": steps,
            "digest": digest,
            "wrappers": len(acc.switcher.wrappers),
            "max_diff": max(float((weights[n] - expected[n]).abs().max()) for n in expected),
            "switches": acc.switch_history.count,
        },
    )
    shutdown(gen, disc)


if __name__ == "__main__":
    main()
