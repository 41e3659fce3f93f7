"""Who owns which parameters, and the forward guards on modules that are off the device.

Residency works per module that owns parameters directly (an :class:`Owner`):
its buffers follow its parameters, and when all of them are non-resident a
forward pre-hook (:class:`ForwardGuards`) refuses a forward through it with a
:class:`~hf_altparams.errors.SwitchError` naming the parameter and the phase,
instead of a device-mismatch error deep inside torch (or, on CPU, a silent use
of a parameter DDP no longer syncs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...errors import SwitchError

__all__ = ["ForwardGuards", "Owner"]


@dataclass(frozen=True)
class Owner:
    """A module that owns parameters directly, and the groups they belong to."""

    name: str
    module: nn.Module
    groups: frozenset[Optional[str]]  # None: an ungrouped parameter (always resident)
    params: tuple[tuple[str, Optional[str]], ...]  # (full name, group)

    def is_off(self, offloaded: frozenset[str]) -> bool:
        return None not in self.groups and self.groups <= offloaded  # type: ignore[operator]

    def buffer_names(self) -> list[tuple[str, str]]:
        """``(full name, attribute name)`` of the module's own buffers."""
        prefix = f"{self.name}." if self.name else ""
        return [(prefix + b, b) for b, t in self.module.named_buffers(recurse=False) if t is not None]


class ForwardGuards:
    """Forward pre-hooks that refuse a forward through a module whose parameters are all off the device.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> owner = Owner("", net, frozenset({"t1"}), (("weight", "t1"), ("bias", "t1")))
        >>> guards = ForwardGuards(torch.device("cpu"))
        >>> guards.install([owner], frozenset({"t1"}), "task0")
        >>> try:
        ...     net(torch.ones(1, 2))
        ... except SwitchError as err:
        ...     print(str(err)[:48])
        module '<root>' ran its forward in phase 'task0'
        >>> guards.remove(); net(torch.ones(1, 2)).shape
        torch.Size([1, 1])
    """

    def __init__(self, offload_device: Optional[torch.device]) -> None:
        self.offload_device = offload_device
        self._hooks: list[RemovableHandle] = []

    def install(self, owners: Iterable[Owner], offloaded: frozenset[str], phase_name: str) -> None:
        """Replace the hooks: guard every owner that is entirely in ``offloaded``."""
        self.remove()
        for owner in owners:
            if owner.is_off(offloaded):
                self._hooks.append(owner.module.register_forward_pre_hook(self._hook(owner, phase_name)))

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def _hook(self, owner: Owner, phase_name: str) -> Callable[..., None]:
        param, group = owner.params[0]
        where = f"lives on {self.offload_device}" if self.offload_device is not None else "is not kept current"

        def refuse_non_resident(module: nn.Module, args: object) -> None:
            raise SwitchError(
                f"module {owner.name or '<root>'!r} ran its forward in phase {phase_name!r}, "
                f"but its parameter {param!r} (group {group!r}) is not resident in that phase: it "
                f"{where} and DDP does not sync it. Add {group!r} to the "
                "phase's `resident` groups, route inputs only through the resident tasks, or wrap "
                f"an evaluation in `accelerator.visiting([{group!r}])` (the Trainer callback's "
                "`.visiting`, or `switcher.residency.visiting` with the engine)"
            )

        return refuse_non_resident
