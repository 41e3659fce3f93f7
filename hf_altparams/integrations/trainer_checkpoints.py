"""The Trainer's saves and resumes under :class:`~hf_altparams.integrations.trainer.AlternatingFreeze`.

**The callback's record.** It lives in ``TrainerState.stateful_callbacks``
(saved in every checkpoint's ``trainer_state.json``): the schedule's state, the
groups' sizes and membership (group -> parameter names), the phase, the
driver's position and the groups trained so far
(:class:`~hf_altparams.engine.driver.DriverState`), written by
:func:`save_callback_state` at every switch and before every save. A resumed
run checks it (:func:`check_callback_state`: another schedule, other groups or
another phase are refused) and restores the trained groups from it
(:func:`saved_driver_state`).

**Complete and torn checkpoints.**
The Trainer's ``_save_checkpoint`` writes, in this order (transformers 5.17 to
5.23): the model, the optimizer and scheduler, each rank's RNG state, then
``trainer_state.json`` (which holds the callback's record); ``on_save`` runs
after all of that. A process killed in between leaves a ``checkpoint-N``
folder with part of those files, and ``resume_from_checkpoint=True`` takes the
highest-numbered folder, torn or not.

So, at ``on_save``, once every rank has written its part (a barrier), the
process that wrote ``trainer_state.json`` writes :data:`COMPLETE_MARKER`
atomically, last: the step, epoch and phase the checkpoint holds, and every
file of the folder with its size. Before the Trainer writes a folder
(:func:`prepare_save`, at the ``on_step_end`` / ``on_epoch_end`` that decided
the save), the ranks' weights are compared (the drift check) and a marker an
earlier run left there is removed, then a barrier. A resume
from a folder without it (whose record says a marker is due) is refused at
``train()`` with the latest complete checkpoint named; a marker for another
step (a folder reused by a new run) is refused too. :func:`last_complete_checkpoint`
skips interrupted saves, for jobs that restart by themselves.

Where the Trainer itself cannot read a torn folder (no or half a
``trainer_state.json``: transformers 5.x fails in ``train()``, before any
callback runs, with ``FileNotFoundError`` / ``JSONDecodeError``), the way out
is the same: ``resume_from_checkpoint=last_complete_checkpoint(output_dir)``.
"""

from __future__ import annotations

import json
import os
import warnings
from types import FrameType
from typing import Any, Optional

import torch.distributed as dist
from transformers import TrainerState, TrainingArguments

from ..engine.collective import is_distributed
from ..engine.driver import DriverState
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError, PlanError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from .checkpoint_files import (
    COMPLETE_MARKER,
    manifest,
    manifest_problem,
    membership,
    membership_difference,
    numbered_folders,
    remove_file,
    write_atomically,
)
from .transformers_internals import resumed_checkpoint_from_stack

__all__ = [
    "COMPLETE_MARKER",
    "STATE_KEY",
    "check_callback_state",
    "check_resumed",
    "drop_stale_marker",
    "last_complete_checkpoint",
    "mark_complete",
    "prepare_save",
    "resumed_checkpoint",
    "save_callback_state",
    "saved_driver_state",
]

_FORMAT = "hf_altparams.AlternatingFreeze/1"

#: Key of the callback's record in ``TrainerState.stateful_callbacks``. Deliberately
#: not the class name: the Trainer's ``restore_callback_states_from_checkpoint``
#: would try to rebuild the callback from JSON arguments, which a schedule cannot be.
STATE_KEY = "hf_altparams.AlternatingFreeze"

_HOW = "pass `check_resume=False` to AlternatingFreeze to continue with the new set-up anyway"


def _checkpoint_dir(args: TrainingArguments, state: TrainerState) -> str:
    return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")


def mark_complete(args: TrainingArguments, state: TrainerState, record: dict[str, Any]) -> None:
    """Write the marker into the checkpoint the Trainer just saved (the process that wrote its state)."""
    folder = _checkpoint_dir(args, state)
    if args.should_save and os.path.isdir(folder):
        write_atomically(
            os.path.join(folder, COMPLETE_MARKER),
            {"format": _FORMAT, "step": state.global_step, **record, "files": manifest(folder, skip=[COMPLETE_MARKER])},
        )


