"""Kill a checkpoint save part-way, for the torn-checkpoint tests; the library has no test hook.

:class:`SaveFault` wraps, in the process under test, the calls a save goes
through, and "dies" (calls the ``die`` it was given: a test raises an exception
standing for the lost process, a launched script would ``os._exit``) at the
stage it is armed for. Each stage is a point where a real process can be
killed, found from what the library does rather than from hooks inside it:

* ``state_file_tmp`` / ``marker_tmp``: ``hf_altparams_state.json`` /
  ``hf_altparams_complete.json`` written to its temporary file, not yet moved
  into place (the wrapped ``os.replace`` dies instead of moving it);
* ``state_file`` / ``marker``: that file just moved into place;
* ``before_marker``: ``Accelerator.save_state`` returned (every file of
  Accelerate's and the state file written), the marker not yet begun;
* ``trainer_saved``: the Trainer wrote every file of its checkpoint and calls
  the callbacks' ``on_save``; ``AlternatingFreeze.on_save`` (which writes the
  marker) dies before it runs.

Example::

    class Killed(BaseException): ...

    def die(stage: str) -> NoReturn:
        raise Killed(stage)

    fault = SaveFault(monkeypatch, die)
    fault.arm("state_file")  # the next save dies right after the state file is in place
    with pytest.raises(Killed):
        accelerator.save_state()
"""

from __future__ import annotations

import os
from typing import Any, Callable, NoReturn, Optional

import pytest
from accelerate import Accelerator

from hf_altparams.integrations.accelerate_checkpoints import COMPLETE_MARKER, STATE_FILE
from hf_altparams.integrations.trainer import AlternatingFreeze

__all__ = ["STAGES", "SaveFault"]

_FILES = {STATE_FILE: "state_file", COMPLETE_MARKER: "marker"}
#: Every stage :meth:`SaveFault.arm` accepts.
STAGES = ("state_file_tmp", "state_file", "before_marker", "marker_tmp", "marker", "trainer_saved")


class SaveFault:
    """Dies at the armed stage of the next save (see the module docstring); disarmed otherwise.

    Args:
        monkeypatch: the test's, so every wrapper goes at the end of the test
            (or at ``monkeypatch.undo()``).
        die: called with the stage; must not return (raise, or ``os._exit``).
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch, die: Callable[[str], NoReturn]) -> None:
        self.die = die
        self.stage: Optional[str] = None
        replace = os.replace
        save_state = Accelerator.save_state
        on_save = AlternatingFreeze.on_save

        def replacing(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            kind = _FILES.get(os.path.basename(os.fspath(dst)))
            if kind is not None:
                self._reached(f"{kind}_tmp")
            replace(src, dst, *args, **kwargs)
            if kind is not None:
                self._reached(kind)

        def saving(accelerator: Accelerator, *args: Any, **kwargs: Any) -> Any:
            location = save_state(accelerator, *args, **kwargs)
            self._reached("before_marker")
            return location

        def on_saving(callback: AlternatingFreeze, *args: Any, **kwargs: Any) -> None:
            self._reached("trainer_saved")
            on_save(callback, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replacing)
        monkeypatch.setattr(Accelerator, "save_state", saving)
        monkeypatch.setattr(AlternatingFreeze, "on_save", on_saving)

    def arm(self, stage: str) -> None:
        """Die when the next save reaches ``stage`` (one of :data:`STAGES`)."""
        if stage not in STAGES:
            raise ValueError(f"`stage` must be one of {STAGES}, got {stage!r}")
        self.stage = stage

    def disarm(self) -> None:
        self.stage = None

    def _reached(self, stage: str) -> None:
        if stage == self.stage:
            self.stage = None  # a process dies once
            self.die(stage)
