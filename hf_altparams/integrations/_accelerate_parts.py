"""Pieces of :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator` that stand alone.

The prepared optimizer and scheduler wrappers (they report sync-boundary steps to
their accelerator), the distributed types that are refused, and the
``hf_altparams_state.json`` file that ``save_state`` adds to a checkpoint, and the
completion marker written after everything else (a save killed part-way leaves a
folder without it, which loading refuses and automatic resume skips).
"""

from __future__ import annotations

import json
import os
import re
from typing import TYPE_CHECKING, Any, Callable

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils import DistributedType
from torch.optim import Optimizer

from ..errors import AltParamsError

if TYPE_CHECKING:
    from .accelerate import PhasedAccelerator

#: File that ``save_state`` adds to the checkpoint folder (schedule position and state).
STATE_FILE = "hf_altparams_state.json"
_STATE_FORMAT = "hf_altparams.PhasedAccelerator/1"
#: File written last by ``save_state``, once every rank has written its part.
COMPLETE_MARKER = "hf_altparams_complete.json"
#: Fault-injection hook for tests: the process exits at once at the save stage this names
#: (``state_tmp``, ``state_file``, ``before_marker``).
FAULT_ENV = "HF_ALTPARAMS_FAULT_AT"
FAULT_EXIT_CODE = 17
_hard_exit: Callable[[int], Any] = os._exit  # replaced in tests, which cannot lose their process
UNSUPPORTED = {
    DistributedType.DEEPSPEED: "DeepSpeed ignores or rejects trainable-set changes after `initialize`",
    DistributedType.FSDP: "FSDP shards parameters itself; FSDP2 needs no reducer rebuild",
    DistributedType.MEGATRON_LM: "Megatron-LM builds its own optimizer and reducer",
    DistributedType.XLA: "XLA reduces gradients itself, without a DDP reducer",
}


class PhasedOptimizer(AcceleratedOptimizer):
    """The prepared optimizer: reports sync-boundary steps and zero_grads to its accelerator."""

    def __init__(self, optimizer: Optimizer, owner: PhasedAccelerator, **kwargs: Any) -> None:
        super().__init__(optimizer, **kwargs)
        self._owner = owner

    def step(self, closure: Any = None) -> None:
        at_boundary = self.gradient_state.sync_gradients
        if at_boundary:
            self._owner._check_gradients()
        super().step(closure)
        if at_boundary:
            self._owner._count_step()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none)
        if self.gradient_state.sync_gradients:
            self._owner._switch_if_due()


class PreparedGroupedLRScheduler(AcceleratedScheduler):
    """Accelerate's scheduler wrapper for a GroupedLRScheduler (which has no ``_step_count``)."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.step_with_optimizer and not self.gradient_state.sync_gradients:
            return  # inside an accumulation window: the optimizer did not step
        super().step(*args, **kwargs)


def fault_point(stage: str) -> None:
    """Exit the process at once (no cleanup) when ``$HF_ALTPARAMS_FAULT_AT`` names ``stage``."""
    if os.environ.get(FAULT_ENV) == stage:
        _hard_exit(FAULT_EXIT_CODE)


def _write_atomically(path: str, payload: dict[str, Any], stage: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    fault_point(f"{stage}_tmp")
    os.replace(tmp, path)  # readers see the old file or the whole new one, never a part
    fault_point(stage)


def write_state(output_dir: str, **state: Any) -> None:
    """Write the schedule position and switcher state into checkpoint folder ``output_dir``."""
    _write_atomically(os.path.join(output_dir, STATE_FILE), {"format": _STATE_FORMAT, **state}, "state_file")


def mark_complete(output_dir: str) -> None:
    """Write the completion marker: call after every rank finished writing ``output_dir``."""
    _write_atomically(os.path.join(output_dir, COMPLETE_MARKER), {"format": _STATE_FORMAT}, "marker")


def check_complete(input_dir: str) -> None:
    """A clear error when ``input_dir`` is not a checkpoint whose save ran to its end."""
    if not os.path.isfile(os.path.join(input_dir, COMPLETE_MARKER)):
        raise AltParamsError(
            f"`load_state` refuses {input_dir!r}: it has no {COMPLETE_MARKER}, so its save was "
            "interrupted (or it was not written by PhasedAccelerator.save_state) and it may hold "
            "another phase's files or half of the groups' optimizer state; load an earlier checkpoint"
        )


def latest_complete_checkpoint(checkpoints_dir: str) -> str:
    """The highest-numbered ``checkpoint_<n>`` folder in ``checkpoints_dir`` whose save completed."""
    found = []
    for name in os.listdir(checkpoints_dir) if os.path.isdir(checkpoints_dir) else []:
        match = re.fullmatch(r"checkpoint_([0-9]+)", name)
        path = os.path.join(checkpoints_dir, name)
        if match and os.path.isfile(os.path.join(path, COMPLETE_MARKER)):
            found.append((int(match.group(1)), path))
    if not found:
        raise AltParamsError(
            f"`load_state()` found no complete checkpoint_<n> folder in {checkpoints_dir!r} "
            "(automatic resume skips folders whose save was interrupted); start from scratch"
        )
    return max(found)[1]


def read_state(input_dir: str) -> dict[str, Any]:
    """Read what :func:`write_state` wrote; a clear error when the file is missing or foreign."""
    path = os.path.join(input_dir, STATE_FILE)
    if not os.path.isfile(path):
        raise AltParamsError(
            f"`load_state` found no {STATE_FILE} in {input_dir!r}; load a checkpoint written by "
            "PhasedAccelerator.save_state (it holds the schedule position)"
        )
    with open(path) as f:
        state: dict[str, Any] = json.load(f)
    if state.get("format") != _STATE_FORMAT:
        raise AltParamsError(f"{path}: `format` is {state.get('format')!r}, expected {_STATE_FORMAT!r}")
    return state


def refuse_without_groups(optimizers: list[Optimizer]) -> None:
    """`prepare` got optimizers but no groups are known: the schedule could never apply."""
    raise AltParamsError(
        f"`prepare` got {[type(o).__name__ for o in optimizers]} but PhasedAccelerator does not know "
        "the parameter groups, so its schedule would never apply (everything would train, "
        "`phase` None); pass `groups=ParamGroups(model, ...)` to PhasedAccelerator, or use a "
        "GroupedOptimizer(groups, ...)"
    )


def refuse_user_ddp() -> None:
    """`prepare` got a DistributedDataParallel the user built around the grouped model."""
    raise AltParamsError(
        "`prepare` got a DistributedDataParallel you built around the grouped model; pass the model itself "
        "(`groups.module`): PhasedAccelerator applies the first phase before it builds DDP, and rebuilds "
        "DDP's reducer at each switch, which a wrapper built earlier (over every parameter) would miss"
    )
