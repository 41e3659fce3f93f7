"""What a phase switch must free, and a guard that fails when it does not (CPU, gloo; any device for the census).

Under DDP a switch drops the wrapper's reducer (and the logger that holds it)
and builds a new one; the old reducer's gradient buckets (one flat copy of the
old phase's trainable gradients) must go with it. Nothing of that is visible to
Python's garbage collector: the buckets are held by the C++ reducer. So the
guard looks three ways:

* :class:`FreedBySwitch`: weak references, taken before each switch, to the
  DDP reducer and logger and to every gradient-bucket storage seen in that
  phase, checked dead right after the switch. A reducer and a logger can be
  weakly referenced (torch 2.11-2.13). A bucket's storage can be reached two
  ways: with ``gradient_as_bucket_view=True`` every gradient is a view of its
  bucket (``p.grad.untyped_storage()``); otherwise only a comm hook sees the
  bucket (``bucket.buffer()``), which :class:`BucketProbe` does while
  all-reducing as DDP's default does. torch keeps a storage's Python object as
  long as the C++ storage lives, so a weak reference to it dies with the C++
  storage itself, whoever holds it (``tests/engine/test_switch_leaks.py``
  checks that first).
* :func:`tensor_census`: every storage reachable from a tensor the garbage
  collector tracks (count and bytes): what Python code can still reach.
* :func:`storages_kept`: the storages created during a window of switches
  (by any operator, called from Python or from C++: the reducer's buckets
  too, seen by a torch dispatch mode) that are still alive at its end. The
  window's last switch built what the coming phase holds (the live reducer's
  buckets), so two windows of different lengths must keep the same storages.
  (The torch profiler's memory events were tried first: they miss frees done
  by gloo's worker threads, which drop the last reference to what an
  all-reduce used, so their count moved by a few bytes from run to run.)

:func:`guard_alternation` runs the whole check on a model alternating two
halves every step (``PhaseSwitcher`` + ``GroupedOptimizer(Adam)``) and raises
:class:`SwitchLeakError` on the first failure; ``leak=`` builds the
deliberately broken set-ups that prove the guard can fail.
"""

from __future__ import annotations

import gc
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode  # public extension point, underscore module

__all__ = [
    "Alternation",
    "BucketProbe",
    "FreedBySwitch",
    "GuardReport",
    "Leak",
    "NewStorages",
    "SwitchLeakError",
    "guard_alternation",
    "settled",
    "storages_kept",
    "tensor_census",
]

T = TypeVar("T")

#: A deliberately broken set-up: ``"reducers"`` keeps every old reducer in a list (what a
#: reference held by a user object, a work object or a stream would do); ``"buckets"``
#: keeps every old gradient bucket (a gradient that is a bucket view, or a comm hook
#: state holding its buckets).
Leak = Literal["none", "reducers", "buckets"]


class SwitchLeakError(AssertionError):
    """Something a switch should have freed is still alive, or memory grew over switches."""


class BucketProbe:
    """A DDP comm hook that all-reduces like DDP's default and notes each bucket's storage, weakly.

    ``keep=True`` holds the buckets strongly instead (a leaking hook state: the
    guard's negative control). The state holds no reference to the wrapper,
    which a switch would refuse.

    Example:
        >>> probe = BucketProbe()
        >>> # probe.register(ddp); ...backward...; probe.drain() -> weak references to the buckets seen
    """

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep
        self.seen: list[weakref.ref[torch.UntypedStorage]] = []
        self.kept: list[torch.Tensor] = []

    def register(self, ddp: DistributedDataParallel) -> None:
        """Register on ``ddp`` (before its first forward); a rebuilt reducer gets it again."""
        ddp.register_comm_hook(self, _probe_hook)

    def note(self, buffer: torch.Tensor) -> None:
        """Note one bucket (called by the hook)."""
        self.seen.append(weakref.ref(buffer.untyped_storage()))
        if self.keep:
            self.kept.append(buffer)

    def drain(self) -> list[weakref.ref[torch.UntypedStorage]]:
        """The references noted since the last call."""
        seen, self.seen = self.seen, []
        return seen


