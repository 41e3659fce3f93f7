"""Per-task residency: the groups a phase does not need live off the device.

A :class:`~hf_altparams.plan.Phase` whose ``resident`` is set names the groups
that must be on the device while it runs; every other group is *non-resident*
(``PerTaskCycle`` produces such phases: the trunk and the current task stay,
the other tasks go). For a non-resident group, :class:`ResidencyManager`

* moves its parameters, their gradients and their optimizer state to
  ``offload_device`` (pinned host memory with non-blocking copies from CUDA;
  parameters keep their identity, only ``.data`` changes, so optimizers and
  hooks that hold them stay valid), together with the buffers of modules whose
  own parameters are all non-resident;
* lists those parameters and buffers in DDP's ignore list (through
  :func:`~hf_altparams.engine.ddp._surgery.rebuild_reducer` at a switch, and through
  the module attribute DDP's constructor reads before the first wrap), so DDP
  neither all-reduces nor broadcasts them;
* guards every module whose own parameters are all non-resident with a
  forward pre-hook that raises :class:`~hf_altparams.errors.SwitchError` naming
  the parameter and the phase, instead of a device-mismatch error deep inside
  torch (or, on CPU, a silent use of a parameter DDP no longer syncs).

When a group comes back it returns to the device it left (or ``device``), and
the first time a group becomes resident after the DDP wrap it is broadcast
from rank 0 once, as DDP's constructor would have done (``init_sync``).
Device peak memory then holds the trunk and one task, whatever the number of
tasks.

This module holds which groups are off, the DDP ignore list, the first-time
broadcast, the guards and :meth:`ResidencyManager.visiting`; the tensor moves
themselves (and the prefetch) are in :mod:`._placement`.

Limits: a module that owns parameters of several groups (some resident, some
not) is not guarded, because its forward may use only the resident ones; a
forward that reads a non-resident parameter of such a module, or reads one
directly without calling its module, fails with torch's own device error on a
GPU. Residency works per parameter object: a tied parameter lives with the
group that owns it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from ...errors import PlanError
from ...plan.groups import ParamGroups
from ...plan.phase import Phase
from ..ddp import _surgery as _ddp
from ._owners import ForwardGuards, Owner
from ._placement import Placement
from ._transfer import HostCopies, Prefetcher, nbytes, set_data

__all__ = ["DeviceLike", "ResidencyManager", "as_device", "non_resident_groups"]

DeviceLike = Union[str, torch.device]

#: Module attribute listing the ignore-list entries this library added (not the user's).
_WRITTEN_ATTR = "_hf_altparams_ignore_written"


def non_resident_groups(phase: Phase, groups: Iterable[str]) -> frozenset[str]:
    """The groups of ``groups`` that ``phase`` does not keep on the device.

    Example:
        >>> from hf_altparams.plan import Phase
        >>> sorted(non_resident_groups(Phase({"t0"}, resident={"trunk"}), ["trunk", "t0", "t1"]))
        ['t1']
        >>> non_resident_groups(Phase({"t0"}), ["trunk", "t0", "t1"])
        frozenset()
    """
    if phase.resident is None:
        return frozenset()
    return frozenset(groups) - phase.resident


def as_device(value: DeviceLike, argument: str) -> torch.device:
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise PlanError(
            f"`{argument}` is {value!r}, which is not a torch device; pass e.g. 'cpu' or 'cuda:0'"
        ) from exc
    if device.type == "cuda":  # a CUDA build takes any index (a bare int too) without a check
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is not None and device.index >= count or count == 0:
            raise PlanError(f"`{argument}` is {value!r} ({device}), but this process sees {count} CUDA "
                            f"device(s); pass 'cpu'{' or cuda:0..cuda:%d' % (count - 1) if count else ''}")
    return device


class ResidencyManager(Placement):
    """Keeps non-resident groups off the device, out of DDP and out of forwards.

    Args:
        groups: the parameter groups of the model.
        offload_device: where non-resident groups live (default the CPU);
            ``None`` leaves them where they are (still out of DDP and guarded).
        device: where resident groups live; by default the device each tensor
            left from (or the DDP wrapper's device).
        guard: install the forward pre-hooks that refuse a forward through a
            module whose parameters are all non-resident.

    The :class:`~hf_altparams.engine.PhaseSwitcher` drives it (its
    ``offload_device`` / ``device`` arguments); on its own:

    Example:
        >>> import torch
        >>> from hf_altparams.errors import SwitchError
        >>> from hf_altparams.plan import ParamGroups, Phase
        >>> net = torch.nn.ModuleDict({"trunk": torch.nn.Linear(2, 2), "t0": torch.nn.Linear(2, 1),
        ...                            "t1": torch.nn.Linear(2, 1)})
        >>> res = ResidencyManager(ParamGroups(net, {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"}))
        >>> res.apply(non_resident_groups(Phase({"t0", "trunk"}, resident={"trunk"}), ["trunk", "t0", "t1"]))
        0
        >>> sorted(res.ignore_names())
        ['t1.bias', 't1.weight']
        >>> res.install_guards("task0")
        >>> try:
        ...     net["t1"](torch.ones(1, 2))
        ... except SwitchError as err:
        ...     print(str(err)[:60])
        module 't1' ran its forward in phase 'task0', but its parame
    """

    def __init__(
        self,
        groups: ParamGroups,
        *,
        offload_device: Optional[DeviceLike] = "cpu",
        device: Optional[DeviceLike] = None,
        guard: bool = True,
    ) -> None:
        self.groups = groups
        self.offload_device = None if offload_device is None else as_device(offload_device, "offload_device")
        self.device = None if device is None else as_device(device, "device")
        self.guard = bool(guard)
        self.optimizer: Any = None
        self.ddp_device: Optional[torch.device] = None
        module = groups.module
        self._group_of: dict[int, str] = {id(p): g for g in groups.names for p in groups.params(g)}
        self._names: dict[str, list[str]] = {g: [] for g in groups.names}  # aliases included
        self._param_named: dict[str, nn.Parameter] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            self._param_named[name] = param
            group = self._group_of.get(id(param))
            if group is not None:
                self._names[group].append(name)
        self._owners: list[Owner] = []
        for mname, sub in module.named_modules():
            direct = [(f"{mname}.{n}" if mname else n, p) for n, p in sub.named_parameters(recurse=False)]
            if direct:
                owned = tuple((n, self._group_of.get(id(p))) for n, p in direct)
                self._owners.append(Owner(mname, sub, frozenset(g for _, g in owned), owned))
        # The user's own ignore list, without what an earlier manager wrote there.
        user_ignore = _ddp.ignored_before_wrap(module)
        self._written: set[str] = set(getattr(module, _WRITTEN_ATTR, ()))
        self._base_ignore: set[str] = user_ignore - self._written
        self._offloaded: frozenset[str] = frozenset()
        self._marked: Optional[set[str]] = None  # the ignore list last written to the module
        self._ignore_cache: Optional[tuple[Any, frozenset[str]]] = None
        self._placed = False
        self._home: dict[int, torch.device] = {}
        self._guards = ForwardGuards(self.offload_device)
        self._phase_name = ""
        self._synced: Optional[set[str]] = None  # groups known equal on every rank (set at attach)
        self._host_copies = HostCopies()
        self._prefetcher = Prefetcher()
        #: How a moved copy becomes a tensor's data (the FSDP2 backend also swaps its storage).
        self.place_data: Callable[[torch.Tensor, torch.Tensor], None] = set_data

    # ------------------------------------------------------------ queries
    @property
    def offloaded(self) -> frozenset[str]:
        """The groups currently non-resident."""
        return self._offloaded

    def non_resident(self, phase: Phase) -> frozenset[str]:
        """The groups ``phase`` keeps off the device."""
        return non_resident_groups(phase, self.groups.names)

    def param_names(self, group: str) -> tuple[str, ...]:
        """Every name (aliases included) of the parameters of ``group``."""
        return tuple(self._names[group])

    def off_buffer_names(self, offloaded: Optional[frozenset[str]] = None) -> list[str]:
        """Buffers that live off the device with ``offloaded`` (default: now)."""
        off = self._offloaded if offloaded is None else offloaded
        return [full for o in self._owners if o.is_off(off) for full, _ in o.buffer_names()]

    def ignore_names(self, offloaded: Optional[frozenset[str]] = None) -> set[str]:
        """The full DDP ignore list: the user's own, plus non-resident parameters and buffers."""
        off = self._offloaded if offloaded is None else frozenset(offloaded)
        key = (off, frozenset(self._base_ignore))
        if self._ignore_cache is not None and self._ignore_cache[0] == key:
            return set(self._ignore_cache[1])
        names = set(self._base_ignore)
        for group in off:
            names.update(self._names[group])
        names.update(self.off_buffer_names(off))
        self._ignore_cache = (key, frozenset(names))
        return names

    def offloaded_bytes(self) -> int:
        """Bytes of the non-resident groups' parameters (wherever they are)."""
        return sum(nbytes(p) for g in self._offloaded for p in self.groups.params(g))

    # ------------------------------------------------------------ placement
    def apply(
        self,
        offloaded: Iterable[str],
        *,
        keep_state_off: Callable[[str], bool] = lambda group: False,
    ) -> int:
        """Make ``offloaded`` the non-resident groups; return the bytes moved.

        Groups leaving the device move first (freeing device memory), then the
        groups coming back. Idempotent per tensor, so calling it again with the
        previous set undoes a partial failure. ``keep_state_off(group)`` says
        that a returning group's optimizer state stays off the device (its
        optimizer's own idle policy offloads or drops it next).
        """
        target = frozenset(offloaded)
        unknown = sorted(target - set(self.groups.names))
        if unknown:
            raise PlanError(f"`offloaded` names unknown groups {unknown}; known: {list(self.groups.names)}")
        # The first placement checks every group: a resident group may still sit on
        # the host (a model built on the CPU with `device` set).
        changed = target ^ self._offloaded if self._placed else frozenset(self.groups.names)
        self._placed = True
        self._offloaded = target
        moved = self._place(changed, keep_state_off=keep_state_off)
        self._host_copies.wait()  # a checkpoint may read the host copies on the CPU next
        self._prefetcher.cancel()  # anything prefetched but not taken is stale now
        self.mark_for_wrap()
        return moved

    def enforce(self, *, keep_state_off: Callable[[str], bool] = lambda group: False) -> int:
        """Put every tensor where the current residency says (after ``model.to(device)``)."""
        moved = self._place(frozenset(self.groups.names), keep_state_off=keep_state_off)
        self._host_copies.wait()
        self.mark_for_wrap()
        return moved

    # ------------------------------------------------------------ DDP
    def mark_for_wrap(self) -> None:
        """Write the ignore list where DDP's constructor reads it (before the first wrap).

        ``DistributedDataParallel`` reads ``module._ddp_params_and_buffers_to_ignore``
        when it is built, so a model wrapped after the first switch never
        broadcasts or buckets its non-resident parameters, which may sit on
        another device than the rest (DDP's constructor rejects mixed devices
        that are not ignored).
        """
        module = self.groups.module
        ignore = self.ignore_names()
        if ignore == self._marked and _ddp.ignored_before_wrap(module) == ignore:
            return
        changed = ignore ^ (self._marked or set())
        self._written = ignore - self._base_ignore
        setattr(module, _WRITTEN_ATTR, sorted(self._written))
        buffers = {full: (o.module, attr) for o in self._owners for full, attr in o.buffer_names()}
        tensors: dict[str, torch.Tensor] = {}
        for name in changed:
            tensor: Optional[torch.Tensor] = self._param_named.get(name)
            if tensor is None and name in buffers:
                owner, attr = buffers[name]
                tensor = owner._buffers.get(attr)
            if tensor is not None:
                tensors[name] = tensor
        _ddp.mark_ignored_before_wrap(module, ignore, tensors, keep_tagged=self._base_ignore)
        self._marked = ignore

    def attached(self, ignored_at_wrap: Iterable[str], device: Optional[torch.device]) -> None:
        """Record a new DDP wrapper: what its constructor ignored, and its device.

        Groups whose names were not ignored at the wrap were broadcast by DDP's
        constructor; the others are broadcast from rank 0 the first time they
        become resident (:meth:`sync_returning`).
        """
        ignored = set(ignored_at_wrap)
        self._base_ignore |= ignored - self._written
        self.ddp_device = device if device is not None and device != self.offload_device else None
        self._synced = {g for g in self.groups.names if not ignored & set(self._names[g])}

    def sync_returning(self, process_group: Optional[dist.ProcessGroup]) -> int:
        """Broadcast, from rank 0, resident groups that no rank has synced since the wrap.

        Call it on every rank after a switch (a collective). Returns the bytes sent.
        """
        if self._synced is None:
            return 0
        pending = [g for g in self.groups.names if g not in self._offloaded and g not in self._synced]
        if not pending:
            return 0
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        sent = 0
        with torch.no_grad():
            for group in pending:
                tensors: list[torch.Tensor] = list(self.groups.params(group))
                tensors += [
                    o.module._buffers[attr]  # type: ignore[misc]
                    for o in self._owners if group in o.groups for _, attr in o.buffer_names()
                ]
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=src, group=process_group)
                    sent += nbytes(tensor)
                self._synced.add(group)
        return sent

    # ------------------------------------------------------------ guards
    def install_guards(self, phase_name: str) -> None:
        """(Re)install the forward pre-hooks on modules whose parameters are all non-resident."""
        self._phase_name = phase_name
        self._guards.install(self._owners if self.guard else [], self._offloaded, phase_name)

    def remove_guards(self) -> None:
        """Remove every forward guard (the run is over: a later run on the same model installs its own)."""
        self._guards.remove()

    @contextlib.contextmanager
    def visiting(self, groups: Iterable[str]) -> Iterator[None]:
        """Bring non-resident ``groups`` to the device for a while (e.g. to evaluate every task).

        Parameters and buffers come back and their guards go; optimizer state
        stays off the device and DDP keeps ignoring them (use it under
        ``torch.no_grad()``: their gradients would never be synced). Not a
        collective: each rank may visit on its own.
        """
        before = self._offloaded
        visit = frozenset(groups) & before
        unknown = sorted(set(groups) - set(self.groups.names))
        if unknown:
            raise PlanError(f"`groups` names unknown groups {unknown}; known: {list(self.groups.names)}")
        saved_optimizer, self.optimizer = self.optimizer, None
        try:
            self._offloaded = before - visit
            self._place(visit, keep_state_off=lambda g: True)
            self.install_guards(self._phase_name)
            yield
        finally:
            self._offloaded = before
            self._place(visit, keep_state_off=lambda g: True)
            self._host_copies.wait()
            self.optimizer = saved_optimizer
            self.install_guards(self._phase_name)
