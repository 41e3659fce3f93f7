"""Moving tensors between the compute device and the host: :class:`TensorMover`, the one mover.

Every tensor hf_altparams moves off the device and back goes through a
:class:`TensorMover`: idle groups' optimizer state (:class:`~hf_altparams.engine.GroupedOptimizer`),
idle groups' fp32 masters (:class:`~hf_altparams.engine.PrecisionOptimizer`),
and the parameters, gradients, buffers and optimizer state of non-resident
groups (:class:`~hf_altparams.engine.memory.ResidencyManager`). Each of those
owns one mover; the rules below hold for all of them:

* Device -> host copies go into pinned memory with ``non_blocking=True`` when
  the source is on CUDA. The device memory of the source is released in stream
  order (later kernels on the same stream may reuse it at once, so the copy
  never raises the peak), and the host does not wait. A host copy must not be
  *read on the CPU* before :meth:`TensorMover.settle` (a checkpoint does that).
* Host -> device copies at a switch run on the current stream, ``non_blocking``
  from pinned memory: they are ordered before the next step's kernels.
* A *prefetch* runs on a side stream while the current phase computes: the
  destination is allocated on the current stream (so its memory comes from the
  same pool as everything else), the side stream waits for the current stream
  before writing, and a later :meth:`TensorMover.to_device` for the same key
  makes the current stream wait for the copy's event before using it. A
  prefetched copy is used only if its source is still the same tensor, with the
  same version counter and data pointer (an in-place write, a
  ``load_state_dict`` or a replaced tensor make it stale: copied afresh).
* Optimizer state lives where torch keeps it for its parameter
  (:func:`state_target_device`: ``Optimizer.load_state_dict``'s rule).

A ``DTensor`` (FSDP2's sharded parameters and their optimizer state) moves by
its local shard: the copy is rewrapped with the same spec, and its size is the
shard's (the DTensor internals are in :mod:`hf_altparams.engine.fsdp2`).

Example:
    >>> import torch
    >>> param = torch.nn.Parameter(torch.ones(3))
    >>> opt = torch.optim.Adam([param]); param.grad = torch.ones(3); opt.step()
    >>> mover = TensorMover()
    >>> mover.state_to_host(opt, [param], torch.device("cpu"))  # already on the CPU: nothing moves
    0
    >>> mover.misplaced_state(opt, [param])
    []
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Iterable, Mapping, Optional

import torch
from torch import nn
from torch.optim import Optimizer

from ..fsdp2 import dtensor_with_local, is_dtensor, local_tensor
from ..torch_internals import version_counter

__all__ = [
    "TensorMover",
    "nbytes",
    "optimizer_of",
    "param_group_map",
    "state_target_device",
    "to_device",
    "to_host",
]


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements on this rank (``numel * element_size``; a DTensor's shard)."""
    return local_tensor(tensor).nbytes


