"""Per-phase layouts: what a switch needs of a trainable set, computed once.

A run that switches every step goes through the same few phases again and
again; the flag per parameter, the trainable names and the sizes of a phase
never change (the groups are fixed), so :class:`PhaseLayouts` computes them at
the first switch into a phase and a later switch only looks them up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from torch import nn

from ..plan.groups import ParamGroups
from ..plan.phase import Phase

__all__ = ["CACHED_PHASES", "Layout", "PhaseLayouts", "remember"]

#: How many phases the per-phase caches hold: a random schedule (``RandomBlocks``)
#: can visit thousands of distinct phases, and the caches must stay bounded.
CACHED_PHASES = 64

K = TypeVar("K")
V = TypeVar("V")


def remember(cache: dict[K, V], key: K, value: V, limit: int = CACHED_PHASES) -> V:
    """Store ``value`` under ``key``, dropping the oldest entry past ``limit``; return ``value``.

    Example:
        >>> cache: dict[int, int] = {}
        >>> for i in range(5):
        ...     _ = remember(cache, i, i * i, limit=3)
        >>> cache
        {2: 4, 3: 9, 4: 16}
    """
    if key not in cache and len(cache) >= limit:
        del cache[next(iter(cache))]
    cache[key] = value
    return value


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
        self._split: dict[frozenset[str], tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]] = {}

    def get(self, trainable_groups: frozenset[str]) -> Layout:
        """The layout of the phase that trains ``trainable_groups``."""
        layout = self._by_groups.get(trainable_groups)
        if layout is None:
            names = self.groups.trainable_param_names(Phase(trainable_groups).trainable)
            flags = self.flags(names)
            chosen = [p for p, flag in zip(self.params, flags) if flag]
            layout = remember(
                self._by_groups,
                trainable_groups,
                Layout(
                    trainable=names,
                    flags=flags,
                    groups=tuple(sorted(trainable_groups)),
                    params=sum(p.numel() for p in chosen),
                    nbytes=sum(p.numel() * p.element_size() for p in chosen),
                ),
            )
        return layout

    def split(
        self, trainable_groups: frozenset[str]
    ) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
        """The phase's trainable ``(name, parameter)`` pairs and the idle ones, in ParamGroups order."""
        split = self._split.get(trainable_groups)
        if split is None:
            flags = self.get(trainable_groups).flags
            named = list(zip(self.names, self.params))
            split = remember(
                self._split,
                trainable_groups,
                (
                    [pair for pair, flag in zip(named, flags) if flag],
                    [pair for pair, flag in zip(named, flags) if not flag],
                ),
            )
        return split

    def flags(self, trainable_names: frozenset[str]) -> tuple[bool, ...]:
        """``requires_grad`` per parameter for a set of trainable parameter names."""
        flags = self._flags.get(trainable_names)  # a layout's own frozenset: its hash is cached
        if flags is None:
            flags = remember(self._flags, trainable_names, tuple(n in trainable_names for n in self.names))
        return flags
