"""FSDP2 (``fully_shard``) pieces shared by the Accelerate and Trainer integrations.

With FSDP2, Accelerate's ``prepare`` (and so the Trainer's) calls
``fully_shard`` on the model *in place*: the module object stays, but every
parameter is replaced by a new ``DTensor`` parameter, and Accelerate points the
optimizer's ``param_groups`` at the new ones. Groups resolved before that hold
the old parameters, so after ``prepare`` the integrations:

* :func:`rebind_groups`: the same groups, by name, on the sharded parameters
  (names canonicalised as Accelerate does, so activation checkpointing's
  ``_checkpoint_wrapped_module.`` does not break the match), and a
  :class:`~hf_altparams.engine.GroupedOptimizer` driving the schedule is told
  the new groups (its per-group state is keyed by parameter object);
* build the :class:`~hf_altparams.engine.PhaseSwitcher` on them and apply the
  first phase *after* sharding: FSDP2 reads ``requires_grad`` at every
  all-gather (docs/design.md, fact 12), and with mixed precision Accelerate upcasts only
  the parameters trainable at ``prepare`` to fp32, so every parameter must be
  trainable then for a later-unfrozen one to match its unit's dtype;
* :func:`grouped_checkpoint_view`: Accelerate saves an FSDP2 optimizer with
  ``torch.distributed.checkpoint`` (``get_optimizer_state_dict``), which needs a
  standard optimizer; a ``GroupedOptimizer`` is handed to it as the tuple of
  its inner optimizers that hold state (DCP's multi-optimizer form);
* the Trainer (:func:`shard_trainer_groups` at ``on_train_begin``): the same
  rebinding, and what makes its strict DCP optimizer load resume exactly
  (empty state entries for the scheduled parameters,
  :func:`forget_untrained_state` after a resume).

FSDP1 and DeepSpeed are refused in the one refusal table (:mod:`.refusals`).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from ..engine.optim import GroupedOptimizer
from ..errors import AltParamsError
from ..plan.groups import ParamGroups
from .accelerate_internals import shared_accelerator_state

__all__ = [
    "InnerOptimizers",
    "forget_untrained_state",
    "fsdp2_not_running",
    "grouped_checkpoint_view",
    "groups_with_state",
    "rebind_groups",
    "rebind_optimizer",
    "shard_trainer_groups",
    "trainer_fsdp_version",
    "uses_fsdp2",
]

_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter name without the wrappers' inserted parts (activation checkpointing, compile)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def rebind_groups(groups: ParamGroups, model: nn.Module) -> ParamGroups:
    """``groups`` on ``model``'s current parameters (after ``fully_shard`` replaced them), by name.

    Raises:
        AltParamsError: when a grouped name has no parameter in ``model`` any more.
    """
    by_canonical = {canonical_name(n): n for n, _ in model.named_parameters(remove_duplicate=False)}
    specs: dict[str, list[str]] = {}
    missing: list[str] = []
    for group in groups.names:
        names = []
        for old in groups.param_names(group):
            new = by_canonical.get(canonical_name(old))
            if new is None:
                missing.append(old)
            else:
                names.append("re:" + re.escape(new))
        specs[group] = names
    if missing:
        raise AltParamsError(
            f"after FSDP2 sharding the model has no parameter named {missing[:3]} "
            f"({len(missing)} grouped parameter(s) missing); the groups were resolved on "
            "another model than the one passed to `prepare`"
        )
    return ParamGroups(model, specs, ungrouped=groups.ungrouped)


def _unwrapped(optimizer: Optional[Optimizer]) -> Optional[Optimizer]:
    while optimizer is not None and not isinstance(optimizer, GroupedOptimizer):
        inner = getattr(optimizer, "optimizer", None)  # Accelerate's wrapper holds the optimizer it wraps
        if not isinstance(inner, Optimizer):
            break
        optimizer = inner
    return optimizer


def rebind_optimizer(driving: Optional[Optimizer], old: ParamGroups, new: ParamGroups) -> None:
    """Point a GroupedOptimizer over ``old`` at ``new``; check the optimizer holds the sharded parameters.

    Accelerate swapped the parameters in the optimizer's ``param_groups``
    (``fsdp2_switch_optimizer_parameters``); a parameter left unswapped would
    never be updated, so it is refused here, before any step.
    """
    inner = _unwrapped(driving)
    if isinstance(inner, GroupedOptimizer) and inner.groups is old:
        inner.rebind(new)
    if inner is None:
        return
    current = {id(p) for _, p in new.all_named_params()}
    stale = sum(1 for g in inner.param_groups for p in g["params"] if id(p) not in current)
    if stale:
        raise AltParamsError(
            f"after FSDP2 sharding, {stale} parameter(s) of the optimizer are not the model's sharded "
            "parameters, so they would never be updated; pass the model and its optimizer to the same "
            "`prepare` call (Accelerate swaps the optimizer's parameters for the sharded ones there)"
        )


class InnerOptimizers(tuple):
    """The inner optimizers of a GroupedOptimizer, as the tuple DCP's ``get_optimizer_state_dict`` accepts."""