def prepare_save(args: TrainingArguments, state: TrainerState, switcher: PhaseSwitcher) -> None:
    """Before the Trainer writes ``checkpoint-<global_step>`` (every rank): drift check, stale marker, barrier.

    The drift check runs unless the switcher's ``drift_check`` is ``False``: a
    :class:`~hf_altparams.errors.DriftError` on every rank, before the Trainer
    writes anything.
    """
    if switcher.drift.at_save:
        switcher.check_weights(
            f"before the Trainer's save at step {state.global_step}", "The Trainer's checkpoint was not written"
        )
    drop_stale_marker(args, state)
    if is_distributed(None):
        dist.barrier()  # no rank writes into the folder (its RNG state, its shard) while an old marker stands


def drop_stale_marker(args: TrainingArguments, state: TrainerState) -> None:
    """Remove the marker a previous run left in the folder the Trainer is about to overwrite."""
    if args.should_save:
        remove_file(os.path.join(_checkpoint_dir(args, state), COMPLETE_MARKER))


def last_complete_checkpoint(output_dir: str) -> Optional[str]:
    """The highest ``checkpoint-N`` in ``output_dir`` whose save ran to its end, or ``None``.

    Pass it to ``trainer.train(resume_from_checkpoint=...)`` instead of ``True``
    (which takes the highest folder, even one whose save was interrupted):
    ``None`` starts from scratch.

    Example:
        >>> import tempfile
        >>> last_complete_checkpoint(tempfile.mkdtemp()) is None  # nothing saved yet
        True
        >>> # trainer.train(resume_from_checkpoint=last_complete_checkpoint(args.output_dir))
    """
    found = [
        (n, path)
        for n, path in numbered_folders(output_dir, "checkpoint-")
        if _marker_step(os.path.join(path, COMPLETE_MARKER)) == n
    ]  # no marker (or another's): None
    return max(found)[1] if found else None


