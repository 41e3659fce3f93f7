"""The fence around the 🤗 Trainer's internals: every frame walk or private name of transformers, here only.

A ``TrainerCallback`` is handed the model, the arguments and the state, never
the Trainer or its callback handler. Two things the phased run needs are only
reachable from the call stack of a callback event, so they are read there,
in this module and nowhere else:

* **the checkpoint a resumed run loaded** (:func:`resumed_checkpoint_from_stack`):
  ``Trainer._inner_training_loop`` holds it in its local
  ``resume_from_checkpoint``; ``AlternatingFreeze`` refuses a resume from a
  torn checkpoint (one whose save did not complete);
* **the Trainer under construction** (:func:`trainer_from_stack`): under
  DeepSpeed, ``AlternatingFreeze`` has the Trainer build its optimizer split
  per group (its public ``optimizer_cls_and_kwargs``, read inside ``train()``),
  which a callback can set only on the Trainer whose ``__init__`` calls
  ``on_init_end``;
* **the callback handler** (:func:`move_before_reporters`): the Trainer calls
  callbacks in list order with the reporting integrations (TensorBoard, W&B)
  before user callbacks, so the ``altparams/*`` keys added in ``on_log`` would
  reach only the progress bar; the handler found on the stack reorders the list.

:data:`USES` names what each relies on; :func:`missing_names` checks them
against the installed transformers at import (an absent one raises a clear
error), the version is compared with :data:`TESTED_TRANSFORMERS` (a warning
outside it), and ``tests/integrations/test_fences.py`` exercises both uses on
a real Trainer.
"""

from __future__ import annotations

import inspect
import sys
from types import FrameType
from typing import Any, Optional

import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from .._compat import check_library_at_import

__all__ = [
    "TESTED_TRANSFORMERS",
    "USES",
    "caller_frame",
    "check_transformers",
    "missing_names",
    "move_before_reporters",
    "resumed_checkpoint_from_stack",
    "trainer_from_stack",
]

#: Inclusive range of (major, minor) transformers releases these uses were checked on.
TESTED_TRANSFORMERS: tuple[tuple[int, int], tuple[int, int]] = ((5, 17), (5, 24))

#: The Trainer method whose frame holds the resumed checkpoint, and the local it holds it in.
TRAINING_LOOP, RESUME_LOCAL = "_inner_training_loop", "resume_from_checkpoint"

#: Each use and the transformers names it relies on.
USES: dict[str, tuple[str, ...]] = {
    "resumed_checkpoint_from_stack": (f"Trainer.{TRAINING_LOOP}", f"Trainer.{TRAINING_LOOP}({RESUME_LOCAL}=...)"),
    "move_before_reporters": ("CallbackHandler.callbacks", "DefaultFlowCallback", "sys._getframe"),
    "trainer_from_stack": ("Trainer.__init__ calling on_init_end", "sys._getframe"),
}


def missing_names() -> list[str]:
    """The names of :data:`USES` the installed transformers lacks (empty on a tested version)."""
    missing = []
    loop = getattr(Trainer, TRAINING_LOOP, None)
    if loop is None:
        missing.append(f"Trainer.{TRAINING_LOOP}")
    elif RESUME_LOCAL not in inspect.signature(loop).parameters:
        missing.append(f"Trainer.{TRAINING_LOOP}({RESUME_LOCAL}=...)")
    if "callbacks" not in inspect.signature(CallbackHandler.__init__).parameters:
        missing.append("CallbackHandler.callbacks")
    if not hasattr(sys, "_getframe"):
        missing.append("sys._getframe")
    return missing


def check_transformers() -> None:
    """At import: refuse a transformers that lacks a name the library relies on; warn outside the tested range."""
    check_library_at_import(
        "transformers", transformers.__version__, TESTED_TRANSFORMERS, missing_names(), "Trainer internals"
    )


def caller_frame() -> Optional[FrameType]:
    """The frame of the function that calls this one (a callback event's own frame, when it does)."""
    return sys._getframe(1)


def resumed_checkpoint_from_stack(frame: Optional[FrameType]) -> tuple[bool, Optional[str]]:
    """``(found, folder)``: whether the Trainer's training loop is on the stack above ``frame``, and the
    checkpoint it resumed from (``None``: a fresh run).

    ``frame`` is a callback event's frame (:func:`caller_frame`); the loop is
    looked for within eight frames up.
    """
    for _ in range(8):
        if frame is None:
            break
        if frame.f_code.co_name == TRAINING_LOOP and RESUME_LOCAL in frame.f_locals:
            path = frame.f_locals[RESUME_LOCAL]
            return True, str(path) if isinstance(path, (str, bytes)) or hasattr(path, "__fspath__") else None
        frame = frame.f_back
    return False, None


def trainer_from_stack(frame: Optional[FrameType]) -> Optional[Trainer]:
    """The Trainer whose ``__init__`` is on the stack above ``frame`` (a callback's ``on_init_end``), or ``None``.

    Looked for within eight frames up, as the ``self`` of a ``Trainer.__init__`` frame.
    """
    for _ in range(8):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return None
        found = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and isinstance(found, Trainer):
            return found
    return None


def move_before_reporters(callback: TrainerCallback, frame: Optional[FrameType]) -> bool:
    """Move ``callback`` ahead of the reporting callbacks in the handler found above ``frame``; whether it was.

    ``frame`` is a callback event's frame (:func:`caller_frame`); the handler is
    the ``self`` of one of the next four frames up.
    """
    for _ in range(4):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return False
        handler: Any = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            callbacks = handler.callbacks
            callbacks.remove(callback)
            first = next(
                (i for i, cb in enumerate(callbacks) if not isinstance(cb, DefaultFlowCallback)), len(callbacks)
            )
            callbacks.insert(first, callback)
            return True
    return False


check_transformers()
