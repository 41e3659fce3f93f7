"""Optimizers of a phased run: one per parameter group, and low-precision storage with fp32 masters.

* :class:`GroupedOptimizer`: one inner optimizer per group behind one
  ``torch.optim.Optimizer``; idle groups' state follows a :data:`StatePolicy`
  (``keep``, ``offload`` or ``drop``).
* :class:`PrecisionOptimizer`: a GroupedOptimizer over bf16/fp16 parameters with
  fp32 master weights (and state) only for the groups that train.
* :class:`GroupedLRScheduler` and :func:`reapply_state_policy` act on a built one.
"""

from ._grouped import GroupedOptimizer, OptimizerFactory, StatePolicy
from ._loss_scale import DynamicLossScale
from ._precision import MasterPolicy, PrecisionOptimizer
from ._scheduler import GroupedLRScheduler, SchedulerFactory, reapply_state_policy

__all__ = [
    "DynamicLossScale",
    "GroupedLRScheduler",
    "GroupedOptimizer",
    "MasterPolicy",
    "OptimizerFactory",
    "PrecisionOptimizer",
    "SchedulerFactory",
    "StatePolicy",
    "reapply_state_policy",
]
