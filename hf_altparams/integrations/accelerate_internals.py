"""The fence around Accelerate's internals: every private name or patched behaviour of Accelerate, here only.

hf_altparams uses Accelerate through its public API, except where the phased
run needs something that API does not expose. Each such use is one function
below, named for what it does, listed in :data:`USES` with the Accelerate
names it relies on; the rest of the library calls these functions and never
touches an Accelerate private name itself. At import, :func:`check_accelerate`
verifies that every name exists in the installed Accelerate and warns when its
version is outside :data:`TESTED_ACCELERATE`; ``tests/integrations/test_fences.py``
checks each use against the installed version (a rename there fails a test,
not a user's run).

The uses:

* the accelerator's lists of what it prepared (``Accelerator._optimizers``,
  ``_schedulers``, ``_dataloaders``): a phase-aware optimizer or scheduler
  wrapper made by ``PhasedAccelerator`` joins them, as Accelerate's own
  wrappers do, so ``save_state`` and gradient unscaling see it; the dataloaders
  give the steps in an epoch (the loop check of an epoch-unit schedule);
* the "already prepared" mark Accelerate sets on the objects it wraps
  (``_is_accelerate_prepared``): an optimizer passed to ``prepare`` a second
  time is not a new driving optimizer;
* the shared state of Accelerate's singletons (``AcceleratorState._shared_state``,
  ``PartialState._shared_state``, ``AcceleratorState._reset_state``): the
  Trainer callback reads the distributed type and plugins of the Trainer's
  accelerator (callbacks are not given it), and the test helper that runs
  Accelerate's FSDP2 code on CPU ranks sets the distributed type;
* ``ProjectConfiguration.total_limit`` set aside during ``save_state``:
  Accelerate deletes the oldest folders *before* it saves, counting torn ones;
  ``PhasedAccelerator`` applies the limit itself once the new checkpoint is
  complete (:func:`without_total_limit`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import accelerate
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from .._compat import check_library_at_import
from ..errors import AltParamsError

__all__ = [
    "TESTED_ACCELERATE",
    "USES",
    "check_accelerate",
    "fresh_accelerator_state",
    "is_prepared",
    "mark_prepared",
    "missing_names",
    "prepared_dataloaders",
    "prepared_optimizers",
    "register_prepared_optimizer",
    "register_prepared_scheduler",
    "run_fsdp_state",
    "shared_accelerator_state",
    "without_total_limit",
]

#: Inclusive range of (major, minor) Accelerate releases these uses were checked on.
TESTED_ACCELERATE: tuple[tuple[int, int], tuple[int, int]] = ((1, 15), (1, 15))

#: Each use: (what for, the Accelerate names it relies on as ``owner.attribute``).
USES: dict[str, tuple[str, ...]] = {
    "prepared_optimizers": ("Accelerator._optimizers",),
    "register_prepared_scheduler": ("Accelerator._schedulers",),
    "prepared_dataloaders": ("Accelerator._dataloaders",),
    "is_prepared": ("AcceleratedOptimizer._is_accelerate_prepared",),
    "shared_accelerator_state": ("AcceleratorState._shared_state",),
    "fresh_accelerator_state": ("AcceleratorState._reset_state",),
    "run_fsdp_state": ("PartialState._shared_state", "AcceleratorState.distributed_type",
                       "AcceleratorState.fsdp_plugin"),
    "without_total_limit": ("ProjectConfiguration.total_limit",),
}

_PREPARED_MARK = "_is_accelerate_prepared"


def missing_names() -> list[str]:
    """The names of :data:`USES` the installed Accelerate lacks (empty on a tested version).

    Instance attributes are looked for on a fresh object of their class where one
    is cheap to make, on the class otherwise.
    """
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import ProjectConfiguration

    probes: dict[str, Any] = {
        "Accelerator": Accelerator,
        "AcceleratedOptimizer": AcceleratedOptimizer,
        "AcceleratorState": AcceleratorState,
        "PartialState": PartialState,
        "ProjectConfiguration": ProjectConfiguration(),
    }
    instance_attributes = {"Accelerator._optimizers", "Accelerator._schedulers", "Accelerator._dataloaders",
                           "AcceleratedOptimizer._is_accelerate_prepared", "AcceleratorState.distributed_type",
                           "AcceleratorState.fsdp_plugin"}
    missing = []
    for names in USES.values():
        for name in names:
            owner, attribute = name.split(".")
            if name in instance_attributes:
                continue  # set in __init__: checked by the tests on a live object
            if not hasattr(probes[owner], attribute):
                missing.append(name)
    return sorted(set(missing))


def check_accelerate() -> None:
    """At import: refuse an Accelerate that lacks a name the library relies on; warn outside the tested range."""
    check_library_at_import("accelerate", accelerate.__version__, TESTED_ACCELERATE, missing_names(), "Accelerate internals")


# ------------------------------------------------------------------ what an accelerator prepared
def prepared_optimizers(acc: Accelerator) -> list[Any]:
    """The optimizer wrappers ``acc`` prepared (the list ``save_state`` saves, in order)."""
    return acc._optimizers


def register_prepared_optimizer(acc: Accelerator, wrapped: Any) -> None:
    """Add an optimizer wrapper made outside ``Accelerator.prepare_optimizer`` to ``acc``'s prepared ones."""
    acc._optimizers.append(wrapped)


