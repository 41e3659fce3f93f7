"""The switch's DDP backend: the same wrapper re-bucketed in place at every switch.

The surgery itself (private torch APIs, fenced and version-checked) is in
:mod:`._surgery`; this module is what :class:`~hf_altparams.engine.backend.Backend`
asks of it, and the owner of each wrapper's state between switches: whether
the fast reducer inputs were verified for it, and its kept idle reducers. The
wrapper's backend is found weakly (``backend_of``), so that ending a
wrapper's life (:func:`free_reducer`) also frees the reducers kept for it. It
calls ``_ddp.rebuild_reducer`` through the module, so a test that replaces that
function (to inject a failed rebuild) reaches every switch.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ...errors import SwitchError
from ..backend import Backend
from ..collective import any_rank_failed, is_distributed
from . import _surgery as _ddp
from ._reducer_cache import ReducerCache, why_not_cacheable

__all__ = ["DDPBackend", "backend_of", "free_reducer"]

#: The backend driving each DDP wrapper (held weakly on both sides: neither keeps the other alive).
_BACKENDS: weakref.WeakKeyDictionary[DistributedDataParallel, weakref.ref[DDPBackend]] = weakref.WeakKeyDictionary()


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
        #: The wrapper's reducer inputs, verified against DDP's own on the first rebuild.
        self.inputs = _ddp.InputsVerdict()
        #: The wrapper's kept idle reducers (``keep_reducers``), or ``None``.
        self.cache: Optional[ReducerCache] = None
        previous = backend_of(ddp)
        if previous is not None and previous is not self:
            previous.close()  # attached again: one backend per wrapper, its kept reducers freed
        _BACKENDS[ddp] = weakref.ref(self)

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self.ddp.process_group

    @property
    def device(self) -> torch.device | None:
        return self.ddp.device

    def ignored_at_wrap(self) -> set[str]:
        return set(self.ddp.parameters_to_ignore)

    @property
    def find_unused(self) -> bool:
        return bool(self.ddp.find_unused_parameters)

    def built_for_other_flags(self, group: Optional[dist.ProcessGroup]) -> Optional[str]:
        """Whether the reducer buckets what the ``requires_grad`` flags say, on every rank (one all-gather)."""
        actual = _ddp.reducer_parameter_names(self.ddp)
        names = {id(p): n for n, p in self.ddp.module.named_parameters()}
        wanted = {names[id(p)] for p in _ddp.reduced_parameters(self.ddp)}
        local = None
        if actual is not None and actual != wanted:
            extra, missing = sorted(actual - wanted), sorted(wanted - actual)
            local = (
                f"buckets {len(extra)} parameter(s) the phase freezes (e.g. {extra[:3]}) and misses "
                f"{len(missing)} it trains (e.g. {missing[:3]})"
            )
        if is_distributed(group):
            if any_rank_failed(group, local is not None) and local is None:
                local = "matches here but not on another rank"
        return local

    def release(self) -> None:
        """Free the wrapper's reducer (and the kept ones) before the process group goes (:func:`free_reducer`)."""
        free_reducer(self.ddp)

    def precondition_error(self, *, in_accumulation_window: bool = False) -> str | None:
        if not in_accumulation_window and not self.ddp.require_backward_grad_sync:
            return (
                "called inside `no_sync()` (a gradient-accumulation window): switch only at "
                "an optimizer-step boundary, after optimizer.step() and zero_grad()"
            )
        return self.hook_error() or _ddp.unfinished_reduction_error(self.ddp, self.inputs)

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
        _ddp.rebuild_reducer(self.ddp, ignore=ignore, inputs=self.inputs, cache=self.cache)

    def restore(self, snapshot: set[str]) -> None:
        _ddp.rebuild_reducer(self.ddp, ignore=snapshot, inputs=self.inputs, cache=self.cache)

    def reduced_bytes_per_step(self) -> int:
        return sum(p.numel() * p.element_size() for p in _ddp.reduced_parameters(self.ddp))

    def keep_reducers(self, count: int) -> Optional[str]:
        why = why_not_cacheable(self.ddp) if count else None
        count = 0 if why else count
        if count <= 0:
            if self.cache is not None:
                self.cache.clear()
            self.cache = None
        elif self.cache is None:
            self.cache = ReducerCache(count)  # DDP's own first reducer is not kept (what it was built over is unknown)
        else:
            self.cache.size = count
        return why

    def kept_reducer_bytes(self) -> int:
        return self.cache.kept_bytes if self.cache is not None else 0

    def close(self) -> None:
        """Free the kept idle reducers (they hold the process group): this backend drives the wrapper no more."""
        if self.cache is not None:
            self.cache.clear()


def backend_of(ddp: DistributedDataParallel) -> Optional[DDPBackend]:
    """The live backend driving ``ddp``, if a switcher attached it."""
    ref = _BACKENDS.get(ddp)
    return ref() if ref is not None else None


def free_reducer(ddp: DistributedDataParallel) -> None:
    """End ``ddp``'s training life: drop its reducer and logger, and the idle reducers kept for it.

    The reducer, its buckets and its reference to the process group go before
    the group does (call it before ``destroy_process_group``). The wrapper's
    forward no longer works afterwards (a later rebuild makes it usable again).
    """
    backend = backend_of(ddp)
    _ddp.drop_reducer(ddp, backend.cache if backend is not None else None)
