"""Per-task residency: the groups a phase does not need live off the device.

A :class:`~hf_altparams.plan.Phase` whose ``resident`` is set names the groups
that must be on the device while it runs; every other group is *non-resident*
(``PerTaskCycle`` produces such phases: the trunk and the current task stay,
the other tasks go). For a non-resident group, :class:`ResidencyManager`

* moves its parameters, their gradients and their optimizer state to
  ``offload_device`` (pinned host memory with non-blocking copies from CUDA,
  through a :class:`~hf_altparams.engine.memory.transfer.TensorMover`;
  parameters keep their identity, only ``.data`` changes, so optimizers and
  hooks that hold them stay valid), together with the buffers of modules whose
  own parameters are all non-resident;
* lists those parameters and buffers in DDP's ignore list (through the
  reducer rebuild at a switch, and through the module attribute DDP's
  constructor reads before the first wrap), so DDP neither all-reduces nor
  broadcasts them;
* guards every module whose own parameters are all non-resident with a
  forward pre-hook (:class:`ForwardGuards`) that raises
  :class:`~hf_altparams.errors.SwitchError` naming the parameter and the phase,
  instead of a device-mismatch error deep inside torch (or, on CPU, a silent
  use of a parameter DDP no longer syncs).

When a group comes back it returns to the device it left (or ``device``), and
the first time a group becomes resident after the DDP wrap it is broadcast
from rank 0 once, as DDP's constructor would have done (``init_sync``).
Device peak memory then holds the trunk and one task, whatever the number of
tasks. :meth:`ResidencyManager.prefetch` starts a coming phase's copies early,
on a CUDA side stream; :meth:`ResidencyManager.visiting` brings groups back
for an evaluation.

Limits: a module that owns parameters of several groups (some resident, some
not) is not guarded, because its forward may use only the resident ones; a
forward that reads a non-resident parameter of such a module, or reads one
directly without calling its module, fails with torch's own device error on a
GPU. Residency works per parameter object: a tied parameter lives with the
group that owns it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from ...errors import PlanError, SwitchError
from ...plan.groups import ParamGroups
from ...plan.phase import Phase
from ..ddp import ignored_before_wrap, mark_ignored_before_wrap
from ..driver import PhaseSource
from ..fsdp2 import set_data
from .transfer import TensorMover, nbytes, optimizer_of

__all__ = ["DataPlacer", "DeviceLike", "ForwardGuards", "Owner", "ResidencyManager", "as_device", "non_resident_groups"]

DeviceLike = Union[str, torch.device]
#: How a moved copy becomes a tensor's data: ``placer(tensor, moved_copy)``.
DataPlacer = Callable[[torch.Tensor, torch.Tensor], None]
#: The ignore-list entries a manager wrote on a module (not the user's own), per module.
_WRITTEN: weakref.WeakKeyDictionary[nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()


def _never(group: str) -> bool:
    return False


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
    """``value`` as a ``torch.device`` this process has; a :class:`PlanError` naming ``argument`` otherwise."""
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as exc:
        raise PlanError(f"`{argument}` is {value!r}, which is not a torch device; pass e.g. 'cpu' or 'cuda:0'") from exc
    if device.type == "cuda":  # a CUDA build takes any index (a bare int too) without a check
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if device.index is not None and device.index >= count or count == 0:
            raise PlanError(
                f"`{argument}` is {value!r} ({device}), but this process sees {count} CUDA "
                f"device(s); pass 'cpu'{f' or cuda:0..cuda:{count - 1}' if count else ''}"
            )
    return device


@dataclass(frozen=True)
class Owner:
    """A module that owns parameters directly, and the groups they belong to."""

    name: str
    module: nn.Module
    groups: frozenset[Optional[str]]  # None: an ungrouped parameter (always resident)
    params: tuple[tuple[str, Optional[str]], ...]  # (full name, group)

    def is_off(self, offloaded: frozenset[str]) -> bool:
        return None not in self.groups and self.groups <= offloaded

    def buffers(self) -> list[tuple[str, torch.Tensor]]:
        """``(full name, tensor)`` of the module's own buffers."""
        prefix = f"{self.name}." if self.name else ""
        return [(prefix + b, t) for b, t in self.module.named_buffers(recurse=False)]


