"""Checkpoints of :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator`: save, load, resume.

``save_state`` adds ``hf_altparams_state.json`` (the switcher's state: the
schedule, the position and the groups trained so far; and the group
membership) to Accelerate's checkpoint folder, and a completion marker written
after everything else, listing every file with its size: a save killed
part-way leaves a folder without it, which ``load_state`` refuses and automatic
resume skips. Around Accelerate's own save, on every rank:

1. the drift check (:meth:`~hf_altparams.engine.PhaseSwitcher.check_weights`,
   unless ``drift_check=False``): ranks holding different weights get a
   :class:`~hf_altparams.errors.DriftError` on every rank, and nothing is
   written (an older checkpoint in the same folder stays complete);
2. the completion marker an earlier save left in the target folder
   (``save_state("latest")`` again) is removed by every process that writes
   markers, then a barrier: from then on a save killed part-way leaves a
   folder without a marker, never one whose old marker vouches for new files;
3. ``ProjectConfiguration(total_limit=N)`` with automatic naming is set aside
   for Accelerate's save (which would count torn folders and delete the oldest
   ones before saving, the last complete checkpoint among them); once the
   marker is written, the N newest complete checkpoints are kept and older
   ones, and torn ones below the new checkpoint, are deleted
   (:func:`~.checkpoint_files.prune`): at most N + 1 folders exist while a save
   runs, and the last complete checkpoint goes only once a newer one is complete.

``load_state`` agrees with the other ranks on the folder (each reads its own
disk), checks the listed files and the groups before anything loads, and
applies the saved phase before the optimizer state loads, so idle groups keep
their policy.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
from accelerate import Accelerator
from torch import nn

from ..engine.collective import is_distributed
from ..engine.driver import DriverState
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError
from .accelerate_internals import prepared_optimizers, without_total_limit
from .checkpoint_files import (
    COMPLETE_MARKER,
    manifest,
    manifest_problem,
    membership,
    membership_difference,
    numbered_folders,
    prune,
    remove_file,
    write_atomically,
)
from .fsdp2 import grouped_checkpoint_view

if TYPE_CHECKING:
    from .accelerate_run import PhasedRun

__all__ = [
    "COMPLETE_MARKER",
    "STATE_FILE",
    "Checkpoints",
    "agreed_checkpoint",
    "check_complete",
    "complete_iterations",
    "latest_complete_checkpoint",
    "read_state",
    "save_target",
    "write_state",
    "writes_state_files",
]

#: File that ``save_state`` adds to the checkpoint folder (schedule position and state).
STATE_FILE = "hf_altparams_state.json"
_STATE_FORMAT = "hf_altparams.PhasedAccelerator/1"


def write_state(output_dir: str, **state: Any) -> None:
    """Write the schedule position and switcher state into checkpoint folder ``output_dir``."""
    write_atomically(os.path.join(output_dir, STATE_FILE), {"format": _STATE_FORMAT, **state})


def mark_complete(output_dir: str) -> None:
    """Write the completion marker, listing every file and its size: call after every rank finished writing."""
    write_atomically(
        os.path.join(output_dir, COMPLETE_MARKER),
        {"format": _STATE_FORMAT, "files": manifest(output_dir, skip=[COMPLETE_MARKER])},
    )


def folder_problem(input_dir: str) -> Optional[str]:
    """Why ``input_dir`` is not a checkpoint whose save ran to its end and whose files are all there (or ``None``)."""
    marker = os.path.join(input_dir, COMPLETE_MARKER)
    if not os.path.isdir(input_dir):
        return "it does not exist (or is not a folder)"
    if not os.path.isfile(marker):
        return (
            f"it has no {COMPLETE_MARKER}, so its save was interrupted (or it was not written by "
            "PhasedAccelerator.save_state) and it may hold another phase's files or half of the groups' "
            "optimizer state"
        )
    try:
        with open(marker) as f:
            files = json.load(f).get("files", {})
    except (OSError, ValueError, AttributeError) as exc:
        return f"its {COMPLETE_MARKER} cannot be read ({type(exc).__name__}: {exc})"
    problem = manifest_problem(input_dir, files)  # markers written before the list existed: nothing to check
    return None if problem is None else f"{problem}: the folder is not the checkpoint its save completed"


def check_complete(input_dir: str) -> None:
    """A clear error when ``input_dir`` is not a checkpoint whose save ran to its end, with all its files."""
    problem = folder_problem(input_dir)
    if problem is not None:
        raise AltParamsError(f"`load_state` refuses {input_dir!r}: {problem}; load another checkpoint")


def _numbered(checkpoints_dir: str) -> list[tuple[int, str]]:
    """Every ``checkpoint_<n>`` folder in ``checkpoints_dir``, complete or not, as ``(n, path)``."""
    return numbered_folders(checkpoints_dir, "checkpoint_")


def complete_iterations(checkpoints_dir: str) -> list[int]:
    """The ``n`` of every ``checkpoint_<n>`` folder in ``checkpoints_dir`` whose save completed, ascending."""
    return sorted(n for n, path in _numbered(checkpoints_dir) if os.path.isfile(os.path.join(path, COMPLETE_MARKER)))


def latest_complete_checkpoint(checkpoints_dir: str) -> str:
    """The highest-numbered ``checkpoint_<n>`` folder in ``checkpoints_dir`` whose save completed."""
    found = complete_iterations(checkpoints_dir)
    if not found:
        raise AltParamsError(
            f"`load_state()` found no complete checkpoint_<n> folder in {checkpoints_dir!r} "
            "(automatic resume skips folders whose save was interrupted); start from scratch"
        )
    return os.path.join(checkpoints_dir, f"checkpoint_{found[-1]}")


_SHARED_STORAGE_HINT = (
    "on several nodes, each node reads its own disk: with `ProjectConfiguration(save_on_each_node=False)` "
    "(the default) only the main process writes the model, the optimizer and the state file, so the "
    "checkpoint folder must be on storage every node shares; with separate disks per node set "
    "`save_on_each_node=True`"
)


def _gathered(value: Any) -> list[Any]:
    """``value`` from every rank, in rank order (one ``all_gather_object``); ``[value]`` in one process."""
    if not is_distributed(None):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _common(iterations: list[list[int]]) -> set[int]:
    """The checkpoint numbers complete on every rank."""
    return set(iterations[0]).intersection(*map(set, iterations[1:]))


def agreed_checkpoint(input_dir: Optional[str], checkpoints_dir: Optional[str]) -> Optional[str]:
    """The checkpoint folder every rank loads, the same on all of them, or the same error on every rank.

    ``input_dir`` (given by the caller) must be complete on every rank; without it,
    ``checkpoints_dir`` (automatic naming) gives the latest ``checkpoint_<n>``
    complete on EVERY rank's disk (a save interrupted on one node only is skipped
    everywhere). Each rank reads its own filesystem, so on several nodes the ranks
    can see different folders; one all-gather of what each rank found makes them
    agree, instead of letting some ranks load while others fail (they would then
    wait in the next collective) or load another checkpoint (the ranks then stand
    at different steps: mismatched collectives, or weights that differ). On NCCL
    the gather runs on the current CUDA device, which Accelerate has set.
    Single process: the local answer.
    """
    if input_dir is None and checkpoints_dir is None:
        return None
    if input_dir is not None:
        input_dir = os.path.expanduser(str(input_dir))
        found: Any = folder_problem(input_dir)
    else:
        assert checkpoints_dir is not None
        found = complete_iterations(checkpoints_dir)
    if not is_distributed(None):
        if input_dir is not None:
            check_complete(input_dir)
            return input_dir
        assert checkpoints_dir is not None
        latest = latest_complete_checkpoint(checkpoints_dir)
        check_complete(latest)
        return latest
    gathered = _gathered(found)
    if input_dir is not None:
        _refuse_problems(input_dir, gathered)
        return input_dir
    assert checkpoints_dir is not None
    common = _common(gathered)
    if not common:
        seen = "; ".join(f"rank {r}: {sorted(its)}" for r, its in enumerate(gathered))
        raise AltParamsError(
            f"`load_state()` found no checkpoint_<n> folder complete on every rank in {checkpoints_dir!r} "
            f"(complete ones seen: {seen}); automatic resume skips folders whose save was interrupted. "
            f"Start from scratch, or: {_SHARED_STORAGE_HINT}"
        )
    chosen = max(common)
    newer = sorted({n for its in gathered for n in its if n > chosen})
    if newer:
        warnings.warn(
            f"`load_state()`: checkpoint(s) {newer} in {checkpoints_dir!r} are complete on some ranks only "
            f"(their save was interrupted elsewhere); every rank loads checkpoint_{chosen}, the latest complete "
            "on every rank",
            stacklevel=3,
        )
    folder = os.path.join(checkpoints_dir, f"checkpoint_{chosen}")
    _refuse_problems(folder, _gathered(folder_problem(folder)))
    return folder


def _refuse_problems(folder: str, problems: list[Optional[str]]) -> None:
    """The same error on every rank when any rank found a problem with ``folder`` (``problems``: gathered)."""
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if not found:
        return
    if len({p for _, p in found}) == 1:
        ranks = [r for r, _ in found]
        where = "" if len(ranks) == len(problems) else f" on rank(s) {ranks}"
        detail = f"{found[0][1]}{where}"
    else:
        detail = "; ".join(f"rank {r}: {p}" for r, p in found)
    hint = "" if len(found) == len(problems) else f"; {_SHARED_STORAGE_HINT}"
    raise AltParamsError(f"`load_state` refuses {folder!r}: {detail}; load another checkpoint{hint}")


def check_saved_groups(input_dir: str, groups: Any) -> None:
    """Refuse, naming the groups that differ, a checkpoint saved with another group membership."""
    saved = read_state(input_dir).get("groups")
    difference = None if saved is None else membership_difference(saved, groups)  # None: saved before it was kept
    if difference is not None:
        raise AltParamsError(
            f"`load_state` refuses {input_dir!r}: it was saved with other groups ({difference}); its optimizer "
            "state and schedule position belong to those groups. Build the groups as the saved run did, or "
            "start from scratch"
        )


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


def writes_state_files(acc: Accelerator) -> bool:
    """Whether this process writes the state file and the marker (the main one; per node with ``save_on_each_node``)."""
    on_each_node = acc.project_configuration.save_on_each_node
    return bool(acc.is_main_process or (on_each_node and acc.is_local_main_process))


def checkpoints_folder(acc: Accelerator) -> str:
    """``project_dir/checkpoints``: where automatic checkpoint naming puts its ``checkpoint_<n>`` folders.

    Raises:
        AltParamsError: the accelerator has no ``project_dir`` (Accelerate's own
            ``save_state`` would fail on it with a bare ``TypeError``).
    """
    project_dir = acc.project_dir
    if project_dir is None:
        raise AltParamsError(
            "`ProjectConfiguration(automatic_checkpoint_naming=True)` names checkpoints under `project_dir`, and "
            "the accelerator has none (project_dir None): pass `ProjectConfiguration(project_dir=..., "
            "automatic_checkpoint_naming=True)`, or give `save_state` / `load_state` a folder without automatic naming"
        )
    return os.path.join(project_dir, "checkpoints")


def save_target(acc: Accelerator, output_dir: Optional[str]) -> Optional[str]:
    """The folder Accelerate's ``save_state(output_dir)`` is about to write."""
    config = acc.project_configuration
    if config.automatic_checkpoint_naming:
        return os.path.join(checkpoints_folder(acc), f"checkpoint_{config.iteration}")
    return None if output_dir is None else os.path.expanduser(str(output_dir))


