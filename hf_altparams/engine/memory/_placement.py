"""How a residency's tensors move between the device and the offload device.

:class:`Placement` is the half of :class:`~hf_altparams.engine.memory._residency.ResidencyManager`
that moves tensors: parameters (their ``.data``, so their identity stays), their
gradients, the buffers of modules whose parameters are all non-resident, and
the optimizer state of those parameters, out to ``offload_device`` and back to
the device each one left (or ``device``); plus the prefetch of a coming
phase's tensors on a side stream, which the next placement consumes. The
copies themselves (pinned host buffers, side streams) are in :mod:`._transfer`;
which groups are off, the DDP ignore list and the guards stay in
:mod:`.residency`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch import nn

from ...plan.groups import ParamGroups
from ._owners import Owner
from ._transfer import HostCopies, Prefetcher, nbytes, optimizer_of, param_group_map, state_target_device, to_device, to_host

__all__ = ["Placement"]


class Placement:
    """Tensor moves for :class:`~hf_altparams.engine.memory._residency.ResidencyManager` (a mixin).

    The manager sets every attribute annotated here in its ``__init__``.
    """

    groups: ParamGroups
    offload_device: Optional[torch.device]
    device: Optional[torch.device]
    ddp_device: Optional[torch.device]
    optimizer: Any
    place_data: Callable[[torch.Tensor, torch.Tensor], None]
    _offloaded: frozenset[str]
    _owners: list[Owner]
    _home: dict[int, torch.device]
    _host_copies: HostCopies
    _prefetcher: Prefetcher

    # ------------------------------------------------------------ placement
    def _place(self, check: frozenset[str], keep_state_off: Callable[[str], bool]) -> int:
        if not check:  # a switch that moves no group (the usual case): nothing to look at
            return 0
        off = self._offloaded
        state = self._optimizer_state()
        moved = 0
        # Out first: free device memory before anything comes back.
        for group in sorted(check & off):
            for param in self.groups.params(group):
                moved += self._move_out(param)
                moved += self._state_out(state, param)
        for owner in self._owners:
            if owner.is_off(off) and owner.groups & check:
                for _, attr in owner.buffer_names():
                    moved += self._move_out(owner.module._buffers[attr])  # type: ignore[arg-type]
        for owner in self._owners:
            if not owner.is_off(off) and owner.groups & check:
                for _, attr in owner.buffer_names():
                    moved += self._move_in(owner.module._buffers[attr])  # type: ignore[arg-type]
        groups_of = param_group_map(state[1]) if state is not None else {}
        for group in sorted(check - off):
            for param in self.groups.params(group):
                moved += self._move_in(param)
                if not keep_state_off(group):
                    moved += self._state_in(state, param, groups_of)
        return moved

    def _home_of(self, tensor: torch.Tensor) -> Optional[torch.device]:
        if self.device is not None:
            return self.device
        return self._home.get(id(tensor), self.ddp_device)

    def _move_out(self, tensor: torch.Tensor) -> int:
        if self.offload_device is None or tensor.device == self.offload_device:
            return 0
        self._home[id(tensor)] = tensor.device
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
        if grad is not None:
            tensor.grad = None
        moved = nbytes(tensor)
        self.place_data(tensor, to_host(tensor.data, self.offload_device))
        if grad is not None:
            tensor.grad = to_host(grad, self.offload_device)
            moved += nbytes(grad)
        self._host_copies.note(self._home[id(tensor)])
        return moved

    def _move_in(self, tensor: torch.Tensor) -> int:
        home = self._home_of(tensor)
        if home is None or tensor.device == home:
            return 0
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
        if grad is not None:
            tensor.grad = None
        prefetched = self._prefetcher.take(("param", id(tensor)), tensor)
        self.place_data(tensor, prefetched if prefetched is not None else to_device(tensor.data, home))
        moved = nbytes(tensor)
        if grad is not None:
            tensor.grad = to_device(grad, home)
            moved += nbytes(grad)
        return moved

    def _optimizer_state(self) -> Optional[tuple[Mapping[Any, Any], list[Mapping[str, Any]]]]:
        opt = optimizer_of(self.optimizer) if self.optimizer is not None else None
        if opt is None:
            return None
        return opt.state, opt.param_groups

    def _state_out(self, state: Optional[tuple[Mapping[Any, Any], Any]], param: nn.Parameter) -> int:
        if state is None or self.offload_device is None:
            return 0
        entry = state[0].get(param)
        moved = 0
        for key, value in list((entry or {}).items()):
            if isinstance(value, torch.Tensor) and value.device != self.offload_device:
                entry[key] = to_host(value, self.offload_device)  # type: ignore[index]
                self._host_copies.note(value.device)
                moved += nbytes(value)
        return moved

    def _state_in(
        self,
        state: Optional[tuple[Mapping[Any, Any], Any]],
        param: nn.Parameter,
        groups_of: Mapping[int, Mapping[str, Any]],
    ) -> int:
        if state is None:
            return 0
        entry = state[0].get(param)
        moved = 0
        for key, value in list((entry or {}).items()):
            if not isinstance(value, torch.Tensor):
                continue
            target = state_target_device(param, key, groups_of.get(id(param)))
            if target is not None and value.device != target:
                ready = self._prefetcher.take(("state", id(param), key), value)
                entry[key] = ready if ready is not None else to_device(value, target)  # type: ignore[index]
                moved += nbytes(value)
        return moved

    # ------------------------------------------------------------ prefetch
    def prefetch(self, groups: Iterable[str], max_bytes: Optional[int] = None) -> int:
        """Start copying the parameters of non-resident ``groups`` back, on a side stream.

        The copies overlap whatever the device computes until the next switch,
        which consumes them; until then they occupy device memory (that is the
        trade-off: see ``PhaseSwitcher(prefetch=...)``). Returns the bytes started
        (0 off CUDA, or when nothing of ``groups`` is off the device).
        """
        started = 0
        todo: list[tuple[tuple[Any, ...], torch.Tensor, torch.device]] = []
        later: list[tuple[tuple[Any, ...], torch.Tensor, torch.device]] = []
        state = self._optimizer_state()
        groups_of = param_group_map(state[1]) if state is not None else {}
        for group in sorted(set(groups) & self._offloaded):
            for param in self.groups.params(group):
                home = self._home_of(param)
                if home is None or param.device == home:
                    continue
                todo.append((("param", id(param)), param, home))
                entry = state[0].get(param) if state is not None else None
                for key, value in (entry or {}).items():
                    if isinstance(value, torch.Tensor) and value.device != home and \
                            state_target_device(param, key, groups_of.get(id(param))) is not None:
                        later.append((("state", id(param), key), value, home))
        for key, tensor, home in todo + later:  # parameters first: the forward needs them first
            if max_bytes is not None and started + nbytes(tensor) > max_bytes:
                break
            started += self._prefetcher.start(key, tensor, home)
        return started

    @property
    def prefetched_bytes(self) -> int:
        """Device bytes of parameters prefetched and not yet consumed."""
        return self._prefetcher.bytes