class ForwardGuards:
    """Forward pre-hooks that refuse a forward through a module whose parameters are all off the device.

    Example:
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
                "`.visiting`, or `switcher.visiting` with the engine)"
            )

        return refuse_non_resident


class _NoPhase:
    """The phase source of a manager used on its own (the phase is given to :meth:`ResidencyManager.install_guards`)."""

    current: Optional[Phase] = None


class ResidencyManager:
    """Keeps non-resident groups off the device, out of DDP and out of forwards.

    Args:
        groups: the parameter groups of the model.
        phase: what says the phase applied now (the run's
            :class:`~hf_altparams.engine.PhaseDriver`); the guards name it.
            ``None``: a manager used on its own, told the phase at :meth:`install_guards`.
        offload_device: where non-resident groups live (default the CPU);
            ``None`` leaves them where they are (still out of DDP and guarded).
        device: where resident groups live; by default the device each tensor
            left from (or the DDP wrapper's device).
        guard: install the forward pre-hooks that refuse a forward through a
            module whose parameters are all non-resident.

    The :class:`~hf_altparams.engine.PhaseSwitcher` drives it (its
    ``offload_device`` / ``device`` arguments); on its own:

    Example:
        >>> from hf_altparams.plan import ParamGroups, Phase
        >>> net = torch.nn.ModuleDict({"trunk": torch.nn.Linear(2, 2), "t0": torch.nn.Linear(2, 1),
        ...                            "t1": torch.nn.Linear(2, 1)})
        >>> res = ResidencyManager(ParamGroups(net, {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"}))
        >>> task0 = Phase({"t0", "trunk"}, resident={"trunk"}, label="task0")
        >>> res.apply(res.non_resident(task0))
        0
        >>> sorted(res.ignore_names())
        ['t1.bias', 't1.weight']
        >>> res.install_guards(task0)
        >>> try:
        ...     net["t1"](torch.ones(1, 2))
        ... except SwitchError as err:
        ...     print(str(err)[:60])
        module 't1' ran its forward in phase 'task0', but its parame
    """

    def __init__(
        self,
        groups: ParamGroups,
        phase: Optional[PhaseSource] = None,
        *,
        offload_device: Optional[DeviceLike] = "cpu",
        device: Optional[DeviceLike] = None,
        guard: bool = True,
    ) -> None:
        self.groups = groups
        self.offload_device = None if offload_device is None else as_device(offload_device, "offload_device")
        self.device = None if device is None else as_device(device, "device")
        self.guard = bool(guard)
        self._phase: PhaseSource = phase if phase is not None else _NoPhase()
        self._guarded_phase = ""  # the phase named by the guards installed now
        self._optimizer: Optional[Optimizer] = None
        self._wrapper_device: Optional[torch.device] = None
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
        self._written: set[str] = set(_WRITTEN.get(module, frozenset()))
        self._base_ignore: set[str] = ignored_before_wrap(module) - self._written
        self._offloaded: frozenset[str] = frozenset()
        self._marked: Optional[set[str]] = None  # the ignore list last written to the module
        self._ignore_cache: Optional[tuple[Any, frozenset[str]]] = None
        self._placed = False
        self._home: dict[int, torch.device] = {}
        self._guards = ForwardGuards(self.offload_device)
        self._synced: Optional[set[str]] = None  # groups known equal on every rank (set at attach)
        self._mover = TensorMover()
        self._place_data: DataPlacer = set_data

    # ------------------------------------------------------------ wiring
    def set_optimizer(self, optimizer: Optional[Any]) -> None:
        """The run's optimizer (its state of non-resident groups moves with them); wrappers are unwrapped."""
        inner = optimizer_of(optimizer) if optimizer is not None else None
        self._optimizer = inner if isinstance(inner, Optimizer) else None

    def set_data_placer(self, placer: DataPlacer) -> None:
        """How a moved copy becomes a tensor's data (the FSDP2 backend also swaps FSDP2's storage)."""
        self._place_data = placer

    @property
    def data_placer(self) -> DataPlacer:
        """How a moved copy becomes a tensor's data now (``set_data`` unless a backend routed it)."""
        return self._place_data

    # ------------------------------------------------------------ queries
    @property
    def offloaded(self) -> frozenset[str]:
        """The groups currently non-resident."""
        return self._offloaded

    @property
    def phase_name(self) -> str:
        """The name of the phase the guards installed now refer to."""
        return self._guarded_phase

    def non_resident(self, phase: Phase) -> frozenset[str]:
        """The groups ``phase`` keeps off the device."""
        return non_resident_groups(phase, self.groups.names)

    def param_names(self, group: str) -> tuple[str, ...]:
        """Every name (aliases included) of the parameters of ``group``."""
        return tuple(self._names[group])

    def off_buffer_names(self, offloaded: Optional[frozenset[str]] = None) -> list[str]:
        """Buffers that live off the device with ``offloaded`` (default: now)."""
        off = self._offloaded if offloaded is None else offloaded
        return [full for o in self._owners if o.is_off(off) for full, _ in o.buffers()]

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

    @property
    def prefetched_bytes(self) -> int:
        """Device bytes of parameters and state prefetched and not yet consumed."""
        return self._mover.prefetched_bytes

    # ------------------------------------------------------------ placement
    def apply(self, offloaded: Iterable[str], *, keep_state_off: Callable[[str], bool] = _never) -> int:
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
        self._mover.settle()  # a checkpoint may read the host copies on the CPU next
        self._mover.cancel_prefetch()  # anything prefetched but not taken is stale now
        self.mark_for_wrap()
        return moved

    def enforce(self, *, keep_state_off: Callable[[str], bool] = _never) -> int:
        """Put every tensor where the current residency says (after ``model.to(device)``)."""
        moved = self._place(frozenset(self.groups.names), keep_state_off=keep_state_off)
        self._mover.settle()
        self.mark_for_wrap()
        return moved

    def _place(self, check: frozenset[str], keep_state_off: Callable[[str], bool]) -> int:
        if not check:  # a switch that moves no group (the usual case): nothing to look at
            return 0
        off = self._offloaded
        optimizer = self._optimizer
        moved = 0
        # Out first: free device memory before anything comes back.
        for group in sorted(check & off):
            params = self.groups.params(group)
            for param in params:
                moved += self._move_out(param)
            if optimizer is not None and self.offload_device is not None:
                moved += self._mover.state_to_host(optimizer, params, self.offload_device)
        for owner in self._owners:
            if owner.is_off(off) and owner.groups & check:
                for _, buffer in owner.buffers():
                    moved += self._move_out(buffer)
        for owner in self._owners:
            if not owner.is_off(off) and owner.groups & check:
                for _, buffer in owner.buffers():
                    moved += self._move_in(buffer)
        for group in sorted(check - off):
            params = self.groups.params(group)
            for param in params:
                moved += self._move_in(param)
            if optimizer is not None and not keep_state_off(group):
                moved += self._mover.state_to_device(optimizer, params)
        return moved

    def _home_of(self, tensor: torch.Tensor) -> Optional[torch.device]:
        if self.device is not None:
            return self.device
        return self._home.get(id(tensor), self._wrapper_device)

    def _move_out(self, tensor: torch.Tensor) -> int:
        if self.offload_device is None or tensor.device == self.offload_device:
            return 0
        self._home[id(tensor)] = tensor.device
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
        if grad is not None:
            tensor.grad = None
        moved = nbytes(tensor)
        self._place_data(tensor, self._mover.to_host(tensor.data, self.offload_device))
        if grad is not None:
            tensor.grad = self._mover.to_host(grad, self.offload_device)
            moved += nbytes(grad)
        return moved

    def _move_in(self, tensor: torch.Tensor) -> int:
        home = self._home_of(tensor)
        if home is None or tensor.device == home:
            return 0
        grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
        if grad is not None:
            tensor.grad = None
        self._place_data(tensor, self._mover.to_device(tensor.data, home, key=("param", id(tensor))))
        moved = nbytes(tensor)
        if grad is not None:
            tensor.grad = self._mover.to_device(grad, home)
            moved += nbytes(grad)
        return moved

    def prefetch(self, groups: Iterable[str], max_bytes: Optional[int] = None) -> int:
        """Start copying the parameters (then the optimizer state) of non-resident ``groups`` back.

        The copies run on a CUDA side stream and overlap whatever the device
        computes until the next switch, which takes them; until then they
        occupy device memory (the trade-off of ``PhaseSwitcher(prefetch=...)``).
        Returns the bytes started (0 off CUDA, or when nothing of ``groups`` is
        off the device).
        """
        started = 0
        chosen = [g for g in sorted(set(groups) & self._offloaded)]
        for group in chosen:  # parameters first: the forward needs them first
            for param in self.groups.params(group):
                home = self._home_of(param)
                if home is None or param.device == home:
                    continue
                if max_bytes is not None and started + nbytes(param) > max_bytes:
                    return started
                started += self._mover.prefetch(("param", id(param)), param.data, home)
        if self._optimizer is not None:
            for group in chosen:
                budget = None if max_bytes is None else max_bytes - started
                started += self._mover.prefetch_state(self._optimizer, self.groups.params(group), budget)
        return started

    # ------------------------------------------------------------ DDP
    def mark_for_wrap(self) -> None:
        """Write the ignore list where DDP's constructor reads it (before the first wrap).

        ``DistributedDataParallel`` reads its ignore list from the module when it
        is built, so a model wrapped after the first switch never broadcasts or
        buckets its non-resident parameters, which may sit on another device
        than the rest (DDP's constructor rejects mixed devices that are not ignored).
        """
        module = self.groups.module
        ignore = self.ignore_names()
        if ignore == self._marked and ignored_before_wrap(module) == ignore:
            return
        changed = ignore ^ (self._marked or set())
        self._written = ignore - self._base_ignore
        _WRITTEN[module] = frozenset(self._written)
        buffers = {full: tensor for o in self._owners for full, tensor in o.buffers()}
        tensors: dict[str, torch.Tensor] = {}
        for name in changed:
            tensor: Optional[torch.Tensor] = self._param_named.get(name, buffers.get(name))
            if tensor is not None:
                tensors[name] = tensor
        mark_ignored_before_wrap(module, ignore, tensors, keep_tagged=self._base_ignore)
        self._marked = ignore

    def attached(self, ignored_at_wrap: Iterable[str], device: Optional[torch.device]) -> None:
        """Record a new DDP wrapper: what its constructor ignored, and its device.

        Groups whose names were not ignored at the wrap were broadcast by DDP's
        constructor; the others are broadcast from rank 0 the first time they
        become resident (:meth:`sync_returning`).
        """
        ignored = set(ignored_at_wrap)
        self._base_ignore |= ignored - self._written
        self._wrapper_device = device if device is not None and device != self.offload_device else None
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
                tensors += [t for o in self._owners if group in o.groups for _, t in o.buffers()]
                for tensor in tensors:
                    dist.broadcast(tensor.data, src=src, group=process_group)
                    sent += nbytes(tensor)
                self._synced.add(group)
        return sent

    # ------------------------------------------------------------ guards
    def install_guards(self, phase: Optional[Phase] = None) -> None:
        """(Re)install the forward pre-hooks on modules whose parameters are all non-resident.

        ``phase``: the phase the guards name (default: the phase applied now).
        """
        if phase is None:
            phase = self._phase.current
        self._guarded_phase = phase.name if phase is not None else ""
        self._guards.install(self._owners if self.guard else [], self._offloaded, self._guarded_phase)

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
        optimizer, self._optimizer = self._optimizer, None  # optimizer state stays where it is
        phase_name = self._guarded_phase
        try:
            self._offloaded = before - visit
            self._place(visit, keep_state_off=lambda g: True)
            self._guards.install(self._owners if self.guard else [], self._offloaded, phase_name)
            yield
        finally:
            self._offloaded = before
            self._place(visit, keep_state_off=lambda g: True)
            self._mover.settle()
            self._optimizer = optimizer
            self._guards.install(self._owners if self.guard else [], self._offloaded, phase_name)
