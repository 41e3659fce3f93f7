"""Set-ups for ``python -m hf_altparams check --setup tests.check.setups:NAME``: one correct, the rest broken.

Each broken one makes a mistake this library guards against, the way a user's
code would make it; ``tests/check/test_check_runs.py`` runs the check on each and
asserts that it fails naming that cause. A small Llama (4 layers) keeps each run short.
"""

from __future__ import annotations

import os
import random
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
    return CheckSetup(
        groups, schedule_for(schedule, groups, every=1, **drawn, **options), description=f"small Llama, {schedule}"
    )


def lisa_small() -> CheckSetup:
    """Correct: LISA, one layer re-drawn every step."""
    return _small()


def alternating_small() -> CheckSetup:
    """Correct: every group in turn (state kept)."""
    return _small("alternating")


def lisa_callback_of_ones_own() -> CheckSetup:
    """The usual LISA callback instead of the library's schedule: before every step, freeze every layer and
    unfreeze one drawn at random (the same draws on every rank); the schedule trains every group (one phase).

    Under DDP or one process the frozen layers get no gradient and torch's AdamW skips them; under DeepSpeed
    ZeRO the optimizer steps every partition it was built with, and the undrawn layers move.
    """
    model = builtin_model(layers=4, hidden=128, vocab=512)
    groups = layer_groups(model)
    draws = random.Random(0)

    def freeze_all_unfreeze_drawn(model: nn.Module, step: int) -> None:
        layers = model.model.layers
        for param in layers.parameters():
            param.requires_grad_(False)
        for index in draws.sample(range(len(layers)), 1):
            for param in layers[index].parameters():
                param.requires_grad_(True)

    return CheckSetup(
        groups,
        Alternating([tuple(groups.names)]),
        on_step=freeze_all_unfreeze_drawn,
        description="small Llama, a LISA callback of one's own",
    )


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

    return CheckSetup(
        groups,
        Alternating(["trunk", "branch"], always=["head"]),
        batch=batch,
        description="trunk, branch and head; the branch skipped on every fourth batch",
    )


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


def batchnorm_net() -> CheckSetup:
    """Correct: a small convolutional net with BatchNorm (buffers that change in every forward), alternating.

    Built without a seed, as the ``CheckSetup`` docstring's own example is: each rank draws other weights,
    which DDP's constructor replaces with rank 0's.
    """
    from hf_altparams.plan import Alternating, ParamGroups

    torch.seed()  # what a fresh process does without a seed: a seed of its own
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 12 * 12, 10),
    )
    groups = ParamGroups(net, {"conv1": ["0.*", "1.*"], "conv2": ["3.*", "4.*"], "head": "7.*"})

    def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 * step + rank)
        return {"input": torch.randn(16, 3, 16, 16, generator=generator)}

    return CheckSetup(groups, Alternating(["conv1", "conv2", "head"]), batch=batch, description="BatchNorm CNN")


def _every_third() -> CheckSetup:
    """The small Llama, every group in turn for 3 steps (fewer switches: a leak per step, not per switch)."""
    model = builtin_model(layers=4, hidden=128, vocab=512)
    groups = layer_groups(model)
    return CheckSetup(groups, schedule_for("alternating", groups, every=3), description="small Llama, alternating")


def keeps_256k_per_step() -> CheckSetup:
    """Per-step code that keeps 256 KiB at every optimizer step in a list (a cache of its own, a history)."""
    setup = _every_third()

    def keep(model: nn.Module, step: int) -> None:
        KEPT.append(torch.ones(64 << 10))  # 256 KiB, written: resident

    setup.on_step = keep
    return setup


def sums_losses_with_their_graphs() -> CheckSetup:
    """``total_loss += loss`` without ``.item()``: every step's graph (its nodes) stays alive."""
    setup = _every_third()
    total: list[torch.Tensor] = [torch.zeros(())]

    def loss(outputs: Any) -> torch.Tensor:
        total[0] = total[0] + outputs.loss  # the running sum holds each step's graph
        return outputs.loss

    setup.loss = loss
    return setup


def unseeded_small() -> CheckSetup:
    """A small Llama built without a seed (``torch.seed()``: a different one in each process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.seed()
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    )
    groups = layer_groups(model)
    return CheckSetup(groups, schedule_for("alternating", groups), description="unseeded small Llama")


class DecayEverything(torch.optim.Optimizer):
    """SGD with decoupled weight decay applied to every parameter it holds, gradient or not (a user's own)."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 1e-2) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                param.mul_(1 - group["lr"] * group["weight_decay"])
                if param.grad is not None:
                    param.add_(param.grad, alpha=-group["lr"])


def optimizer_decays_idle_groups() -> CheckSetup:
    """An optimizer of one's own that decays every parameter it holds, idle ones too."""
    setup = _small("alternating")
    setup.optimizer = lambda model: DecayEverything(model.parameters())
    return setup


def decays_every_weight_per_step() -> CheckSetup:
    """Per-step code that shrinks every weight (``p.mul_(1 - 1e-3)``), trained or not."""
    setup = _small("alternating")

    def shrink(model: nn.Module, step: int) -> None:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(1 - 1e-3)

    setup.on_step = shrink
    return setup


def ema_written_back() -> CheckSetup:
    """An EMA of the weights, written back into the model every 5 steps."""
    setup = _small("alternating")
    average: dict[str, torch.Tensor] = {}

    def ema(model: nn.Module, step: int) -> None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                kept = average.setdefault(name, param.detach().clone())
                kept.mul_(0.9).add_(param.detach(), alpha=0.1)
                if step % 5 == 4:
                    param.copy_(kept)

    setup.on_step = ema
    return setup


class TwoHeads(nn.Module):
    """A trunk and two task heads; each optimizer step's batch picks one head (a multi-task loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 16)
        self.head_a = nn.Linear(16, 1)
        self.head_b = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        hidden = self.trunk(x).relu()
        return (self.head_a if task == 0 else self.head_b)(hidden)


def multi_task_with_options() -> CheckSetup:
    """``ddp``, ``accumulation`` and ``before_step`` at work: a head unused at every step (DDP must find it),
    2 micro-batches per optimizer step, gradient clipping and an LR schedule between backward and step.

    ``before_step`` writes one line per call to ``$CHECK_HOOK_LOG`` (rank, step, gradient norm after
    clipping, learning rate) for the test to read.
    """
    from hf_altparams.plan import Alternating, ParamGroups

    torch.manual_seed(0)
    net = TwoHeads()
    groups = ParamGroups(net, {"trunk": "trunk.*", "heads": ["head_a.*", "head_b.*"]})
    per_step = 2

    def batch(index: int, rank: int) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(7919 * index + rank)
        return {"x": torch.randn(8, 16, generator=generator), "task": (index // per_step) % 2}

    schedulers: list[Any] = []

    def before_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        if not schedulers:
            schedulers.append(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        clipped = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        with open(os.environ["CHECK_HOOK_LOG"], "a") as log:
            log.write(
                f"{os.environ.get('RANK', '0')} {step} {float(norm):.6f} {float(clipped):.6f} "
                f"{optimizer.param_groups[0]['lr']:.8f}\n"
            )
        schedulers[0].step()

    return CheckSetup(
        groups,
        Alternating(["trunk", "heads"], every=2),
        batch=batch,
        before_step=before_step,
        ddp={"find_unused_parameters": True},
        accumulation=per_step,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        description="two task heads, options",
    )
