import enum
from typing import Any

from ...utils import DistributedType

# `accelerate launch`'s default config file: $HF_HOME/accelerate/default_config.yaml, or under
# $XDG_CACHE_HOME/huggingface, or ~/.cache/huggingface (computed when the module is imported)
default_config_file: str

class ComputeEnvironment(str, enum.Enum):
    LOCAL_MACHINE = "LOCAL_MACHINE"
    AMAZON_SAGEMAKER = "AMAZON_SAGEMAKER"

# What the file holds, as read: the YAML's values are not converted (a `distributed_type: NO` left
# unquoted reads as False), hence the loose types.
class BaseConfig:
    compute_environment: ComputeEnvironment | str
    distributed_type: DistributedType | str
    mixed_precision: str
    use_cpu: bool
    debug: bool

class ClusterConfig(BaseConfig):
    num_processes: int
    machine_rank: int
    num_machines: int
    mpirun_config: dict[str, Any] | None

class SageMakerConfig(BaseConfig):
    num_machines: int

def load_config_from_file(config_file: str | None) -> ClusterConfig | SageMakerConfig: ...
