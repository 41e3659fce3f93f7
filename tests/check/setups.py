"""Set-ups for ``python -m hf_altparams check --setup tests.check.setups:NAME``: one correct, the rest broken.

Each broken one makes a mistake this library guards against, the way a user's
code would make it; ``tests/check/test_check_runs.py`` runs the check on each and
asserts that it fails naming that cause. A small Llama (4 layers) keeps each run short.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_altparams.check import CheckSetup, builtin_model
from hf_altparams.check.workload import layer_groups, schedule_for
from hf_altparams.plan import Alternating, ParamGroups

#: Tensors the leaking set-ups keep (module-level, as a user's cache would be).
KEPT: list[torch.Tensor] = []


def _small(schedule: str = "lisa", seed: int = 0, **options: Any) -> CheckSetup:
    model = builtin_model(layers=4, hidden=128, vocab=512)
    groups = layer_groups(model)
    drawn = {"k": 1, "seed": seed} if schedule == "lisa" else {}  # options only a draw takes
    return CheckSetup(groups, schedule_for(schedule, groups, every=1, **drawn, **options),
                      description=f"small Llama, {schedule}")


def lisa_small() -> CheckSetup:
    """Correct: LISA, one layer re-drawn every step."""
    return _small()


def alternating_small() -> CheckSetup:
    """Correct: every group in turn (state kept)."""
    return _small("alternating")


def requires_grad_behind() -> CheckSetup:
    """A LISA callback of one's own: turns ``requires_grad`` on for layer 0 before every step."""
    setup = _small()

    def unfreeze(model: nn.Module, step: int) -> None:
        for param in model.model.layers[0].parameters():
            param.requires_grad_(True)

    setup.on_step = unfreeze
    return setup


def optimizer_of_other_model() -> CheckSetup:
    """The optimizer is built over another model's parameters (a copy made before the groups)."""
    setup = _small()
    other = builtin_model(layers=4, hidden=128, vocab=512)
    setup.optimizer = lambda model: torch.optim.AdamW(other.parameters(), lr=1e-4)
    return setup


def optimizer_of_trainable_only() -> CheckSetup:
    """The optimizer holds only the first phase's parameters (built after freezing, the usual way)."""
    setup = _small()
    setup.optimizer = lambda model: torch.optim.AdamW(model.model.layers[0].parameters(), lr=1e-4)
    return setup


def leaking() -> CheckSetup:
    """Per-step code that keeps 8 MiB at every step (every step is a switch here)."""
    setup = _small()

    def keep(model: nn.Module, step: int) -> None:
        KEPT.append(torch.ones(2 << 20))  # 8 MiB, written: resident

    setup.on_step = keep
    return setup


def holding_beyond_plan() -> CheckSetup:
    """Per-step code that allocates 512 MiB once and holds it: flat, but far beyond the plan."""
    setup = _small()

    def hold(model: nn.Module, step: int) -> None:
        if not KEPT:
            KEPT.append(torch.ones(128 << 20))  # 512 MiB

    setup.on_step = hold
    return setup


def schedule_per_rank(rank: int) -> CheckSetup:
    """LISA seeded with the rank: each rank draws other layers."""
    return _small(seed=rank)


def drifting(rank: int) -> CheckSetup:
    """Rank 1 writes a frozen weight alone at step 3 (an EMA or a load on one rank)."""
    setup = _small()

    def nudge(model: nn.Module, step: int) -> None:
        if rank == 1 and step == 3:
            with torch.no_grad():
                model.model.norm.weight.add_(1e-3)

    setup.on_step = nudge
    return setup


class _WithBranch(nn.Module):
    """A trunk, a branch some batches skip, and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(32, 32)
        self.branch = nn.Linear(32, 32)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, use_branch: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.trunk(x))
        if bool(use_branch):
            hidden = hidden + self.branch(hidden)
        return self.head(hidden)


def branch_skipped_on_some_steps() -> CheckSetup:
    """A branch the forward skips on every fourth batch, trained in turn with the trunk, under DDP's default
    ``find_unused_parameters=False``: at step 3 the branch trains but gets no gradient."""
    torch.manual_seed(0)
    model = _WithBranch()
    groups = ParamGroups(model, {"trunk": "trunk.*", "branch": "branch.*", "head": "head.*"})

    def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * rank + step)
        return {"x": torch.randn(8, 32, generator=generator), "use_branch": torch.tensor(step % 4 != 3)}

    return CheckSetup(groups, Alternating(["trunk", "branch"], always=["head"]), batch=batch,
                      description="trunk, branch and head; the branch skipped on every fourth batch")


def drop_that_does_nothing() -> CheckSetup:
    """A library fault made on purpose: dropping idle optimizer state does nothing (lisa's default is drop)."""
    from hf_altparams.engine.optim.idle import IdleState

    IdleState.leave = lambda self, name: 0  # type: ignore[method-assign]
    return _small()


def hangs_ignoring_sigterm(rank: int) -> CheckSetup:
    """Not a mistake of the user's: a rank that never gets to train and ignores SIGTERM.

    The check's ``--deadline`` must still stop it. It notes in ``$HANG_MARK`` that
    it is past the point where SIGTERM alone would have stopped it.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(os.environ["HANG_MARK"], f"rank{rank}").touch()
    time.sleep(600)
    raise AssertionError("the check's deadline should have stopped this rank")


def killed_by_the_kernel(rank: int) -> CheckSetup:
    """Rank 1 ends by SIGKILL at its second step, as the kernel's out-of-memory killer ends a process."""
    setup = _small()

    def die(model: nn.Module, step: int) -> None:
        if rank == 1 and step == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    setup.on_step = die
    return setup
