"""Elastic restart of a phased run: a rank dies mid-phase, the job restarts and resumes by itself.

Run it (two CPU processes; rank 1 kills itself at step 8 of the first attempt)::

    ACCELERATE_USE_CPU=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1 --nproc-per-node 2 \
        --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \
        examples/elastic_restart.py --project-dir /tmp/elastic --kill-at-step 8

(on GPUs drop ``ACCELERATE_USE_CPU``; ``accelerate launch --max_restarts 1
--rdzv_backend c10d`` passes the same options to the same torch elastic agent).
The c10d rendezvous with a fresh store per attempt avoids restarts that fail or
hang on the previous attempt's addresses (``docs/faults.md``).

The recipe, everything a job needs to survive a lost rank:

1. ``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``save_state()``
   writes ``checkpoint_<n>`` folders; a save killed part-way leaves a folder
   without its completion marker.
2. On start, ``if accelerator.latest_checkpoint(): accelerator.load_state()``:
   the latest *complete* checkpoint (interrupted saves are skipped) brings back
   the weights, the optimizer state of every group (also the ones offloaded to
   the host), the schedule position and the phase, the RNG states; the next
   ``save_state()`` numbers after the highest folder.
3. Each step's data must be the same after a restart: here each step's batch is
   derived from the step number (with a ``DataLoader``, skip the batches already
   seen with ``accelerator.skip_first_batches``).
4. Save every ``--save-every`` steps; the steps after the last complete save are
   trained again after a restart.
5. Bound the time a surviving rank waits for a dead or hung one: the process
   group's timeout (``InitProcessGroupKwargs(timeout=...)``; 30 min by default)
   and the switch's ``collective_timeout``. On one node torchrun stops the
   other ranks at once when one dies; across nodes these timeouts do.

The launcher restarts every rank (``--max-restarts`` times); the restarted job
(``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the latest complete checkpoint
and ends bit-equal to an uninterrupted run: the last line, ``final parameter
sha256``, is the same (``tests/integrations/test_elastic_restart.py`` checks it).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import os
import signal

import torch
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project-dir", required=True, help="checkpoints go to PROJECT_DIR/checkpoints")
    parser.add_argument("--max-steps", type=int, default=12, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=2, help="save_state() every N steps")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="on the first attempt only, --kill-rank SIGKILLs itself after the backward of this step",
    )
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--group-timeout", type=float, default=60.0, help="process group timeout, seconds")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.middle = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.middle(self.encoder(x)))


def batch_for(step: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of optimizer step ``step`` on ``rank``: the same after any restart."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    x = torch.randn(8, 16, generator=gen)
    return x, x[:, :1].sin() + 0.1 * torch.randn(8, 1, generator=gen)


def digest(model: nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    args = parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    accelerator = PhasedAccelerator(
        Alternating({"encoder": 3, "middle": 2, "head": 2}),
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=args.group_timeout))],
        switcher_options={"collective_timeout": args.group_timeout},
        log_switches=False,
    )
    torch.manual_seed(args.seed)
    model = Net()
    groups = ParamGroups(model, {"encoder": "encoder.*", "middle": "middle.*", "head": "head.*"})
    # Idle groups' AdamW state lives on the host (offload) or is dropped (drop): a checkpoint holds both kinds.
    optimizer = GroupedOptimizer(
        groups,
        functools.partial(torch.optim.AdamW, lr=1e-2),
        state_policy={"encoder": "offload", "middle": "drop", "head": "keep"},
    )
    model, optimizer = accelerator.prepare(model, optimizer)

    if accelerator.latest_checkpoint() is not None:
        resumed = accelerator.latest_checkpoint()
        accelerator.load_state()  # the latest complete checkpoint: interrupted saves are skipped
        accelerator.print(
            f"attempt {attempt}: resumed from {os.path.basename(str(resumed))} "
            f"at step {accelerator.schedule_step} (phase {accelerator.phase.name if accelerator.phase else None})"
        )
    else:
        accelerator.print(f"attempt {attempt}: no complete checkpoint, starting at step 0")

    model.train()
    while accelerator.schedule_step < args.max_steps:
        step = accelerator.schedule_step
        x, y = batch_for(step, accelerator.process_index, args.seed)
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        if attempt == 0 and step == args.kill_at_step and accelerator.process_index == args.kill_rank:
            print(
                f"rank {args.kill_rank}: SIGKILL at step {step}, mid-phase "
                f"{accelerator.phase.name if accelerator.phase else None}",
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.step()  # counts the step; switches phase when the next step starts a new one
        optimizer.zero_grad()
        if accelerator.schedule_step % args.save_every == 0:
            location = accelerator.save_state()
            accelerator.print(f"step {accelerator.schedule_step}: saved {os.path.basename(str(location))}")

    accelerator.print(f"attempt {attempt}: done, {accelerator.schedule_step} steps")
    accelerator.print(f"final parameter sha256: {digest(accelerator.unwrap_model(model))}")
    accelerator.end_training()  # frees the DDP wrapper, then destroys the process group


if __name__ == "__main__":
    main()
