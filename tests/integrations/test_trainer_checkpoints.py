"""Torn Trainer checkpoints: a save killed at any stage never resumes into the wrong phase.

A 6-step Trainer run with ``AlternatingFreeze`` saves at steps 2 and 4; the
save at step 4 is "killed" (an exception at that point: the files written so
far stay, as after a SIGKILL) at each stage of the Trainer's ``_save_checkpoint``
and of the callback's marker. Then:

* ``train(resume_from_checkpoint=True)`` (which takes ``checkpoint-4``) fails
  with an error (the Trainer's own when it cannot read its state; the
  callback's, naming ``checkpoint-2``, when it can) unless the save completed;
* :func:`last_complete_checkpoint` skips the torn folder, and resuming from
  what it returns ends bit-equal to an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainerState

from hf_altparams.errors import AltParamsError
from hf_altparams.integrations import accelerate_checkpoints as _accelerate_checkpoints
from hf_altparams.integrations.trainer import AlternatingFreeze, last_complete_checkpoint
from hf_altparams.plan import Alternating
from tests.scripts import script_path
from tests.support.faults import SaveFault


def _load_script() -> Any:
    spec = importlib.util.spec_from_file_location("trainer_phases", script_path("trainer_phases.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("trainer_phases", module)
    spec.loader.exec_module(module)
    return module


S = _load_script()
STEPS, KILLED_AT = 6, 4


class _Killed(BaseException):
    """Stands for the process dying: nothing after it runs."""


#: every ``Trainer.train()`` runs a full collection: see the fixture in ``tests/conftest.py``
pytestmark = pytest.mark.usefixtures("imports_frozen")


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Any:
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


class _ArmFault(TrainerCallback):
    """Arms ``fault`` at ``stage`` right before the Trainer saves at ``KILLED_AT``."""

    def __init__(self, stage: str, fault: SaveFault) -> None:
        self.stage, self.fault = stage, fault

    def on_step_end(self, args: Any, state: TrainerState, control: Any, **kwargs: Any) -> None:
        if state.global_step == KILLED_AT:
            self.fault.arm(self.stage)


def _die(stage: str) -> NoReturn:
    raise _Killed(stage)


def _trainer(out: Path, *extra: TrainerCallback) -> tuple[Trainer, torch.nn.Module]:
    model = S.tiny_bert()
    # Steps 0-2 train the head, 3-4 layer1, 5 the head: both checkpoints are mid-phase.
    freeze = AlternatingFreeze(S.groups_of, Alternating({"head": 3, "layer1": 2}))
    args = S.arguments(out, max_steps=STEPS, gradient_accumulation_steps=1, save_strategy="steps", save_steps=2)
    return Trainer(model=model, args=args, train_dataset=S.TokenDataset(64), callbacks=[freeze, *extra]), model


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    trainer, model = _trainer(tmp_path_factory.mktemp("plain"))
    trainer.train()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _kill_in(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, partial: bool = False) -> None:
    original: Callable[..., Any] = getattr(owner, name)

    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        step = self.global_step if isinstance(self, TrainerState) else self.state.global_step
        if step != KILLED_AT:
            return original(self, *args, **kwargs)
        if partial:  # half of trainer_state.json reaches the disk
            original(self, *args, **kwargs)
            path = Path(args[0])
            path.write_text(path.read_text()[: len(path.read_text()) // 2])
        raise _Killed(name)

    monkeypatch.setattr(owner, name, dying)


# stage -> what a resume with `resume_from_checkpoint=True` meets (None: it resumes)
STAGES = {
    "optimizer": (FileNotFoundError, AltParamsError),  # model written, no optimizer, no trainer_state.json
    "trainer_state": (ValueError, AltParamsError),  # half a trainer_state.json
    "trainer_saved": (AltParamsError,),  # every Trainer file, no marker
    "marker_tmp": (AltParamsError,),  # the marker's temporary file only
    "marker": None,  # complete
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_trainer_save_killed_at_any_stage_never_resumes_wrong(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, uninterrupted: dict[str, torch.Tensor], stage: str
) -> None:
    extra: list[TrainerCallback] = []
    if stage == "optimizer":
        _kill_in(monkeypatch, Trainer, "_save_optimizer_and_scheduler")
    elif stage == "trainer_state":
        _kill_in(monkeypatch, TrainerState, "save_to_json", partial=True)
    else:
        extra.append(_ArmFault(stage, SaveFault(monkeypatch, _die)))
    if stage == "trainer_saved":  # an earlier run's complete checkpoint-4 is in the way: its marker must go
        (tmp_path / "checkpoint-4").mkdir()
        (tmp_path / "checkpoint-4" / _accelerate_checkpoints.COMPLETE_MARKER).write_text(
            '{"format": "hf_altparams.AlternatingFreeze/1", "step": 4}'
        )
    trainer, _ = _trainer(tmp_path, *extra)
    with pytest.raises(_Killed):
        trainer.train()
    monkeypatch.undo()
    torn = tmp_path / f"checkpoint-{KILLED_AT}"
    assert torn.is_dir()

    expected = STAGES[stage]
    if expected is not None:
        trainer, _ = _trainer(tmp_path)
        with pytest.raises(expected) as caught:
            trainer.train(resume_from_checkpoint=True)
        if isinstance(caught.value, AltParamsError):
            assert f"refuses to resume from {str(torn)!r}: its save was interrupted" in str(caught.value)
            assert f"resume_from_checkpoint={str(tmp_path / 'checkpoint-2')!r}" in str(caught.value)
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)

    latest = last_complete_checkpoint(str(tmp_path))
    assert latest == str(tmp_path / ("checkpoint-4" if expected is None else "checkpoint-2"))
    trainer, model = _trainer(tmp_path)
    trainer.train(resume_from_checkpoint=latest)
    for name, value in model.state_dict().items():
        assert torch.equal(value, uninterrupted[name]), name


def test_a_marker_left_by_another_run_is_refused(tmp_path: Path) -> None:
    from hf_altparams.integrations.trainer_checkpoints import check_resumed

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / _accelerate_checkpoints.COMPLETE_MARKER).write_text(
        '{"format": "hf_altparams.AlternatingFreeze/1", "step": 2}'
    )
    state = TrainerState(global_step=4)
    with pytest.raises(
        AltParamsError, match=r"is for step 2 but trainer_state.json for step 4.*no complete checkpoint"
    ):
        check_resumed(str(folder), state, {"complete_marker": True})
    older = tmp_path / "checkpoint-6"
    older.mkdir()
    check_resumed(str(older), TrainerState(global_step=6), {"phase": ["a"]})  # saved before markers: allowed
    with pytest.raises(AltParamsError, match=r"interrupted.*resume_from_checkpoint=.*checkpoint-4|no complete"):
        check_resumed(str(older), TrainerState(global_step=6), {"complete_marker": True})
