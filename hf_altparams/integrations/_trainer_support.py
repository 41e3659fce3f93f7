"""What the Trainer callback needs around the Trainer: backend refusals, and the DDP wrapper's first call.

Kept apart from :mod:`.trainer` (the callback's events) because these read the
Trainer's and Accelerate's state from the outside: the refusal messages for
strategies the callback cannot drive, the optimizer inside Accelerate's
wrapper, the one-shot global forward pre-hook that finds the
``DistributedDataParallel`` the Trainer keeps in a local variable, and
(:class:`WrapperMixin`) what the callback does when that hook fires: re-bucket
the wrapper, or refuse a multi-process run with no wrapper.
"""

from __future__ import annotations

import logging
import os
import weakref
from types import FrameType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim import Optimizer
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback

from ..engine.optim import GroupedOptimizer
from ._fsdp2_prepare import FSDP1_MESSAGE, trainer_fsdp_version


__all__ = ["FIND_UNUSED_WARNING", "FirstCallCatcher", "no_wrapper_error", "run_before_reporters", "unsupported_backend", "unwrap_optimizer"]

# The callback's logger (records keep the name they had when this code lived in `.trainer`).
logger = logging.getLogger(__name__.rpartition(".")[0] + ".trainer")

_DEEPSPEED_MESSAGE = (
    "AlternatingFreeze does not support DeepSpeed: DeepSpeed fixes the trainable set, its gradient "
    "partitions and optimizer state at `deepspeed.initialize` and ignores (or crashes on) later "
    "`requires_grad` changes. Train with plain DDP instead: drop `deepspeed=` from TrainingArguments "
    "(and any DeepSpeed accelerate config) and launch with `torchrun` or `accelerate launch "
    "--multi_gpu`; AlternatingFreeze then all-reduces only the phase's parameters, and "
    "`grouped_optimizer(..., state_policy='offload')` keeps idle groups' optimizer state on the CPU. "
    "To shard the model, use FSDP2: `fsdp='full_shard'` with `fsdp_config={'version': 2}`."
)
_FSDP_MESSAGE = "AlternatingFreeze does not support FSDP1: " + FSDP1_MESSAGE
_COMPILE_MESSAGE = (
    "AlternatingFreeze does not support `torch_compile=True` in a multi-process run: the compiled "
    "DDP graph is split by the gradient-bucket layout fixed at compile time, which every phase "
    "switch changes. Set `torch_compile=False` (a single-process run may compile)."
)


# ----------------------------------------------------------------------------- helpers


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def unsupported_backend(args: TrainingArguments) -> Optional[str]:
    """The refusal message for DeepSpeed / FSDP1 / compiled DDP in ``args``, or None (FSDP2 is accepted)."""
    from accelerate.state import AcceleratorState

    shared = AcceleratorState._shared_state  # the Trainer's accelerator exists by on_init_end
    kind = str(getattr(shared.get("distributed_type"), "value", shared.get("distributed_type")))
    if (
        kind == "DEEPSPEED"
        or getattr(args, "deepspeed", None)
        or getattr(args, "deepspeed_plugin", None) is not None
        or shared.get("deepspeed_plugin") is not None
        or shared.get("deepspeed_plugins") is not None
        or _env_true("ACCELERATE_USE_DEEPSPEED")
    ):
        return _DEEPSPEED_MESSAGE
    if (
        kind == "FSDP"
        or getattr(args, "fsdp", None)
        or getattr(args, "fsdp_plugin_args", None) is not None
        or shared.get("fsdp_plugin") is not None
        or _env_true("ACCELERATE_USE_FSDP")
    ) and trainer_fsdp_version(args, shared.get("fsdp_plugin")) != 2:
        return _FSDP_MESSAGE  # FSDP2 is supported (on_train_begin rebinds the groups to the shards)
    if getattr(args, "torch_compile", False) and getattr(args, "world_size", 1) > 1:
        return _COMPILE_MESSAGE
    return None


