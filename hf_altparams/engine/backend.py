"""The per-wrapper runtime object a switch drives: :class:`Backend`.

:class:`~hf_altparams.engine.PhaseSwitcher` runs one transaction for every
backend (agree, move residency, flip ``requires_grad``, let the backend adapt,
roll back on failure, release, record). What differs per wrapper is behind
:class:`Backend`; each is made by its strategy
(:meth:`hf_altparams.engine.strategies.Strategy.backend`), in its own module,
with any private torch API it needs fenced there:

* :class:`LocalBackend` (here): a plain module, one process or no wrapper yet.
* the DDP backend (:mod:`hf_altparams.engine.ddp`): rebuilds the DDP reducer
  in place so that only the phase's gradients are bucketed and all-reduced.
* the FSDP2 backend (:mod:`hf_altparams.engine.fsdp2`): a ``fully_shard``
  model; no rebuild, mixed-precision dtypes re-initialised, shards moved with
  FSDP2's storage.
* :class:`ModelsBackend` (here): several models trained by one schedule (a
  GAN: ``ParamGroups.of_models``), one wrapper each, applied together inside
  the same transaction (one agreement, one rollback for all). A model whose
  groups are all frozen in a phase gets a reducer over no parameter: DDP then
  neither all-reduces nor broadcasts for it.

Which strategy, hence which backend, drives a given model is the registry's
answer (:func:`hf_altparams.engine.strategies.strategy_for`), asked where the
switcher attaches it (:meth:`~hf_altparams.engine.PhaseSwitcher.attach`).

Example:
    >>> import torch
    >>> backend = LocalBackend(torch.nn.Linear(2, 2))
    >>> backend.kind, backend.reduced_bytes_per_step(), backend.precondition_error()
    ('local', 0, None)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..plan.groups import ParamGroups

__all__ = ["Backend", "LocalBackend", "ModelsBackend", "Residency", "model_name_in"]


class Residency(Protocol):
    """What a backend may ask of the run's residency (a :class:`~hf_altparams.engine.memory.ResidencyManager`)."""

    offload_device: Optional[torch.device]
    guard: bool

    @property
    def offloaded(self) -> frozenset[str]:
        """The groups off the device now."""

    @property
    def phase_name(self) -> str:
        """The phase the forward guards name."""

    def set_data_placer(self, placer: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Route every move of a tensor's data through ``placer`` (FSDP2 swaps its own storage too)."""


class Backend:
    """What a switch needs from the wrapper that trains the grouped module.

    Every method is called on every rank, in the same order, inside the switch
    transaction (so a backend may run collectives in :meth:`apply`).
    """

    #: Short name used in records and messages ("local", "ddp", ...).
    kind: str = "local"
    #: The wrapper object (``None`` for a plain module).
    wrapper: Optional[nn.Module] = None
    #: True when :meth:`apply` and :meth:`restore` run no collective and
    #: :meth:`restore` can run on a rank that did not apply (it then rebuilds the
    #: wrapper for the unchanged flags). The switch then applies first and settles
    #: agreement and outcome in ONE all-reduce; otherwise it agrees before
    #: applying and checks the outcome after (two). See ``docs/switch.md``.
    collective_free_apply: bool = False

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        """The group the switch's own collectives run on (``None``: the default group)."""
        return None

    @property
    def device(self) -> Optional[torch.device]:
        """The compute device of the wrapper, when it has one."""
        return None

    def bind(self, groups: ParamGroups, residency: Residency) -> None:
        """Called once when the switcher attaches the wrapper (before any :meth:`apply`)."""

    def ignored_at_wrap(self) -> set[str]:
        """Names the wrapper was built to ignore (neither synced nor broadcast)."""
        return set()

    def precondition_error(self, *, in_accumulation_window: bool = False) -> Optional[str]:
        """Why a switch must be refused now (checked before anything changes), or ``None``.

        ``in_accumulation_window``: the caller re-applies the current phase at the
        start of an accumulation window (``attach(rebuild=True)``), which is allowed.
        """
        return None

    def snapshot(self) -> Any:
        """What :meth:`restore` needs to undo :meth:`apply` (taken before the flags flip)."""
        return None

    def apply(self, ignore: set[str]) -> None:
        """Adapt the wrapper to the new ``requires_grad`` flags and the ``ignore`` list."""

    def restore(self, snapshot: Any) -> None:
        """Undo :meth:`apply` after the flags were restored (a failed switch)."""

    def reduced_bytes_per_step(self) -> int:
        """Bytes of gradients the wrapper synchronises per optimizer step (0 without one)."""
        return 0

    def keep_reducers(self, count: int) -> Optional[str]:
        """Keep up to ``count`` idle phases' gradient-sync state for switches back (DDP: reducers).

        Returns why the wrapper cannot, or ``None``. A backend that rebuilds
        nothing at a switch has nothing to keep.
        """
        return None

    def kept_reducer_bytes(self) -> int:
        """Bytes the kept idle reducers hold (their gradient buckets)."""
        return 0

    @property
    def wrappers(self) -> list[nn.Module]:
        """The wrapper objects this backend drives (none for a plain module)."""
        return [] if self.wrapper is None else [self.wrapper]

    @property
    def find_unused(self) -> bool:
        """Whether the wrapper searches every step for trainable parameters the forward skipped (DDP's setting)."""
        return False

    def built_for_other_flags(self, group: Optional[dist.ProcessGroup]) -> Optional[str]:
        """Why the wrapper, attached without a rebuild, does not sync what ``requires_grad`` says now, or ``None``.

        Called on every rank at attach; may run a collective on ``group`` (so
        that every rank takes the same decision).
        """
        return None

    def release(self) -> None:
        """End the wrapper's training life before its process group goes (DDP: its reducer freed)."""

    def close(self) -> None:
        """This backend drives the wrapper no more (another one took it over): free what it kept for it."""


class LocalBackend(Backend):
    """A plain module: nothing to rebuild, nothing synchronised by a wrapper."""

    collective_free_apply = True

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        self.wrapper = None


def model_name_in(root: nn.Module, module: nn.Module) -> Optional[str]:
    """The name of ``module`` among ``root``'s direct children (a root of several models), or ``None``."""
    if not isinstance(root, nn.ModuleDict):
        return None
    return next((name for name, child in root.items() if child is module), None)


class ModelsBackend(Backend):
    """One backend per model of a root of several models, applied together.

    Example:
        >>> backend = ModelsBackend()
        >>> backend.kind, backend.reduced_bytes_per_step(), backend.wrappers
        ('models', 0, [])
    """

    kind = "models"

    def __init__(self) -> None:
        self.parts: dict[str, Backend] = {}
        self.wrapper = None

    def add(self, name: str, backend: Backend) -> None:
        """Drive model ``name``'s wrapper with ``backend`` from now on (replacing an earlier one)."""
        old = self.parts.get(name)
        if old is not None and old is not backend:
            old.close()
        self.parts[name] = backend

    @property
    def wrappers(self) -> list[nn.Module]:
        return [w for b in self.parts.values() for w in b.wrappers]

    @property
    def find_unused(self) -> bool:
        return any(b.find_unused for b in self.parts.values())

    def release(self) -> None:
        for backend in self.parts.values():
            backend.release()

    def close(self) -> None:
        for backend in self.parts.values():
            backend.close()

    @property
    def collective_free_apply(self) -> bool:  # type: ignore[override]
        return all(b.collective_free_apply for b in self.parts.values())

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]:
        return next((b.process_group for b in self.parts.values()), None)

    @property
    def device(self) -> Optional[torch.device]:
        return next((b.device for b in self.parts.values()), None)

    def ignored_at_wrap(self) -> set[str]:
        return {f"{name}.{n}" for name, b in self.parts.items() for n in b.ignored_at_wrap()}

    def precondition_error(self, *, in_accumulation_window: bool = False) -> Optional[str]:
        for name, backend in self.parts.items():
            error = backend.precondition_error(in_accumulation_window=in_accumulation_window)
            if error is not None:
                return f"model {name!r}: {error}"
        return None

    def snapshot(self) -> dict[str, Any]:
        return {name: b.snapshot() for name, b in self.parts.items()}

    def apply(self, ignore: set[str]) -> None:
        for name, backend in self.parts.items():
            backend.apply(_within(name, ignore))

    def restore(self, snapshot: dict[str, Any]) -> None:
        for name, backend in self.parts.items():
            backend.restore(snapshot.get(name))

    def reduced_bytes_per_step(self) -> int:
        return sum(b.reduced_bytes_per_step() for b in self.parts.values())

    def keep_reducers(self, count: int) -> Optional[str]:
        reasons = [b.keep_reducers(count) for b in self.parts.values()]
        return next((r for r in reasons if r), None)

    def kept_reducer_bytes(self) -> int:
        return sum(b.kept_reducer_bytes() for b in self.parts.values())


def _within(name: str, names: set[str]) -> set[str]:
    """The names under model ``name``, relative to it (what its own wrapper calls them)."""
    prefix = f"{name}."
    return {n[len(prefix) :] for n in names if n.startswith(prefix)}
