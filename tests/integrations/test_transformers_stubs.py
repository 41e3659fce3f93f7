"""The transformers stub (``typings/transformers``) says only what the installed transformers has.

mypy reads the stub instead of transformers (``setup.cfg``: ``follow_imports =
error`` for transformers, so that its 2,500 modules are not analysed): a name,
attribute, method or parameter written there that transformers lacks (or lost
in a release) would let a wrong call pass the type check and fail in a user's
run. Each stub module is compared with the module it stands for
(:mod:`tests.support.stub_drift` says what is compared). Every attribute the
stub names is a dataclass field or assigned to ``self`` in transformers'
source, so no live object is needed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.stub_drift import edited_stubs, stub_problems

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "typings"


def test_every_name_in_the_stub_exists_in_the_installed_transformers() -> None:
    assert stub_problems(STUBS, "transformers", {}, "transformers") == []


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            ("trainer_callback.pyi", "    global_step: int\n", "    global_steps: int\n"),
            "transformers.trainer_callback.TrainerState.global_steps: no such attribute",
        ),
        (
            (
                "trainer_callback.pyi",
                "    def on_step_end(\n        self, args: TrainingArguments,",
                "    def on_step_end(\n        self, model: Any, args: TrainingArguments,",
            ),
            "TrainerCallback.on_step_end: parameter 'model' is not one of",
        ),
        (
            ("trainer_callback.pyi", "class CallbackHandler(TrainerCallback)", "class CallbackHandler(TrainerState)"),
            "CallbackHandler: base TrainerState is not among",
        ),
        (
            ("trainer.pyi", "    @staticmethod\n", ""),
            "Trainer.get_optimizer_cls_and_kwargs: a method in the stub, a staticmethod in transformers",
        ),
        (
            ("trainer.pyi", "    optimizer: Optimizer | None\n", "    optimizers: Optimizer | None\n"),
            "Trainer.optimizers: no such attribute",
        ),
        (
            ("models/auto/configuration_auto.pyi", "    @classmethod\n", ""),
            "AutoConfig.from_pretrained: a method in the stub, a classmethod in transformers",
        ),
        (
            ("models/llama/configuration_llama.pyi", "        *,\n", ""),
            "LlamaConfig.__init__: positional parameters",
        ),
        (
            ("models/llama/modeling_llama.pyi", "def __init__(self, config: LlamaConfig)", "def __init__(self)"),
            "LlamaForCausalLM.__init__: transformers requires parameter 'config', the stub lacks it",
        ),
        (
            ("models/auto/modeling_auto.pyi", "MODEL_FOR_MASKED_LM_MAPPING_NAMES:", "MODEL_FOR_MASKED_MAPPING_NAMES:"),
            "modeling_auto.MODEL_FOR_MASKED_MAPPING_NAMES: no such module attribute",
        ),
        (
            (
                "__init__.pyi",
                "from .trainer_callback import TrainerState as TrainerState",
                "from .trainer_callback import TrainerControl as TrainerState",
            ),
            "transformers.TrainerState: not transformers.trainer_callback.TrainerControl",
        ),
    ],
)
def test_the_drift_check_catches_a_stub_that_says_more_than_transformers(
    tmp_path: Path, edit: tuple[str, str, str], expected: str
) -> None:
    copy = edited_stubs(STUBS, "transformers", edit, tmp_path / "typings")
    problems = stub_problems(copy, "transformers", {}, "transformers")
    assert any(expected in p for p in problems), problems
