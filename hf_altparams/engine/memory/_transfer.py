"""Moving tensors between the compute device and the offload device.

Shared by the optimizer-state policy (:mod:`.optim`) and per-task residency
(:mod:`.residency`). Three rules hold everywhere:

* Device -> host copies go into pinned memory with ``non_blocking=True`` when
  the source is on CUDA. The device memory of the source is released in stream
  order (later kernels on the same stream may reuse it at once, so the copy
  never raises the peak), and the host does not wait. A host copy must not be
  *read on the CPU* before :meth:`HostCopies.wait` (a checkpoint does that).
* Host -> device copies at a switch run on the current stream, ``non_blocking``
  from pinned memory: they are ordered before the next step's kernels.
* A *prefetch* runs on a side stream while the current phase computes: the
  destination is allocated on the current stream (so its memory comes from the
  same pool as everything else), the side stream waits for the current stream
  before writing, and the consumer makes the current stream wait for the copy's
  event before using it (:meth:`Prefetcher.take`).

A ``DTensor`` (FSDP2's sharded parameters and their optimizer state) moves by
its local shard: the copy is rewrapped with the same spec, and its size is the
shard's (:mod:`._fsdp2` holds the DTensor internals).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Optional

import torch
from torch import nn

from ..fsdp2._dtensor import dtensor_with_local, is_dtensor, local_tensor, set_data

__all__ = [
    "HostCopies",
    "Prefetcher",
    "nbytes",
    "optimizer_of",
    "param_group_map",
    "set_data",
    "state_target_device",
    "to_device",
    "to_host",
]


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements on this rank (``numel * element_size``; a DTensor's shard)."""
    return local_tensor(tensor).nbytes


def to_host(tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``host``; pinned and non-blocking from CUDA.

    Keeps the strides of a dense tensor (``empty_like``), so a parameter comes
    back with the layout it left with.
    """
    if is_dtensor(tensor):
        return dtensor_with_local(tensor, to_host(local_tensor(tensor), host))
    pin = tensor.is_cuda and host.type == "cpu"
    out = torch.empty_like(tensor, device=host, pin_memory=pin)
    out.copy_(tensor, non_blocking=pin)
    return out


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; non-blocking when the source is pinned host memory."""
    if tensor.device == device:
        return tensor
    if is_dtensor(tensor):
        return dtensor_with_local(tensor, to_device(local_tensor(tensor), device))
    pinned = tensor.device.type == "cpu" and device.type == "cuda" and tensor.is_pinned()
    return tensor.to(device, non_blocking=pinned)


class HostCopies:
    """Tracks device -> host copies still in flight (CUDA only).

    :meth:`note` each device a copy was queued from, :meth:`record` once after
    a batch of copies, and :meth:`wait` before the CPU reads a host copy.
    Only the latest event per stream is kept (work on one stream completes in
    order), so nothing accumulates over many switches. Off CUDA the copies were
    synchronous and there is nothing to track.
    """

    def __init__(self) -> None:
        self._devices: set[torch.device] = set()
        self._events: dict[tuple[torch.device, int], Any] = {}

    def note(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._devices.add(device)

    def record(self) -> None:
        for device in self._devices:
            stream = torch.cuda.current_stream(device)
            event = torch.cuda.Event()
            event.record(stream)
            self._events[(device, stream.stream_id)] = event
        self._devices.clear()

    def wait(self) -> None:
        self.record()
        for event in self._events.values():
            event.synchronize()
        self._events.clear()

    @property
    def pending(self) -> bool:
        return bool(self._events or self._devices)


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@dataclass
class _Pending:
    source: torch.Tensor
    version: int
    pointer: int
    dest: torch.Tensor
    event: Any


class Prefetcher:
    """Host -> device copies started early on a side stream, consumed at the switch.

    A prefetched copy is used only if its source is still the same tensor with
    the same version counter (an in-place write, e.g. ``load_state_dict``, or a
    replaced optimizer state tensor makes it stale, and the consumer copies
    afresh). Off CUDA nothing is prefetched (:meth:`start` returns 0).
    """

    def __init__(self) -> None:
        self._pending: dict[Hashable, _Pending] = {}

    def start(self, key: Hashable, source: torch.Tensor, device: torch.device) -> int:
        """Start copying ``source`` (pinned host) to ``device``; return the bytes started."""
        if device.type != "cuda" or is_dtensor(source) or not source.is_pinned() or key in self._pending:
            return 0
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        with torch.no_grad():
            dest = torch.empty_like(source, device=device)  # from the current stream's pool
            side.wait_stream(current)  # the block may still be read by queued kernels
            with torch.cuda.stream(side):
                dest.copy_(source, non_blocking=True)
        dest.record_stream(side)  # freeing `dest` early must wait for the copy
        event = torch.cuda.Event()
        event.record(side)
        self._pending[key] = _Pending(source, source._version, source.data_ptr(), dest, event)
        return nbytes(source)

    def take(self, key: Hashable, source: torch.Tensor) -> Optional[torch.Tensor]:
        """The prefetched copy of ``source`` (the current stream waits for it), or None."""
        entry = self._pending.pop(key, None)
        if entry is None or entry.source is not source or entry.version != source._version:
            return None
        if entry.pointer != source.data_ptr():  # `.data` was replaced since
            return None
        torch.cuda.current_stream(entry.dest.device).wait_event(entry.event)
        return entry.dest

    def cancel(self, keys: Optional[Iterable[Hashable]] = None) -> None:
        """Drop prefetched copies (all, or those of ``keys``); their memory is freed."""
        if keys is None:
            self._pending.clear()
        else:
            for key in keys:
                self._pending.pop(key, None)

    @property
    def bytes(self) -> int:
        """Device bytes held by prefetched copies not yet consumed."""
        return sum(nbytes(p.dest) for p in self._pending.values())

    def __len__(self) -> int:
        return len(self._pending)


def optimizer_of(optimizer: Any) -> Any:
    """Unwrap ``.optimizer`` chains (Accelerate's ``AcceleratedOptimizer``, LOMO wrappers)."""
    seen: set[int] = set()
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        if id(optimizer) in seen:
            break
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def param_group_map(param_groups: Iterable[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """``id(param) -> its param group`` for an optimizer's ``param_groups``."""
    return {id(p): group for group in param_groups for p in group["params"]}


def state_target_device(
    param: nn.Parameter, key: Hashable, group: Optional[Mapping[str, Any]]
) -> Optional[torch.device]:
    """Where torch keeps state ``key`` of ``param``; None when it stays where it is.

    The same rule as ``Optimizer.load_state_dict``: ``"step"`` lives on the CPU
    unless the group is ``capturable`` or ``fused``; everything else lives on the
    parameter's device.
    """
    if key == "step" and not (group and (group.get("capturable") or group.get("fused"))):
        return None
    return param.device
