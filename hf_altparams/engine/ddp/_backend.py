"""The switch's DDP backend: the same wrapper re-bucketed in place at every switch.

The surgery itself (private torch APIs, fenced and version-checked) is in
:mod:`._ddp`; this module is what :class:`~hf_altparams.engine.backend.Backend`
asks of it. It calls ``_ddp.rebuild_reducer`` through the module, so a test
that replaces that function (to inject a failed rebuild) reaches every switch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...errors import SwitchError
from . import _surgery as _ddp
from ._reducer_cache import why_not_cacheable
from ..backend import Backend

__all__ = ["DDPBackend"]


class DDPBackend(Backend):
    """The switch's DDP backend: re-buckets the same wrapper in place at every switch.

    Example:
        >>> # backend = DDPBackend(ddp); backend.apply(ignore=set())  # after flipping requires_grad
    """

    kind = "ddp"
    #: The rebuild runs no collective (DDP's constructor syncs; its init helper does not).
    collective_free_apply = True

    def __init__(self, ddp: DistributedDataParallel) -> None:
        _ddp.check_ddp_supported(ddp)
        self.wrapper = ddp
        self.ddp = ddp

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.ddp.process_group

    @property
    def device(self) -> torch.device | None:
        return self.ddp.device

    def ignored_at_wrap(self) -> set[str]:
        return set(self.ddp.parameters_to_ignore)

    def precondition_error(self, *, in_accumulation_window: bool = False) -> str | None:
        if not in_accumulation_window and not self.ddp.require_backward_grad_sync:
            return ("called inside `no_sync()` (a gradient-accumulation window): switch only at "
                    "an optimizer-step boundary, after optimizer.step() and zero_grad()")
        return self.hook_error() or _ddp.unfinished_reduction_error(self.ddp)

    def hook_error(self) -> str | None:
        """Why the registered comm hooks forbid a rebuild (checked before anything changes)."""
        # Failing inside the rebuild would also fail the rollback.
        try:
            _ddp.check_comm_hooks(self.ddp)
        except SwitchError as exc:
            return str(exc)
        return None

    def snapshot(self) -> set[str]:
        return set(self.ddp.parameters_to_ignore)

    def apply(self, ignore: set[str]) -> None:
        _ddp.rebuild_reducer(self.ddp, ignore=ignore)

    def restore(self, snapshot: set[str]) -> None:
        _ddp.rebuild_reducer(self.ddp, ignore=snapshot)

    def reduced_bytes_per_step(self) -> int:
        return sum(p.numel() * p.element_size() for p in _ddp.reduced_parameters(self.ddp))

    def keep_reducers(self, count: int) -> Optional[str]:
        why = why_not_cacheable(self.ddp) if count else None
        _ddp.keep_reducers(self.ddp, 0 if why else count)
        return why

    def kept_reducer_bytes(self) -> int:
        cache = _ddp.kept_reducers(self.ddp)
        return cache.kept_bytes if cache is not None else 0
