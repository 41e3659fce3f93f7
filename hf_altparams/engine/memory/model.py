"""The memory model: what a phased run holds per group and category, as pure arithmetic.

One module answers "how many bytes" for everyone who asks: the planner
(:func:`~hf_altparams.planner.plan_cost`, on a model built on ``meta``),
:func:`~hf_altparams.engine.memory_report` and
:func:`~hf_altparams.engine.expected_peak_bytes` (on the live model), and
through the latter the release and prefetch decisions of a switch. It touches
no tensor data, no device and no process group: its inputs are shapes, dtypes,
the state policies and which groups have trained so far.

The pieces, in the order they are used:

* :class:`StatePolicy`: what happens to an idle group's optimizer state (and,
  under :class:`~hf_altparams.engine.PrecisionOptimizer`, to its fp32 master):
  ``keep`` (stays on the device), ``offload`` (moves to the host), ``drop``
  (freed; re-created when the group trains again).
* :func:`state_tensors`, :data:`STATE_TENSORS`, :data:`OPTIMIZER_STATES`: how
  many tensors of a parameter's shape an optimizer keeps per parameter.
* :class:`Storage` and :func:`tensor_sizes`: the bytes of a set of parameters
  (a group): parameters as stored, gradients at the step, DDP bucket, bytes
  all-reduced, optimizer state, fp32 masters.
* :func:`layout`: where each group's state and master are in a phase, given
  the policies and the groups that have trained so far (torch creates a
  group's state at its first step; a master appears at its first step too).
* :func:`footprint`: a phase's bytes per category on the device and the host.

A phase's *peak* is the moment inside the optimizer step: parameters and
buffers, the trainable parameters' gradients (fp32 on the masters under
``PrecisionOptimizer``: the storage-dtype gradient is released as it is cast),
DDP's buckets where they are not the gradients themselves, the optimizer
state and the masters on the device. Not counted: activations, temporaries,
the 0-d ``step`` counters of Adam-like optimizers and allocator rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Callable, Iterable, Literal, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim import Optimizer

from ...errors import PlanError

__all__ = [
    "OPTIMIZER_STATES",
    "STATE_TENSORS",
    "UNGROUPED",
    "Footprint",
    "Layout",
    "Sizes",
    "StatePolicy",
    "StatePolicyLike",
    "Storage",
    "buffer_owners",
    "everything_layout",
    "footprint",
    "layout",
    "run_idle_policies",
    "state_bytes_for",
    "state_tensors",
    "tensor_sizes",
]

#: The key of the parameters in no group, next to the group names.
UNGROUPED = "<ungrouped>"
DEVICE, HOST = "device", "host"


class StatePolicy(str, Enum):
    """What an idle group's optimizer state (or fp32 master) does: ``keep``, ``offload`` or ``drop``.

    A ``str``: users pass the plain strings, and a member compares equal to its string.

    Example:
        >>> StatePolicy.parse("offload", "`state_policy`") is StatePolicy.OFFLOAD, StatePolicy.KEEP == "keep"
        (True, True)
        >>> StatePolicy.parse("lazy", "`state_policy`")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `state_policy` must be one of ['keep', 'offload', 'drop'], got 'lazy'
    """

    KEEP = "keep"
    OFFLOAD = "offload"
    DROP = "drop"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, argument: str) -> StatePolicy:
        """``value`` as a policy; :class:`PlanError` naming ``argument``, the value and the accepted ones otherwise."""
        if isinstance(value, str):
            for policy in cls:
                if value == policy.value:
                    return policy
        raise PlanError(f"{argument} must be one of {[p.value for p in cls]}, got {value!r}")


#: What users pass for a policy: a :class:`StatePolicy` or its string.
StatePolicyLike = Union[StatePolicy, Literal["keep", "offload", "drop"]]


def run_idle_policies(
    recipe_idle_state: str, recipe: str, given: Optional[object] = None
) -> tuple[StatePolicy, StatePolicy, str]:
    """``(optimizer state, fp32 masters, why)`` of idle groups where the optimizer leaves them open.

    ``given`` (the run's ``idle_state``) when set; else the recipe's assumption
    (``schedule.idle_state == "drop"``: lisa and badam, whose published memory
    figures hold no state for idle layers); else state kept and masters offloaded.
    The switch and the planner both decide by it.

    Example:
        >>> run_idle_policies("drop", "RandomBlocks")
        (<StatePolicy.DROP: 'drop'>, <StatePolicy.DROP: 'drop'>, "the RandomBlocks recipe's assumption")
        >>> run_idle_policies("drop", "RandomBlocks", given="keep")[2], run_idle_policies("keep", "Alternating")[2]
        ("idle_state='keep'", 'the default')
    """
    if given is not None:
        policy = StatePolicy.parse(given, "`idle_state`")
        return policy, policy, f"idle_state={policy.value!r}"
    if recipe_idle_state == "drop":
        return StatePolicy.DROP, StatePolicy.DROP, f"the {recipe} recipe's assumption"
    return StatePolicy.KEEP, StatePolicy.OFFLOAD, "the default"


#: Tensors of a parameter's shape that a torch optimizer keeps per parameter, by class name, with the
#: options that add one (``SGD``'s momentum, ``Adam``'s amsgrad, ...) read by :func:`state_tensors`.
#: Adafactor's factored moments are a small fraction of the parameter, whatever its shape: 0.1 is an estimate.
STATE_TENSORS: dict[str, float] = {
    "SGD": 0, "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
    "SparseAdam": 2, "Adagrad": 1, "RMSprop": 1, "ASGD": 1, "Adafactor": 0.1,
}  # fmt: skip
#: Options that add a state tensor of the parameter's shape when set: ``(class name, option)``.
_EXTRA_STATE: tuple[tuple[str, str], ...] = (
    ("SGD", "momentum"),
    ("Adam", "amsgrad"),
    ("AdamW", "amsgrad"),
    ("RMSprop", "momentum"),
    ("RMSprop", "centered"),
)
#: The optimizer names the planner accepts (``--optimizer``), with their state tensors per parameter.
OPTIMIZER_STATES: dict[str, float] = {
    "adam": STATE_TENSORS["Adam"],
    "adamw": STATE_TENSORS["AdamW"],
    "sgd": STATE_TENSORS["SGD"],
    "sgd-momentum": STATE_TENSORS["SGD"] + 1,
}
#: Unknown optimizer classes are assumed to keep as much as Adam.
_DEFAULT_STATES = 2.0


def state_tensors(optimizer: Optimizer) -> float:
    """State tensors of a parameter's shape that ``optimizer`` keeps per parameter (its kind and options).

    Example:
        >>> net = nn.Linear(2, 2)
        >>> state_tensors(torch.optim.AdamW(net.parameters())), state_tensors(torch.optim.SGD(net.parameters(), lr=1))
        (2, 0)
        >>> state_tensors(torch.optim.SGD(net.parameters(), lr=1, momentum=0.9))
        1
    """
    kind = type(optimizer).__name__
    states = STATE_TENSORS.get(kind, _DEFAULT_STATES)
    for name, option in _EXTRA_STATE:
        if kind == name and any(group.get(option) for group in optimizer.param_groups):
            states += 1
    return states


def state_bytes_for(states: float, tensor: torch.Tensor) -> int:
    """Bytes of ``states`` tensors of ``tensor``'s shape and dtype (rounded up)."""
    return math.ceil(states * tensor.numel() * tensor.element_size())


@dataclass(frozen=True)
class Storage:
    """How a run stores its parameters and gradients.

    Attributes:
        dtype: the storage dtype floating parameters are held in (``None``: as they are).
        masters: fp32 masters for the floating parameters stored below fp32
            (:class:`~hf_altparams.engine.PrecisionOptimizer`): their gradient at
            the step is fp32 (cast from the storage dtype and released), their
            optimizer state is fp32, and DDP's bucket outlives the cast gradient
            even when gradients are bucket views.
        grad_dtype: the gradients' (and buckets') dtype if not the parameters'.
        allreduce_dtype: the dtype buckets are all-reduced in if not theirs.
    """

    dtype: Optional[torch.dtype] = None
    masters: bool = False
    grad_dtype: Optional[torch.dtype] = None
    allreduce_dtype: Optional[torch.dtype] = None

    def stored(self, tensor: torch.Tensor) -> torch.dtype:
        """The dtype ``tensor`` is stored in."""
        return self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype

    def has_master(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (a parameter) gets an fp32 master when its group trains."""
        return self.masters and tensor.is_floating_point() and self.stored(tensor) != torch.float32


@dataclass(frozen=True)
class Sizes:
    """Bytes of a set of parameters (one group), per kind.

    Attributes:
        numel: elements.
        param: the parameters as stored.
        grad: their gradients at the step (fp32 for those with masters).
        bucket: what DDP's buckets hold for them (the gradients in their dtype).
        bucket_kept: the part of ``bucket`` that is not the gradients even with
            ``gradient_as_bucket_view`` (parameters with masters).
        reduced: bytes all-reduced per step (``bucket``, or in ``allreduce_dtype``).
        state: their optimizer state (fp32 for those with masters).
        master: their fp32 masters.
    """

    numel: int = 0
    param: int = 0
    grad: int = 0
    bucket: int = 0
    bucket_kept: int = 0
    reduced: int = 0
    state: int = 0
    master: int = 0

    def __add__(self, other: Sizes) -> Sizes:
        return Sizes(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


def _as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor``, or a stand-in of its shape in ``dtype`` on ``meta`` (no memory)."""
    if tensor.dtype == dtype:
        return tensor
    return nn.Parameter(torch.empty(tensor.shape, dtype=dtype, device="meta"), requires_grad=False)


def tensor_sizes(
    params: Iterable[tuple[str, torch.Tensor]], state_bytes: Callable[[str, torch.Tensor], int], storage: Storage
) -> Sizes:
    """The :class:`Sizes` of ``params`` (``(name, tensor)``; a DTensor's local shard for per-rank bytes).

    ``state_bytes(name, tensor)`` gives a parameter's optimizer state; ``tensor``
    has the parameter's shape and the state's dtype (fp32 for a parameter with
    a master, else the stored dtype), on ``meta`` when that is not the
    parameter's own dtype.

    Example:
        >>> w = torch.empty(10, 10, device="meta")
        >>> s = tensor_sizes([("w", w)], lambda n, t: state_bytes_for(2, t), Storage(torch.bfloat16, masters=True))
        >>> (s.param, s.grad, s.bucket, s.bucket_kept, s.state, s.master)
        (200, 400, 200, 200, 800, 400)
    """
    total = Sizes()
    for name, tensor in params:
        numel, stored = tensor.numel(), storage.stored(tensor)
        master = storage.has_master(tensor)
        grad_size = (storage.grad_dtype or stored).itemsize
        bucket = numel * grad_size
        total = total + Sizes(
            numel=numel,
            param=numel * stored.itemsize,
            grad=numel * (4 if master else grad_size),
            bucket=bucket,
            bucket_kept=bucket if master else 0,
            reduced=numel * (storage.allreduce_dtype or storage.grad_dtype or stored).itemsize,
            state=state_bytes(name, _as_dtype(tensor, torch.float32 if master else stored)),
            master=numel * 4 if master else 0,
        )
    return total


def buffer_owners(
    module: nn.Module, group_of: Callable[[str], Optional[str]], storage: Storage = Storage()
) -> list[tuple[frozenset[Optional[str]], int]]:
    """Per module holding buffers: the groups of its own parameters (``None``: ungrouped or none) and their bytes.

    A module's buffers leave the device only with its own parameters, when all
    of them are in non-resident groups (as the engine moves them). Floating
    buffers of a module with floating parameters are stored in ``storage.dtype``
    (:class:`~hf_altparams.engine.PrecisionOptimizer` casts them with the
    parameters); the others keep their dtype.
    """
    out = []
    for mname, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False))
        follows = any(p.is_floating_point() for _, p in own)
        held = sum(
            b.numel() * (storage.stored(b) if follows else b.dtype).itemsize
            for b in sub.buffers(recurse=False)
            if b is not None
        )
        if held:
            groups = [group_of(f"{mname}.{n}" if mname else n) for n, _ in own]
            out.append((frozenset(groups or [None]), held))
    return out


