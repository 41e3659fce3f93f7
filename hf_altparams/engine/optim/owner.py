"""Who decides where a run's optimizer state lives: the :class:`StateOwner` interface, and the library's choice.

A phased run leaves groups idle; their optimizer state (and, under
:class:`~hf_altparams.engine.PrecisionOptimizer`, their fp32 masters) is kept
on the device, offloaded to the host or dropped, per a
:class:`~hf_altparams.engine.memory.StatePolicy`. One object per run makes
that decision and applies it: its :class:`StateOwner`. The switcher talks to
it and to nothing else about optimizer state: it hands it the run's policies
and the driver (:meth:`StateOwner.follow`), tells it each new phase
(:meth:`StateOwner.enter_phase`), asks it to put state back after a framework
moved it (:meth:`StateOwner.reapply_policy`), to prefetch a coming group's
state, and for the line it logs (:meth:`StateOwner.summary`).

Which object owns the state is the strategy's call
(:meth:`hf_altparams.engine.strategies.Strategy.state_owner`). For the
optimizers the library can see, :func:`library_state_owner` decides: a
:class:`~hf_altparams.engine.GroupedOptimizer` (inside Accelerate's wrapper or
a handle too) owns its state itself, per group; a plain torch optimizer over
every parameter gets a :class:`~.idle.PlainOptimizerState`. A wrapper that
keeps the state in its own optimizer (DeepSpeed ZeRO's fp32 partitions and
their Adam moments) comes with its strategy's own implementation.

Example:
    >>> import torch
    >>> from hf_altparams.plan import ParamGroups
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    >>> type(library_state_owner(torch.optim.AdamW(net.parameters()), groups)).__name__
    'PlainOptimizerState'
    >>> library_state_owner(None, groups) is None
    True
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Protocol

from torch.optim import Optimizer

from ...plan.groups import ParamGroups
from ..driver import PhaseSource
from ..memory import StatePolicy, optimizer_of
from .grouped import grouped_in
from .idle import PlainOptimizerState

__all__ = ["StateOwner", "library_state_owner"]


class StateOwner(Protocol):
    """Decides and applies where idle groups' optimizer state (and fp32 masters) lives; one per run."""

    @property
    def policies(self) -> Mapping[str, StatePolicy]:
        """Each group's idle-state policy now."""

    @property
    def active(self) -> frozenset[str]:
        """The groups whose state is in use (the followed phase's)."""

    def follow(
        self, source: PhaseSource, idle_state: Optional[StatePolicy] = None, idle_master: Optional[StatePolicy] = None
    ) -> None:
        """Follow ``source``'s phases; the run's policies where the optimizer left them open."""

    def enter_phase(self, trainable: Iterable[str]) -> None:
        """A phase that trains ``trainable`` starts: idle groups' state per policy, active groups' back."""

    def idle_state_leaves(self, group: str) -> bool:
        """Whether ``group``'s state leaves the device while it is idle."""

    def reapply_policy(self) -> int:
        """Put every group's state where its policy says (after a framework moved it); the bytes moved."""

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        """Start bringing idle group ``name``'s state back early; the bytes started."""

    def summary(self, idle: Iterable[str], source: str) -> str:
        """One line: what the ``idle`` groups' state is, under which policy (``source``: who chose it) and where."""


def library_state_owner(optimizer: Any, groups: ParamGroups) -> Optional[StateOwner]:
    """The library's owner of ``optimizer``'s state: the GroupedOptimizer inside it, a plain optimizer's
    :class:`~.idle.PlainOptimizerState`, or ``None`` (no optimizer, or one it cannot see into)."""
    if optimizer is None:
        return None
    grouped = grouped_in(optimizer)
    if grouped is not None:
        return grouped
    inner = optimizer_of(optimizer)
    return PlainOptimizerState(inner, groups) if isinstance(inner, Optimizer) else None