def groups_with_state(grouped: GroupedOptimizer) -> list[str]:
    """The groups whose inner optimizer holds state (the ones a checkpoint stores)."""
    return [n for n, opt in grouped.inner.items() if opt.state]


def _init_state(optimizer: Optimizer) -> None:
    """Create ``optimizer``'s state with a zero-gradient step at lr 0 (DCP loads into it)."""
    saved_grads = {}
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group.get("lr"))
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            saved_grads[p] = p.grad
            p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for p, grad in saved_grads.items():
            p.grad = grad


@contextlib.contextmanager
def grouped_checkpoint_view(
    optimizers: list[Any], names_by_index: Optional[dict[int, list[str]]] = None
) -> Iterator[dict[int, list[str]]]:
    """Within the block, each prepared GroupedOptimizer in ``optimizers`` is its inner optimizers.

    Accelerate's FSDP2 ``save_state`` / ``load_state`` pass each entry of
    prepared optimizer to ``torch.distributed.checkpoint``; a
    GroupedOptimizer's own state dict is not the format DCP reads, its inner
    optimizers (one standard torch optimizer per group) are. Only groups with
    state are passed (an idle group under ``drop`` has none, and must not be
    expected in the checkpoint); DCP skips the state of frozen parameters, so
    their ``requires_grad`` is on inside the block (no forward runs there).
    Saving: yields ``{index: [groups saved]}``; loading: pass the same mapping
    as ``names_by_index`` (the inner optimizers named there get a state to load
    into first). The list and the flags are restored after.
    """
    swapped: dict[int, Any] = {}
    saved: dict[int, list[str]] = {}
    flags: dict[nn.Parameter, bool] = {}
    try:
        for i, prepared in enumerate(optimizers):
            grouped = getattr(prepared, "optimizer", prepared)
            if not isinstance(grouped, GroupedOptimizer):
                continue
            if names_by_index is None:
                names = groups_with_state(grouped)
            else:
                names = list(names_by_index.get(i, []))
                for name in names:
                    if not grouped.inner[name].state:
                        _init_state(grouped.inner[name])
            for name in names:
                for param in grouped.groups.params(name):
                    # DCP reads and writes optimizer state only for parameters with requires_grad
                    flags.setdefault(param, param.requires_grad)
                    param.requires_grad_(True)
            saved[i] = names
            swapped[i] = prepared
            optimizers[i] = InnerOptimizers(grouped.inner[n] for n in names)
        yield saved
    finally:
        for i, prepared in swapped.items():
            optimizers[i] = prepared
        for param, flag in flags.items():
            param.requires_grad_(flag)


def trainer_fsdp_version(args: Any, shared_plugin: Any) -> Optional[int]:
    """The FSDP version a Trainer run uses (``None``: no FSDP), from its arguments or Accelerate's plugin."""
    plugin_args = getattr(args, "fsdp_plugin_args", None) or {}
    for source in (plugin_args.get("fsdp_version"), getattr(shared_plugin, "fsdp_version", None)):
        if source is not None:
            return int(source)
    return None