@dataclass(frozen=True)
class Layout:
    """Where things are in a phase.

    Attributes:
        active: the groups that train (``UNGROUPED`` among them when ungrouped parameters train).
        off: non-resident groups: their parameters (and buffers) on the host.
        state: group -> ``"device"`` or ``"host"``: where its optimizer state is (absent: none).
        masters: group -> ``"device"`` or ``"host"``: where its fp32 masters are (absent: none).
    """

    active: frozenset[str]
    off: frozenset[str] = frozenset()
    state: Mapping[str, str] = field(default_factory=dict)
    masters: Mapping[str, str] = field(default_factory=dict)


def layout(
    active: Iterable[str],
    off: Iterable[str],
    trained: Iterable[str],
    state_policy: Mapping[str, StatePolicy],
    master_policy: Mapping[str, StatePolicy],
) -> Layout:
    """The :class:`Layout` of a phase training ``active``, with ``off`` non-resident.

    ``trained``: the groups that have state or masters by the phase's peak (those
    that trained before, and ``active``). A trained group's state is on the
    device while it trains or, idle, under ``keep`` unless its parameters are
    off the device; on the host otherwise, unless ``drop`` freed it. Its master
    is on the device while it trains or under ``keep``; on the host under
    ``offload``. Groups missing from a policy mapping are ``keep`` (state) and
    ``offload`` (masters), the defaults of the optimizers.
    """
    active, off = frozenset(active), frozenset(off)
    state: dict[str, str] = {}
    masters: dict[str, str] = {}
    for group in set(trained) | active:
        policy = state_policy.get(group, StatePolicy.KEEP)
        if group in active or (policy is StatePolicy.KEEP and group not in off):
            state[group] = DEVICE
        elif policy is not StatePolicy.DROP:
            state[group] = HOST
        policy = master_policy.get(group, StatePolicy.OFFLOAD)
        if group in active or policy is StatePolicy.KEEP:
            masters[group] = DEVICE
        elif policy is StatePolicy.OFFLOAD:
            masters[group] = HOST
    return Layout(active, off, state, masters)


