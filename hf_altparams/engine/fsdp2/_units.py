"""FSDP2 units against parameter groups: the check at set-up, and ``shard_by_groups``.

FSDP2 all-gathers a ``fully_shard`` unit whole. A unit that holds parameters of
two groups keeps all-gathering (and holding unsharded during its forward and
backward) the frozen group's parameters while the other trains; only its
reduce-scatter shrinks to the trainable parameters. The switcher warns about
such units when it attaches, naming the unit and the groups, and refuses a
per-task residency that would leave part of a unit on the device and part off
it (the unit's all-gather would read both). :func:`shard_by_groups` shards one
unit per group, so that freezing a group saves its all-gather too.

A forward through a unit whose groups are all non-resident is refused by a
pre-forward hook that runs before FSDP2's own (which would all-gather shards
that live on the host): :func:`install_unit_guards`.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

from ...errors import SwitchError
from ...plan.groups import ParamGroups
from ..backend import Residency
from ._dtensor import fsdp2_units, is_fsdp2, unit_params

__all__ = [
    "check_groups_fit_units",
    "check_residency_fits_units",
    "install_unit_guards",
    "mixed_units",
    "shard_by_groups",
]

#: The unit guards' hook handles per model (replaced when a switcher attaches again).
_GUARDS: weakref.WeakKeyDictionary[nn.Module, list[RemovableHandle]] = weakref.WeakKeyDictionary()


def _unit_names(model: nn.Module) -> dict[int, str]:
    return {id(m): (n or "<root>") for n, m in model.named_modules() if is_fsdp2(m)}


def mixed_units(model: nn.Module, groups: ParamGroups) -> dict[str, list[str]]:
    """``{unit name: its groups}`` for every ``fully_shard`` unit holding parameters of several groups.

    Example:
        >>> import torch
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> mixed_units(net, ParamGroups(net, {"a": "0.*", "b": "1.*"}))  # not sharded: no unit
        {}
    """
    group_of = {id(p): g for g in groups.names for p in groups.params(g)}
    names = _unit_names(model)
    out: dict[str, list[str]] = {}
    for unit in fsdp2_units(model):
        held = sorted({group_of[id(p)] for p in unit_params(unit) if id(p) in group_of})
        if len(held) > 1:
            out[names[id(unit)]] = held
    return out


def check_groups_fit_units(model: nn.Module, groups: ParamGroups) -> None:
    """At attach: refuse groups built before ``fully_shard``; warn about units mixing groups."""
    current = dict(model.named_parameters())
    stale = [n for n, p in groups.all_named_params() if current.get(n) is not p]
    if stale:
        raise SwitchError(
            f"`groups` holds parameters that fully_shard has replaced (e.g. {stale[:3]}): ParamGroups was "
            "built before sharding, so switching would flip flags on parameters nothing trains. Build "
            "ParamGroups after fully_shard, or pass `groups.rebind(model)` (shard_by_groups returns it)."
        )
    for unit, held in mixed_units(model, groups).items():
        warnings.warn(
            f"hf_altparams: fully_shard unit {unit!r} holds parameters of groups {held}: FSDP2 all-gathers "
            "a unit whole, so while some of them are frozen the unit still all-gathers (and holds unsharded) "
            "their parameters; only its reduce-scatter shrinks. Shard one unit per group with "
            "`hf_altparams.engine.shard_by_groups(model, groups)`.",
            stacklevel=4,
        )


def check_residency_fits_units(model: nn.Module, off_names: Iterable[str]) -> None:
    """Refuse a residency that leaves part of a unit off the device (its all-gather reads all of it)."""
    off = set(off_names)
    name_of = {id(p): n for n, p in model.named_parameters()}
    names = _unit_names(model)
    for unit in fsdp2_units(model):
        params = [name_of[id(p)] for p in unit_params(unit) if id(p) in name_of]
        gone = [n for n in params if n in off]
        if gone and len(gone) < len(params):
            kept = [n for n in params if n not in off]
            raise SwitchError(
                f"fully_shard unit {names[id(unit)]!r} would be partly off the device in this phase "
                f"(non-resident {gone[:3]}, resident {kept[:3]}): FSDP2 all-gathers a unit whole. Shard "
                "one unit per group (`hf_altparams.engine.shard_by_groups`), or pass `offload_device=None`."
            )


def install_unit_guards(model: nn.Module, groups: ParamGroups, residency: Residency) -> None:
    """Refuse, before FSDP2 all-gathers it, a forward through a unit whose groups are all non-resident.

    The hooks read ``residency.offloaded`` when they run, so ``residency.visiting``
    (which brings groups back for a while) passes through.
    """
    for handle in _GUARDS.pop(model, []):
        handle.remove()
    group_of = {id(p): g for g in groups.names for p in groups.params(g)}
    names = _unit_names(model)
    handles = []
    for unit in fsdp2_units(model):
        held = frozenset(group_of.get(id(p)) for p in unit_params(unit))
        if not held or None in held:  # no parameters, or ungrouped ones (always resident)
            continue

        def refuse(module: nn.Module, args: object, held: frozenset[Any] = held, name: str = names[id(unit)]) -> None:
            if residency.guard and held <= residency.offloaded:
                raise SwitchError(
                    f"fully_shard unit {name!r} ran its forward in phase {residency.phase_name!r}, but its groups "
                    f"{sorted(held)} are not resident in that phase (their shards live on "
                    f"{residency.offload_device}). Add them to the phase's `resident` groups, route inputs only "
                    "through the resident tasks, or wrap an evaluation in `switcher.visiting(...)`"
                )

        handles.append(unit.register_forward_pre_hook(refuse, prepend=True))
    _GUARDS[model] = handles


def _pure_modules(model: nn.Module, members: set[int]) -> list[tuple[str, nn.Module]]:
    """The largest modules all of whose parameters are in ``members`` (disjoint, in module order)."""
    out: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> None:
        params = list(module.parameters())
        if params and all(id(p) in members for p in params):
            out.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    for child_name, child in model.named_children():
        visit(child_name, child)
    return out


def shard_by_groups(
    model: nn.Module, groups: ParamGroups, *, per_module: bool = False, **fully_shard_kwargs: Any
) -> ParamGroups:
    """``fully_shard`` one unit per group (the largest modules holding only that group), then the root.

    Each group's unit is the list of the largest sub-modules whose parameters
    all belong to it (``fully_shard`` accepts a list); with ``per_module=True``
    each of those modules is a unit of its own (one per layer for groups built
    with :meth:`ParamGroups.from_layers` over several layers). Parameters in no
    such module (ungrouped ones, or ones a module shares with another group)
    stay in the root unit. ``fully_shard`` replaces the parameters, so use the
    returned groups (``groups.rebind(model)``) from then on.

    Args:
        model: the model, not yet sharded (its parameters on the device to shard from).
        groups: the parameter groups of ``model``.
        per_module: one unit per module instead of one per group.
        fully_shard_kwargs: passed to every ``fully_shard`` call (``mesh``, ``mp_policy``, ...).

    Returns:
        ``groups`` rebound to the sharded parameters.

    Example:
        >>> # groups = shard_by_groups(model, groups, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        >>> # switcher = PhaseSwitcher(groups, Alternating(groups.names), model=model)
    """
    from torch.distributed.fsdp import fully_shard

    if groups.module is not model:
        raise SwitchError("`groups` was built on another module than `model`; build ParamGroups on the model")
    if fsdp2_units(model):
        raise SwitchError("`model` is already sharded (it holds fully_shard units); pass the unsharded model")
    for name in groups.names:
        modules = _pure_modules(model, {id(p) for p in groups.params(name)})
        for unit in [[m] for _, m in modules] if per_module else [[m for _, m in modules]]:
            if unit:
                fully_shard(unit if len(unit) > 1 else unit[0], **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return groups.rebind(model)