def forget_untrained_state(optimizer: Optional[Optimizer], groups: ParamGroups, trained: set[str]) -> None:
    """After the Trainer's FSDP2 resume: drop the optimizer state of groups that had not trained yet.

    DCP's optimizer load first creates a state for every trainable parameter
    with a zero-gradient step at lr 0 (``step`` 1, zero moments); a group that
    had not trained before the checkpoint keeps that, where the uninterrupted
    run starts it fresh at its first step. Dropping it makes the resume exact.
    Only parameters the optimizer holds are touched: a group no phase of the
    schedule trains is frozen at ``on_init_end`` under FSDP2, so the optimizer
    the Trainer builds leaves it out, and a state entry for it would make the
    next checkpoint's ``get_optimizer_state_dict`` fail (a bare ``KeyError``).
    """
    inner = _unwrapped(optimizer)
    if inner is None or isinstance(inner, GroupedOptimizer):
        return
    held = {id(p) for group in inner.param_groups for p in group["params"]}
    for name in groups.names:
        if name not in trained:
            for param in groups.params(name):
                if id(param) in held:
                    inner.state[param] = {}  # kept (empty) for the next checkpoint


def fsdp2_not_running(asked: str, running: str) -> str:
    """The warning for a run that asked for FSDP2 and trains with plain DDP (Accelerate on CPU or one process)."""
    return (
        f"hf_altparams: FSDP2 was asked for ({asked}), but Accelerate runs {running} here: it ignores an FSDP "
        "plugin on CPU ranks and with one process, so this run trains with plain DDP (correct, not sharded). "
        "To run Accelerate's FSDP2 code on CPU ranks, call `hf_altparams.testing.use_accelerate_fsdp2(...)` "
        "before `prepare` / `train()` (docs/testing.md); on several GPUs nothing is needed."
    )


def uses_fsdp2(args: Any) -> bool:
    """True when a Trainer run with ``args`` shards with FSDP2 (Accelerate's shared plugin or the arguments)."""
    shared = shared_accelerator_state()
    return trainer_fsdp_version(args, shared.get("fsdp_plugin")) == 2 and bool(
        getattr(args, "fsdp", None) or shared.get("fsdp_plugin") is not None
    )


def shard_trainer_groups(
    groups: ParamGroups, model: nn.Module, optimizer: Optional[Optimizer], args: Any, state: Any, trained: set[str]
) -> ParamGroups:
    """For the Trainer's FSDP2 run (at ``on_train_begin``): the groups on the sharded parameters.

    The Trainer's ``accelerator.prepare`` ran ``fully_shard`` on the model in
    place before any callback event of ``train()``; the optimizer (swapped by
    Accelerate) and a GroupedOptimizer's groups follow. For the Trainer's FSDP2
    checkpoints (``torch.distributed.checkpoint``, strict: state for every
    trainable parameter): every parameter the schedule trains gets an empty
    state entry (on_init_end left exactly those trainable; torch optimizers
    initialise an empty state at the first step, as without the entry), so a
    checkpoint holds one for a group not trained yet; on a resume
    (``global_step > 0``) the groups not in ``trained`` get it back empty
    (:func:`forget_untrained_state`).
    """
    if isinstance(_unwrapped(optimizer), GroupedOptimizer) and args.save_strategy != "no":
        raise AltParamsError(
            "AlternatingFreeze with FSDP2 cannot checkpoint a GroupedOptimizer through the Trainer (its state "
            "dict is not the torch.distributed.checkpoint format the Trainer's FSDP save writes); use a torch "
            "optimizer over every scheduled parameter (the Trainer's default), or `save_strategy='no'` "
            "(PhasedAccelerator checkpoints a GroupedOptimizer under FSDP2)"
        )
    rebound = rebind_groups(groups, model)
    rebind_optimizer(optimizer, groups, rebound)
    if state.global_step > 0:
        forget_untrained_state(optimizer, rebound, trained)
    inner = _unwrapped(optimizer)
    if inner is not None and not isinstance(inner, GroupedOptimizer):
        held = {id(p) for group in inner.param_groups for p in group["params"]}
        for _, param in rebound.all_named_params():
            if param.requires_grad and id(param) in held:
                inner.state[param]  # noqa: B018 - a defaultdict: creates the empty entry
    return rebound