def _probe_hook(probe: BucketProbe, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    probe.note(bucket.buffer())
    return allreduce_hook(None, bucket)  # type: ignore[arg-type]  # None: the default group, as DDP's


# DDP checks a hook's annotations are the real types (this module's annotations are strings).
_probe_hook.__annotations__ = {
    "probe": BucketProbe,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


@dataclass
class Survivors:
    """What outlived one switch: reducers (and loggers), bucket storages (their bytes)."""

    switch: int
    reducers: int = 0
    storages: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reducers or self.storages)

    def describe(self) -> str:
        parts = []
        if self.reducers:
            parts.append(f"{self.reducers} DDP reducer/logger object(s)")
        if self.storages:
            parts.append(f"{len(self.storages)} gradient-bucket storage(s) of {sum(self.storages)} B")
        return f"switch {self.switch}: " + " and ".join(parts) + " still alive"


class FreedBySwitch:
    """Weak references to what a switch must free, taken before it and checked after it.

    Before a switch (after ``optimizer.step()``, before ``zero_grad``), :meth:`before`
    notes the wrapper's reducer and logger, the storages of the gradients (bucket
    views with ``gradient_as_bucket_view=True``) and the buckets ``probe`` saw
    since the last switch. :meth:`after` returns what of everything noted so far
    is still alive, the wrapper's live reducer and logger aside.
    ``allowed_reducers`` idle reducers may stay alive (``keep_reducers=N`` keeps N
    by design, with their buckets): then only reducers beyond that count fail
    (which bucket belongs to which idle reducer cannot be told apart).

    Example:
        >>> # freed = FreedBySwitch(ddp); ...step...; freed.before(); switcher.step_to(s); freed.after(s)
    """

    def __init__(
        self, ddp: DistributedDataParallel, probe: Optional[BucketProbe] = None, allowed_reducers: int = 0
    ) -> None:
        self.ddp = ddp
        self.probe = probe
        self.allowed = allowed_reducers
        self._watched: dict[int, tuple[str, weakref.ref[Any], int]] = {}  # by id() of the live object

    def _watch(self, kind: str, obj: Any, size: int = 0) -> None:
        self._watched[id(obj)] = (kind, weakref.ref(obj), size)

    def before(self) -> None:
        """Note the reducer, the logger and the bucket storages of the phase about to end."""
        if self.ddp.reducer is not None:
            self._watch("reducer", self.ddp.reducer)
            self._watch("logger", self.ddp.logger)
        for param in self.ddp.module.parameters():
            if param.grad is not None:
                storage = param.grad.untyped_storage()
                self._watch("storage", storage, storage.nbytes())
        if self.probe is not None:
            for ref in self.probe.drain():
                storage = ref()
                if storage is not None:
                    self._watch("storage", storage, storage.nbytes())

    def after(self, switch: int) -> Survivors:
        """What of the noted objects is alive now, the live reducer and logger aside."""
        live = (self.ddp.reducer, self.ddp.logger)
        alive = {}
        for key, (kind, ref, size) in self._watched.items():
            obj = ref()
            if obj is not None:
                alive[key] = (kind, ref, size)
                if any(obj is current for current in live):
                    alive.pop(key)
        self._watched = {key: value for key, value in self._watched.items() if value[1]() is not None}
        reducers = sum(1 for kind, _, _ in alive.values() if kind == "reducer")
        storages = [size for kind, _, size in alive.values() if kind == "storage"]
        if self.allowed:
            return Survivors(switch, reducers=max(0, reducers - self.allowed))
        loggers = sum(1 for kind, _, _ in alive.values() if kind == "logger")
        return Survivors(switch, reducers=max(reducers, loggers), storages=storages)

    def wait_freed(self, switch: int, grace_s: float) -> Survivors:
        """:meth:`after`, polled for up to ``grace_s`` seconds while only storages survive.

        A gloo worker thread drops its reference to a finished all-reduce (and so
        to the bucket it all-reduced) a moment after the reducer saw it complete;
        a reducer is never held there, so a surviving reducer fails at once.
        """
        deadline = time.monotonic() + grace_s
        survivors = self.after(switch)
        while survivors and not survivors.reducers and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL for the worker thread
            survivors = self.after(switch)
        return survivors


def tensor_census() -> tuple[int, int]:
    """(storages, bytes) reachable from the tensors Python's garbage collector tracks, each storage once."""
    storages: dict[tuple[int, str], int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(), not isinstance: no deprecated __getattr__
            continue
        try:
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), str(obj.device))
        except (RuntimeError, NotImplementedError):  # meta, sparse, a subclass without storage, or a fake
            continue  # tensor an earlier torch.compile in this process left alive (it has no data pointer)
        storages[key] = storage.nbytes()
    return len(storages), sum(storages.values())


