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
  complete (:func:`without_total_limit`);
* ``accelerate launch``'s config files (``accelerate.commands.config.config_args``:
  ``default_config_file``, ``load_config_from_file``) and what its launcher
  does with them (:func:`default_launch_config`, :func:`read_launch_config`,
  :class:`LaunchConfig`): ``python -m hf_altparams check`` starts its ranks
  with the user's config and must know, before it does, how many processes
  that launch starts; and it must know when it is the one process such a
  launch started (:func:`started_alone_by_accelerate`: the environment
  variables ``accelerate launch``'s one-process launcher sets);
* the dynamo plugin of Accelerate's shared state (``AcceleratorState.dynamo_plugin``,
  its ``backend`` and ``use_regional_compilation``): with regional compilation
  ``prepare`` would compile the regions of the *DDP wrapper* into a copy of it
  that keeps the reducer of the moment it was made; ``PhasedAccelerator``
  compiles the model's regions in place before DDP wraps it and sets the plugin
  aside while Accelerate prepares (:func:`dynamo_settings`, :func:`without_compile`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import accelerate
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, DynamoBackend

from .._compat import check_library_at_import
from ..errors import AltParamsError

__all__ = [
    "ONE_PROCESS_TYPES",
    "TESTED_ACCELERATE",
    "USES",
    "LaunchConfig",
    "check_accelerate",
    "DynamoSettings",
    "default_launch_config",
    "dynamo_settings",
    "fresh_accelerator_state",
    "is_prepared",
    "mark_prepared",
    "missing_names",
    "prepared_dataloaders",
    "prepared_optimizers",
    "read_launch_config",
    "register_prepared_optimizer",
    "register_prepared_scheduler",
    "run_fsdp_state",
    "shared_accelerator_state",
    "started_alone_by_accelerate",
    "without_compile",
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
    "run_fsdp_state": (
        "PartialState._shared_state",
        "AcceleratorState.distributed_type",
        "AcceleratorState.fsdp_plugin",
    ),
    "without_total_limit": ("ProjectConfiguration.total_limit",),
    "default_launch_config": ("config_args.default_config_file",),
    "read_launch_config": ("config_args.load_config_from_file",),
    "dynamo_settings": (
        "AcceleratorState.dynamo_plugin",
        "TorchDynamoPlugin.use_regional_compilation",
        "TorchDynamoPlugin.to_kwargs",
    ),
    "without_compile": ("AcceleratorState.dynamo_plugin",),
}

_PREPARED_MARK = "_is_accelerate_prepared"


def missing_names() -> list[str]:
    """The names of :data:`USES` the installed Accelerate lacks (empty on a tested version).

    Instance attributes are looked for on a fresh object of their class where one
    is cheap to make, on the class otherwise.
    """
    from accelerate.commands.config import config_args
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.utils import ProjectConfiguration, TorchDynamoPlugin

    probes: dict[str, Any] = {
        "config_args": config_args,
        "Accelerator": Accelerator,
        "AcceleratedOptimizer": AcceleratedOptimizer,
        "AcceleratorState": AcceleratorState,
        "PartialState": PartialState,
        "ProjectConfiguration": ProjectConfiguration(),
        "TorchDynamoPlugin": TorchDynamoPlugin(),
    }
    instance_attributes = {
        "Accelerator._optimizers",
        "Accelerator._schedulers",
        "Accelerator._dataloaders",
        "AcceleratedOptimizer._is_accelerate_prepared",
        "AcceleratorState.distributed_type",
        "AcceleratorState.fsdp_plugin",
        "AcceleratorState.dynamo_plugin",
    }
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
    check_library_at_import(
        "accelerate", accelerate.__version__, TESTED_ACCELERATE, missing_names(), "Accelerate internals"
    )


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
        raise AltParamsError(
            "the accelerator does not run FSDP2 after its state was set to FSDP; pass a "
            "FullyShardedDataParallelPlugin(fsdp_version=2)"
        )


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


# ------------------------------------------------------------------ the dynamo plugin (torch.compile)
@dataclass(frozen=True)
class DynamoSettings:
    """What an accelerator's dynamo plugin asks for.

    ``backend``: the backend's name (``"NO"``: no compile); ``regional``:
    ``use_regional_compilation``; ``compile_kwargs``: what Accelerate passes to
    ``torch.compile`` for it.
    """

    backend: str = "NO"
    regional: bool = False
    compile_kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def compiles(self) -> bool:
        return self.backend != "NO"


def dynamo_settings(acc: Accelerator) -> DynamoSettings:
    """The dynamo plugin of ``acc``'s state (an Accelerate without regional compilation: never regional)."""
    plugin = getattr(acc.state, "dynamo_plugin", None)
    backend = getattr(plugin, "backend", None)
    name = str(getattr(backend, "value", backend or "NO")).upper()
    if plugin is None or name == "NO":
        return DynamoSettings()
    return DynamoSettings(name, bool(getattr(plugin, "use_regional_compilation", False)), dict(plugin.to_kwargs()))


@contextlib.contextmanager
def without_compile(acc: Accelerator) -> Iterator[None]:
    """Within the block ``acc.prepare`` compiles nothing (a copy of the plugin with no backend); restored after.

    ``PhasedAccelerator`` compiled the model's regions in place already; left to
    itself, Accelerate (1.15) would compile the regions of the DDP wrapper it
    built into a copy of that wrapper sharing its reducer (``compile_regions``).
    """
    state = acc.state
    plugin = getattr(state, "dynamo_plugin", None)
    if plugin is None:
        yield
        return
    idle = copy.copy(plugin)
    idle.backend = DynamoBackend.NO
    state.dynamo_plugin = idle
    try:
        yield
    finally:
        state.dynamo_plugin = plugin


check_accelerate()


# ------------------------------------------------------------------ accelerate launch's config files
#: The ``distributed_type`` values for which ``accelerate launch`` (1.15) starts ONE process, whatever the
#: config's ``num_processes``: ``launch_command`` sends only ``MULTI_<device>``, ``FSDP``, ``MEGATRON_LM`` and
#: ``DEEPSPEED`` to the multi-process launchers (torch's elastic launcher); ``NO`` and ``MULTI_CPU`` go to its
#: "simple" launcher, which runs the script once, with no ``RANK``, ``WORLD_SIZE`` or ``LOCAL_RANK`` (an
#: ``mpirun_hostfile`` makes ``MULTI_CPU`` run under ``mpirun`` instead).
ONE_PROCESS_TYPES: tuple[str, ...] = ("NO", "MULTI_CPU")
_MULTI_PROCESS_TYPES = ("FSDP", "MEGATRON_LM", "DEEPSPEED")


@dataclass(frozen=True)
class LaunchConfig:
    """An ``accelerate launch`` config file as Accelerate reads it, and what its launcher starts from it.

    Attributes:
        path: the file.
        distributed_type: its ``distributed_type`` (``"NO"``, ``"MULTI_CPU"``, ``"MULTI_GPU"``, ``"FSDP"``, ...).
        num_processes: its ``num_processes`` (Accelerate's default 1 for ``NO``); ``None`` where it names none.
        num_machines: its ``num_machines``.
        mpirun_hostfile: its MPI hostfile, where ``MULTI_CPU`` runs under ``mpirun``.
        sagemaker: whether it launches on Amazon SageMaker (``compute_environment``).
    """

    path: Path
    distributed_type: str
    num_processes: Optional[int]
    num_machines: int
    mpirun_hostfile: Optional[str]
    sagemaker: bool

    @property
    def one_process(self) -> bool:
        """Whether ``accelerate launch`` starts one process from it, whatever ``num_processes`` says."""
        return self.distributed_type in ONE_PROCESS_TYPES and not self.mpirun_hostfile

    def elsewhere(self) -> Optional[str]:
        """Why this launch is not one a single command on this machine starts and ends (``None``: it is)."""
        if self.sagemaker:
            return "it launches on Amazon SageMaker (compute_environment)"
        if self.mpirun_hostfile:
            return f"it runs under mpirun over the machines of {self.mpirun_hostfile!r} (mpirun_hostfile)"
        if self.num_machines > 1:
            return f"it spans num_machines {self.num_machines}: every machine must start its part"
        if (
            not self.one_process
            and not self.distributed_type.startswith("MULTI_")
            and self.distributed_type not in _MULTI_PROCESS_TYPES
        ):
            return f"distributed_type {self.distributed_type} has a launcher of its own"
        return None

    def processes(self, num_processes: Optional[int] = None) -> Optional[int]:
        """The processes ``accelerate launch --config_file path [--num_processes N]`` starts on one machine.

        ``None`` where the config names no count and none is given (Accelerate then refuses to launch).

        Example:
            >>> LaunchConfig(Path("c.yaml"), "MULTI_CPU", 2, 1, None, False).processes()
            1
            >>> LaunchConfig(Path("c.yaml"), "MULTI_GPU", 2, 1, None, False).processes(4)
            4
        """
        if self.one_process:
            return 1
        return num_processes if num_processes is not None else self.num_processes


def default_launch_config() -> Path:
    """The file ``accelerate launch`` reads when given no ``--config_file`` (it may not exist).

    ``$HF_HOME/accelerate/default_config.yaml``, else under ``$XDG_CACHE_HOME/huggingface``, else
    ``~/.cache/huggingface``: Accelerate works it out once, when its config module is imported.
    """
    from accelerate.commands.config import config_args

    return Path(config_args.default_config_file)


def read_launch_config(path: Union[str, Path]) -> LaunchConfig:
    """Read ``path`` the way ``accelerate launch --config_file path`` does (Accelerate's own loader and defaults).

    Raises:
        AltParamsError: the file is missing or Accelerate cannot read it (the message names the file).
    """
    from accelerate.commands.config import config_args

    try:
        config = config_args.load_config_from_file(str(path))
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise AltParamsError(f"Accelerate config {str(path)!r} cannot be read: {type(err).__name__}: {err}") from err
    kind = getattr(config.distributed_type, "value", config.distributed_type)
    if kind is False:  # `distributed_type: NO` unquoted: YAML reads a boolean (Accelerate's writer quotes it)
        kind = "NO"
    count = getattr(config, "num_processes", None)
    mpirun = (getattr(config, "mpirun_config", None) or {}).get("mpirun_hostfile")
    environment = getattr(config.compute_environment, "value", config.compute_environment)
    return LaunchConfig(
        path=Path(path),
        distributed_type=str(kind),
        num_processes=count if isinstance(count, int) and count > 0 else None,
        num_machines=int(getattr(config, "num_machines", 1) or 1),
        mpirun_hostfile=mpirun or None,
        sagemaker=str(environment) == "AMAZON_SAGEMAKER",
    )


#: Variables ``accelerate launch``'s one-process ("simple") launcher sets in its process's environment
#: (1.15: ``prepare_simple_launcher_cmd_env``), besides ``ACCELERATE_USE_CPU`` and ``ACCELERATE_MIXED_PRECISION``,
#: which a user may export by hand.
_SIMPLE_LAUNCHER_ENV = (
    "ACCELERATE_DYNAMO_BACKEND",
    "ACCELERATE_DYNAMO_MODE",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH",
    "ACCELERATE_DYNAMO_USE_DYNAMIC",
    "ACCELERATE_MIXED_PRECISION",
)


def started_alone_by_accelerate(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is that of the one process ``accelerate launch`` starts (a ``NO`` or ``MULTI_CPU`` config).

    Its launcher sets its dynamo and precision variables and no ``WORLD_SIZE``.

    Example:
        >>> started_alone_by_accelerate({"PATH": "/usr/bin"})
        False
    """
    return "WORLD_SIZE" not in environ and all(name in environ for name in _SIMPLE_LAUNCHER_ENV)
