"""Whether DDP must broadcast buffers at every forward, decided per phase.

By default DDP broadcasts every buffer it does not ignore from rank 0 at the
start of each forward (``broadcast_buffers=True``, ``forward_sync_buffers`` in
torch 2.13). That keeps buffers that a forward *updates* (BatchNorm running
statistics) equal on every rank. Buffers that never change after the wrap
(position ids, masks, rotary tables) gain nothing from it.

:class:`BufferSync` decides per phase, with two settings:

* ``policy="keep"`` (default): DDP's behaviour is left exactly as the user
  built it. The plan only *reports* what is broadcast per forward (and what
  the residency ignore list already saves: buffers of non-resident modules).
* ``policy="auto"``: broadcast only while some module that updates its buffers
  in forward may run in train mode: a norm layer with running statistics
  (``BatchNorm*``, ``SyncBatchNorm``, ``InstanceNorm*`` with
  ``track_running_stats=True``) or an instance of ``updating_types``. Every
  other buffer is *assumed* constant after the wrap; that is the one assumption
  this policy adds, so it is opt-in. A model with no buffer to broadcast is the
  provable case: DDP itself skips the broadcast then, under either policy.

and ``frozen_norms``:

* ``"train"`` (default): frozen norm layers follow the model's train/eval mode
  as usual (in train mode they normalise with batch statistics and keep
  updating their running statistics, although their weights are frozen).
* ``"eval"``: norm layers whose parameters are all frozen in the phase are held
  in eval mode at every forward (a forward pre-hook, so ``model.train()`` does
  not undo it): they normalise with their running statistics and stop
  updating them. This changes results, which is why it is a setting. With
  ``policy="auto"`` and no trainable norm layer left, the broadcast stops.

Parameter-less norm layers (``affine=False``) have no parameters to be frozen
and are never forced into eval mode.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Literal, Optional, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from ..errors import PlanError
from .memory import nbytes
from .torch_internals import NORM_BASE

__all__ = [
    "BufferPlan",
    "BufferSync",
    "BufferSyncPolicy",
    "FrozenNormPolicy",
    "buffer_updating_modules",
    "check_buffer_sync",
    "plan_buffer_sync",
]

BufferSyncPolicy = Literal["keep", "auto"]
FrozenNormPolicy = Literal["train", "eval"]
_POLICIES = ("keep", "auto")
_FROZEN = ("train", "eval")


@dataclass(frozen=True)
class BufferPlan:
    """What DDP broadcasts at each forward in a phase, and why.

    Attributes:
        broadcast: whether DDP broadcasts buffers at each forward of the phase.
        bytes_per_forward: bytes broadcast per forward (0 when ``broadcast`` is False).
        saved_bytes_per_forward: bytes per forward that DDP, as the user built
            it, would broadcast and this phase does not (ignored non-resident
            buffers, or a broadcast the ``auto`` policy turned off).
        updating_modules: modules that may update their buffers in this phase's forwards.
        eval_modules: frozen norm layers held in eval mode (``frozen_norms="eval"``).
        reason: one sentence for logs.
    """

    broadcast: bool
    bytes_per_forward: int
    saved_bytes_per_forward: int
    updating_modules: tuple[str, ...]
    eval_modules: tuple[str, ...]
    reason: str

    def as_log(self, prefix: str = "altparams/buffers/") -> dict[str, Union[int, str]]:
        """Flat metrics for trackers."""
        data = asdict(self)
        data["broadcast"] = int(self.broadcast)
        data["updating_modules"] = len(self.updating_modules)
        data["eval_modules"] = len(self.eval_modules)
        return {f"{prefix}{k}": v for k, v in data.items()}


def _updates_buffers(module: nn.Module, updating_types: tuple[type, ...]) -> bool:
    if updating_types and isinstance(module, updating_types):
        return True
    return isinstance(module, NORM_BASE) and bool(module.track_running_stats) and module.running_mean is not None


def buffer_updating_modules(module: nn.Module, updating_types: Iterable[type] = ()) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every submodule that updates buffers in forward when training.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2), nn.LayerNorm(2))
        >>> [name for name, _ in buffer_updating_modules(net)]
        ['1']
    """
    types = tuple(updating_types)
    return [(n, m) for n, m in module.named_modules() if _updates_buffers(m, types)]


