from typing import Any, ClassVar

import torch

from .utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin, TorchDynamoPlugin

class PartialState:
    # one dict shared by every instance (Accelerate's singleton); private, read in the fence module only
    _shared_state: ClassVar[dict[str, Any]]
    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    def __init__(self, cpu: bool = False, **kwargs: Any) -> None: ...
    @property
    def initialized(self) -> bool: ...
    @property
    def use_distributed(self) -> bool: ...
    @property
    def is_main_process(self) -> bool: ...
    @property
    def is_local_main_process(self) -> bool: ...
    def wait_for_everyone(self) -> None: ...
    @staticmethod
    def _reset_state() -> None: ...

class AcceleratorState:
    _shared_state: ClassVar[dict[str, Any]]
    distributed_type: DistributedType
    num_processes: int
    process_index: int
    local_process_index: int
    device: torch.device
    fsdp_plugin: FullyShardedDataParallelPlugin | None
    dynamo_plugin: TorchDynamoPlugin
    def __init__(
        self,
        mixed_precision: str | None = None,
        cpu: bool = False,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        deepspeed_plugin: DeepSpeedPlugin | dict[str, DeepSpeedPlugin] | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        torch_tp_plugin: Any | None = None,
        megatron_lm_plugin: Any | None = None,
        parallelism_config: Any | None = None,
        _from_accelerator: bool = False,
        **kwargs: Any,
    ) -> None: ...
    @property
    def initialized(self) -> bool: ...
    @property
    def mixed_precision(self) -> str: ...
    @property
    def use_distributed(self) -> bool: ...
    @property
    def is_fsdp2(self) -> bool: ...
    @property
    def is_main_process(self) -> bool: ...
    @property
    def is_local_main_process(self) -> bool: ...
    @property
    def deepspeed_plugin(self) -> DeepSpeedPlugin | None: ...
    @staticmethod
    def _reset_state(reset_partial_state: bool = False) -> None: ...

class GradientState:
    _shared_state: ClassVar[dict[str, Any]]
    sync_gradients: bool
    plugin_kwargs: dict[str, Any]
    def __init__(self, gradient_accumulation_plugin: Any | None = None) -> None: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def end_of_dataloader(self) -> bool: ...
