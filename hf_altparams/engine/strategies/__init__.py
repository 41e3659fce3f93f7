"""The strategy registry: every way of training the grouped model across ranks, one registered object each.

A strategy (:class:`Strategy`, :mod:`.base`) declares what it supports,
recognises the wrapper it drives, applies a phase through its backend, counts
what it communicates, decides who owns the optimizer state and prices itself
for the planner. Everything that depends on the kind of wrapper asks the
registry for the strategy and reads it:

* :meth:`~hf_altparams.engine.PhaseSwitcher.attach`: :func:`strategy_for` the
  wrapper, then its backend;
* the integrations' run assembly (:mod:`hf_altparams.integrations.assembly`)
  and refusals (:mod:`hf_altparams.integrations.refusals`): its capabilities;
* the planner (``plan_cost(backend=...)``, ``--strategy``) and
  ``python -m hf_altparams check``: :func:`strategy_named` and its pricing.

Registered, in the order they are tried: FSDP2 (a ``fully_shard`` model), DDP
(a ``DistributedDataParallel``), DeepSpeed ZeRO-1, ZeRO-2 and ZeRO-3 (a
``DeepSpeedEngine`` at that stage; ZeRO-3 priced only, :mod:`.deepspeed`); one process (:class:`~.local.LocalStrategy`)
takes any model the others do not recognise. Adding a strategy is a module
with its :class:`Strategy` subclass (and, for private APIs, a fence package
such as :mod:`hf_altparams.engine.ddp`) plus one line in :data:`_REGISTERED`
below; ``docs/design.md`` walks through DeepSpeed ZeRO as the example. Only
this module imports the strategy modules (``tests/test_structure.py``).

Example:
    >>> import torch
    >>> strategy_for(torch.nn.Linear(2, 2)).name, strategy_named("fsdp2").label
    ('local', 'FSDP2')
    >>> [s.name for s in registered()]
    ['fsdp2', 'ddp', 'zero1', 'zero2', 'zero3', 'local']
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from ...errors import PlanError
from .base import Capabilities, Collective, Gather, Placement, Pricing, StepBoundary, Strategy
from .ddp import DDPStrategy
from .deepspeed import ZeroStrategy
from .fsdp2 import FSDP2Strategy
from .local import LocalStrategy

__all__ = [
    "Capabilities",
    "Collective",
    "Gather",
    "Placement",
    "Pricing",
    "StepBoundary",
    "Strategy",
    "is_registered",
    "local_strategy",
    "register",
    "registered",
    "strategy_for",
    "strategy_named",
    "unregister",
]

#: The strategies tried in order by :func:`strategy_for` (the fallback, one process, is tried last).
_REGISTERED: list[Strategy] = [FSDP2Strategy(), DDPStrategy(), ZeroStrategy(1), ZeroStrategy(2), ZeroStrategy(3)]
_FALLBACK: Strategy = LocalStrategy()


def registered() -> tuple[Strategy, ...]:
    """Every registered strategy, in the order they are tried, the fallback (one process) last."""
    return (*_REGISTERED, _FALLBACK)


def local_strategy() -> Strategy:
    """The one-process strategy (a plain module, no wrapper): what a switcher drives before any attach."""
    return _FALLBACK


def _names(strategy: Strategy) -> tuple[str, ...]:
    return (strategy.name, *strategy.aliases)


def strategy_named(name: str, *, argument: str = "`strategy`") -> Strategy:
    """The strategy called ``name`` (or one of its aliases).

    Raises:
        PlanError: no registered strategy has that name; the message lists them (``argument`` names the setting).

    Example:
        >>> strategy_named("ddp").capabilities.rebuckets_at_switch
        True
        >>> strategy_named("fsdp1")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `strategy` must be one of the registered strategies ['fsdp2', 'ddp', 'zero1', 'zero2', 'zero3', 'local'] (aliases: 'deepspeed-zero1' for 'zero1', 'deepspeed-zero2' for 'zero2', 'deepspeed-zero3' for 'zero3', 'none' for 'local'), got 'fsdp1'
    """
    for strategy in registered():
        if isinstance(name, str) and name.lower() in _names(strategy):
            return strategy
    aliases = ", ".join(f"{a!r} for {s.name!r}" for s in registered() for a in s.aliases)
    raise PlanError(
        f"{argument} must be one of the registered strategies {[s.name for s in registered()]}"
        + (f" (aliases: {aliases})" if aliases else "")
        + f", got {name!r}"
    )


def is_registered(name: str) -> bool:
    """Whether a strategy called ``name`` (or with that alias) is registered."""
    return any(name in _names(s) for s in registered())


def strategy_for(model: nn.Module) -> Strategy:
    """The first registered strategy that recognises ``model`` (one process when none does)."""
    for strategy in _REGISTERED:
        if strategy.recognises(model):
            return strategy
    return _FALLBACK


def register(strategy: Strategy, *, before: Optional[str] = None) -> Strategy:
    """Add ``strategy`` to the registry (tried before ``before``'s strategy, else after every other); returns it.

    Raises:
        PlanError: ``strategy`` is not a :class:`Strategy`, has no name, or shares a name or alias with a
            registered one.
    """
    if not isinstance(strategy, Strategy):
        raise PlanError(f"`strategy` must be a hf_altparams Strategy instance, got {type(strategy).__name__}")
    if not strategy.name:
        raise PlanError(f"`strategy` {type(strategy).__name__} has no `name`; give the class a `name`")
    taken = sorted(set(_names(strategy)) & {n for s in registered() for n in _names(s)})
    if taken:
        raise PlanError(
            f"`strategy` {type(strategy).__name__} takes the name(s) {taken} of a registered strategy; "
            f"registered: {[s.name for s in registered()]}"
        )
    at = len(_REGISTERED)
    if before is not None:
        at = next((i for i, s in enumerate(_REGISTERED) if before in _names(s)), -1)
        if at < 0:
            raise PlanError(
                f"`before` must name a registered strategy (the one-process fallback comes last "
                f"anyway), got {before!r}; registered: {[s.name for s in _REGISTERED]}"
            )
    _REGISTERED.insert(at, strategy)
    return strategy


def unregister(name: str) -> Strategy:
    """Remove the strategy called ``name`` from the registry (the fallback stays); returns it.

    Raises:
        PlanError: no removable strategy has that name.
    """
    for strategy in _REGISTERED:
        if name in _names(strategy):
            _REGISTERED.remove(strategy)
            return strategy
    raise PlanError(
        f"`name` {name!r} is no removable registered strategy; registered: "
        f"{[s.name for s in _REGISTERED]} (one process stays as the fallback)"
    )
