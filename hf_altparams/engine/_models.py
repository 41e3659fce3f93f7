"""Several models, one schedule: a backend over one DDP wrapper per model.

A GAN is two modules, each wrapped in its own ``DistributedDataParallel`` by
Accelerate, each with its own optimizer. Their groups live under one root
(:meth:`~hf_altparams.plan.ParamGroups.of_models`: an ``nn.ModuleDict`` of the
models, so a parameter is named ``"generator.0.weight"``), and one switcher
drives them: :class:`ModelsBackend` holds each model's own backend and applies
a switch to all of them inside the same transaction (one agreement, one
rollback for all). A model whose groups are all frozen in a phase gets a
reducer over no parameter: DDP then neither all-reduces nor broadcasts for it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .backend import Backend

__all__ = ["ModelsBackend", "model_name_in"]


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
        close = getattr(old, "close", None)
        if close is not None and old is not backend:
            close()
        self.parts[name] = backend

    @property
    def wrappers(self) -> list[nn.Module]:
        return [b.wrapper for b in self.parts.values() if b.wrapper is not None]

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
    return {n[len(prefix):] for n in names if n.startswith(prefix)}