def unwrap_optimizer(optimizer: Optional[Any]) -> Optional[Any]:
    """The user's optimizer inside Accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    seen = 0
    while optimizer is not None and not isinstance(optimizer, GroupedOptimizer) and seen < 4:
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, Optimizer):
            break
        optimizer, seen = inner, seen + 1
    return optimizer


class FirstCallCatcher:
    """A one-shot *global* forward pre-hook that finds the wrapper the Trainer built.

    The Trainer keeps its ``DistributedDataParallel`` in a local variable and
    hands callbacks the bare model. A global pre-hook sees every module call,
    the wrapper's own included, *before* its ``forward`` runs (a pre-hook on
    the inner module would run after ``DDP._pre_forward`` has already prepared
    the old reducer for this iteration). It removes itself at the first call
    of either the wrapper or, when there is none, the bare model in training.
    """

    def __init__(
        self,
        module: nn.Module,
        on_ddp: Callable[[nn.parallel.DistributedDataParallel], None],
        on_plain: Callable[[], None],
    ) -> None:
        self._module = weakref.ref(module)  # a global hook must not keep the model alive
        self.on_ddp = on_ddp
        self.on_plain = on_plain
        self._handle: Optional[Any] = register_module_forward_pre_hook(self._hook)

    def _hook(self, called: nn.Module, _inputs: Any) -> None:
        module = self._module()
        if module is None:
            self.remove()
        elif isinstance(called, nn.parallel.DistributedDataParallel) and called.module is module:
            self.remove()
            self.on_ddp(called)
        elif called is module and called.training and torch.is_grad_enabled():
            self.remove()
            self.on_plain()

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def run_before_reporters(callback: TrainerCallback, event_frame: Optional[FrameType]) -> None:
    """Move ``callback`` ahead of the reporting callbacks (TensorBoard, W&B, ...).

    The Trainer calls callbacks in list order and puts user callbacks after
    the reporters, so keys added in ``on_log`` would reach only the progress
    bar. Callbacks do not get the handler; it is the caller of the event, found
    by walking up from ``event_frame`` (the frame of the callback's event method).
    """
    frame = event_frame
    for _ in range(4):
        frame = frame.f_back if frame is not None else None
        if frame is None:
            return
        handler = frame.f_locals.get("self")
        if isinstance(handler, CallbackHandler) and callback in handler.callbacks:
            callbacks = handler.callbacks
            callbacks.remove(callback)
            first = next((i for i, cb in enumerate(callbacks) if not isinstance(cb, DefaultFlowCallback)),
                         len(callbacks))
            callbacks.insert(first, callback)
            return


#: Logged when the Trainer's DDP searches for unused parameters (its default without gradient checkpointing).
FIND_UNUSED_WARNING = (
    "AlternatingFreeze: DDP runs with find_unused_parameters=True (the Trainer's default without gradient "
    "checkpointing), which walks the autograd graph and all-reduces a used-parameter map on every step. "
    "AlternatingFreeze re-buckets DDP for exactly the phase's parameters, so pass "
    "`ddp_find_unused_parameters=False` to TrainingArguments unless your forward skips some trainable parameters."
)


def no_wrapper_error() -> Optional[str]:
    """Why a model training without a DDP wrapper is refused (several processes), or ``None``."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world <= 1:
        return None
    return (
        f"AlternatingFreeze: the model trains in {world} processes but the Trainer did not "
        "wrap it in DistributedDataParallel, so no gradient would be synchronised. A known "
        "cause: `trainer.evaluate()` or `trainer.predict()` ran before the first "
        "`trainer.train()` (Accelerate then marks the bare model as prepared and `train()` "
        "skips the DDP wrapper; transformers 5.23, accelerate 1.15). Evaluate before "
        "training outside the Trainer, or only after `train()`. Otherwise: only DDP (the "
        "Trainer's default for multi-process runs) is supported."
    )
