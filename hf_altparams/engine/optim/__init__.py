"""Optimizers of a phased run: one per parameter group, and low-precision storage with fp32 masters.

* :class:`GroupedOptimizer`: one inner optimizer per group behind one
  ``torch.optim.Optimizer``; idle groups' state follows a :class:`StatePolicy`
  (``keep``, ``offload`` or ``drop``; users pass the strings), the one typed
  value the planner and the memory report read too.
* :class:`PrecisionOptimizer`: a GroupedOptimizer over a model stored in
  bf16/fp16 (:func:`store_model`) with fp32 master weights (and state) only for
  the groups that train; idle masters follow a :class:`StatePolicy` as well
  (``MasterPolicy`` is the same type).
* :class:`GroupedLRScheduler` and :func:`reapply_state_policy` act on a built one.
"""

from ..memory.model import StatePolicyLike
from ._grouped import GroupedOptimizer, OptimizerFactory, StatePolicy
from ._loss_scale import DynamicLossScale
from ._precision import MasterPolicy, PrecisionOptimizer
from ._scheduler import GroupedLRScheduler, SchedulerFactory, reapply_state_policy
from ._storage import store_model

__all__ = [
    "DynamicLossScale",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "MasterPolicy",
    "OptimizerFactory",
    "PrecisionOptimizer",
    "SchedulerFactory",
    "StatePolicy",
    "StatePolicyLike",
    "reapply_state_policy",
    "store_model",
]