def to_host(tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
    """A copy of ``tensor`` on ``host``; pinned and non-blocking from CUDA (see :meth:`TensorMover.settle`).

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


def optimizer_of(optimizer: Any) -> Any:
    """Unwrap ``.optimizer`` chains (Accelerate's ``AcceleratedOptimizer``, LOMO wrappers).

    Accelerate's wrapper is itself a torch ``Optimizer``: an optimizer is
    unwrapped when its ``.optimizer`` is an optimizer too; any other object
    whenever it has an ``.optimizer``.

    Example:
        >>> class Wrapper(torch.optim.Optimizer):  # the shape of Accelerate's AcceleratedOptimizer
        ...     def __init__(self, optimizer: Optimizer) -> None:
        ...         self.optimizer = optimizer
        >>> inner = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
        >>> optimizer_of(Wrapper(Wrapper(inner))) is inner, optimizer_of(inner) is inner
        (True, True)
    """
    seen: set[int] = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        inner = optimizer.optimizer
        if isinstance(optimizer, Optimizer) and not isinstance(inner, Optimizer):
            break  # an optimizer with an attribute of that name, not a wrapper
        seen.add(id(optimizer))
        optimizer = inner
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


_SIDE_STREAMS: dict[int, Any] = {}


def _side_stream(device: torch.device) -> Any:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


@dataclass
class _Prefetched:
    source: torch.Tensor
    version: int
    pointer: int
    dest: torch.Tensor
    event: Any


class TensorMover:
    """Copies tensors to the host and back, tracks the copies in flight and the prefetched ones.

    Off CUDA every copy is synchronous: nothing is in flight and nothing is
    prefetched. For the copies in flight only the devices that queued one are
    kept (:meth:`settle` waits for their current stream: work on one stream
    completes in order), so nothing accumulates over many switches.
    """

    def __init__(self) -> None:
        self._devices: set[torch.device] = set()  # devices that queued a copy to the host since the last settle
        self._prefetched: dict[Hashable, _Prefetched] = {}

    # ------------------------------------------------------------ single tensors
    def to_host(self, tensor: torch.Tensor, host: torch.device) -> torch.Tensor:
        """A copy of ``tensor`` on ``host`` (pinned and non-blocking from CUDA; :meth:`settle` before reading it)."""
        if tensor.device.type == "cuda":
            self._devices.add(tensor.device)
        return to_host(tensor, host)

    def to_device(self, tensor: torch.Tensor, device: torch.device, key: Optional[Hashable] = None) -> torch.Tensor:
        """``tensor`` on ``device``: the copy prefetched under ``key`` when it is still current, else a new one."""
        if tensor.device == device:
            return tensor
        ready = self._take(key, tensor) if key is not None else None
        return ready if ready is not None else to_device(tensor, device)

    def prefetch(self, key: Hashable, source: torch.Tensor, device: torch.device) -> int:
        """Start copying ``source`` (pinned host memory) to ``device`` on a side stream; return the bytes started.

        The copy is taken by a later :meth:`to_device` with the same ``key``;
        until then it occupies device memory. 0 off CUDA, for a tensor that is
        not pinned, a DTensor, or a key already in flight.
        """
        if device.type != "cuda" or is_dtensor(source) or not source.is_pinned() or key in self._prefetched:
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
        self._prefetched[key] = _Prefetched(source, version_counter(source), source.data_ptr(), dest, event)
        return nbytes(source)

    def _take(self, key: Hashable, source: torch.Tensor) -> Optional[torch.Tensor]:
        entry = self._prefetched.pop(key, None)
        if entry is None or entry.source is not source or entry.version != version_counter(source):
            return None
        if entry.pointer != source.data_ptr():  # `.data` was replaced since
            return None
        torch.cuda.current_stream(entry.dest.device).wait_event(entry.event)
        return entry.dest

    def cancel_prefetch(self) -> None:
        """Drop every prefetched copy not taken (stale now); their device memory is freed."""
        self._prefetched.clear()

    @property
    def prefetched_bytes(self) -> int:
        """Device bytes held by prefetched copies not yet taken."""
        return sum(nbytes(p.dest) for p in self._prefetched.values())

    def settle(self) -> None:
        """Wait until every device -> host copy queued so far has landed (before the CPU reads one)."""
        for device in self._devices:
            torch.cuda.current_stream(device).synchronize()
        self._devices.clear()

    # ------------------------------------------------------------ optimizer state
    def state_to_host(self, optimizer: Optimizer, params: Iterable[nn.Parameter], host: torch.device) -> int:
        """Move every state tensor of ``params`` in ``optimizer`` to ``host``; return the bytes moved."""
        moved = 0
        for param in params:
            entry = optimizer.state.get(param)
            for key, value in list((entry or {}).items()):
                if isinstance(value, torch.Tensor) and value.device != host:
                    entry[key] = self.to_host(value, host)  # type: ignore[index]
                    moved += nbytes(value)
        return moved

    def misplaced_state(
        self, optimizer: Optimizer, params: Iterable[nn.Parameter]
    ) -> list[tuple[nn.Parameter, Hashable, torch.Tensor, torch.device]]:
        """``(param, key, tensor, target)`` for each state tensor of ``params`` not where torch keeps it."""
        groups_of: Optional[dict[int, Mapping[str, Any]]] = None
        out = []
        for param in params:
            for key, value in (optimizer.state.get(param) or {}).items():
                # The target is the parameter's device or "stays": state on that device is never
                # misplaced, so the (rarer) exact rule runs only for state elsewhere.
                if not isinstance(value, torch.Tensor) or value.device == param.device:
                    continue
                if groups_of is None:
                    groups_of = param_group_map(optimizer.param_groups)
                target = state_target_device(param, key, groups_of.get(id(param)))
                if target is not None and value.device != target:
                    out.append((param, key, value, target))
        return out

    def state_to_device(self, optimizer: Optimizer, params: Iterable[nn.Parameter]) -> int:
        """Bring the state of ``params`` back where torch keeps it (prefetched copies used); the bytes moved."""
        moved = 0
        for param, key, tensor, target in self.misplaced_state(optimizer, params):
            optimizer.state[param][key] = self.to_device(tensor, target, key=("state", id(param), key))
            moved += nbytes(tensor)
        return moved

    def prefetch_state(
        self, optimizer: Optimizer, params: Iterable[nn.Parameter], max_bytes: Optional[int] = None
    ) -> int:
        """Start copying the misplaced state of ``params`` back (:meth:`prefetch`), up to ``max_bytes``."""
        started = 0
        for param, key, tensor, target in self.misplaced_state(optimizer, params):
            if max_bytes is not None and started + nbytes(tensor) > max_bytes:
                break
            started += self.prefetch(("state", id(param), key), tensor, target)
        return started
