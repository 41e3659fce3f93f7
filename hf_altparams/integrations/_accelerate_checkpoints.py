"""Checkpoints of :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator`.

``save_state`` adds ``hf_altparams_state.json`` (the schedule position and the
switcher's state) to Accelerate's checkpoint folder, and a completion marker
written after everything else: a save killed part-way leaves a folder without it,
which ``load_state`` refuses and automatic resume skips. ``load_state`` applies the
saved phase before the optimizer state loads, so idle groups keep their policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Optional

from torch import nn

from ..errors import AltParamsError
from ._fsdp2_prepare import grouped_checkpoint_view

if TYPE_CHECKING:
    from .accelerate import PhasedAccelerator

__all__ = ["COMPLETE_MARKER", "STATE_FILE", "CheckpointMixin", "check_complete", "latest_complete_checkpoint",
           "read_state", "write_state"]

#: File that ``save_state`` adds to the checkpoint folder (schedule position and state).
STATE_FILE = "hf_altparams_state.json"
_STATE_FORMAT = "hf_altparams.PhasedAccelerator/1"
#: File written last by ``save_state``, once every rank has written its part.
COMPLETE_MARKER = "hf_altparams_complete.json"
#: Fault-injection hook for tests: the process exits at once at the save stage this names
#: (``state_file_tmp``, ``state_file``, ``before_marker``, ``marker_tmp``, ``marker``).
FAULT_ENV = "HF_ALTPARAMS_FAULT_AT"
FAULT_EXIT_CODE = 17
_hard_exit: Callable[[int], Any] = os._exit  # replaced in tests, which cannot lose their process


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


class CheckpointMixin:
    """``save_state`` / ``load_state`` with the schedule position, for :class:`PhasedAccelerator`."""

    def save_state(self: PhasedAccelerator, output_dir: Optional[str] = None, safe_serialization: bool = True,
                   **kwargs: Any) -> Any:
        """``Accelerator.save_state`` plus ``hf_altparams_state.json``; a completion marker goes last.

        The marker is written once every rank has written its part (a barrier before
        and after it): a save killed part-way leaves a folder without it, which
        :meth:`load_state` refuses and automatic resume (``load_state()``) skips.
        """
        with self._fsdp2_optimizer_view(None) as saved:
            self._fsdp2_saved_groups = saved
            location = super().save_state(  # type: ignore[misc]
                output_dir, safe_serialization=safe_serialization, **kwargs)
        fault_point("before_marker")
        self.wait_for_everyone()
        if self.switcher is not None and self._writes_state_files():
            mark_complete(location)
        self.wait_for_everyone()
        return location

    def _writes_state_files(self: PhasedAccelerator) -> bool:
        on_each_node = self.project_configuration.save_on_each_node
        return bool(self.is_main_process or (on_each_node and self.is_local_main_process))

    def _save_hook(self: PhasedAccelerator, models: list[nn.Module], weights: list[dict[str, Any]],
                   output_dir: str) -> None:
        if self.switcher is None:
            return
        if self._writes_state_files():
            extra = {}
            if getattr(self, "_fsdp2_saved_groups", None):  # FSDP2: which groups' optimizer state DCP holds
                extra["fsdp2_optimizer_groups"] = {str(i): g for i, g in self._fsdp2_saved_groups.items()}
            write_state(output_dir, schedule_step=self.schedule_step, schedule_epoch=self.schedule_epoch,
                        switcher=self.switcher.state_dict(), **extra)

    def load_state(self: PhasedAccelerator, input_dir: Optional[str] = None, **kwargs: Any) -> None:
        """``Accelerator.load_state``; the saved phase is applied before the optimizer state loads.

        A folder whose save did not complete is refused before anything loads; with
        automatic checkpoint naming and no ``input_dir``, the latest *complete*
        ``checkpoint_<n>`` is loaded (interrupted saves are skipped).
        """
        if self.switcher is not None:
            if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
                input_dir = latest_complete_checkpoint(os.path.join(self.project_dir, "checkpoints"))
            if input_dir is not None:
                input_dir = os.path.expanduser(str(input_dir))
                check_complete(input_dir)
        saved = None
        if self.switcher is not None and input_dir is not None and self.is_fsdp2:
            # Accelerate loads FSDP optimizers before the pre-hooks run: apply the saved phase first.
            self._load_hook([], input_dir)
            saved = {int(i): g for i, g in read_state(input_dir).get("fsdp2_optimizer_groups", {}).items()}
        with self._fsdp2_optimizer_view(saved):
            super().load_state(input_dir, **kwargs)
        if self.switcher is not None:
            self.switcher.reapply_placement()  # load_state put optimizer state on the device

    def _fsdp2_optimizer_view(self: PhasedAccelerator, saved: Optional[dict[int, list[str]]]) -> Any:
        """With FSDP2, GroupedOptimizers reach DCP as their inner optimizers (``_fsdp2_prepare``)."""
        if self.switcher is None or not self.is_fsdp2:
            return contextlib.nullcontext({})
        return grouped_checkpoint_view(self._optimizers, saved)

    def _load_hook(self: PhasedAccelerator, models: list[nn.Module], input_dir: str) -> None:
        if self.switcher is None:
            return
        state = read_state(input_dir)
        self.switcher.load_state_dict(state["switcher"])
        self.schedule_step, self.schedule_epoch = int(state["schedule_step"]), int(state["schedule_epoch"])
        self._loop_guard.epoch_set_at = self.schedule_step  # the saved epoch counts as set here
        self._backward_since_step = False
        for _, param in self.switcher.groups.all_named_params():
            param.grad = None  # loading replaces the run: in-flight gradients are void
        self._advance()  # before the optimizer state loads: idle groups keep their policy