def before_save(acc: Accelerator, switcher: PhaseSwitcher, output_dir: Optional[str]) -> Optional[int]:
    """Steps 1 and 2 of the module docstring, on every rank; returns the ``total_limit`` to set aside (or ``None``)."""
    if switcher.drift.at_save:
        switcher.check_weights(
            f"before save_state at step {switcher.driver.step}", "save_state refused: nothing was written"
        )
    target = save_target(acc, output_dir)
    if target is not None and writes_state_files(acc):
        remove_file(os.path.join(target, COMPLETE_MARKER))
    acc.wait_for_everyone()  # no rank writes into the folder while its old marker stands
    config = acc.project_configuration
    return config.total_limit if config.automatic_checkpoint_naming else None


def after_save(acc: Accelerator, location: str, limit: Optional[int]) -> None:
    """Once ``location`` is complete: delete what ``total_limit`` lets go (each process that writes markers)."""
    if limit is None or not writes_state_files(acc):
        return
    checkpoints_dir = os.path.dirname(os.path.abspath(location))
    numbered = numbered_folders(checkpoints_dir, "checkpoint_")
    complete = {n for n, folder in numbered if os.path.isfile(os.path.join(folder, COMPLETE_MARKER))}
    newest = int(os.path.basename(os.path.abspath(location)).rpartition("_")[2])
    prune(numbered, complete, newest, max(int(limit), 1))


