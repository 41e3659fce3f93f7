"""Idle phases' DDP reducers, kept for the next switch back (opt-in: ``keep_reducers``).

By default a switch drops the DDP reducer and builds a new one for the new
trainable set (:func:`~hf_altparams.engine.ddp._surgery.rebuild_reducer`). With
per-step alternation the same few reducers are built and freed over and over,
and each new reducer starts with DDP's first-iteration layout: every gradient
in one bucket, so no all-reduce overlaps the backward (``docs/switch.md``).
:class:`ReducerCache` keeps up to ``size`` idle reducers, keyed by what they
were built over; a switch back to such a phase re-installs its reducer, with
the buckets it already re-laid in autograd order.

The price is memory: a kept reducer holds its gradient buckets, one copy of
its phase's trainable gradients. It is used only where a reducer can safely
sit idle while others train (:func:`why_not_cacheable`).

Every attribute of the wrapper touched here is already in
``_ddp.PRIVATE_DDP_ATTRIBUTES`` (checked with the torch version before any
rebuild).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Optional

from torch import nn

from ...errors import PlanError

__all__ = ["PER_BUCKET_HOOK_STATE", "ReducerCache", "check_keep_reducers", "why_not_cacheable"]

#: Attributes of a comm hook state that hold memory per bucket index (PowerSGD's):
#: such a state cannot be shared by reducers with different buckets, and a
#: rebuild clears them (``_ddp._reset_hook_state``).
PER_BUCKET_HOOK_STATE = ("error_dict", "p_memory_dict", "q_memory_dict")


def check_keep_reducers(count: object) -> int:
    """Validate ``keep_reducers``: a whole number of idle reducers, 0 or more."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise PlanError(
            f"`keep_reducers` must be a whole number >= 0 (how many idle phases' DDP reducers "
            f"to keep; 0 keeps none, 1 suits two sets alternating), got {count!r}"
        )
    return count


def why_not_cacheable(ddp: Any) -> Optional[str]:
    """Why ``ddp``'s reducers cannot be kept while idle (``None``: they can).

    * ``find_unused_parameters=True``: an idle reducer's hooks still mark the
      parameters it shares with the active phase as used, which a later
      iteration of that reducer would read.
    * ``static_graph=True``: its first-iteration bookkeeping is per wrapper.
    * a comm hook state with per-bucket memory (PowerSGD): bucket indices mean
      other parameters in each reducer.
    """
    if ddp.find_unused_parameters:
        return "find_unused_parameters=True"
    if ddp.static_graph:
        return "static_graph=True"
    for _, state in ddp._comm_hooks:
        if any(isinstance(getattr(state, attr, None), dict) for attr in PER_BUCKET_HOOK_STATE):
            return f"a comm hook state with per-bucket memory ({type(state).__name__})"
    return None


@dataclass
class _Kept:
    reducer: Any
    logger: Any
    has_rebuilt_buckets: bool
    lazy_init_ran: bool
    nbytes: int  # its gradient buckets (its dense-gradient parameters' bytes)


class ReducerCache:
    """Up to ``size`` idle reducers of one DDP wrapper, oldest dropped first.

    :meth:`built` records the reducer just built and what it was built over;
    :meth:`keep` puts it aside before the wrapper drops it; :meth:`take`
    re-installs a kept reducer built over the same parameters, ignore list and
    comm hooks, and frees the oldest past ``size``.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.hits = 0
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()
        self._live: Optional[tuple[Hashable, Any, int]] = None  # key, reducer, bytes

    @staticmethod
    def key(ddp: Any, parameters: list[nn.Parameter]) -> Hashable:
        """What a reducer is built over: its parameters, the ignore list, the comm hooks."""
        hooks = tuple((id(hook), id(state)) for hook, state in ddp._comm_hooks)
        return (tuple(map(id, parameters)), frozenset(ddp.parameters_to_ignore), hooks)

    def built(self, ddp: Any, parameters: list[nn.Parameter], sparse: list[bool]) -> None:
        """Record the reducer just built over ``parameters`` (``sparse``: which expect sparse gradients)."""
        nbytes = sum(p.numel() * p.element_size() for p, is_sparse in zip(parameters, sparse) if not is_sparse)
        self._live = (self.key(ddp, parameters), ddp.reducer, nbytes)

    def keep(self, ddp: Any) -> None:
        """Put the wrapper's live reducer aside (call before dropping it); no-op if it cannot be kept."""
        live, self._live = self._live, None
        if live is None or self.size <= 0 or ddp.reducer is None or live[1] is not ddp.reducer:
            return  # nothing recorded, or the wrapper's reducer was replaced behind our back
        if why_not_cacheable(ddp) is not None:  # e.g. PowerSGD registered after attach
            return
        key, reducer, nbytes = live
        self._kept.pop(key, None)
        # Not trimmed yet: the reducer the switch goes to may be the oldest one (take trims).
        self._kept[key] = _Kept(reducer, ddp.logger, ddp._has_rebuilt_buckets, ddp._lazy_init_ran, nbytes)

    def take(self, ddp: Any, parameters: list[nn.Parameter]) -> bool:
        """Re-install the kept reducer built over ``parameters`` (and the same ignore list, hooks).

        Either way, the oldest kept reducers past ``size`` are freed, before a
        new reducer would be built.
        """
        key = self.key(ddp, parameters)
        kept = self._kept.pop(key, None)
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)  # the oldest goes: its buckets are freed
        if kept is None:
            return False
        ddp.reducer, ddp.logger = kept.reducer, kept.logger
        ddp._has_rebuilt_buckets = kept.has_rebuilt_buckets
        # Its lazy init ran with it (DDP's in-backward optimizers register a comm
        # hook there, which a reducer accepts once).
        ddp._lazy_init_ran = kept.lazy_init_ran
        self._live = (key, kept.reducer, kept.nbytes)
        self.hits += 1
        return True

    def clear(self) -> None:
        """Drop every kept reducer (their buckets go with them)."""
        self._kept.clear()
        self._live = None

    @property
    def kept_bytes(self) -> int:
        """Bytes of gradient buckets the idle reducers hold."""
        return sum(kept.nbytes for kept in self._kept.values())

    def __len__(self) -> int:
        return len(self._kept)
