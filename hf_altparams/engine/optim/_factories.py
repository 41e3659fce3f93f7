"""Checks of what :class:`~hf_altparams.engine.GroupedOptimizer` is given.

The `optimizers` argument takes a factory ``params -> Optimizer`` (one for every
group), a mapping from group name to factory, or a mapping from group name to an
optimizer the user already built on exactly that group's parameters. Everything
else is refused here with a :class:`PlanError` naming the value and the accepted
forms, before any inner optimizer exists.

It also holds the checks by parameter *identity* that the integrations share:
:func:`match_to_groups` (several built optimizers, one per group, matched by the
parameters they hold) and :func:`uncovered` (the parameters a schedule trains that
no optimizer holds).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from torch import nn
from torch.optim import Optimizer

from ...errors import PlanError
from ...plan.groups import ParamGroups

__all__ = ["check_groups_argument", "as_factories", "match_to_groups", "uncovered"]

_FORMS = (
    "accepted: a factory `params -> Optimizer` (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)), "
    "a dict group name -> factory, or a dict group name -> an optimizer already built on exactly that "
    "group's parameters"
)


def check_groups_argument(groups: Any) -> ParamGroups:
    """Refuse anything but a :class:`ParamGroups` (a model is the usual slip).

    Example:
        >>> check_groups_argument(nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `groups` must be a ParamGroups, got Linear; build one first: ParamGroups(model, {"name": "pattern.*", ...})
    """
    if not isinstance(groups, ParamGroups):
        raise PlanError(
            f"`groups` must be a ParamGroups, got {type(groups).__name__}; build one first: "
            'ParamGroups(model, {"name": "pattern.*", ...})'
        )
    return groups


def _held(opt: Optimizer) -> list[nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]]


def _names_by_id(groups: ParamGroups) -> dict[int, str]:
    return {id(p): n for n, p in groups.all_named_params()}


def _mismatch(groups: ParamGroups, name: str, opt: Optimizer) -> tuple[list[str], list[str]]:
    """Group ``name``'s parameters that ``opt`` lacks, and the ones it holds besides (by name)."""
    wanted = groups.params(name)
    names = dict(zip(map(id, wanted), groups.param_names(name)))
    held_ids = {id(p) for p in _held(opt)}
    missing = [names[id(p)] for p in wanted if id(p) not in held_ids]
    where = _names_by_id(groups)
    extra = sorted(where.get(i, "<a parameter outside the model>") for i in held_ids - set(names))
    return missing, extra


def _check_built(groups: ParamGroups, name: str, opt: Optimizer) -> None:
    missing, extra = _mismatch(groups, name, opt)
    if missing or extra:
        raise PlanError(
            f"`optimizers[{name!r}]` ({type(opt).__name__}) must be built on exactly group {name!r}'s "
            f"parameters; missing: {missing}; extra (not in group {name!r}): {extra}"
        )


def _preview(names: Sequence[str], limit: int = 4) -> str:
    return repr(list(names[:limit]))[:-1] + (", ...]" if len(names) > limit else "]")


def match_to_groups(
    groups: ParamGroups, optimizers: Sequence[tuple[str, Optimizer]], *, forms: str
) -> dict[str, Optimizer]:
    """Match built optimizers to groups by the parameters they hold: one optimizer per group.

    Args:
        groups: the groups.
        optimizers: ``(label, optimizer)`` pairs; the label names the argument in messages.
        forms: the accepted forms, appended to every message.

    Returns:
        group name -> optimizer, for every group (in ``groups.names`` order).

    Raises:
        PlanError: an optimizer holds parameters of several groups (or of none), holds
            a group's parameters but not exactly them (missing and extra are named), two
            optimizers hold the same group, or a group has no optimizer.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt_b, opt_a = torch.optim.SGD(net[1].parameters()), torch.optim.SGD(net[0].parameters())
        >>> matched = match_to_groups(groups, [("opt_b", opt_b), ("opt_a", opt_a)], forms="")
        >>> matched == {"a": opt_a, "b": opt_b}
        True
        >>> match_to_groups(groups, [("opt", torch.optim.SGD(net.parameters()))], forms="Accepted: ...")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: opt (SGD) holds parameters of groups ['a', 'b']; with several optimizers each must hold exactly one group's parameters. Accepted: ...
    """
    by_id = _names_by_id(groups)
    matched: dict[str, tuple[str, Optimizer]] = {}
    for label, opt in optimizers:
        held = [by_id.get(id(p)) for p in _held(opt)]
        touched = sorted({g for g in (groups.group_of(n) for n in held if n is not None) if g is not None},
                         key=groups.names.index)
        what = f"{label} ({type(opt).__name__})"
        if len(touched) > 1:
            raise PlanError(f"{what} holds parameters of groups {touched}; with several optimizers each must "
                            f"hold exactly one group's parameters. {forms}")
        if not touched:
            outside = [n if n is not None else "<a parameter outside the model>" for n in held]
            raise PlanError(f"{what} holds no parameter of any group ({_preview(outside)}); known groups: "
                            f"{list(groups.names)}. {forms}")
        name = touched[0]
        if name in matched:
            raise PlanError(f"{matched[name][0]} and {what} both hold group {name!r}'s parameters; give each "
                            f"group one optimizer. {forms}")
        missing, extra = _mismatch(groups, name, opt)
        if missing or extra:
            raise PlanError(f"{what} holds group {name!r}'s parameters but must hold exactly them; missing: "
                            f"{_preview(missing)}; extra (not in group {name!r}): {_preview(extra)}. {forms}")
        matched[name] = (label, opt)
    left = [g for g in groups.names if g not in matched]
    if left:
        raise PlanError(f"no optimizer holds group(s) {left} (the optimizers hold {list(matched)}); their "
                        f"parameters would never be updated; add one optimizer per group left out, or leave "
                        f"those groups out of the ParamGroups. {forms}")
    return {g: matched[g][1] for g in groups.names}


def uncovered(
    groups: ParamGroups, trained_groups: Iterable[str], optimizers: Iterable[Optimizer]
) -> list[tuple[str, Optional[str]]]:
    """The parameters some phase trains that none of ``optimizers`` holds: ``(name, group or None)``.

    ``trained_groups`` are the groups the schedule trains (``schedule.group_names()``,
    unknown names ignored); ungrouped parameters count when ``groups.ungrouped`` is
    ``"trainable"`` (they train in every phase). Checked by identity, in module order.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> uncovered(groups, ["a", "b"], [torch.optim.SGD(net[0].parameters())])
        [('1.weight', 'b'), ('1.bias', 'b')]
    """
    names = [g for g in groups.names if g in set(trained_groups)]
    wanted = groups.trainable_param_names(names)
    held = {id(p) for opt in optimizers for p in _held(opt)}
    return [(n, groups.group_of(n)) for n, p in groups.all_named_params() if n in wanted and id(p) not in held]


def uncovered_message(
    groups: ParamGroups, trained_groups: Iterable[str], optimizers: Iterable[Optimizer]
) -> Optional[str]:
    """``"leaves out N parameter(s) that the schedule trains (group(s) [...]: names)"``, or ``None``.

    The shared start of the coverage refusals (``PhasedAccelerator.prepare`` and
    ``AlternatingFreeze``), over :func:`uncovered`'s list.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> uncovered_message(groups, ["a", "b"], [torch.optim.SGD(net[0].parameters())])
        "leaves out 2 parameter(s) that the schedule trains (group(s) ['b']: '1.weight', '1.bias')"
    """
    missing = uncovered(groups, trained_groups, optimizers)
    if not missing:
        return None
    left = sorted({g or "<ungrouped>" for _, g in missing})
    names = ", ".join(repr(n) for n, _ in missing[:3]) + (", ..." if len(missing) > 3 else "")
    return f"leaves out {len(missing)} parameter(s) that the schedule trains (group(s) {left}: {names})"


def as_factories(groups: ParamGroups, optimizers: Any) -> dict[str, Callable[[list[nn.Parameter]], Optimizer]]:
    """One factory per group; a built optimizer is checked, then returned as is.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt_a = torch.optim.SGD(net[0].parameters(), lr=0.1)
        >>> opt_b = torch.optim.SGD(net[1].parameters(), lr=0.1)
        >>> f = as_factories(groups, {"a": opt_a, "b": opt_b})
        >>> f["a"](groups.params("a")) is opt_a
        True
        >>> as_factories(groups, {"a": opt_b, "b": opt_b})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `optimizers['a']` (SGD) must be built on exactly group 'a''s parameters; missing: ['0.weight', '0.bias']; extra (not in group 'a'): ['1.bias', '1.weight']
    """
    if isinstance(optimizers, Optimizer):
        raise PlanError(
            f"`optimizers` got one built {type(optimizers).__name__} for all groups {list(groups.names)}; "
            "a GroupedOptimizer needs one optimizer per group; " + _FORMS
        )
    if isinstance(optimizers, Mapping):
        unknown = sorted(set(optimizers) - set(groups.names))
        if unknown:
            raise PlanError(f"`optimizers` names unknown groups {unknown}; known groups: {list(groups.names)}")
        missing = [n for n in groups.names if n not in optimizers]
        if missing:
            raise PlanError(
                f"`optimizers` has no entry for groups {missing}; give one per group "
                f"(an optimizer each, or factories), or a single factory for all of {list(groups.names)}"
            )
        out: dict[str, Callable[[list[nn.Parameter]], Optimizer]] = {}
        for name in groups.names:
            value = optimizers[name]
            if isinstance(value, Optimizer):
                _check_built(groups, name, value)
                out[name] = lambda _params, _opt=value: _opt
            elif callable(value):
                out[name] = value
            else:
                raise PlanError(f"`optimizers[{name!r}]` is a {type(value).__name__}; " + _FORMS)
        return out
    if not callable(optimizers):
        raise PlanError(f"`optimizers` is a {type(optimizers).__name__}; " + _FORMS)
    return {name: optimizers for name in groups.names}
