"""Which parameters each group holds: saved with every checkpoint, compared before a resume loads.

A resume with other groups trains other parameters at the saved schedule
position: the same step now unfreezes another layer, and the optimizer state
of one group lands on another's parameters (refused by torch only when the
shapes differ: under Adam, by luck; under SGD without momentum, never). So
both integrations save the group membership (group -> parameter names) and
refuse, naming the groups that differ, a resume whose groups are not the saved
ones, whatever the optimizer.

Names are compared as the user's model names them: the parts wrappers insert
(activation checkpointing, ``torch.compile``) are dropped, so a checkpoint
saved under FSDP2 compares equal with the same groups on the plain model.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..plan.groups import ParamGroups
from ._fsdp2_prepare import canonical_name

__all__ = ["membership", "membership_difference"]


def membership(groups: ParamGroups) -> dict[str, list[str]]:
    """``{group: [parameter names]}`` in definition order (what a checkpoint records).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> membership(ParamGroups(net, {"a": "0.*", "b": "1.weight"}))
        {'a': ['0.weight', '0.bias'], 'b': ['1.weight']}
    """
    return {g: [canonical_name(n) for n in groups.param_names(g)] for g in groups.names}


def _preview(names: list[str]) -> str:
    return repr(names[:3])[:-1] + (f", ... {len(names) - 3} more]" if len(names) > 3 else "]")


def membership_difference(saved: Mapping[str, Any], groups: ParamGroups) -> Optional[str]:
    """How ``groups`` differ from the ``saved`` membership (``None``: the same groups, the same parameters).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> now = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> membership_difference(membership(now), now) is None
        True
        >>> print(membership_difference({"a": ["1.weight", "1.bias"], "b": ["0.weight", "0.bias"]}, now))
        group 'a' held ['1.weight', '1.bias'] in the checkpoint only and holds ['0.weight', '0.bias'] now only; group 'b' held ['0.weight', '0.bias'] in the checkpoint only and holds ['1.weight', '1.bias'] now only
    """
    mine = membership(groups)
    parts = []
    for group in [*saved, *(g for g in mine if g not in saved)]:
        before, now = saved.get(group), mine.get(group)
        if before is None:
            parts.append(f"group {group!r} is new (not in the checkpoint)")
        elif now is None:
            parts.append(f"group {group!r} of the checkpoint is gone")
        elif [canonical_name(n) for n in before] != now:
            lost = [n for n in before if canonical_name(n) not in set(now)]
            gained = [n for n in now if n not in {canonical_name(m) for m in before}]
            bits = ([f"held {_preview(lost)} in the checkpoint only"] if lost else []) + (
                [f"holds {_preview(gained)} now only"] if gained else [])
            parts.append(f"group {group!r} " + (" and ".join(bits) or "holds the same parameters in another order"))
    return "; ".join(parts) or None
