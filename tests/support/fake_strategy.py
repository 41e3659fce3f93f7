"""A strategy that exists only in the tests: registering it must be all it takes to drive and price it.

:class:`FakeWrapper` stands for a wrapper object around the trained module (as
DDP or DeepSpeed's engine are); :class:`FakeStrategy` recognises it, makes a
:class:`FakeBackend` that records what the switch asks, owns the optimizer
state through :class:`FakeOwner` (as ZeRO keeps its partitions) and prices
itself like ZeRO-1 (optimizer state and masters sharded).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch
from torch import nn

from hf_altparams.engine.backend import Backend
from hf_altparams.engine.driver import PhaseSource
from hf_altparams.engine.memory import StatePolicy
from hf_altparams.engine.strategies import Capabilities, Collective, Placement, Pricing, Strategy, register, unregister
from hf_altparams.plan import ParamGroups


@contextlib.contextmanager
def registered(strategy: Strategy) -> Iterator[Any]:
    """``strategy`` in the registry inside the block only."""
    register(strategy)
    try:
        yield strategy
    finally:
        unregister(strategy.name)


class FakeWrapper(nn.Module):
    """A wrapper object around the trained module, as DDP or DeepSpeed's engine are."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.inner = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class FakeBackend(Backend):
    """Records what the switch asked of it; 'communicates' the trainable gradients."""

    kind = "fake"
    collective_free_apply = True

    def __init__(self, wrapper: FakeWrapper) -> None:
        self.wrapper = wrapper
        self.applied: list[set[str]] = []

    def apply(self, ignore: set[str]) -> None:
        self.applied.append(set(ignore))

    def restore(self, snapshot: Any) -> None:
        self.applied.append(set())

    def reduced_bytes_per_step(self) -> int:
        assert self.wrapper is not None
        return sum(p.numel() * p.element_size() for p in self.wrapper.parameters() if p.requires_grad)


class FakeOwner:
    """A state owner of the kind a strategy that keeps the optimizer state itself brings (ZeRO's partitions)."""

    def __init__(self, groups: ParamGroups) -> None:
        self.groups, self.entered, self.reapplied = groups, [], 0
        self.source: Optional[PhaseSource] = None

    @property
    def policies(self) -> Mapping[str, StatePolicy]:
        return {name: StatePolicy.DROP for name in self.groups.names}

    @property
    def active(self) -> frozenset[str]:
        phase = None if self.source is None else self.source.current
        return frozenset(self.groups.names) if phase is None else frozenset(phase.trainable)

    def follow(
        self, source: PhaseSource, idle_state: Optional[StatePolicy] = None, idle_master: Optional[StatePolicy] = None
    ) -> None:
        self.source = source

    def enter_phase(self, trainable: Iterable[str]) -> None:
        self.entered.append(frozenset(trainable))

    def idle_state_leaves(self, group: str) -> bool:
        return True

    def reapply_policy(self) -> int:
        self.reapplied += 1
        return 0

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        return 0

    def summary(self, idle: Iterable[str], source: str) -> str:
        return f"fake owner: {sorted(idle)} dropped inside the wrapper ({source})"


class FakeStrategy(Strategy):
    name = "fake"
    aliases = ("fake-zero",)
    label = "Fake"
    capabilities = Capabilities(
        wraps_module=True, synchronises_gradients=True, owns_optimizer_state=True, per_task_residency=False
    )
    pricing = Pricing(
        optimizer_state=Placement.SHARDED,
        masters=Placement.SHARDED,
        buckets=True,
        collective=Collective.ALL_REDUCE,
        compare_with="ddp",
    )

    def __init__(self) -> None:
        self.backends: list[FakeBackend] = []
        self.attached_to: list[nn.Module] = []

    def recognises(self, model: nn.Module) -> bool:
        return isinstance(model, FakeWrapper)

    def wrapped_module(self, wrapper: nn.Module) -> nn.Module:
        assert isinstance(wrapper, FakeWrapper)
        return wrapper.inner

    def backend(self, wrapper: nn.Module) -> Backend:
        assert isinstance(wrapper, FakeWrapper)
        self.backends.append(FakeBackend(wrapper))
        return self.backends[-1]

    def attached(self, wrapper: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
        self.attached_to.append(wrapper)

    def state_owner(self, optimizer: Optional[torch.optim.Optimizer], groups: ParamGroups) -> FakeOwner:
        return FakeOwner(groups)
