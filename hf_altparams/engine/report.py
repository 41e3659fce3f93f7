"""Where the bytes are: a census of a switched model, per device and category.

:func:`memory_report` walks the parameters, buffers, gradients and optimizer
state once (no device synchronisation, no allocation), so integrations can log
it at every switch. Categories:

========================== ============================================================
``params_trainable``       parameters with ``requires_grad`` (resident)
``params_frozen``          resident parameters that do not train in the phase
``params_offloaded``       parameters of non-resident groups (``Phase.resident``)
``buffers``                module buffers
``grads``                  ``.grad`` tensors
``optimizer_state``        optimizer state of groups that step or keep their state
``optimizer_state_offloaded`` state of idle groups under ``offload`` and of non-resident groups
``masters``                :class:`~hf_altparams.engine.PrecisionOptimizer`'s fp32 master
                           weights of the groups that train or keep them
``masters_offloaded``      fp32 masters of idle groups under ``master_policy="offload"``
``master_grads``           fp32 gradients held for the masters: sums of a gradient-
                           accumulation window, buckets all-reduced in fp32, a
                           master's ``.grad`` during the step
``ddp_buckets``            DDP's flat gradient buckets, beyond the gradients that are
                           views into them (``gradient_as_bucket_view=True``); computed
                           from the reducer's parameter list, as the C++ reducer sizes
                           its buckets (they are not visible as Python tensors), and
                           the buckets of idle reducers kept by ``keep_reducers``
========================== ============================================================

Every category but ``ddp_buckets`` is a sum over real tensors, each counted
once, under the device it lives on.

The *expected peak* of a phase is the device memory its optimizer step needs,
activations excluded, computed by the memory model the planner uses
(:mod:`.memory.model`; ``plan_cost`` gives the same bytes for the same model and
run): resident parameters and buffers, the trainable parameters' gradients
(fp32 on the masters under ``PrecisionOptimizer``) and DDP's buckets beyond
them, the optimizer state and fp32 masters on the device. Optimizer state is
measured where it exists (its tensors of the parameter's shape; Adam's 0-d
``step`` counters left out, as the planner does) and estimated from the
optimizer's kind where it does not yet; an idle group holds state or a master
only once it has trained (torch creates state at a group's first step), so a
phase's expected peak grows as the groups it keeps have trained: it is the
peak of the phase's coming step. The idle phases' reducers kept by
``keep_reducers`` add their buckets. It is compared with training every
parameter at once, all resident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ..plan.groups import ParamGroups
from ..plan.phase import Phase
from .backend import Backend
from .ddp import reduced_parameters
from .fsdp2 import local_tensor
from .memory import ResidencyManager, StatePolicy, nbytes, optimizer_of
from .memory.model import (
    UNGROUPED,
    Footprint,
    Sizes,
    Storage,
    buffer_owners,
    everything_layout,
    footprint,
    layout,
    state_bytes_for,
    state_tensors,
    tensor_sizes,
)
from .optim import GroupedOptimizer, PrecisionOptimizer
from .records import SwitchHistory

__all__ = ["CATEGORIES", "MemoryReport", "SwitchedRun", "expected_footprint", "expected_peak_bytes", "memory_report"]

CATEGORIES: tuple[str, ...] = (
    "params_trainable",
    "params_frozen",
    "params_offloaded",
    "buffers",
    "grads",
    "optimizer_state",
    "optimizer_state_offloaded",
    "masters",
    "masters_offloaded",
    "master_grads",
    "ddp_buckets",
)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.2f} MiB"


@dataclass(frozen=True)
class MemoryReport:
    """Bytes per device and category, and the phase's expected peak.

    Example:
        >>> import torch
        >>> from hf_altparams.engine import PhaseSwitcher, memory_report
        >>> from hf_altparams.plan import ParamGroups, Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> switcher = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
        >>> _ = switcher.step_to(0)
        >>> report = memory_report(switcher)
        >>> report.total() == sum(p.numel() * 4 for p in net.parameters())
        True

    Attributes:
        phase: the phase name.
        by_device: ``{device: {category: bytes}}`` (only non-zero entries).
        expected_peak_bytes: the phase's expected device peak, activations excluded.
        expected_peak_all_bytes: the same for training every parameter at once.
        prefetched_bytes: device bytes held by prefetched copies for the next phase.
        switches: the run's switch totals so far (``switches``, ``switch_seconds``,
            ``switch_moved_bytes``, ...; :meth:`SwitchHistory.totals`).
    """

    phase: str
    by_device: Mapping[str, Mapping[str, int]]
    expected_peak_bytes: int
    expected_peak_all_bytes: int
    prefetched_bytes: int = 0
    notes: tuple[str, ...] = field(default=())
    switches: Mapping[str, Union[int, float]] = field(default_factory=dict)

    @property
    def totals(self) -> dict[str, int]:
        """Bytes per category, summed over devices (every category present, zeros included)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for cats in self.by_device.values():
            for cat, n in cats.items():
                out[cat] += n
        return out

    def total(self, category: Optional[str] = None, device: Optional[str] = None) -> int:
        """Bytes of one category and/or one device (everything by default)."""
        return sum(
            n for dev, cats in self.by_device.items() if device in (None, dev)
            for cat, n in cats.items() if category in (None, cat)
        )  # fmt: skip

    @property
    def expected_peak_ratio(self) -> float:
        """``expected_peak_bytes / expected_peak_all_bytes`` (1.0 means no saving)."""
        return self.expected_peak_bytes / self.expected_peak_all_bytes if self.expected_peak_all_bytes else 1.0

    def as_log(self, prefix: str = "altparams/memory/") -> dict[str, Union[int, float]]:
        """Flat metrics: totals per category and per device, expected peaks and their ratio."""
        out: dict[str, Union[int, float]] = {f"{prefix}{c}": n for c, n in self.totals.items()}
        for dev in self.by_device:
            out[f"{prefix}device/{dev}"] = self.total(device=dev)
        out[f"{prefix}expected_peak"] = self.expected_peak_bytes
        out[f"{prefix}expected_peak_all"] = self.expected_peak_all_bytes
        out[f"{prefix}expected_peak_ratio"] = round(self.expected_peak_ratio, 4)
        out[f"{prefix}prefetched"] = self.prefetched_bytes
        out.update({f"{prefix}{k}": v for k, v in self.switches.items()})
        return out

    def table(self) -> str:
        """A readable table (one row per category, one column per device)."""
        devices = sorted(self.by_device)
        rows = [f"{'category':<28}" + "".join(f"{d:>14}" for d in devices)]
        for cat in CATEGORIES:
            cells = [self.by_device[d].get(cat, 0) for d in devices]
            if any(cells):
                rows.append(f"{cat:<28}" + "".join(f"{_gib(c):>14}" for c in cells))
        rows.append(
            f"phase {self.phase!r}: expected peak {_gib(self.expected_peak_bytes)} vs "
            f"{_gib(self.expected_peak_all_bytes)} training everything "
            f"({self.expected_peak_ratio:.2f}x; activations excluded)"
        )
        if self.switches:
            rows.append(
                f"{self.switches.get('switches', 0)} switches so far: "
                f"{self.switches.get('switch_seconds', 0.0):.3f} s, "
                f"{_gib(self.switches.get('switch_moved_bytes', 0))} moved"
            )
        return "\n".join(rows)


