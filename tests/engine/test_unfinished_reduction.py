"""A switch refuses when the last backward left a trainable parameter's bucket un-all-reduced.

With ``find_unused_parameters=False``, DDP all-reduces a bucket only once every
parameter in it has a gradient. A trainable parameter the forward skips leaves
the bucket local on every rank; plain DDP raises at its next forward, but a
switch replaces the reducer first, so per-step alternation would hide it while
the ranks drift apart. One process on a world-size-1 gloo group: the reducer's
bookkeeping is the same as on N ranks (``test_switch_distributed.py`` checks
that every rank raises the same error).
"""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.errors import Cause, SwitchError
from hf_altparams.plan import Alternating, ParamGroups


class WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.low = nn.Linear(4, 4)
        self.high = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)  # in the "high" group; used only when asked

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = self.high(self.low(x))
        return self.spare(h) if use_spare else h


@pytest.fixture
def world(gloo_world_1: dist.ProcessGroup) -> Iterator[None]:
    yield


def _setup(**ddp_kwargs: object) -> tuple[WithSpare, DDP, PhaseSwitcher]:
    torch.manual_seed(0)
    model = WithSpare()
    switcher = PhaseSwitcher(
        ParamGroups(model, {"low": "low.*", "high": ["high.*", "spare.*"]}), Alternating(["high", "low"])
    )
    switcher.step_to(0)
    ddp = DDP(model, **ddp_kwargs)  # type: ignore[arg-type]
    switcher.attach(ddp)
    return model, ddp, switcher


def test_an_unused_trainable_parameter_refuses_the_switch_and_names_it(world: None) -> None:
    model, ddp, switcher = _setup()
    ddp(torch.randn(2, 4)).sum().backward()  # spare: trainable, unused
    for p in model.parameters():
        p.grad = None
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(SwitchError, match=r"got no gradient.*'spare\.weight'.*find_unused_parameters=True") as info:
        switcher.step_to(1)
    assert info.value.cause is Cause.TRAINABLE_PARAM_UNUSED  # what `check` names it by
    assert switcher.current.name == "high" and flags == [p.requires_grad for p in model.parameters()]


def test_a_used_parameter_a_forward_only_pass_or_find_unused_switch_fine(world: None) -> None:
    model, ddp, switcher = _setup()
    ddp(torch.randn(2, 4), use_spare=True).sum().backward()
    for p in model.parameters():
        p.grad = None
    assert switcher.step_to(1) is not None  # every trainable parameter had its gradient
    ddp(torch.randn(2, 4)).sum()  # a forward with gradients enabled, no backward: nothing pending
    assert switcher.step_to(2) is not None

    model, ddp, switcher = _setup(find_unused_parameters=True)
    ddp(torch.randn(2, 4)).sum().backward()  # spare unused: DDP marks it ready itself
    for p in model.parameters():
        p.grad = None
    assert switcher.step_to(1) is not None


def test_the_private_reducer_check_exists_on_this_torch(world: None) -> None:
    # The check is skipped where torch lacks it: a tested torch must have it, or this
    # safety net would vanish silently with an upgrade.
    model, ddp, switcher = _setup()
    assert callable(getattr(ddp.reducer, "_check_reducer_finalized", None))
