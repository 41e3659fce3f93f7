import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from .optimizer import AcceleratedOptimizer
from .scheduler import AcceleratedScheduler
from .state import AcceleratorState, GradientState
from .utils import (
    DeepSpeedPlugin,
    DistributedDataParallelKwargs,
    DistributedType,
    DynamoBackend,
    FullyShardedDataParallelPlugin,
    KwargsHandler,
    ProjectConfiguration,
    TorchDynamoPlugin,
)

class Accelerator:
    state: AcceleratorState
    gradient_state: GradientState
    project_configuration: ProjectConfiguration
    ddp_handler: DistributedDataParallelKwargs | None
    # torch.amp.GradScaler, or FSDP's ShardedGradScaler (a subclass), under fp16; else None
    scaler: torch.amp.GradScaler | None
    device_placement: bool
    step_scheduler_with_optimizer: bool
    step: int
    # what prepare() wrapped, in order (private: read only in hf_altparams.integrations.accelerate_internals)
    _optimizers: list[AcceleratedOptimizer]
    _schedulers: list[AcceleratedScheduler]
    _dataloaders: list[Any]
    _models: list[nn.Module]
    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool = ...,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any | None = None,
        deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        torch_tp_plugin: Any | None = None,
        megatron_lm_plugin: Any | None = None,
        rng_types: list[str] | None = None,
        log_with: Any | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: Any | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: DynamoBackend | str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugins: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
        parallelism_config: Any | None = None,
    ) -> None: ...
    @property
    def distributed_type(self) -> DistributedType: ...
    @property
    def num_processes(self) -> int: ...
    @property
    def process_index(self) -> int: ...
    @property
    def local_process_index(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def is_main_process(self) -> bool: ...
    @property
    def is_local_main_process(self) -> bool: ...
    @property
    def is_fsdp2(self) -> bool: ...
    @property
    def split_batches(self) -> bool: ...
    @property
    def mixed_precision(self) -> str: ...
    @property
    def project_dir(self) -> str | None: ...
    @property
    def sync_gradients(self) -> bool: ...
    @sync_gradients.setter
    def sync_gradients(self, sync_gradients: bool) -> None: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...
    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, gradient_accumulation_steps: int) -> None: ...
    @property
    def optimizer_step_was_skipped(self) -> bool: ...
    # device_placement: one entry per object (None: the accelerator's default)
    def prepare(self, *args: Any, device_placement: Sequence[bool | None] | None = None) -> Any: ...
    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> nn.Module: ...
    def prepare_optimizer(self, optimizer: Optimizer, device_placement: bool | None = None) -> AcceleratedOptimizer: ...
    def prepare_scheduler(self, scheduler: Any) -> AcceleratedScheduler: ...
    def accumulate(self, *models: nn.Module) -> AbstractContextManager[None]: ...
    def no_sync(self, model: nn.Module) -> AbstractContextManager[None]: ...
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None: ...
    def unscale_gradients(self, optimizer: Any = None) -> None: ...
    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor: ...
    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module: ...
    def wait_for_everyone(self) -> None: ...
    def log(
        self, values: dict[str, Any], step: int | None = None, log_kwargs: dict[str, Any] | None = None
    ) -> None: ...
    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs: Any
    ) -> str: ...
    def load_state(
        self, input_dir: str | None = None, load_kwargs: dict[str, Any] | None = None, **load_model_func_kwargs: Any
    ) -> None: ...
    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle: ...
    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> RemovableHandle: ...
    def end_training(self) -> None: ...
    def free_memory(self, *objects: Any) -> list[Any]: ...