class NewStorages(TorchDispatchMode):
    """While active, notes (weakly) every storage an operator creates, C++ callers included.

    A dispatch mode sees every operator called on this thread through torch's
    dispatcher, from Python or from C++ (DDP's reducer allocates its buckets
    that way); an output whose storage is not one of the inputs' is new (in-place
    ops and views are not). A weak reference dies with the C++ storage, whichever
    thread frees it, so :meth:`alive` counts what the window created and is
    still held by anyone, C++ included. Temporaries an operator allocates inside
    its own kernel are not seen (they die with the call).

    Example:
        >>> held = []
        >>> with NewStorages() as watch:
        ...     held.append(torch.ones(1000)); temporary = torch.ones(10) + 1; del temporary
        >>> watch.alive()
        (1, 4000)
    """

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, tuple[weakref.ref[torch.UntypedStorage], int]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for tensor in _tensors(out):
            storage = tensor.untyped_storage()
            known = self._refs.get(id(storage))  # an id is reused once its object died
            if storage.nbytes() and storage.data_ptr() not in inputs and (known is None or known[0]() is not storage):
                self._refs[id(storage)] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive(self) -> tuple[int, int]:
        """(count, bytes) of the storages created while active that are still alive."""
        alive = [size for ref, size in self._refs.values() if ref() is not None]
        return len(alive), sum(alive)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def settled(read: Callable[[], T], settle_s: float = 0.05) -> T:
    """``read()`` once two readings ``settle_s`` seconds apart agree (at most 40 readings).

    A gloo worker thread drops what a collective used (a bucket, the switch's
    all-gather rows) a moment after the caller saw it complete; reading memory
    right after a collective can catch that moment.
    """
    last = read()
    for _ in range(40):
        time.sleep(settle_s)  # releases the GIL for the worker threads
        now = read()
        if now == last:
            break
        last = now
    return last


def storages_kept(run: Callable[[], None], settle_s: float = 0.05) -> tuple[int, int]:
    """(count, bytes) of the storages ``run()`` created that are still alive once memory :func:`settled`.

    Example:
        >>> held: list[torch.Tensor] = []
        >>> storages_kept(lambda: held.append(torch.empty(1000)))
        (1, 4000)
    """
    with NewStorages() as watch:
        run()
    return settled(watch.alive, settle_s)


class Alternation:
    """Two halves of a model alternating every step under DDP: ``PhaseSwitcher`` + ``GroupedOptimizer(Adam)``.

    Default switch settings unless ``switcher_options`` says otherwise; the DDP
    wrapper is built over the default process group, with ``probe`` a
    :class:`BucketProbe` comm hook on it. ``leak`` breaks it on purpose (see
    :data:`Leak`). :meth:`iterate` runs one step and the switch after it;
    ``on_before_switch`` runs between them.

    Example:
        >>> # rig = Alternation(size_mib=0.05); rig.iterate(0); rig.close()
    """

    def __init__(
        self,
        *,
        size_mib: float = 0.05,
        gradient_as_bucket_view: bool = False,
        probe: bool = False,
        leak: Leak = "none",
        switcher_options: Optional[dict[str, Any]] = None,
        device: Optional[torch.device] = None,
        seed: int = 0,
    ) -> None:
        from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
        from hf_altparams.plan import Alternating, ParamGroups
        from tests.support.models import TwoHalves

        if leak not in ("none", "reducers", "buckets"):
            raise ValueError(f"`leak` must be 'none', 'reducers' or 'buckets', got {leak!r}")
        self.device = device or torch.device("cpu")
        self.leak = leak
        torch.manual_seed(seed)
        self.model = TwoHalves(size_mib, names=("a", "b")).to(self.device)
        groups = ParamGroups(self.model, {"a": "a.*", "b": "b.*"})
        self.optimizer = GroupedOptimizer(groups, lambda params: torch.optim.Adam(params, lr=1e-3))
        self.switcher = PhaseSwitcher(
            groups, Alternating(["a", "b"]), optimizer=self.optimizer, **(switcher_options or {})
        )
        self.switcher.step_to(0)
        kwargs: dict[str, Any] = {"gradient_as_bucket_view": gradient_as_bucket_view}
        if self.device.type == "cuda":
            kwargs["device_ids"] = [self.device.index]
        self.ddp = DistributedDataParallel(self.model, **kwargs)
        self.probe = (
            BucketProbe(keep=leak == "buckets")
            if probe or (leak == "buckets" and not gradient_as_bucket_view)
            else None
        )
        if self.probe is not None:
            self.probe.register(self.ddp)
        self.switcher.attach(self.ddp)
        generator = torch.Generator().manual_seed(1000 + (dist.get_rank() if dist.is_initialized() else 0))
        self.batch = torch.randn(8, self.model.width, generator=generator).to(self.device)
        self.pinned: list[Any] = []  # what a leaking set-up keeps
        self.on_before_switch: Optional[Callable[[], None]] = None

    def iterate(self, step: int) -> None:
        """Train step ``step`` (forward, backward, optimizer step), then switch for ``step + 1``."""
        self.ddp(self.batch).pow(2).mean().backward()
        self.optimizer.step()
        if self.leak == "reducers":
            self.pinned.append(self.ddp.reducer)
        elif self.leak == "buckets" and self.probe is None:  # a gradient that is a bucket view
            self.pinned += [p.grad for p in self.model.parameters() if p.grad is not None][:1]
        if self.on_before_switch is not None:
            self.on_before_switch()
        self.optimizer.zero_grad(set_to_none=True)
        self.switcher.step_to(step + 1)

    def close(self) -> None:
        """Free the pinned objects and the wrapper's reducer (before the process group goes)."""
        from hf_altparams.engine import shutdown

        self.pinned.clear()
        if self.probe is not None:
            self.probe.kept.clear()
        shutdown(self.ddp, destroy=False)


