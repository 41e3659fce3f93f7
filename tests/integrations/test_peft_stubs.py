"""The peft stub (``typings/peft``) says only what the installed peft has.

mypy reads the stub instead of peft (``setup.cfg``: ``follow_imports = error``
for peft, so that peft and what it imports are not analysed); each stub module
is compared with the module it stands for (:mod:`tests.support.stub_drift`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.stub_drift import edited_stubs, stub_problems

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "typings"

pytest.importorskip("peft")


def test_every_name_in_the_stub_exists_in_the_installed_peft() -> None:
    assert stub_problems(STUBS, "peft", {}, "peft") == []


def test_the_drift_check_catches_a_stub_that_says_more_than_peft(tmp_path: Path) -> None:
    copy = edited_stubs(
        STUBS, "peft", ("utils/other.pyi", "adapter_layer_names:", "adapter_layers_names:"), tmp_path / "typings"
    )
    problems = stub_problems(copy, "peft", {}, "peft")
    assert any("AuxiliaryTrainingWrapper.adapter_layers_names: no such attribute" in p for p in problems), problems
