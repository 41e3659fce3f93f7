"""One ZeRO-1/2 optimizer's partitions per library group: which are stepped and gathered, which are held.

:class:`ZeroPartitions` is the one writer of what a phase changes inside a
``DeepSpeedZeroOptimizer`` (through the names of :mod:`._surface`):

* **which param groups are active** (:meth:`ZeroPartitions.set_active`, from
  the ``requires_grad`` flags the switch set): DeepSpeed steps its inner torch
  optimizer one param group at a time, and a step pre-hook (public torch API)
  takes the gradient off an idle group's fp32 partition, so torch skips it (no
  update, no weight decay, no state); the post-step all-gather leaves idle
  groups out (:class:`._surface.AllGatherFilter`);
* **where an idle group's fp32 partition and optimizer state are**
  (:meth:`ZeroPartitions.place`): kept; dropped (the state popped, the
  partition tensor pointed at the group's own bit16 partition, so DeepSpeed's
  fp32-to-bit16 copy after the step is a copy onto itself, and refilled from
  the bit16 weights when the group returns: exact for fp32 weights, the master
  restarted from the bf16 weights otherwise); or offloaded (state and a copy of
  the partition on the host, the partition pointed at the bit16 one meanwhile,
  both brought back exactly). Memory is let go by dropping references (DeepSpeed's
  per-parameter views re-linked), never by resizing storages: a storage loaded
  from a checkpoint cannot be resized.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.optim import Optimizer

from ..memory import StatePolicy, TensorMover
from ._surface import AllGatherFilter, bit16_partition, fp32_partition, group_params, relink_views, surface_problems

__all__ = ["GROUP_TAG", "ZeroPartitions"]

#: The key naming the library group in each param group of an optimizer split for ZeRO.
GROUP_TAG = "altparams_group"

#: The ZeroPartitions driving each ZeRO optimizer now (by id; one per optimizer).
_LIVE: dict[int, ZeroPartitions] = {}


class ZeroPartitions:
    """The phase's view of one ``DeepSpeedZeroOptimizer``: active param groups, idle groups' placement.

    Args:
        zero: the engine's ZeRO-1/2 optimizer (checked by :func:`._surface.surface_problems` first).
    """

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        self.inner: Optimizer = zero.optimizer
        count = len(self.inner.param_groups)
        #: the library group of each param group (``None``: untagged)
        self.tags: list[Optional[str]] = [pg.get(GROUP_TAG) for pg in self.inner.param_groups]
        self.master_dtype = [fp32_partition(zero, i).dtype for i in range(count)]
        #: param groups whose partition stands in for the bit16 one now (dropped or offloaded)
        self.aliased: set[int] = set()
        self.host_masters: dict[int, torch.Tensor] = {}
        self.host_state: dict[int, dict[str, Any]] = {}
        self.active: frozenset[int] = frozenset(range(count))
        self.mover = TensorMover()
        previous = _LIVE.get(id(zero))
        if previous is not None and previous.zero is zero:  # a new run on the same engine (the Trainer's next
            previous.close()  # train()): what the last one placed is where it is
            self.aliased, self.host_masters = previous.aliased, previous.host_masters
            self.host_state = previous.host_state
            self.master_dtype = previous.master_dtype
        _LIVE[id(zero)] = self
        # DeepSpeed narrows `param_groups` to the one group it steps; a group is known by its partition tensor
        # (the object stays; a checkpoint load replaces the group dicts, and a drop only its `.data`)
        self._index = {id(fp32_partition(zero, i)): i for i in range(count)}
        self._hook = self.inner.register_step_pre_hook(self._skip_idle)
        AllGatherFilter.install()

    # ------------------------------------------------------------ what a phase trains
    @property
    def count(self) -> int:
        return len(self.tags)

    def indices(self, group: str) -> list[int]:
        """The param groups of library group ``group``."""
        return [i for i, tag in enumerate(self.tags) if tag == group]

    def params(self, index: int) -> list[torch.nn.Parameter]:
        """The model parameters of param group ``index``."""
        return group_params(self.zero, index)

    def fp32(self, index: int) -> torch.Tensor:
        """This rank's fp32 partition of param group ``index`` (the bit16 one while it stands in for it)."""
        return fp32_partition(self.zero, index)

    def flags(self) -> list[Optional[bool]]:
        """Each param group's ``requires_grad`` (``None``: its parameters disagree)."""
        out: list[Optional[bool]] = []
        for i in range(self.count):
            seen = {p.requires_grad for p in group_params(self.zero, i)}
            out.append(seen.pop() if len(seen) == 1 else None)
        return out

    def set_active(self, active: frozenset[int]) -> None:
        """Step and gather only ``active`` param groups from the next step on."""
        self.active = active
        AllGatherFilter.set_idle(self.zero, frozenset(range(self.count)) - active)

    def _skip_idle(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        """DeepSpeed steps one param group at a time (``param_groups`` narrowed to it): an idle one is skipped."""
        AllGatherFilter.arm(self.zero)
        for group in optimizer.param_groups:
            index = self._index.get(id(group["params"][0])) if group["params"] else None
            if index is not None and index not in self.active:
                for tensor in group["params"]:
                    tensor.grad = None

    # ------------------------------------------------------------ where idle groups' state lives
    def place(self, index: int, state: StatePolicy, master: StatePolicy) -> tuple[int, int]:
        """Put param group ``index``'s optimizer state and fp32 partition where the idle policies say.

        Returns ``(bytes let go of, bytes brought back)`` on this rank.
        """
        if state is StatePolicy.KEEP and master is StatePolicy.KEEP:
            return 0, self.restore(index)
        freed = 0
        partition = fp32_partition(self.zero, index)
        held = self.inner.state.pop(partition, None)
        if held:
            size = _state_bytes(held)
            if state is StatePolicy.OFFLOAD:
                host = torch.device("cpu")
                self.host_state[index] = {
                    k: self.mover.to_host(v, host) if _is_tensor(v) else v for k, v in held.items()
                }
            elif state is StatePolicy.KEEP:
                self.inner.state[partition] = held
                size = 0
            freed += size
        if index not in self.aliased and master is not StatePolicy.KEEP:
            if master is StatePolicy.OFFLOAD:
                self.host_masters[index] = self.mover.to_host(partition.detach(), torch.device("cpu"))
            freed += partition.untyped_storage().nbytes()
            partition.data = bit16_partition(self.zero, index)
            self.aliased.add(index)
        return freed, 0

    def restore(self, index: int) -> int:
        """Bring param group ``index``'s fp32 partition and state back for training; the bytes brought back."""
        back = 0
        partition = fp32_partition(self.zero, index)
        if index in self.aliased:
            self.mover.settle()
            saved = self.host_masters.pop(index, None)
            source = saved if saved is not None else bit16_partition(self.zero, index)
            partition.data = source.to(device=partition.device, dtype=self.master_dtype[index], copy=True)
            self.aliased.discard(index)
            back += partition.untyped_storage().nbytes()
        held = self.host_state.pop(index, None)
        if held is not None:
            self.mover.settle()
            self.inner.state[partition] = {
                k: self.mover.to_device(v, partition.device) if _is_tensor(v) else v for k, v in held.items()
            }
            back += _state_bytes(self.inner.state[partition])
        return back

    def relink(self) -> None:
        """DeepSpeed's per-parameter views follow the partitions placed; what was let go is referenced no more."""
        relink_views(self.zero)

    # ------------------------------------------------------------ reading
    def state_bytes(self, index: int) -> int:
        """This rank's bytes of optimizer state for param group ``index`` (on the device)."""
        held = self.inner.state.get(fp32_partition(self.zero, index))
        return _state_bytes(held) if held else 0

    def master_bytes(self, index: int) -> int:
        """This rank's bytes of fp32 partition held for param group ``index`` (0 while it stands in for bit16)."""
        return 0 if index in self.aliased else fp32_partition(self.zero, index).untyped_storage().nbytes()

    def problems(self) -> list[str]:
        return surface_problems(self.zero)

    def close(self) -> None:
        """Stop skipping and filtering for this optimizer (the engine trains every group again)."""
        self._hook.remove()
        AllGatherFilter.forget(self.zero)
        if _LIVE.get(id(self.zero)) is self:
            del _LIVE[id(self.zero)]


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _state_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