def register_prepared_scheduler(acc: Accelerator, wrapped: Any) -> None:
    """Add a scheduler wrapper made outside ``Accelerator.prepare_scheduler`` to ``acc``'s, marked prepared."""
    mark_prepared(wrapped)
    acc._schedulers.append(wrapped)


def prepared_dataloaders(acc: Accelerator) -> list[Any]:
    """The dataloaders ``acc`` prepared (empty before any)."""
    return list(getattr(acc, "_dataloaders", []))


def is_prepared(obj: Any) -> bool:
    """Whether Accelerate marked ``obj`` as prepared (its own wrappers, and objects ``prepare`` returned)."""
    return bool(getattr(obj, _PREPARED_MARK, False))


def mark_prepared(obj: Any) -> None:
    """Mark ``obj`` as prepared, as Accelerate marks its own wrappers."""
    setattr(obj, _PREPARED_MARK, True)


# ------------------------------------------------------------------ Accelerate's shared state
def shared_accelerator_state() -> dict[str, Any]:
    """Accelerate's shared ``AcceleratorState`` (a dict; empty before any accelerator exists), read-only use.

    The Trainer builds its accelerator before callbacks see anything, and hands
    them neither it nor its state: this is where its distributed type and plugins are.
    """
    return dict(AcceleratorState._shared_state)


def fresh_accelerator_state(partial: bool = False) -> None:
    """Forget Accelerate's shared ``AcceleratorState``: the next accelerator reads its own plugins.

    ``partial``: forget the ``PartialState`` too (its distributed type and device;
    the process group itself stays).
    """
    AcceleratorState._reset_state(reset_partial_state=partial)


def run_fsdp_state(accelerator: Accelerator, plugin: Any) -> None:
    """Make ``accelerator``'s shared state say FSDP with ``plugin`` (Accelerate on CPU ranks chose MULTI_CPU).

    What ``AcceleratorState.__init__`` does for an FSDP run on GPUs, after the fact:
    the distributed type, the plugin and its mixed precision.
    """
    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if not accelerator.is_fsdp2:
        raise AltParamsError("the accelerator does not run FSDP2 after its state was set to FSDP; pass a "
                             "FullyShardedDataParallelPlugin(fsdp_version=2)")


# ------------------------------------------------------------------ checkpoints
@contextlib.contextmanager
def without_total_limit(acc: Accelerator, limit: Optional[int]) -> Iterator[None]:
    """Within the block Accelerate's ``save_state`` sees no ``total_limit``; restored after, whatever happens.

    Accelerate deletes the oldest ``checkpoint_<n>`` folders before it saves,
    counting torn ones, so the last complete checkpoint could go before the new
    one is complete; ``PhasedAccelerator`` prunes itself after the save.
    """
    if limit is None:
        yield
        return
    config = acc.project_configuration
    config.total_limit = None
    try:
        yield
    finally:
        config.total_limit = limit


check_accelerate()
