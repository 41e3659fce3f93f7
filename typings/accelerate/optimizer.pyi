from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from .state import AcceleratorState, GradientState

class AcceleratedOptimizer(Optimizer):
    optimizer: Optimizer
    scaler: torch.amp.GradScaler | None
    accelerator_state: AcceleratorState
    gradient_state: GradientState
    device_placement: bool
    def __init__(
        self, optimizer: Optimizer, device_placement: bool = True, scaler: torch.amp.GradScaler | None = None
    ) -> None: ...
    def zero_grad(self, set_to_none: bool | None = None) -> None: ...
    # Accelerate returns nothing, closure or not (torch's Optimizer.step returns the closure's loss)
    def step(self, closure: Callable[[], Any] | None = None) -> None: ...  # type: ignore[override]
    def train(self) -> None: ...
    def eval(self) -> None: ...
    @property
    def step_was_skipped(self) -> bool: ...
