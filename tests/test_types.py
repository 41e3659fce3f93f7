"""The type checker passes on the library (mypy, with the settings in setup.cfg), and sees Accelerate's types.

Accelerate ships no type information; ``typings/accelerate`` (``mypy_path`` in
setup.cfg) is the stub of the part the library uses. Without it every Accelerate
name would be ``Any`` and a wrong call into Accelerate, or a ``PhasedAccelerator``
override that no longer fits ``Accelerator``, would pass unseen: the second test
checks that mypy reports such mistakes (``tests/integrations/test_accelerate_stubs.py``
checks that the stub says nothing Accelerate lacks). transformers and peft are read
from their stubs in ``typings/`` too (so that mypy does not analyse them; checked by
``test_transformers_stubs.py`` and ``test_peft_stubs.py`` there).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache for both runs: the second does not analyse torch again."""
    return tmp_path_factory.mktemp("mypy_cache")


def _mypy(target: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"), "--cache-dir", str(cache), target],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )


@pytest.mark.timeout(900)
def test_mypy_passes_on_the_library(mypy_cache: Path) -> None:
    result = _mypy("hf_altparams", mypy_cache)
    assert result.returncode == 0, result.stdout + result.stderr


#: A loop against Accelerate: the lines marked ``# wrong`` misuse it, the others are right.
ACCELERATE_USE = """
import torch
from torch import nn
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, ProjectConfiguration

model = nn.Linear(2, 2)
acc = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
                  project_config=ProjectConfiguration(project_dir="runs", automatic_checkpoint_naming=True))
model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
with acc.accumulate(model):
    acc.backward(model(torch.ones(1, 2)).sum())
    optimizer.step()
location: str = acc.save_state()
acc.load_state(location, {"weights_only": True})
steps: int = acc.gradient_accumulation_steps
if acc.distributed_type == DistributedType.MULTI_CPU:
    acc.wait_for_everyone()
prepared: AcceleratedOptimizer = acc.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

acc.wait_for_everyone(timeout=5)  # wrong: takes no argument
acc.save_state(output_dir=3)  # wrong: a folder name
ranks: str = acc.num_processes  # wrong: an int
acc.prepare_optimzer(optimizer)  # wrong: misspelt
acc.distributed_type == DistributedType.MULTI_TPU  # wrong: no such member
limit: int = acc.project_configuration.total_limit  # wrong: None when unset


class Mine(Accelerator):  # a subclass's overrides must fit Accelerator's methods
    def backward(self, loss: int) -> None:  # wrong: Accelerator.backward takes a tensor and keywords
        pass
"""


@pytest.mark.timeout(900)
def test_mypy_sees_accelerates_types_through_the_stub(tmp_path: Path, mypy_cache: Path) -> None:
    """Each misuse is reported on its line, and nothing else (without the stub: none is)."""
    script = tmp_path / "accelerate_use.py"
    script.write_text(ACCELERATE_USE)
    result = _mypy(str(script), mypy_cache)
    wrong = {n for n, line in enumerate(ACCELERATE_USE.splitlines(), 1) if "# wrong" in line}
    reported = {int(m.group(1)) for m in re.finditer(r"accelerate_use\.py:(\d+): error", result.stdout)}
    assert reported == wrong, result.stdout + result.stderr