def _marker_step(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return None
    step = marker.get("step") if isinstance(marker, dict) and marker.get("format") == _FORMAT else None
    return int(step) if isinstance(step, int) else None


def _marker_files(path: str) -> dict[str, int]:
    """The file list a marker records (``{}`` for markers written before it was kept)."""
    with open(path) as f:
        files = json.load(f).get("files", {})
    return files if isinstance(files, dict) else {}


def resumed_checkpoint(frame: Optional[FrameType], args: TrainingArguments, state: TrainerState) -> Optional[str]:
    """The folder ``Trainer.train`` resumes from (or ``None`` for a fresh run).

    Callbacks are not given it: it is read from the Trainer's training loop on
    the stack above ``frame`` (the callback event's;
    :func:`~.transformers_internals.resumed_checkpoint_from_stack`). If
    transformers ever renames that loop, a resumed run (``state.global_step > 0``)
    falls back to the Trainer's own folder for that step,
    ``<output_dir>/checkpoint-<step>``; if that does not exist either, a warning
    says the torn-checkpoint check is off.
    """
    found, path = resumed_checkpoint_from_stack(frame)
    if found:
        return path
    if state.global_step <= 0:
        return None  # a fresh run
    candidate = os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")
    if os.path.isdir(candidate):
        return candidate
    warnings.warn(
        f"hf_altparams: AlternatingFreeze cannot tell which checkpoint this run resumed from (step "
        f"{state.global_step}: no `_inner_training_loop` frame, no {candidate!r}), so it cannot check that the "
        "checkpoint's save completed; resume from `last_complete_checkpoint(output_dir)` to be sure",
        stacklevel=3,
    )
    return None


def check_resumed(path: str, state: TrainerState, record: Optional[dict[str, Any]]) -> None:
    """Refuse to resume from ``path`` when its save did not complete (``record``: the callback's saved record)."""
    marker = os.path.join(path, COMPLETE_MARKER)
    step = _marker_step(marker) if os.path.isfile(marker) else None
    if step == state.global_step:
        problem = manifest_problem(path, _marker_files(marker))
        if problem is not None:
            raise AltParamsError(
                f"AlternatingFreeze refuses to resume from {path!r}: {problem}, so the Trainer resumed from an "
                "incomplete folder (it skips a missing optimizer, scheduler or RNG file silently); resume from "
                "another checkpoint"
            )
        return
    if step is None and record is None and state.global_step > 0:
        return  # saved by a run without AlternatingFreeze: nothing of ours to check
    if step is None and record is not None and not record.get("complete_marker"):
        return  # saved before checkpoints had a marker: nothing to check against
    why = (
        f"its save was interrupted (no complete {COMPLETE_MARKER}: the process died while the Trainer "
        "wrote it), so it may hold another step's optimizer state, RNG states or phase"
        if step is None
        else f"its {COMPLETE_MARKER} is for step {step} but trainer_state.json for step {state.global_step} "
        "(a folder reused by another run, whose save was interrupted)"
    )
    parent = os.path.dirname(os.path.abspath(path))
    latest = last_complete_checkpoint(parent)
    way = (
        f"the latest complete checkpoint there is {latest!r}: pass `resume_from_checkpoint={latest!r}`, or "
        "`resume_from_checkpoint=last_complete_checkpoint(args.output_dir)` "
        "(hf_altparams.integrations.trainer), which skips interrupted saves"
        if latest is not None
        else f"no complete checkpoint is left in {parent!r}: train without `resume_from_checkpoint`"
    )
    raise AltParamsError(f"AlternatingFreeze refuses to resume from {path!r}: {why}; {way}")


def save_callback_state(
    state: TrainerState, schedule: Schedule, groups: ParamGroups, current: Optional[Phase], driver: DriverState
) -> None:
    """Write the record for the phase ``current`` and the driver's ``driver`` state into ``state``.

    Example:
        >>> import torch
        >>> from hf_altparams.plan import ParamGroups, Alternating, Phase
        >>> groups = ParamGroups(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"a": "0.*"})
        >>> state = TrainerState()
        >>> save_callback_state(state, Alternating(["a"]), groups, Phase({"a"}), DriverState(0, 0))
        >>> state.stateful_callbacks[STATE_KEY]["phase"]
        ['a']
    """
    if not isinstance(state.stateful_callbacks, dict):
        return
    state.stateful_callbacks[STATE_KEY] = {
        "schedule": schedule.state_dict(),
        "groups": {g: groups.numel(g) for g in groups.names},
        "members": membership(groups),  # group -> parameter names, compared at resume
        "phase": None if current is None else sorted(current.trainable),
        "step": driver.step,
        "epoch": driver.epoch,
        "complete_marker": True,  # checkpoints of this record end with hf_altparams_complete.json
        "trained": list(driver.trained_groups),
    }


def saved_driver_state(state: TrainerState, epoch: int) -> DriverState:
    """The driver state a run resumed from ``state`` continues: its step and epoch, and the groups trained so far.

    The record is written before every save, so it holds the groups trained up
    to the checkpoint's step (a record written at a switch, older than the
    checkpoint, adds the phase it names). A fresh run (no record) has trained none.

    Example:
        >>> state = TrainerState(global_step=5)
        >>> state.stateful_callbacks = {STATE_KEY: {"phase": ["b"], "step": 5, "trained": ["a", "b"]}}
        >>> saved_driver_state(state, epoch=0)
        DriverState(step=5, epoch=0, trained_groups=('a', 'b'))
    """
    saved = state.stateful_callbacks.get(STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
    if not saved:
        return DriverState(state.global_step, epoch)
    trained = set(saved.get("trained", ()))
    if saved.get("phase") is not None and state.global_step > int(saved.get("step", 0)):
        trained |= set(saved["phase"])  # a record written at a switch, before that phase trained
    return DriverState(state.global_step, epoch, tuple(sorted(trained)))


def check_callback_state(state: TrainerState, schedule: Schedule, groups: ParamGroups) -> None:
    """Refuse to resume from a record written with another schedule, other groups or another phase.

    Raises:
        PlanError: naming what differs, and ``check_resume=False`` as the way to continue anyway.
    """
    saved = state.stateful_callbacks.get(STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
    if not saved:
        return
    try:
        schedule.load_state_dict(saved["schedule"])
    except PlanError as err:
        raise PlanError(f"AlternatingFreeze: the checkpoint was saved with another schedule ({err}); {_HOW}") from err
    members = saved.get("members")
    difference = None if members is None else membership_difference(members, groups)  # None: an older record
    if difference is not None:
        raise PlanError(f"AlternatingFreeze: the checkpoint was saved with other groups ({difference}); {_HOW}")
    mine = {g: groups.numel(g) for g in groups.names}
    if saved.get("groups") != mine:
        raise PlanError(
            f"AlternatingFreeze: the checkpoint was saved with groups {saved.get('groups')} "
            f"(name: parameter count), these are {mine}; {_HOW}"
        )
    step, epoch = int(saved.get("step", 0)), int(saved.get("epoch", 0))
    expected = schedule.phase_at(step, epoch)
    if saved.get("phase") is not None and sorted(expected.trainable) != saved["phase"]:
        raise PlanError(
            f"AlternatingFreeze: at step {step} the checkpoint trained {saved['phase']}, this "
            f"schedule gives {sorted(expected.trainable)} (a function schedule that changed?); {_HOW}"
        )