def _check(value: object, argument: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise PlanError(f"`{argument}` is {value!r}; accepted: {list(accepted)}")


def check_buffer_sync(
    policy: object,
    frozen_norms: object,
    updating_types: Iterable[object] = (),
    *,
    types_argument: str = "buffer_updating_types",
) -> None:
    """Validate the buffer settings: ``buffer_sync``, ``frozen_norms`` and the buffer-updating module types."""
    _check(policy, "buffer_sync", _POLICIES)
    _check(frozen_norms, "frozen_norms", _FROZEN)
    bad = [t for t in updating_types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise PlanError(f"`{types_argument}` must be nn.Module subclasses, got {bad!r}")


@dataclass(frozen=True)
class _Updating:
    name: str
    module: nn.Module
    buffers: tuple[str, ...]  # full names of its own buffers
    params: tuple[str, ...]  # full names of its own parameters
    is_norm: bool


@dataclass(frozen=True)
class _Structure:
    """What planning needs from a module, walked once (a switch must stay cheap)."""

    buffers: tuple[tuple[str, nn.Module, str], ...]  # (full name, owner, attribute)
    updating: tuple[_Updating, ...]
    modules: dict[str, nn.Module]

    @classmethod
    def of(cls, module: nn.Module, updating_types: tuple[type, ...]) -> _Structure:
        buffers, updating, modules = [], [], {}
        for name, sub in module.named_modules():
            modules[name] = sub
            prefix = f"{name}." if name else ""
            own = [(prefix + b, sub, b) for b, _ in sub.named_buffers(recurse=False, remove_duplicate=False)]
            buffers.extend(own)
            if _updates_buffers(sub, updating_types):
                params = tuple(prefix + n for n, _ in sub.named_parameters(recurse=False))
                updating.append(_Updating(name, sub, tuple(n for n, _, _ in own), params, isinstance(sub, NORM_BASE)))
        return cls(tuple(buffers), tuple(updating), modules)


def plan_buffer_sync(
    module: nn.Module,
    trainable: Iterable[str],
    *,
    ignore: Iterable[str] = (),
    user_ignore: Iterable[str] = (),
    user_broadcast: bool = True,
    policy: BufferSyncPolicy = "keep",
    frozen_norms: FrozenNormPolicy = "train",
    updating_types: Iterable[type] = (),
) -> BufferPlan:
    """Decide whether DDP must broadcast buffers in a phase (pure: changes nothing).

    Args:
        module: the model (unwrapped).
        trainable: names of the parameters trainable in the phase.
        ignore: DDP's full ignore list in the phase.
        user_ignore: the part of ``ignore`` the user set (the baseline for "saved").
        user_broadcast: the ``broadcast_buffers`` setting the DDP was built with.
        policy: ``"keep"`` or ``"auto"`` (see the module docstring).
        frozen_norms: ``"train"`` or ``"eval"``.
        updating_types: extra module types that update their buffers in forward.

    Example:
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> plan = plan_buffer_sync(net, {"0.weight", "0.bias"}, policy="auto", frozen_norms="eval")
        >>> plan.broadcast, plan.eval_modules, plan.saved_bytes_per_forward
        (False, ('1',), 24)
    """
    _check(policy, "buffer_sync", _POLICIES)
    _check(frozen_norms, "frozen_norms", _FROZEN)
    structure = _Structure.of(module, tuple(updating_types))
    return _plan(structure, frozenset(trainable), set(ignore), set(user_ignore), user_broadcast, policy, frozen_norms)


def _plan(
    structure: _Structure,
    trainable: frozenset[str],
    ignore: set[str],
    user_ignore: set[str],
    user_broadcast: bool,
    policy: str,
    frozen_norms: str,
) -> BufferPlan:
    sizes = [
        (name, nbytes(buffer))
        for name, owner, attr in structure.buffers
        if isinstance(buffer := getattr(owner, attr, None), torch.Tensor)
    ]
    baseline = sum(n for name, n in sizes if name not in user_ignore) if user_broadcast else 0
    live = sum(n for name, n in sizes if name not in ignore)

    updating, eval_modules = [], []
    for sub in structure.updating:
        if not any(b not in ignore for b in sub.buffers):
            continue  # all its buffers are ignored (a non-resident module)
        frozen = bool(sub.params) and not any(p in trainable for p in sub.params)
        if frozen_norms == "eval" and sub.is_norm and frozen:
            eval_modules.append(sub.name)
        else:
            updating.append(sub.name)

    if not user_broadcast:
        broadcast, reason = False, "the DDP wrapper was built with broadcast_buffers=False"
    elif live == 0:
        broadcast, reason = False, "no buffer to broadcast (DDP skips the broadcast)"
    elif policy == "keep":
        broadcast, reason = True, "buffer_sync='keep': DDP broadcasts its buffers at every forward"
    elif updating:
        broadcast = True
        reason = f"{len(updating)} module(s) update buffers in forward (e.g. {updating[0]!r})"
    else:
        broadcast = False
        reason = "buffer_sync='auto': no module that updates its buffers runs in train mode"
    sent = live if broadcast else 0
    return BufferPlan(
        broadcast=broadcast,
        bytes_per_forward=sent,
        saved_bytes_per_forward=max(0, baseline - sent),
        updating_modules=tuple(updating),
        eval_modules=tuple(eval_modules),
        reason=reason,
    )


def _hold_eval(module: nn.Module, args: object) -> None:
    module.training = False


class BufferSync:
    """Applies a :func:`plan_buffer_sync` decision to a DDP wrapper at each switch.

    Args:
        policy: ``"keep"`` (default: DDP untouched) or ``"auto"``.
        frozen_norms: ``"train"`` (default) or ``"eval"``.
        updating_types: module types, besides norm layers with running stats,
            that update their buffers in forward.

    Example:
        >>> sync = BufferSync(policy="auto", frozen_norms="eval")
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        >>> sync.apply(net, trainable={"0.weight", "0.bias"}).eval_modules
        ('1',)
        >>> _ = net.train(); _ = net(torch.ones(3, 2)); net[1].training
        False
    """

    def __init__(
        self,
        policy: BufferSyncPolicy = "keep",
        frozen_norms: FrozenNormPolicy = "train",
        updating_types: Iterable[type] = (),
    ) -> None:
        types = tuple(updating_types)
        check_buffer_sync(policy, frozen_norms, types, types_argument="updating_types")
        self.policy: BufferSyncPolicy = policy
        self.frozen_norms: FrozenNormPolicy = frozen_norms
        self.updating_types = types
        self.user_broadcast = True
        self.user_ignore: frozenset[str] = frozenset()
        self.plan: Optional[BufferPlan] = None
        self._hooks: dict[str, RemovableHandle] = {}
        self._structure: Optional[tuple[int, _Structure]] = None

    def attach(self, ddp: DistributedDataParallel, user_ignore: Iterable[str] = ()) -> None:
        """Record the wrapper's own settings (the baseline every plan is compared with)."""
        self.user_broadcast = bool(ddp.broadcast_buffers)
        self.user_ignore = frozenset(user_ignore)

    def apply(
        self,
        module: nn.Module,
        trainable: Iterable[str],
        *,
        ddp: Optional[DistributedDataParallel] = None,
        ignore: Iterable[str] = (),
    ) -> BufferPlan:
        """Plan the phase, hold its frozen norm layers in eval mode, set DDP's broadcast.

        The module's structure (which modules own which buffers) is walked once
        and reused; buffer sizes are read afresh at every call.
        """
        if self._structure is None or self._structure[0] != id(module):
            self._structure = (id(module), _Structure.of(module, self.updating_types))
        structure = self._structure[1]
        plan = _plan(
            structure,
            frozenset(trainable),
            set(ignore),
            set(self.user_ignore),
            self.user_broadcast if ddp is not None else True,
            self.policy,
            self.frozen_norms,
        )
        self._hold_eval(module, plan.eval_modules, structure.modules)
        if ddp is not None and self.policy == "auto":
            ddp.broadcast_buffers = plan.broadcast  # the public setting DDP reads at each forward
        if ddp is None:
            plan = BufferPlan(False, 0, 0, plan.updating_modules, plan.eval_modules, "no DDP wrapper")
        self.plan = plan
        return plan

    def _hold_eval(
        self, module: nn.Module, names: Iterable[str], modules: Optional[dict[str, nn.Module]] = None
    ) -> None:
        wanted = set(names)
        if not wanted and not self._hooks:
            return
        modules = modules if modules is not None else dict(module.named_modules())
        for name in list(self._hooks):
            if name not in wanted:
                self._hooks.pop(name).remove()
                modules[name].training = module.training  # back to the model's mode
        for name in wanted - set(self._hooks):
            sub = modules[name]
            sub.training = False
            self._hooks[name] = sub.register_forward_pre_hook(_hold_eval)

    def restore(self, module: nn.Module, ddp: Optional[DistributedDataParallel] = None) -> None:
        """Undo everything: remove the eval hooks and give DDP back its own setting."""
        self._hold_eval(module, ())
        if ddp is not None:
            ddp.broadcast_buffers = self.user_broadcast
