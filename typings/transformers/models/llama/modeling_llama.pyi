from ...modeling_utils import PreTrainedModel
from .configuration_llama import LlamaConfig

class LlamaForCausalLM(PreTrainedModel):
    def __init__(self, config: LlamaConfig) -> None: ...
