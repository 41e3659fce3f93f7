"""The optimizer layout ZeRO needs for phases: one param group per library group, tagged with its name.

ZeRO-1/2 flattens each param group of the optimizer it is given into one
buffer and gives every rank an equal slice of it, whatever the parameter
boundaries: with the usual two param groups (decay and no decay) every rank's
fp32 partition mixes layers, and no layer can be skipped, freed or left out of
the all-gather. Split by library group, each group owns whole param groups,
hence whole partitions, whole optimizer states and whole all-gathers, and
every rank holds an equal slice of each group (any phase is balanced).

Both splits keep each param group's settings (``weight_decay``, ``lr``, ...) and
its order, splitting it by library group in the order the groups' parameters
come; a parameter in no group keeps an untagged group of its own settings,
unless none of them requires a gradient (ungrouped parameters frozen for the
run, such as a final norm in no group): that piece is left out of the
optimizer, since ZeRO leaves frozen parameters out of its partitions and stops
``deepspeed.initialize`` on a param group with none to optimize (deepspeed
0.19: an ``IndexError``). Pure torch: nothing here touches DeepSpeed.

Example:
    >>> import torch
    >>> from hf_altparams.plan import ParamGroups
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    >>> opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    >>> split_param_groups(opt, groups)
    2
    >>> [(g[GROUP_TAG], len(g["params"])) for g in opt.param_groups]
    [('a', 2), ('b', 2)]
    >>> type(split_optimizer_class(torch.optim.AdamW, groups)(net.parameters(), lr=0.1)).__name__
    'AdamW'
"""

from __future__ import annotations

from typing import Any, Optional

from torch import nn
from torch.optim import Optimizer

from ...errors import PlanError
from ...plan.groups import ParamGroups
from ._partitions import GROUP_TAG

__all__ = ["GROUP_TAG", "is_split", "split_optimizer_class", "split_param_groups"]


def is_split(optimizer: Optimizer) -> bool:
    """Whether every param group of ``optimizer`` carries a library group's tag."""
    return all(GROUP_TAG in group for group in optimizer.param_groups)


def split_param_groups(optimizer: Optimizer, groups: ParamGroups) -> int:
    """Split ``optimizer``'s param groups in place, one per (param group x library group), tagged; their count.

    Nothing to do when they are split already.

    Raises:
        PlanError: ``optimizer`` has state already (it must be split before its first step).
    """
    if is_split(optimizer):
        return len(optimizer.param_groups)
    if any(optimizer.state.values()):
        raise PlanError(
            "the optimizer has stepped already: it must be split per group before DeepSpeed partitions "
            "it, i.e. before its first step; pass a fresh optimizer"
        )
    group_of = _group_of(groups)
    split: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        pieces: dict[Optional[str], list[nn.Parameter]] = {}
        for param in group["params"]:
            pieces.setdefault(group_of.get(id(param)), []).append(param)
        split += [
            {**group, "params": params, GROUP_TAG: name}
            for name, params in pieces.items()
            if name is not None or any(p.requires_grad for p in params)  # ungrouped and frozen: never optimized
        ]
    optimizer.param_groups[:] = split
    return len(split)


def split_optimizer_class(cls: type[Optimizer], groups: ParamGroups) -> type[Optimizer]:
    """A stand-in for ``cls`` that builds a ``cls`` whose param groups are split over ``groups``.

    For the Trainer's ``optimizer_cls_and_kwargs``: calling it with the Trainer's
    param groups and options returns an instance of ``cls`` itself (DeepSpeed
    checks the exact class against the optimizers it supports), split.
    """

    def build(_: type, params: Any, **kwargs: Any) -> Optimizer:
        optimizer = cls(params, **kwargs)
        split_param_groups(optimizer, groups)
        return optimizer

    return type(f"Split{cls.__name__}", (cls,), {"__new__": build, "altparams_groups": groups})


def _group_of(groups: ParamGroups) -> dict[int, str]:
    return {id(param): name for name in groups.names for param in groups.params(name)}
