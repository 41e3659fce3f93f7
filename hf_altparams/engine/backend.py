"""The small interface between the switch transaction and a distributed wrapper.

:class:`~hf_altparams.engine.PhaseSwitcher` runs one transaction for every
backend (agree, move residency, flip ``requires_grad``, let the backend adapt,
roll back on failure, release, record). What differs per wrapper is behind
:class:`Backend`; each backend lives in its own module, with any private torch
API it needs fenced there:

* :class:`LocalBackend` (here): a plain module, one process or no wrapper yet.
* ``DDPBackend`` (:mod:`hf_altparams.engine.ddp`): rebuilds the DDP reducer
  in place so that only the phase's gradients are bucketed and all-reduced.
* ``FSDP2Backend`` (:mod:`hf_altparams.engine.fsdp2._backend`): a ``fully_shard``
  model; no rebuild, mixed-precision dtypes re-initialised, shards moved with
  FSDP2's storage.

Example:
    >>> import torch
    >>> backend = LocalBackend(torch.nn.Linear(2, 2))
    >>> backend.kind, backend.reduced_bytes_per_step(), backend.precondition_error()
    ('local', 0, None)
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Backend", "LocalBackend"]


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

    def bind(self, switcher: Any) -> None:
        """Called once when ``switcher`` attaches the wrapper (before any :meth:`apply`)."""

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


class LocalBackend(Backend):
    """A plain module: nothing to rebuild, nothing synchronised by a wrapper."""

    collective_free_apply = True

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        self.wrapper = None
