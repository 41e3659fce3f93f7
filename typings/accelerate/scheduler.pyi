from typing import Any

from torch.optim import Optimizer

from .state import GradientState

class AcceleratedScheduler:
    scheduler: Any  # an LR scheduler: torch's, or any object with step() / state_dict()
    optimizers: list[Optimizer]
    split_batches: bool
    step_with_optimizer: bool
    gradient_state: GradientState
    def __init__(
        self,
        scheduler: Any,
        optimizers: Optimizer | list[Optimizer] | tuple[Optimizer, ...],
        step_with_optimizer: bool = True,
        split_batches: bool = False,
    ) -> None: ...
    def step(self, *args: Any, **kwargs: Any) -> None: ...
    def get_last_lr(self) -> list[float]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
