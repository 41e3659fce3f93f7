"""Checks of what :class:`~hf_altparams.engine.GroupedOptimizer` is given.

The `optimizers` argument takes a factory ``params -> Optimizer`` (one for every
group), a mapping from group name to factory, or a mapping from group name to an
optimizer the user already built on exactly that group's parameters. Everything
else is refused here with a :class:`PlanError` naming the value and the accepted
forms, before any inner optimizer exists.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from torch import nn
from torch.optim import Optimizer

from ..errors import PlanError
from ..plan.groups import ParamGroups

__all__ = ["check_groups_argument", "as_factories"]

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


def _check_built(groups: ParamGroups, name: str, opt: Optimizer) -> None:
    wanted = groups.params(name)
    names = dict(zip(map(id, wanted), groups.param_names(name)))
    held = _held(opt)
    held_ids = {id(p) for p in held}
    missing = [names[id(p)] for p in wanted if id(p) not in held_ids]
    extra_ids = held_ids - set(names)
    if missing or extra_ids:
        where = {id(p): n for n, p in groups.module.named_parameters(remove_duplicate=False)}
        extra = sorted(where.get(i, "<a parameter outside the model>") for i in extra_ids)
        raise PlanError(
            f"`optimizers[{name!r}]` ({type(opt).__name__}) must be built on exactly group {name!r}'s "
            f"parameters; missing: {missing}; extra (not in group {name!r}): {extra}"
        )


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
