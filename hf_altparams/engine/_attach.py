"""Wiring a wrapper to a switcher: what :meth:`PhaseSwitcher.attach` does before any transaction.

A DDP wrapper gets its backend (kept reducers, the precision optimizer's comm
hook), a check that it was built for the current phase, and the residency and
buffer-sync baselines it was built with; a ``fully_shard`` model gets the FSDP2
backend; the grouped module itself marks a run trained without a wrapper on
purpose. Whether the wrapper must then be re-bucketed for the current phase
(a transaction) is returned to the switcher, which runs it.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Protocol

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from ..errors import SwitchError
from ..plan.phase import Phase
from . import _misuse
from ._backends import backend_for
from .backend import Backend
from .buffers import BufferSync
from .config import SwitchConfig
from .ddp._surgery import is_ddp
from ._models import ModelsBackend, model_name_in
from .memory._release import ReleasePolicy
from .memory._residency import ResidencyManager
from .memory._transfer import optimizer_of

__all__ = ["attach_wrapper"]


class _Switcher(Protocol):
    """What :func:`attach_wrapper` reads and sets on the switcher."""

    config: SwitchConfig
    backend: Backend
    plain_attached: bool
    optimizer: Optional[Optimizer]
    residency: ResidencyManager
    buffer_sync: BufferSync
    release_policy: ReleasePolicy
    _reduced_bytes: dict[Phase, int]

    @property
    def module(self) -> nn.Module: ...

    @property
    def current(self) -> Optional[Phase]: ...

    @property
    def process_group(self) -> Optional[dist.ProcessGroup]: ...

    def _distributed(self) -> bool: ...

    def _state_stays_off(self, phase: Phase) -> Callable[[str], bool]: ...

    def trainable_names(self, phase: Phase) -> frozenset[str]: ...


def attach_wrapper(switcher: Any, model: nn.Module, rebuild: bool) -> bool:
    """Wire ``model`` (a DDP wrapper, an FSDP2 model or the module) to ``switcher``; return whether to rebuild."""
    sw: _Switcher = switcher
    if not is_ddp(model):
        _attach_plain(sw, model)
        return False
    part = model_name_in(sw.module, model.module)
    if model.module is not sw.module and part is None:
        raise SwitchError(
            "`model` is a DistributedDataParallel around a different module than the one "
            "ParamGroups was built on; build ParamGroups on `ddp.module` (or before wrapping), or on "
            "the models together with ParamGroups.of_models({...}) when each has its own wrapper"
        )
    backend = backend_for(model)
    if part is not None:
        return _attach_part(sw, part, backend)
    sw.backend = backend
    keep = sw.config.keep_reducers
    why_not = sw.backend.keep_reducers(keep)
    if why_not:
        warnings.warn(f"hf_altparams: keep_reducers={keep} is not used with this DDP wrapper "
                      f"({why_not}); every switch builds a new reducer", stacklevel=3)
    grouped = optimizer_of(sw.optimizer) if sw.optimizer is not None else None
    attach_ddp = getattr(grouped, "attach_ddp", None)  # PrecisionOptimizer: its comm hook
    if attach_ddp is not None:
        attach_ddp(model)
    sw._reduced_bytes.clear()
    sw.release_policy.forget_footprints()  # DDP adds a gradient copy per trainable byte
    current = sw.current
    if current is not None and not rebuild:
        mismatch = _misuse.wrapper_mismatch(model, sw.process_group if sw._distributed() else None)
        if mismatch:
            warnings.warn(
                f"hf_altparams: the DDP wrapper passed to `attach` was built before phase "
                f"{current.name!r} was applied: its reducer {mismatch}, so the ranks would diverge. "
                "Re-bucketing it now for the current phase; build DDP after `switcher.step_to(0)` "
                "(or pass `attach(ddp, rebuild=True)`) to skip this.", stacklevel=3)
            rebuild = True
    sw.residency.attached(sw.backend.ignored_at_wrap(), sw.backend.device)
    sw.buffer_sync.attach(model, user_ignore=sw.residency.ignore_names(frozenset()))
    if current is not None:
        # Accelerate's prepare() and the Trainer move the whole model to the device.
        sw.residency.enforce(keep_state_off=sw._state_stays_off(current))
        sw.residency.install_guards(current.name)
        if not rebuild:
            if sw.backend.ignored_at_wrap() != sw.residency.ignore_names():
                sw.backend.apply(sw.residency.ignore_names())
            sw.buffer_sync.apply(sw.module, sw.trainable_names(current), ddp=model,
                                 ignore=sw.residency.ignore_names())
    return rebuild


def _attach_part(sw: _Switcher, name: str, backend: Backend) -> bool:
    """One model of several (``ParamGroups.of_models``): its wrapper joins the others'; always re-bucketed.

    Its DDP was built over every parameter of the model (DDP refuses a module
    with nothing to train), so it is re-bucketed for the current phase now.
    """
    if sw.config.buffer_sync != "keep":
        raise SwitchError(f"`buffer_sync={sw.config.buffer_sync!r}` is not supported with one wrapper per model; "
                          "leave it at 'keep'")
    models = sw.backend if isinstance(sw.backend, ModelsBackend) else ModelsBackend()
    if sw.backend is not models and sw.backend.kind != "local":
        raise SwitchError(f"model {name!r} has its own wrapper, but the switcher already drives a "
                          f"{sw.backend.kind} wrapper around the whole module; wrap either the models or the root")
    why_not = backend.keep_reducers(sw.config.keep_reducers)
    if why_not:
        warnings.warn(f"hf_altparams: keep_reducers={sw.config.keep_reducers} is not used with model {name!r}'s "
                      f"wrapper ({why_not}); every switch builds a new reducer", stacklevel=4)
    models.add(name, backend)
    sw.backend = models
    sw._reduced_bytes.clear()
    sw.release_policy.forget_footprints()
    sw.residency.attached(models.ignored_at_wrap(), models.device)
    return sw.current is not None


def _attach_plain(sw: _Switcher, model: nn.Module) -> None:
    if model is not sw.module:
        raise SwitchError(
            f"`model` ({type(model).__name__}) is neither the grouped module nor a "
            "DistributedDataParallel around it; build ParamGroups on the model you train"
        )
    sw.plain_attached = True  # no DDP wrapper, on purpose
    backend = backend_for(model)
    if backend.kind == "local":
        return
    backend.bind(sw)  # FSDP2: groups vs units checked, residency moves routed
    sw.backend = backend  # fully_shard changed the module in place (FSDP2)
    sw._reduced_bytes.clear()
    if sw.current is not None:
        sw.backend.apply(sw.residency.ignore_names())
