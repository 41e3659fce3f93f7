"""The Accelerate stub (``typings/accelerate``) says only what the installed Accelerate has.

mypy believes the stub without looking at Accelerate: a name, attribute, method
or parameter written there that Accelerate lacks (or lost in a release) would
let a wrong call pass the type check and fail in a user's run. Each stub module
is compared with the module it stands for (:mod:`tests.support.stub_drift` says
what is compared); the live objects are an ``Accelerator(cpu=True)``, its state
and a prepared optimizer and scheduler, whose attributes are set at construction.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.stub_drift import edited_stubs, stub_problems

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "typings"


def _live_objects() -> dict[str, Any]:
    """Accelerate's objects whose attributes are set at construction (or copied from a shared state)."""
    from accelerate import Accelerator, PartialState
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    acc = Accelerator(cpu=True)
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    return {
        "Accelerator": acc,
        "AcceleratorState": acc.state,
        "PartialState": PartialState(),
        "GradientState": acc.gradient_state,
        "AcceleratedOptimizer": AcceleratedOptimizer(optimizer),
        "AcceleratedScheduler": AcceleratedScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 1), optimizer),
    }


# ------------------------------------------------------------------ the tests
def test_every_name_in_the_stub_exists_in_the_installed_accelerate(fresh_accelerate_state: None) -> None:
    assert stub_problems(STUBS, "accelerate", _live_objects(), "Accelerate") == []


@pytest.mark.parametrize(
    "edit, expected",
    [
        (
            ("accelerator.pyi", "    def wait_for_everyone(self)", "    def wait_for_everyones(self)"),
            "accelerate.accelerator.Accelerator.wait_for_everyones: no such method",
        ),
        (
            ("accelerator.pyi", "def end_training(self)", "def end_training(self, force: bool = False)"),
            "Accelerator.end_training: parameter 'force' is not one of ['self']",
        ),
        (
            (
                "accelerator.pyi",
                "def register_save_state_pre_hook(self, hook: Callable[..., None])",
                "def register_save_state_pre_hook(self, hook: Callable[..., None] = ...)",
            ),
            "Accelerator.register_save_state_pre_hook: Accelerate requires parameter 'hook', the stub gives it a default",
        ),
        (
            (
                "accelerator.pyi",
                "self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs",
                "self, safe_serialization: bool = True, output_dir: str | None = None, **save_model_func_kwargs",
            ),
            "Accelerator.save_state: positional parameters",
        ),
        (
            ("accelerator.pyi", "    device_placement: bool\n", "    device_placements: bool\n"),
            "Accelerator.device_placements: no such attribute",
        ),
        (
            ("utils/__init__.pyi", '    MULTI_CPU = "MULTI_CPU"', '    MULTI_CPU = "multi_cpu"'),
            "DistributedType.MULTI_CPU: no such member with value 'multi_cpu'",
        ),
        (
            (
                "utils/__init__.pyi",
                "def is_compiled_module(module: nn.Module)",
                "def is_compiled_module(model: nn.Module)",
            ),
            "is_compiled_module: parameter 'model' is not one of ['module']",
        ),
        (
            (
                "__init__.pyi",
                "from .state import PartialState as PartialState",
                "from .state import AcceleratorState as PartialState",
            ),
            "accelerate.PartialState: not accelerate.state.AcceleratorState",
        ),
    ],
)
def test_the_drift_check_catches_a_stub_that_says_more_than_accelerate(
    fresh_accelerate_state: None, tmp_path: Path, edit: tuple[str, str, str], expected: str
) -> None:
    copy = edited_stubs(STUBS, "accelerate", edit, tmp_path / "typings")
    problems = stub_problems(copy, "accelerate", _live_objects(), "Accelerate")
    assert any(expected in p for p in problems), problems
