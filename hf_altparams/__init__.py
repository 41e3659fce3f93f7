"""hf_altparams: train alternating or changing parameter groups under DDP.

Only the parameters of the current phase are trained, all-reduced and kept
resident; switching phases rebuilds the DDP reducer in place, on every rank at
the same optimizer-step boundary.
"""

from __future__ import annotations

from ._compat import check_torch_at_import

check_torch_at_import()

__version__ = "0.1.0"

# ---------------------------------------------------------------------------
# Public API: everything users may import from `hf_altparams` is in `__all__`.
# The plan and engine load eagerly; the integrations (which import accelerate,
# transformers: seconds) and the planner load on first attribute access.
# ---------------------------------------------------------------------------
from importlib import import_module
from typing import Any

from .engine import (
    CommCounter,
    GroupedLRScheduler,
    GroupedOptimizer,
    MemoryReport,
    PhaseSwitcher,
    PrecisionOptimizer,
    SwitchHistory,
    SwitchRecord,
    memory_report,
    reapply_state_policy,
    register_comm_counter,
    shard_by_groups,
)
from .errors import AltParamsError, AltParamsWarning, Cause, DriftError, PlanError, SwitchError, UnreachedPhaseError
from .plan import (
    Alternating,
    Chain,
    FnSchedule,
    GradualUnfreeze,
    ParamGroups,
    PerTaskCycle,
    Phase,
    PhaseSequence,
    ProgressiveFreeze,
    RandomBlocks,
    Schedule,
    TrainShareWarning,
    badam,
    lisa,
)

_LAZY = {
    "PhasedAccelerator": ".integrations.accelerate",
    "AlternatingFreeze": ".integrations.trainer",
    "grouped_optimizer": ".integrations.trainer",
    "compile_regions_in_place": ".integrations.regions",
    "plan_cost": ".planner",
    "CostPlan": ".planner",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hf_altparams' has no attribute {name!r}")


__all__ = [
    "AltParamsError",
    "AltParamsWarning",
    "Alternating",
    "AlternatingFreeze",
    "Cause",
    "Chain",
    "CommCounter",
    "CostPlan",
    "DriftError",
    "FnSchedule",
    "GradualUnfreeze",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "MemoryReport",
    "ParamGroups",
    "PerTaskCycle",
    "Phase",
    "PhaseSequence",
    "PhaseSwitcher",
    "PhasedAccelerator",
    "PlanError",
    "PrecisionOptimizer",
    "ProgressiveFreeze",
    "RandomBlocks",
    "Schedule",
    "SwitchError",
    "SwitchHistory",
    "SwitchRecord",
    "TrainShareWarning",
    "UnreachedPhaseError",
    "__version__",
    "badam",
    "compile_regions_in_place",
    "grouped_optimizer",
    "lisa",
    "memory_report",
    "plan_cost",
    "reapply_state_policy",
    "register_comm_counter",
    "shard_by_groups",
]
