"""Engine-side checks for wiring mistakes that would otherwise let ranks drift apart silently.

* :func:`wrapper_mismatch`: a DDP wrapper attached without ``rebuild`` whose
  reducer buckets other parameters than the current phase trains (DDP built
  before ``switcher.step_to(0)``): :meth:`PhaseSwitcher.attach` then warns and
  re-buckets it, as one collective transaction.
* :func:`unattached_error`: a switch after the first phase in a multi-rank run
  while no wrapper was ever attached (``switcher.attach(ddp)`` forgotten): the
  new phase's gradients would never be all-reduced, so the switch is refused on
  every rank, naming ``attach``.
* :func:`pending_grads_error`: a switch while gradients no optimizer step
  applied are pending (they would reach the next phase).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..plan.phase import Phase
from ._collective import any_rank_failed, is_distributed
from .backend import Backend
from .ddp import _surgery as _ddp

__all__ = ["pending_grads_error", "unattached_error", "wrapper_mismatch"]


def wrapper_mismatch(ddp: nn.Module, group: Optional[dist.ProcessGroup]) -> Optional[str]:
    """Why ``ddp``'s reducer does not match the current ``requires_grad`` flags on some rank, or ``None``.

    Collective when ``group`` spans several ranks (one small all-gather), so
    every rank takes the same decision.
    """
    if not _ddp.is_ddp(ddp):
        return None
    assert isinstance(ddp, DistributedDataParallel)
    actual = _ddp.reducer_parameter_names(ddp)
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    wanted = {names[id(p)] for p in _ddp.reduced_parameters(ddp)}
    local = None
    if actual is not None and actual != wanted:
        extra, missing = sorted(actual - wanted), sorted(wanted - actual)
        local = (f"buckets {len(extra)} parameter(s) the phase freezes (e.g. {extra[:3]}) and misses "
                 f"{len(missing)} it trains (e.g. {missing[:3]})")
    if is_distributed(group):
        if any_rank_failed(group, local is not None) and local is None:
            local = "matches here but not on another rank"
    return local


def unattached_error(current: Optional[Phase], backend: Backend, plain_attached: bool) -> Optional[str]:
    """The refusal for a switch in a multi-rank run that never attached its wrapper, or ``None``."""
    if current is None or backend.kind != "local":
        return None  # the first phase comes before DDP is built; a wrapper is attached
    if plain_attached or not is_distributed(None):
        return None
    return (f"this run has {dist.get_world_size()} ranks but no DDP wrapper was attached to the switcher, "
            "so the new phase's gradients would never be all-reduced (DDP keeps the parameter set it was "
            "built with). Call `switcher.attach(ddp)` right after building the wrapper (or "
            "`switcher.attach(module)` if this run trains the module without a wrapper on purpose)")


def pending_grads_error(named_params: Iterable[tuple[str, nn.Parameter]]) -> Optional[str]:
    """The refusal for a switch while parameters hold gradients no optimizer step applied, or ``None``."""
    pending = [n for n, p in named_params if p.grad is not None and _nonzero(p.grad)]
    if pending:
        return (f"{len(pending)} parameters hold pending gradients (e.g. {pending[:3]}): "
                "call optimizer.step() and optimizer.zero_grad(set_to_none=True) before switching")
    return None


def _nonzero(grad: Any) -> bool:
    """Whether a gradient holds any non-zero value (a sparse one, e.g. from ``Embedding(sparse=True)``, too)."""
    if grad.is_sparse:
        grad = grad.coalesce().values()
    return bool(grad.ne(0).any())
