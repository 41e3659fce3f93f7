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
``ddp_buckets``            DDP's flat gradient buckets, beyond the gradients that are
                           views into them (``gradient_as_bucket_view=True``); computed
                           from the reducer's parameter list, as the C++ reducer sizes
                           its buckets (they are not visible as Python tensors), and
                           the buckets of idle reducers kept by ``keep_reducers``
========================== ============================================================

Every category but ``ddp_buckets`` is a sum over real tensors, each counted
once, under the device it lives on. The *expected peak* of a phase is the
device memory that training it needs, activations excluded: resident
parameters and buffers, the trainable parameters' gradients and DDP buckets,
and the optimizer state that lives on the device (measured where it exists,
estimated from the optimizer's kind where it does not yet). It is compared
with training every group at once, all resident.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from ...plan.phase import Phase
from ..ddp import _surgery as _ddp
from ._transfer import nbytes, optimizer_of
from ..optim._grouped import GroupedOptimizer


__all__ = ["CATEGORIES", "MemoryReport", "expected_peak_bytes", "memory_report"]

CATEGORIES: tuple[str, ...] = (
    "params_trainable",
    "params_frozen",
    "params_offloaded",
    "buffers",
    "grads",
    "optimizer_state",
    "optimizer_state_offloaded",
    "ddp_buckets",
)

#: Optimizer state bytes per parameter byte, by optimizer class name, used for
#: groups whose state does not exist yet (torch creates it at the first step).
_STATE_FACTOR: dict[str, float] = {
    "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2,
    "SparseAdam": 2, "Adagrad": 1, "RMSprop": 1, "ASGD": 1, "Adafactor": 0.1,
}  # fmt: skip


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
        expected_peak_all_bytes: the same for training every group at once.
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
            rows.append(f"{self.switches.get('switches', 0)} switches so far: "
                        f"{self.switches.get('switch_seconds', 0.0):.3f} s, "
                        f"{_gib(self.switches.get('switch_moved_bytes', 0))} moved")
        return "\n".join(rows)


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


def _group_optimizers(switcher: Any) -> dict[str, Optional[Optimizer]]:
    opt = optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None
    if isinstance(opt, GroupedOptimizer):
        return dict(opt.inner)
    return {g: opt for g in switcher.groups.names}


def _offloaded_state_groups(switcher: Any, phase: Optional[Phase]) -> set[str]:
    out = set(switcher.residency.offloaded) if switcher.residency is not None else set()
    opt = optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None
    if isinstance(opt, GroupedOptimizer):
        out |= {g for g, p in opt.policies.items() if p == "offload" and g not in opt.active}
    return out


def _state_bytes(opt: Optional[Optimizer], params: Iterable[nn.Parameter]) -> tuple[int, int]:
    """(bytes of existing state, bytes of the parameters that have state)."""
    if opt is None:
        return 0, 0
    state, with_state = 0, 0
    for param in params:
        entry = opt.state.get(param) if hasattr(opt.state, "get") else None
        if entry:
            with_state += nbytes(param)
            state += sum(nbytes(v) for v in entry.values() if isinstance(v, torch.Tensor))
    return state, with_state


def _state_factor(opt: Optional[Optimizer]) -> float:
    if opt is None:
        return 0.0
    name = type(opt).__name__
    if name == "SGD":
        return 1.0 if any(g.get("momentum", 0) for g in opt.param_groups) else 0.0
    return _STATE_FACTOR.get(name, 2.0)


def _group_state_estimate(opt: Optional[Optimizer], params: list[nn.Parameter]) -> int:
    existing, covered = _state_bytes(opt, params)
    rest = sum(nbytes(p) for p in params) - covered
    return existing + int(rest * _state_factor(opt))


def expected_peak_bytes(switcher: Any, phase: Optional[Phase] = None) -> tuple[int, int]:
    """``(phase's expected device peak, training everything)``, activations excluded.

    Args:
        switcher: the phase switcher (groups, optimizer, DDP, residency).
        phase: the phase to estimate (default the current one; every group if none).

    Example:
        >>> # peak, everything = expected_peak_bytes(switcher, switcher.phase_at(100))
    """
    groups = switcher.groups
    phase = phase or switcher.current or Phase(groups.names)
    non_resident = switcher.residency.non_resident(phase) if switcher.residency is not None else frozenset()
    opts = _group_optimizers(switcher)
    opt = optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None
    policies = opt.policies if isinstance(opt, GroupedOptimizer) else {}
    bucket_view = switcher.ddp is not None and switcher.ddp.gradient_as_bucket_view
    grad_copies = (1 if switcher.ddp is not None else 0) + (0 if bucket_view else 1)

    by_name = dict(groups.all_named_params())
    loose = sum(nbytes(by_name[n]) for n in groups.ungrouped_names())
    loose_train = loose if groups.ungrouped == "trainable" else 0
    buffers = sum(nbytes(b) for _, b in groups.module.named_buffers())
    params = {g: sum(nbytes(p) for p in groups.params(g)) for g in groups.names}
    state = {g: _group_state_estimate(opts[g], groups.params(g)) for g in groups.names}

    everything = sum(params.values()) + loose + buffers
    everything += (sum(params.values()) + loose_train) * grad_copies + sum(state.values())
    # What the idle phases' kept reducers hold now (keep_reducers; 0 by default).
    peak = loose + buffers + loose_train * grad_copies + switcher.backend.kept_reducer_bytes()
    for g in groups.names:
        if g in non_resident:
            continue
        peak += params[g]
        if g in phase.trainable:
            peak += params[g] * grad_copies + state[g]
        elif policies.get(g, "keep") == "keep":
            peak += state[g]
    return peak, everything


def memory_report(switcher: Any, phase: Optional[Phase] = None) -> MemoryReport:
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
    reduced = _ddp.reduced_parameters(ddp) if ddp is not None else []
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

    off_state = _offloaded_state_groups(switcher, phase)
    optimizers = _group_optimizers(switcher)
    plain = optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None
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

    peak, everything = expected_peak_bytes(switcher, phase)
    prefetched = switcher.residency.prefetched_bytes if switcher.residency is not None else 0
    opt = optimizer_of(switcher.optimizer) if switcher.optimizer is not None else None
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
