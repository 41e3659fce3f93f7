from typing import Any

from torch.optim import Optimizer

from .modeling_utils import PreTrainedModel
from .training_args import TrainingArguments

class Trainer:
    # `Trainer(optimizers=(optimizer, scheduler))`: None unless given, until train() builds it
    optimizer: Optimizer | None
    optimizer_cls_and_kwargs: tuple[type[Optimizer], dict[str, Any]] | None
    @staticmethod
    def get_optimizer_cls_and_kwargs(
        args: TrainingArguments, model: PreTrainedModel | None = None
    ) -> tuple[Any, Any]: ...
