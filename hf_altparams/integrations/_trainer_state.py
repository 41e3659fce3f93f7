"""The callback's record in Trainer checkpoints, and the check a resumed run makes against it.

The record lives in ``TrainerState.stateful_callbacks`` (saved in every
checkpoint's ``trainer_state.json``): the schedule's state, the groups' sizes,
the phase, the group membership (group -> parameter names), and the step and
epoch it was written at.
"""

from __future__ import annotations

from typing import Iterable, Optional

from transformers import TrainerState

from ..errors import PlanError
from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from ..plan.schedules import Schedule
from ._membership import membership, membership_difference

__all__ = ["STATE_KEY", "check_callback_state", "save_callback_state", "trained_groups"]

#: Key of the callback's record in ``TrainerState.stateful_callbacks``. Deliberately
#: not the class name: the Trainer's ``restore_callback_states_from_checkpoint``
#: would try to rebuild the callback from JSON arguments, which a schedule cannot be.
STATE_KEY = "hf_altparams.AlternatingFreeze"

_HOW = "pass `check_resume=False` to AlternatingFreeze to continue with the new set-up anyway"


def save_callback_state(state: TrainerState, schedule: Schedule, groups: ParamGroups,
                        current: Optional[Phase], epoch: int, trained: Iterable[str] = ()) -> None:
    """Write the record for the phase ``current`` at ``state.global_step`` into ``state``.

    ``trained``: the groups that have trained at least one step before ``current``.

    Example:
        >>> import torch
        >>> from hf_altparams.plan import ParamGroups, Alternating, Phase
        >>> groups = ParamGroups(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"a": "0.*"})
        >>> state = TrainerState()
        >>> save_callback_state(state, Alternating(["a"]), groups, Phase({"a"}), epoch=0)
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
        "step": state.global_step,
        "epoch": epoch,
        "complete_marker": True,  # checkpoints of this record end with hf_altparams_complete.json
        "trained": sorted(trained),
    }


def trained_groups(state: TrainerState) -> set[str]:
    """The groups that trained at least one step before the checkpoint ``state`` was loaded from.

    The record is written at switches: the phase it names has trained too when
    ``global_step`` went past the record's step.

    Example:
        >>> state = TrainerState(global_step=5)
        >>> state.stateful_callbacks = {STATE_KEY: {"phase": ["b"], "step": 4, "trained": ["a"]}}
        >>> sorted(trained_groups(state))
        ['a', 'b']
    """
    saved = state.stateful_callbacks.get(STATE_KEY) if isinstance(state.stateful_callbacks, dict) else None
    if not saved:
        return set()
    trained = set(saved.get("trained", ()))
    if saved.get("phase") is not None and state.global_step > int(saved.get("step", 0)):
        trained |= set(saved["phase"])
    return trained


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
