# Type stubs for the part of transformers (5.24) that hf_altparams uses. transformers ships its own types, but
# type-checking the package against them makes mypy analyse transformers itself (some 2,500 modules, about half
# of the check's time); this stub stands in for it (setup.cfg: `mypy_path`, and `follow_imports = error` for
# transformers, so no transformers module outside this folder is ever read). Only the names and members the
# package uses are here, with the types transformers' own annotations give them (an unannotated parameter or
# return: `Any`, as mypy reads it there). Not shipped: the wheel holds hf_altparams only.
# tests/integrations/test_transformers_stubs.py checks that every name here exists in the installed
# transformers, with the parameter names written here. A new use of a transformers name: add it here (mypy
# names what is missing).

from .models.auto.configuration_auto import AutoConfig as AutoConfig
from .models.llama.configuration_llama import LlamaConfig as LlamaConfig
from .models.llama.modeling_llama import LlamaForCausalLM as LlamaForCausalLM
from .trainer import Trainer as Trainer
from .trainer_callback import TrainerCallback as TrainerCallback
from .trainer_callback import TrainerControl as TrainerControl
from .trainer_callback import TrainerState as TrainerState
from .training_args import TrainingArguments as TrainingArguments

__version__: str
