"""Optimizers of a phased run: one per parameter group, and low-precision storage with fp32 masters.

* :class:`GroupedOptimizer` (:mod:`.grouped`): one inner optimizer per group
  behind one ``torch.optim.Optimizer``; idle groups' state follows a
  :class:`StatePolicy` (``keep``, ``offload`` or ``drop``; users pass the
  strings), the one typed value the planner and the memory report read too.
* :class:`PrecisionOptimizer` (:mod:`.precision`): a GroupedOptimizer over a
  model stored in bf16/fp16 (:func:`store_model`) with fp32 master weights (and
  state) only for the groups that train; idle masters follow a
  :class:`StatePolicy` as well (``MasterPolicy`` is the same type).
* :class:`GroupedLRScheduler` (:mod:`.scheduler`): one LR schedule per group.
* :mod:`.idle`: where an idle group's optimizer state lives (:class:`IdleState`),
  for a GroupedOptimizer and for a plain torch optimizer following a run's
  phases (:class:`PlainOptimizerState`); the run's default comes from the
  schedule (``drop`` for lisa and badam).
* :mod:`.owner`: the one interface through which a run's switcher decides and
  applies where optimizer state lives (:class:`StateOwner`), and the library's
  owner for the optimizers it can see (:func:`library_state_owner`); a
  strategy whose wrapper keeps the state itself brings its own.

Both optimizers move state and masters through
:class:`~hf_altparams.engine.memory.TensorMover`; this package builds on
:mod:`hf_altparams.engine.memory`, never the other way round.
"""

from ..memory import StatePolicyLike
from .grouped import (
    GroupedOptimizer,
    OptimizerFactory,
    StatePolicy,
    check_groups_argument,
    frozen_ungrouped,
    grouped_in,
    match_to_groups,
    reapply_state_policy,
    uncovered,
    uncovered_message,
)
from .idle import IdleState, PlainOptimizerState
from .owner import StateOwner, library_state_owner
from .precision import DynamicLossScale, MasterPolicy, PrecisionOptimizer, store_model
from .scheduler import GroupedLRScheduler, SchedulerFactory

__all__ = [
    "DynamicLossScale",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "IdleState",
    "MasterPolicy",
    "OptimizerFactory",
    "PlainOptimizerState",
    "PrecisionOptimizer",
    "SchedulerFactory",
    "StatePolicy",
    "StateOwner",
    "StatePolicyLike",
    "check_groups_argument",
    "frozen_ungrouped",
    "grouped_in",
    "library_state_owner",
    "match_to_groups",
    "reapply_state_policy",
    "store_model",
    "uncovered",
    "uncovered_message",
]
