"""Per-phase layouts: what a switch needs of a trainable set, computed once.

A run that switches every step goes through the same few phases again and
again; the flag per parameter, the trainable names and the sizes of a phase
never change (the groups are fixed), so :class:`PhaseLayouts` computes them at
the first switch into a phase and a later switch only looks them up.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..plan.groups import ParamGroups
from ..plan.phase import Phase

__all__ = ["Layout", "PhaseLayouts"]


@dataclass(frozen=True)
class Layout:
    """A trainable set's flags and sizes."""

    trainable: frozenset[str]  # parameter names
    flags: tuple[bool, ...]  # requires_grad per parameter, in ParamGroups order
    groups: tuple[str, ...]
    params: int
    nbytes: int


class PhaseLayouts:
    """The layouts of the trainable sets seen so far.

    Example:
        >>> import torch
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> layouts = PhaseLayouts(ParamGroups(net, {"a": "0.*", "b": "1.*"}))
        >>> layout = layouts.get(frozenset({"b"}))
        >>> layout.flags, layout.params, layouts.get(frozenset({"b"})) is layout
        ((False, False, True, True), 3, True)
    """

    def __init__(self, groups: ParamGroups) -> None:
        self.groups = groups
        named = groups.all_named_params()
        self.names = [name for name, _ in named]
        self.params = [param for _, param in named]
        self._by_groups: dict[frozenset[str], Layout] = {}
        self._flags: dict[frozenset[str], tuple[bool, ...]] = {}

    def get(self, trainable_groups: frozenset[str]) -> Layout:
        """The layout of the phase that trains ``trainable_groups``."""
        layout = self._by_groups.get(trainable_groups)
        if layout is None:
            names = self.groups.trainable_param_names(Phase(trainable_groups).trainable)
            flags = self.flags(names)
            chosen = [p for p, flag in zip(self.params, flags) if flag]
            layout = self._by_groups[trainable_groups] = Layout(
                trainable=names, flags=flags, groups=tuple(sorted(trainable_groups)),
                params=sum(p.numel() for p in chosen), nbytes=sum(p.numel() * p.element_size() for p in chosen))
        return layout

    def flags(self, trainable_names: frozenset[str]) -> tuple[bool, ...]:
        """``requires_grad`` per parameter for a set of trainable parameter names."""
        flags = self._flags.get(trainable_names)  # a layout's own frozenset: its hash is cached
        if flags is None:
            flags = self._flags[trainable_names] = tuple(n in trainable_names for n in self.names)
        return flags