def everything_layout(keys: Iterable[str]) -> Layout:
    """Every parameter training at once, all on the device (full fine-tuning): the reference."""
    keys = frozenset(keys)
    return Layout(keys, frozenset(), dict.fromkeys(keys, DEVICE), dict.fromkeys(keys, DEVICE))


@dataclass(frozen=True)
class Footprint:
    """A phase's bytes at its peak, per category (``device`` sums those on the device)."""

    params: int
    buffers: int
    grads: int
    buckets: int
    optimizer: int
    masters: int
    host: int
    allreduced: int

    @property
    def device(self) -> int:
        """Bytes on the device: parameters, buffers, gradients, DDP buckets, optimizer state and masters."""
        return self.params + self.buffers + self.grads + self.buckets + self.optimizer + self.masters


def footprint(
    sizes: Mapping[str, Sizes],
    where: Layout,
    owners: Sequence[tuple[frozenset[Optional[str]], int]],
    ddp: bool = True,
    bucket_view: bool = False,
) -> Footprint:
    """The :class:`Footprint` of the phase laid out as ``where``.

    Args:
        sizes: :class:`Sizes` per group (and :data:`UNGROUPED`).
        where: the phase's :class:`Layout`.
        owners: :func:`buffer_owners` of the model.
        ddp: whether DDP buckets the gradients (``False``: one process without
            DDP, or FSDP2, which reduce-scatters the gradients themselves).
        bucket_view: DDP's ``gradient_as_bucket_view``: the buckets are the
            gradients, except where the step casts them to fp32 masters.
    """

    def total(keys: Iterable[str], kind: str) -> int:
        return sum(getattr(sizes[k], kind) for k in keys if k in sizes)

    def at(placed: Mapping[str, str], place: str) -> list[str]:
        return [g for g, p in placed.items() if p == place]

    buffers_off = sum(n for owned, n in owners if None not in owned and owned <= where.off)
    return Footprint(
        params=total(set(sizes) - where.off, "param"),
        buffers=sum(n for _, n in owners) - buffers_off,
        grads=total(where.active, "grad"),
        buckets=total(where.active, "bucket_kept" if bucket_view else "bucket") if ddp else 0,
        optimizer=total(at(where.state, DEVICE), "state"),
        masters=total(at(where.masters, DEVICE), "master"),
        host=total(where.off, "param")
        + buffers_off
        + total(at(where.state, HOST), "state")
        + total(at(where.masters, HOST), "master"),
        allreduced=total(where.active, "reduced"),
    )
