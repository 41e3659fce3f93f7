"""The plan layer: parameter groups and schedules; pure Python + torch.nn, no process group.

Modules: :mod:`~hf_altparams.plan.groups` (:class:`ParamGroups`),
:mod:`~hf_altparams.plan.phase` (:class:`Phase`), :mod:`~hf_altparams.plan.schedules`
(:class:`Schedule` and every kind), :mod:`~hf_altparams.plan.recipes` (:func:`lisa`,
:func:`badam`), :mod:`~hf_altparams.plan.share` (what share of the model a schedule
trains), :mod:`~hf_altparams.plan.checks` (the argument checks they share), and the
schedule registry the command lines read: :mod:`~hf_altparams.plan.registry` (kinds,
options, per-command defaults) and :mod:`~hf_altparams.plan.kinds` (the built-in kinds,
:data:`SCHEDULES`).

Example:
    >>> from torch import nn
    >>> from hf_altparams.plan import Alternating, ParamGroups
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    >>> groups = ParamGroups(model, {"a": "0.*", "b": "1.*"})
    >>> schedule = Alternating({"a": 3, "b": 1})
    >>> schedule.validate(groups)
    >>> schedule.phase_at(3).name
    'b'
"""

from __future__ import annotations

from .groups import ParamGroups
from .kinds import SCHEDULES
from .phase import Phase
from .recipes import badam, lisa
from .registry import ANY_KIND, CommandDefaults, Derived, Option, ScheduleArgs, ScheduleKind, ScheduleRegistry
from .schedules import (
    Alternating,
    Chain,
    FnSchedule,
    GradualUnfreeze,
    PerTaskCycle,
    PhaseSequence,
    ProgressiveFreeze,
    RandomBlocks,
    Schedule,
)
from .share import ALWAYS_SHARE_LIMIT, PhaseShare, TrainShare, TrainShareWarning

__all__ = [
    "ALWAYS_SHARE_LIMIT",
    "ANY_KIND",
    "Alternating",
    "Chain",
    "CommandDefaults",
    "Derived",
    "FnSchedule",
    "GradualUnfreeze",
    "Option",
    "ParamGroups",
    "PerTaskCycle",
    "Phase",
    "PhaseSequence",
    "PhaseShare",
    "ProgressiveFreeze",
    "RandomBlocks",
    "SCHEDULES",
    "Schedule",
    "ScheduleArgs",
    "ScheduleKind",
    "ScheduleRegistry",
    "TrainShare",
    "TrainShareWarning",
    "badam",
    "lisa",
]
