import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from torch import nn

# ----------------------------------------------------------------- enums (accelerate.utils.dataclasses)
class DistributedType(str, enum.Enum):
    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"

class DDPCommunicationHookType(enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"

class DynamoBackend(str, enum.Enum):
    NO = "NO"
    EAGER = "EAGER"
    AOT_EAGER = "AOT_EAGER"
    INDUCTOR = "INDUCTOR"
    AOT_TS_NVFUSER = "AOT_TS_NVFUSER"
    NVPRIMS_NVFUSER = "NVPRIMS_NVFUSER"
    CUDAGRAPHS = "CUDAGRAPHS"
    OFI = "OFI"
    FX2TRT = "FX2TRT"
    ONNXRT = "ONNXRT"
    TENSORRT = "TENSORRT"
    AOT_TORCHXLA_TRACE_ONCE = "AOT_TORCHXLA_TRACE_ONCE"
    TORCHXLA_TRACE_ONCE = "TORCHXLA_TRACE_ONCE"
    TVM = "TVM"
    HPU_BACKEND = "HPU_BACKEND"
    NEURON = "NEURON"

# ----------------------------------------------------------------- kwargs handlers
class KwargsHandler:
    def to_dict(self) -> dict[str, Any]: ...
    def to_kwargs(self) -> dict[str, Any]: ...

@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType = ...
    comm_wrapper: Literal[
        DDPCommunicationHookType.NO, DDPCommunicationHookType.FP16, DDPCommunicationHookType.BF16
    ] = ...
    comm_state_option: dict[str, Any] = ...

@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    backend: str | None = "nccl"
    init_method: str | None = None
    timeout: timedelta | None = None

# ----------------------------------------------------------------- configurations and plugins
@dataclass
class ProjectConfiguration:
    # Accelerate annotates project_dir, logging_dir and total_limit as str / int, with None as their default
    project_dir: str | None = None
    logging_dir: str | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False
    def set_directories(self, project_dir: str | None = None) -> None: ...

# The plugins' fields default to None and are filled in from the environment (`accelerate launch`'s
# variables) after construction: the constructors take None, the attributes hold the filled-in values.
class FullyShardedDataParallelPlugin:
    fsdp_version: int
    sharding_strategy: Any  # torch.distributed.fsdp.ShardingStrategy (FSDP1)
    reshard_after_forward: Any  # bool (FSDP2), a ShardingStrategy (FSDP1)
    mixed_precision_policy: Any  # torch's MixedPrecision (FSDP1) or MixedPrecisionPolicy (FSDP2), or None
    auto_wrap_policy: Any
    cpu_offload: Any
    state_dict_type: Any
    activation_checkpointing: bool
    cpu_ram_efficient_loading: bool
    def __init__(
        self,
        fsdp_version: int | None = None,
        sharding_strategy: Any = None,
        reshard_after_forward: Any = None,
        backward_prefetch: Any = None,
        mixed_precision_policy: Any = None,
        auto_wrap_policy: Callable[..., Any] | str | None = None,
        cpu_offload: Any = None,
        ignored_modules: Iterable[nn.Module] | str | None = None,
        state_dict_type: Any = None,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
        limit_all_gathers: bool = True,
        use_orig_params: bool | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        sync_module_states: bool | None = None,
        forward_prefetch: bool | None = None,
        activation_checkpointing: bool | None = None,
        activation_checkpointing_offload: bool | None = None,
        cpu_ram_efficient_loading: bool | None = None,
        transformer_cls_names_to_wrap: list[str] | None = None,
        min_num_params: int | None = None,
    ) -> None: ...
    def set_mixed_precision(
        self, mixed_precision: Any, buffer_autocast: bool = False, override: bool = False
    ) -> None: ...

class DeepSpeedPlugin:
    hf_ds_config: Any  # accelerate's HfDeepSpeedConfig
    deepspeed_config: dict[str, Any]
    gradient_accumulation_steps: int
    gradient_clipping: float | None
    zero_stage: int
    offload_optimizer_device: str
    offload_param_device: str
    zero3_init_flag: bool
    def __init__(
        self,
        hf_ds_config: Any = None,
        gradient_accumulation_steps: int | None = None,
        gradient_clipping: float | None = None,
        zero_stage: int | None = None,
        is_train_batch_min: bool = True,
        offload_optimizer_device: str | None = None,
        offload_param_device: str | None = None,
        offload_optimizer_nvme_path: str | None = None,
        offload_param_nvme_path: str | None = None,
        zero3_init_flag: bool | None = None,
        zero3_save_16bit_model: bool | None = None,
        transformer_moe_cls_names: str | None = None,
        enable_msamp: bool | None = None,
        msamp_opt_level: Literal["O1", "O2"] | None = None,
    ) -> None: ...

class TorchDynamoPlugin(KwargsHandler):
    backend: DynamoBackend
    mode: str
    fullgraph: bool
    dynamic: bool | None
    options: Any
    disable: bool
    use_regional_compilation: bool
    def __init__(
        self,
        backend: DynamoBackend | str | None = None,
        mode: str | None = None,
        fullgraph: bool | None = None,
        dynamic: bool | None = None,
        options: Any = None,
        disable: bool = False,
        use_regional_compilation: bool | None = None,
    ) -> None: ...

# ----------------------------------------------------------------- functions (accelerate.utils.other)
def extract_model_from_parallel(
    model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True, recursive: bool = False
) -> nn.Module: ...
def is_compiled_module(module: nn.Module) -> bool: ...
def has_compiled_regions(module: nn.Module) -> bool: ...
def compile_regions(module: nn.Module, **compile_kwargs: Any) -> nn.Module: ...