class SwitchedRun(Protocol):
    """What the report reads of a run (a :class:`~hf_altparams.engine.PhaseSwitcher`)."""

    groups: ParamGroups
    optimizer: Optional[Optimizer]
    residency: ResidencyManager
    backend: Backend
    history: SwitchHistory

    @property
    def current(self) -> Optional[Phase]: ...

    @property
    def ddp(self) -> Optional[DistributedDataParallel]: ...

    @property
    def idle_state_policies(self) -> Mapping[str, StatePolicy]: ...


class _Census:
    def __init__(self) -> None:
        self._bytes: dict[tuple[torch.device, str], int] = {}
        self._seen: set[int] = set()

    def add(self, tensor: torch.Tensor, category: str) -> None:
        if id(tensor) in self._seen:
            return
        self._seen.add(id(tensor))
        key = (tensor.device, category)
        self._bytes[key] = self._bytes.get(key, 0) + nbytes(tensor)  # a DTensor: this rank's shard

    def add_bytes(self, device: torch.device, category: str, n: int) -> None:
        key = (device, category)
        self._bytes[key] = self._bytes.get(key, 0) + n

    @property
    def by_device(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (device, category), n in self._bytes.items():
            if n:
                out.setdefault(str(device), {})[category] = n
        return out


def _optimizer(switcher: SwitchedRun) -> Optional[Optimizer]:
    return optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None


def _group_optimizers(switcher: SwitchedRun) -> dict[str, Optional[Optimizer]]:
    opt = _optimizer(switcher)
    if isinstance(opt, GroupedOptimizer):
        return dict(opt.inner)
    return {g: opt for g in switcher.groups.names}


def _offloaded_state_groups(switcher: SwitchedRun) -> set[str]:
    out = set(switcher.residency.offloaded)
    trainable = switcher.current.trainable if switcher.current is not None else frozenset(switcher.groups.names)
    out |= {g for g, p in switcher.idle_state_policies.items() if p is StatePolicy.OFFLOAD and g not in trainable}
    return out


def _measured_or_estimated(
    opt: Optional[Optimizer], params: Mapping[str, nn.Parameter]
) -> Callable[[str, torch.Tensor], int]:
    """The model's ``state_bytes``: a parameter's state tensors where they exist, its optimizer's estimate if not."""
    states = state_tensors(opt) if opt is not None else 0

    def state_bytes(name: str, like: torch.Tensor) -> int:
        entry = opt.state.get(params[name]) if opt is not None else None
        if entry:  # Adam's 0-d `step` counters are left out, as the planner leaves them out
            return sum(nbytes(v) for v in entry.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return state_bytes_for(states, like)

    return state_bytes


def _live_sizes(
    groups: ParamGroups, optimizers: Mapping[str, Optional[Optimizer]], plain: Optional[Optimizer], masters: bool
) -> dict[str, Sizes]:
    """:class:`Sizes` per group (and ``<ungrouped>``) of the live model, per rank (a DTensor's shard)."""
    by_name = dict(groups.all_named_params())
    storage = Storage(masters=masters)
    members = {g: (groups.param_names(g), optimizers[g], storage) for g in groups.names}
    # ungrouped parameters (frozen, in the train-everything reference) as the groups' optimizer would hold them
    first = next((o for o in optimizers.values() if o is not None), None)
    members[UNGROUPED] = (groups.ungrouped_names(), plain if plain is not None else first, storage)
    return {
        key: tensor_sizes([(n, local_tensor(by_name[n])) for n in names], _measured_or_estimated(opt, by_name), storage)
        for key, (names, opt, storage) in members.items()
    }


def _trained(switcher: SwitchedRun, optimizers: Mapping[str, Optional[Optimizer]]) -> set[str]:
    """The groups that have trained: they have optimizer state or fp32 masters now."""
    groups, opt = switcher.groups, _optimizer(switcher)
    out = {
        g
        for g in groups.names
        if (inner := optimizers[g]) is not None and any(inner.state.get(p) for p in groups.params(g))
    }
    if isinstance(opt, PrecisionOptimizer):
        out |= {g for g, held in opt.masters.items() if held}
    return out


def expected_footprint(switcher: SwitchedRun, phase: Optional[Phase] = None) -> tuple[Footprint, Footprint]:
    """The memory model's ``(phase's footprint at its peak, training everything)`` for the live run.

    The same arithmetic as :func:`~hf_altparams.planner.plan_cost`'s rows, on the
    switcher's model, optimizer, DDP wrapper and residency (see the module
    docstring); :func:`expected_peak_bytes` is its device total.

    Example:
        >>> # peak, everything = expected_footprint(switcher); peak.optimizer, peak.masters, peak.buckets
    """
    groups = switcher.groups
    phase = phase or switcher.current or Phase(groups.names)
    opt = _optimizer(switcher)
    optimizers = _group_optimizers(switcher)
    plain = None if isinstance(opt, GroupedOptimizer) else opt
    sizes = _live_sizes(groups, optimizers, plain, isinstance(opt, PrecisionOptimizer))
    residency = switcher.residency
    off = (
        residency.non_resident(phase) if residency is not None and residency.offload_device is not None else frozenset()
    )
    active = set(phase.trainable) | ({UNGROUPED} if groups.ungrouped == "trainable" else set())
    state_policy = dict(switcher.idle_state_policies)
    master_policy = opt.master_policies if isinstance(opt, PrecisionOptimizer) else {}
    where = layout(active, off, _trained(switcher, optimizers), state_policy, master_policy)
    owners = buffer_owners(groups.module, groups.group_of)
    ddp = switcher.ddp
    view = ddp is not None and ddp.gradient_as_bucket_view
    return (
        footprint(sizes, where, owners, ddp=ddp is not None, bucket_view=view),
        footprint(sizes, everything_layout(sizes), owners, ddp=ddp is not None, bucket_view=view),
    )


def expected_peak_bytes(switcher: SwitchedRun, phase: Optional[Phase] = None) -> tuple[int, int]:
    """``(phase's expected device peak, training everything)``, activations excluded.

    The phase's figure adds to the memory model's device bytes
    (:func:`expected_footprint`) the buckets of idle phases' reducers kept by
    ``keep_reducers`` (none by default).

    Args:
        switcher: the phase switcher (groups, optimizer, DDP, residency).
        phase: the phase to estimate (default the current one; every group if none).

    Example:
        >>> # peak, everything = expected_peak_bytes(switcher, switcher.phase_at(100))
    """
    peak, everything = expected_footprint(switcher, phase)
    return peak.device + switcher.backend.kept_reducer_bytes(), everything.device


def _census_optimizer(census: _Census, switcher: SwitchedRun) -> None:
    """Add the optimizer state, fp32 masters and their gradients to ``census``."""
    groups = switcher.groups
    off_state = _offloaded_state_groups(switcher)
    optimizers = _group_optimizers(switcher)
    plain = _optimizer(switcher)
    if isinstance(plain, GroupedOptimizer):
        plain = None  # a grouped optimizer holds no state for ungrouped parameters
    for name, param in groups.all_named_params():
        group = groups.group_of(name)
        opt = optimizers[group] if group is not None else plain
        if opt is None:
            continue
        category = "optimizer_state_offloaded" if group in off_state else "optimizer_state"
        for value in (opt.state.get(param) or {}).values():
            if isinstance(value, torch.Tensor):
                census.add(value, category)
    precision = _optimizer(switcher)
    if isinstance(precision, PrecisionOptimizer):
        for group, masters in precision.masters.items():
            idle_off = group not in precision.active and precision.master_policy_of(group) is StatePolicy.OFFLOAD
            for master in masters.values():
                census.add(master, "masters_offloaded" if idle_off else "masters")
        for grad in precision.fp32_grads():
            census.add(grad, "master_grads")


def memory_report(switcher: SwitchedRun, phase: Optional[Phase] = None) -> MemoryReport:
    """A census of the switcher's model and optimizer, per device and category.

    Cheap: one pass over parameters, buffers and optimizer state; no device
    synchronisation. ``phase`` only changes the expected peak (default: the
    current phase).

    Example:
        >>> import torch
        >>> from hf_altparams.engine import PhaseSwitcher
        >>> from hf_altparams.plan import ParamGroups, Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        >>> switcher = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
        >>> _ = switcher.step_to(0)
        >>> report = memory_report(switcher)
        >>> report.totals["params_trainable"], report.totals["params_frozen"]
        (80, 20)
    """
    groups = switcher.groups
    census = _Census()
    offloaded = switcher.residency.offloaded if switcher.residency is not None else frozenset()
    for name, param in groups.all_named_params():
        if groups.group_of(name) in offloaded:
            census.add(param, "params_offloaded")
        else:
            census.add(param, "params_trainable" if param.requires_grad else "params_frozen")
    for _, buf in groups.module.named_buffers():
        census.add(buf, "buffers")

    ddp = switcher.ddp
    reduced = reduced_parameters(ddp) if ddp is not None else []
    bucket_view = ddp is not None and ddp.gradient_as_bucket_view
    in_buckets = 0
    reduced_ids = {id(p) for p in reduced}
    for _, param in groups.all_named_params():
        if param.grad is not None:
            census.add(param.grad, "grads")
            if bucket_view and id(param) in reduced_ids:
                in_buckets += nbytes(param.grad)
    if ddp is not None and reduced:
        census.add_bytes(ddp.device, "ddp_buckets", sum(nbytes(p) for p in reduced) - in_buckets)
    kept = switcher.backend.kept_reducer_bytes()  # idle phases' reducers (keep_reducers)
    if ddp is not None and kept:
        census.add_bytes(ddp.device, "ddp_buckets", kept)

    _census_optimizer(census, switcher)

    peak, everything = expected_peak_bytes(switcher, phase)
    prefetched = switcher.residency.prefetched_bytes if switcher.residency is not None else 0
    opt = _optimizer(switcher)
    if isinstance(opt, GroupedOptimizer):
        prefetched += opt.prefetched_bytes
    current = phase or switcher.current
    return MemoryReport(
        phase=current.name if current is not None else "<none>",
        by_device=census.by_device,
        expected_peak_bytes=peak,
        expected_peak_all_bytes=everything,
        prefetched_bytes=prefetched,
        switches=switcher.history.totals(),
    )