@dataclass
class GuardReport:
    """What :func:`guard_alternation` measured (all checks passed when it returns one)."""

    switches: int
    census_warm: tuple[int, int]
    census_end: tuple[int, int]
    kept: tuple[tuple[int, int], tuple[int, int]]  # (storages, bytes) each window created and still holds
    windows: tuple[int, int]
    graced: int  # switches after which a bucket storage outlived the switch briefly (a gloo thread)

    def as_dict(self) -> dict[str, Any]:
        return {
            "switches": self.switches,
            "census_warm": list(self.census_warm),
            "census_end": list(self.census_end),
            "kept": [list(k) for k in self.kept],
            "windows": list(self.windows),
            "graced": self.graced,
        }


def guard_alternation(
    rig: Alternation,
    *,
    warmup: int = 6,
    census_switches: int = 40,
    windows: tuple[int, int] = (6, 16),
    allowed_reducers: int = 0,
    grace_s: float = 2.0,
) -> GuardReport:
    """Run ``rig`` and fail (:class:`SwitchLeakError`) on anything a switch leaves behind.

    1. After every switch: the old reducer, its logger and its bucket storages
       are dead (beyond ``allowed_reducers`` kept idle ones);
    2. :func:`tensor_census` after ``warmup`` switches and after
       ``census_switches`` more (same phase: an even count) is the same;
    3. :func:`storages_kept` over ``windows[0]`` and over ``windows[1]``
       switches (even counts) is the same.

    The automatic garbage collector is off while it runs, so nothing is freed by
    a collection that happens to run: what a switch frees it frees by reference
    count.
    """
    if census_switches % 2 or any(w % 2 for w in windows) or windows[0] == windows[1]:
        raise ValueError(
            f"the switch counts must be even (the same phase at both ends) and the windows differ; "
            f"got census_switches={census_switches}, windows={windows}"
        )
    freed = FreedBySwitch(rig.ddp, rig.probe, allowed_reducers)
    rig.on_before_switch = freed.before
    step = 0
    graced = 0

    def run(count: int) -> None:
        nonlocal step, graced
        for _ in range(count):
            rig.iterate(step)
            step += 1
            if freed.after(step):
                graced += 1
                survivors = freed.wait_freed(step, grace_s)
                if survivors:
                    raise SwitchLeakError(survivors.describe())

    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        run(warmup + warmup % 2)
        census_warm = settled(tensor_census)
        run(census_switches)
        census_end = settled(tensor_census)
        if census_end != census_warm:
            raise SwitchLeakError(
                f"live tensors changed over {census_switches} switches after the warm-up: {census_warm[0]} "
                f"storages of {census_warm[1]} B, then {census_end[0]} of {census_end[1]} B"
            )
        kept = [storages_kept(lambda count=count: run(count)) for count in windows]  # type: ignore[misc]
        if kept[0] != kept[1]:
            raise SwitchLeakError(
                f"the storages created over {windows[0]} switches and still alive (C++ holders included): "
                f"{kept[0][0]} of {kept[0][1]} B; over {windows[1]} switches: {kept[1][0]} of {kept[1][1]} B, "
                f"about {(kept[1][1] - kept[0][1]) // (windows[1] - windows[0])} B more per switch"
            )
    finally:
        rig.on_before_switch = None
        if enabled:
            gc.enable()
    return GuardReport(step, census_warm, census_end, (kept[0], kept[1]), windows, graced)