class Checkpoints:
    """``save_state`` / ``load_state`` of a :class:`PhasedAccelerator` with the schedule position.

    The accelerator delegates its checkpoint methods and hooks to this object,
    which calls Accelerate's own ``save_state`` / ``load_state`` on it.

    Args:
        acc: the accelerator.
        run: its :class:`~.accelerate_run.PhasedRun` (switcher, driver, optimizers that drive).
    """

    def __init__(self, acc: Accelerator, run: PhasedRun) -> None:
        self.acc, self.run = acc, run
        self.fsdp2_saved_groups: dict[int, list[str]] = {}

    def save(self, output_dir: Optional[str], safe_serialization: bool, **kwargs: Any) -> Any:
        """``Accelerator.save_state`` plus ``hf_altparams_state.json``; a completion marker goes last.

        First the drift check (every rank must hold the same weights, else a
        :class:`~hf_altparams.errors.DriftError` and nothing is written; see
        ``drift_check``) and the removal of an old marker from the folder, on
        every rank before a barrier. The marker is written once every rank has
        written its part (a barrier before and after it): a save killed part-way
        leaves a folder without it, which ``load_state`` refuses and automatic
        resume skips. With automatic naming, ``ProjectConfiguration(total_limit=N)``
        keeps the N newest *complete* checkpoints, deleting older ones only after
        the new one is complete (the module docstring).
        """
        acc, switcher = self.acc, self.run.switcher
        limit = before_save(acc, switcher, output_dir) if switcher is not None else None
        with without_total_limit(acc, limit), self._fsdp2_optimizer_view(None) as saved:
            self.fsdp2_saved_groups = saved
            location = Accelerator.save_state(acc, output_dir, safe_serialization=safe_serialization, **kwargs)
        acc.wait_for_everyone()
        if switcher is not None and writes_state_files(acc):
            mark_complete(location)
        acc.wait_for_everyone()
        if switcher is not None:
            after_save(acc, location, limit)
        return location

    def latest(self) -> Optional[str]:
        """The checkpoint ``load_state()`` would resume from, or ``None`` (a collective; see the accelerator's)."""
        acc = self.acc
        if not acc.project_configuration.automatic_checkpoint_naming:
            raise AltParamsError(
                "`latest_checkpoint()` needs automatic checkpoint naming: pass "
                "`project_config=ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)`"
            )
        checkpoints_dir = checkpoints_folder(acc)
        common = _common(_gathered(complete_iterations(checkpoints_dir)))
        return os.path.join(checkpoints_dir, f"checkpoint_{max(common)}") if common else None

    def save_hook(self, models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        """Accelerate's save pre-hook: the state file (schedule position, switcher state, group membership)."""
        switcher, driver = self.run.switcher, self.run.driver
        if switcher is None or driver is None or not writes_state_files(self.acc):
            return
        extra = {}
        if self.fsdp2_saved_groups:  # FSDP2: which groups' optimizer state DCP holds
            extra["fsdp2_optimizer_groups"] = {str(i): g for i, g in self.fsdp2_saved_groups.items()}
        write_state(output_dir, switcher=switcher.state_dict(), groups=membership(switcher.groups), **extra)

    def load(self, input_dir: Optional[str], load_kwargs: Optional[dict[str, Any]] = None, **kwargs: Any) -> None:
        """``Accelerator.load_state``; the saved phase is applied before the optimizer state loads.

        A folder whose save did not complete, a missing or truncated file, or
        other groups are refused before anything loads; with automatic naming and
        no ``input_dir``, the latest ``checkpoint_<n>`` complete on every rank is
        loaded and the next ``save_state()`` writes after the highest existing
        folder on any rank. The ranks agree on the folder first (each reads its
        own disk), so either all load the same checkpoint or all raise the same error.
        """
        acc, switcher = self.acc, self.run.switcher
        automatic = input_dir is None and acc.project_configuration.automatic_checkpoint_naming
        if switcher is not None:
            input_dir = agreed_checkpoint(input_dir, checkpoints_folder(acc) if automatic else None)
            if input_dir is not None:
                check_saved_groups(input_dir, switcher.groups)  # before anything loads
        saved = None
        if switcher is not None and input_dir is not None and acc.is_fsdp2:
            # Accelerate loads FSDP optimizers before the pre-hooks run: apply the saved phase first.
            self.load_hook([], input_dir)
            saved = {int(i): g for i, g in read_state(input_dir).get("fsdp2_optimizer_groups", {}).items()}
        elif switcher is not None and input_dir is not None and switcher.strategy.capabilities.owns_optimizer_state:
            # DeepSpeed's engine loads its module and partitions before the pre-hooks run, and reads the frozen
            # parameters of the checkpoint by today's `requires_grad`: the saved phase first.
            self.load_hook([], input_dir)
        with self._fsdp2_optimizer_view(saved):
            Accelerator.load_state(acc, input_dir, load_kwargs, **kwargs)
        if automatic:
            # Accelerate restarts its numbering at 0, so the next save_state() would refuse the
            # existing checkpoint_0: continue after the highest folder, interrupted ones included.
            # The highest folder on ANY rank: with a disk per node, every node numbers the next save alike.
            numbered = _numbered(checkpoints_folder(acc))
            acc.project_configuration.iteration = max(_gathered(max((n for n, _ in numbered), default=-1))) + 1
        if switcher is not None:
            switcher.reapply_placement()  # load_state put optimizer state on the device

    def load_hook(self, models: list[nn.Module], input_dir: str) -> None:
        """Accelerate's load pre-hook: the saved position and phase, applied before the optimizer state loads."""
        switcher, driver = self.run.switcher, self.run.driver
        if switcher is None or driver is None:
            return
        state = read_state(input_dir)
        switcher.load_state_dict(state["switcher"])  # the schedule checked; the position and trained groups taken
        if "driver" not in state["switcher"]:  # written before the switcher's state held the position
            driver.restore(DriverState(int(state["schedule_step"]), int(state["schedule_epoch"])))
        switcher.drop_applied_gradients()  # loading replaces the run: in-flight gradients are void
        record = driver.move_to(
            driver.step, driver.epoch
        )  # before the optimizer state loads: idle groups keep their policy
        if record is not None:
            self.run.after_switch(record)

    def _fsdp2_optimizer_view(self, saved: Optional[dict[int, list[str]]]) -> Any:
        """With FSDP2, GroupedOptimizers reach DCP as their inner optimizers (``_fsdp2_prepare``)."""
        if self.run.switcher is None or not self.acc.is_fsdp2:
            return contextlib.nullcontext({})
        return grouped_checkpoint_view(prepared_optimizers(self.acc), saved)
