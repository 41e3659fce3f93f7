"""Per-step alternation under a DDP wrapper built by hand, for 10,000 switches: does device memory stay flat?

The set-up of issue 31: a model of two halves (each ``--layers`` square
``Linear`` layers of ``--size-mib`` MiB together: by default two 4096-wide
layers, 134 MB a half), the user's own ``DistributedDataParallel(model,
device_ids=[0])`` attached to a ``PhaseSwitcher`` with ``GroupedOptimizer(Adam)``,
alternating every step. Accelerate wraps no DDP at world size 1 (which is why
``long_run.py`` never exercised a reducer on one GPU), so DDP is built here
explicitly: over NCCL at world size 1, or, with ``--ranks 2``, two ranks on ONE
GPU over gloo (gloo carries CUDA tensors; NCCL refuses two ranks on one device).
On CPU (gloo, RSS instead of CUDA memory) it runs the same code, small, for CI.

Variants, side by side in one invocation (``--variants``; ``name:N`` sets its switch count):

* ``single_a`` / ``single_b``: one half trained alone (the other frozen before
  wrapping), one Adam: the baselines;
* ``default``: hf_altparams with default settings;
* ``keep_reducers``: ``keep_reducers=1`` (the idle half's reducer and buckets kept);
* ``release``: ``release=True`` (gc, ``empty_cache``, ``malloc_trim`` at every switch);
* ``find_unused``: no hf_altparams: one DDP with ``find_unused_parameters=True``,
  ``requires_grad`` toggled every step, two Adams (the workaround to beat);
* diagnostics: ``probe`` (default + a comm hook that all-reduces like DDP's own
  and counts, by weak reference, the old buckets still alive after each
  switch), ``waited`` (default + a comm hook that keeps each all-reduce's work
  and calls ``work.wait()`` on it before the switch: NCCL drops a collective's
  tensors at ``wait()``; DDP only waits on the future), ``record_streams``
  (default with ``TORCH_NCCL_AVOID_RECORD_STREAMS=0``: the caching allocator
  tracks NCCL's use of the buckets by stream events instead of NCCL holding
  them; NCCL only).

Per variant, after every iteration (step + switch): ``memory_allocated``,
``memory_reserved`` and the iteration's peak (``max_memory_allocated``, reset
each iteration; CPU: RSS only). After ``--warmup`` switches: the growth of
``memory_allocated`` per phase (target <= 1 MiB over 10,000 switches), the
peak above the post-warm-up level (read once the readings settled, so no
collective's leftovers are in it) against one half alone (target <= 1.10x),
the mean iteration (step + switch) over ``--timed`` more iterations with no
reading in them (each reading queries the allocator) against the mean
single-half step (target <= 1.05x), the memory left once the GPU
idled ``--idle-s`` (1.5 s: what NCCL's watchdog frees late), the
Python-visible tensors (gc census) at both ends, and a digest of the weights
(ranks must be equal).
Then, on CUDA, a diagnostic tail of ``--tail`` switches records the Python
stack of every allocation (a private torch API, fenced) and diffs the live
blocks by allocation site between readings, and counts the old reducers
still alive after each switch: where the memory goes, without another GPU run.

Every launch is a ``torchrun`` (``--launcher forked``, CPU only, for the
tests: ranks forked from ``hf_altparams.testing``'s warm server, no start-up
per launch, their RSS not that of a fresh process). Each variant's raw
readings go to ``<out>/switch_soak_<tag>_raw/`` as soon as it ends (a crash or
a timeout loses only what had not finished; a crashed worker is restarted for
the remaining variants); then a JSON summary, a markdown table and a PNG plot
(``memory_allocated`` and ``memory_reserved`` per switch, per variant) go to
``<out>/switch_soak_<tag>.{json,md,png}``,
where ``tag`` is ``cuda_1r`` (NCCL), ``cuda_2r`` (gloo, one GPU) or ``cpu_<N>r``.

Run::

    python benchmarks/switch_soak.py --device cuda                    # NCCL, world size 1 (gpu.sh)
    python benchmarks/switch_soak.py --device cuda --ranks 2 --size-mib 16 --switches 1000
    python benchmarks/switch_soak.py --device cpu --size-mib 0.05 --layers 1 --switches 60 --warmup 10
    python benchmarks/switch_soak.py --summarize --device cuda --out results/   # table and plot from raw files
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))
if str(REPO / "benchmarks") not in sys.path:  # _machine, when imported rather than run
    sys.path.insert(0, str(REPO / "benchmarks"))

MIB = 2**20
HALVES = ("a", "b")
#: Variant -> what it is (the table's legend).
VARIANTS: dict[str, str] = {
    "default": "hf_altparams, default settings",
    "single_a": "half a trained alone (b frozen before wrapping), one Adam",
    "single_b": "half b trained alone",
    "keep_reducers": "hf_altparams, keep_reducers=1",
    "find_unused": "one DDP, find_unused_parameters=True, requires_grad toggled, two Adams",
    "release": "hf_altparams, release=True (empty_cache at every switch)",
    "probe": "default + a comm hook counting the old buckets alive (diagnostic)",
    "waited": "default + work.wait() on every all-reduce before the switch (diagnostic)",
    "record_streams": "default with TORCH_NCCL_AVOID_RECORD_STREAMS=0 (diagnostic, NCCL)",
}
#: Variants run for the full ``--switches``; the others for ``--short-switches``.
LONG = ("default", "keep_reducers")
ALTERNATING = tuple(v for v in VARIANTS if not v.startswith("single"))
HF = tuple(v for v in ALTERNATING if v != "find_unused")
#: Variants that only diagnose (dashed in the plot).
DIAGNOSTIC = ("probe", "waited", "record_streams")
#: The environment a variant needs in its own launch.
VARIANT_ENV = {"record_streams": {"TORCH_NCCL_AVOID_RECORD_STREAMS": "0"}}


# ============================================================== worker: one variant
class WaitedAllReduce:
    """Comm hook state: all-reduce each bucket as DDP does, keep the work, wait on it before the switch."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.works: list[Any] = []

    def wait_all(self) -> None:
        for work in self.works:
            work.wait()  # NCCL drops the tensors it stashed for this collective here
        self.works.clear()


def _waited_hook(state: WaitedAllReduce, bucket: Any) -> Any:
    import torch.distributed as dist

    tensor = bucket.buffer().div_(state.world)
    work = dist.all_reduce(tensor, async_op=True)
    state.works.append(work)
    return work.get_future().then(lambda fut: fut.value()[0])


def _annotate_hook() -> None:
    # DDP checks a comm hook's annotations are the real types (this module's are strings).
    import torch
    import torch.distributed as dist

    _waited_hook.__annotations__ = {
        "state": WaitedAllReduce,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }


class SoakLoop:
    """One variant's training loop: :meth:`iterate` is one step and, for alternation, the switch after it."""

    def __init__(self, variant: str, model: Any, device: Any, batches: list[Any]) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
        from hf_altparams.plan import Alternating, ParamGroups
        from tests.support.switch_leaks import BucketProbe

        self.variant, self.model, self.batches = variant, model, batches
        kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
        self.switcher: Optional[Any] = None
        self.probe: Optional[Any] = None
        self.waited: Optional[WaitedAllReduce] = None
        self.before_switch: list[Callable[[], None]] = []

        def adam(params: Any) -> Any:
            return torch.optim.Adam(params, lr=1e-4)

        if variant.startswith("single"):
            half = variant[-1]
            for name in HALVES:
                getattr(model, name).requires_grad_(name == half)
            self.ddp = DDP(model, **kwargs)
            self.optimizers = [adam(getattr(model, half).parameters())]
        elif variant == "find_unused":
            self.ddp = DDP(model, find_unused_parameters=True, **kwargs)
            self.optimizers = [adam(getattr(model, name).parameters()) for name in HALVES]
        else:
            groups = ParamGroups(model, {name: f"{name}.*" for name in HALVES})
            self.optimizers = [GroupedOptimizer(groups, adam)]
            options = {"keep_reducers": {"keep_reducers": 1}, "release": {"release": True}}.get(variant, {})
            self.switcher = PhaseSwitcher(groups, Alternating(list(HALVES)), optimizer=self.optimizers[0], **options)
            self.switcher.step_to(0)
            self.ddp = DDP(model, **kwargs)
            if variant == "probe":
                self.probe = BucketProbe()
                self.probe.register(self.ddp)
            elif variant == "waited":
                _annotate_hook()
                self.waited = WaitedAllReduce(dist.get_world_size())
                self.ddp.register_comm_hook(self.waited, _waited_hook)
                self.before_switch.append(self.waited.wait_all)
            self.switcher.attach(self.ddp)

    def phase_after(self, step: int) -> str:
        """The phase in force after iteration ``step`` (its switch included)."""
        if self.variant.startswith("single"):
            return self.variant[-1]
        return HALVES[(step + 1) % 2]

    def trained_at(self, step: int) -> str:
        return self.variant[-1] if self.variant.startswith("single") else HALVES[step % 2]

    def iterate(self, step: int) -> None:
        if self.variant == "find_unused":
            for name in HALVES:
                getattr(self.model, name).requires_grad_(name == HALVES[step % 2])
        self.ddp(self.batches[step % 2]).pow(2).mean().backward()
        active = self.optimizers[step % 2] if self.variant == "find_unused" else self.optimizers[0]
        active.step()
        for hook in self.before_switch:
            hook()
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.switcher is not None:
            self.switcher.step_to(step + 1)

    def close(self) -> None:
        from hf_altparams.engine import shutdown

        self.before_switch.clear()
        if self.switcher is not None:
            self.switcher.close()
        shutdown(self.ddp, destroy=False)


class Meter:
    """Memory readings of one process: CUDA allocator counters, or RSS on CPU (bound once: read every switch)."""

    def __init__(self, device: Any) -> None:
        import torch

        from hf_altparams.engine import rss_bytes

        self.device = device
        self.cuda = device.type == "cuda"
        self._torch = torch
        self._rss = rss_bytes

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize(self.device)

    def allocated(self) -> int:
        return self._torch.cuda.memory_allocated(self.device) if self.cuda else self._rss()

    def take_peak(self) -> Optional[int]:
        """The peak allocation since the last call (CUDA; ``None`` on CPU), and restart it."""
        return self.read()[2]

    def read(self) -> tuple[int, Optional[int], Optional[int]]:
        """(allocated, reserved, peak since the last read) in one query of the allocator; the peak restarts.

        ``torch.cuda.memory_allocated`` and its kin each build the allocator's
        whole statistics dict: one nested dict per switch costs a third of that.
        """
        if not self.cuda:
            return self._rss(), None, None
        stats = self._torch.cuda.memory_stats_as_nested_dict(self.device)
        self._torch.cuda.reset_peak_memory_stats(self.device)
        allocated = stats["allocated_bytes"]["all"]
        return allocated["current"], stats["reserved_bytes"]["all"]["current"], allocated["peak"]


def _phase_summary(values: list[int], phases: list[str], start: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in HALVES:
        seen = [v for v, p in zip(values[start:], phases[start:]) if p == phase]
        if not seen:
            continue
        out[phase] = {
            "first": seen[0],
            "last": seen[-1],
            "min": min(seen),
            "max": max(seen),
            "growth": seen[-1] - seen[0],
            "max_excess": max(seen) - seen[0],
            "distinct": len(set(seen)),
            "values": sorted(set(seen))[:8],
        }
    return out


def run_variant(variant: str, switches: int, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """Train ``variant`` for ``switches`` iterations; every reading (see the module docstring)."""
    import torch
    import torch.distributed as dist

    from tests.support.digests import param_sha
    from tests.support.models import TwoHalves
    from tests.support.switch_leaks import settled as settled_reading
    from tests.support.switch_leaks import tensor_census

    meter = Meter(device)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = TwoHalves(args.size_mib, names=HALVES, layers=args.layers).to(device)
    generator = torch.Generator().manual_seed(1000 + rank)
    batches = [torch.randn(args.batch, model.width, generator=generator).to(device) for _ in range(2)]
    gc.collect()
    meter.sync()
    baseline = meter.allocated()
    loop = SoakLoop(variant, model, device, batches)
    warmup = min(args.warmup, switches - 2)
    allocated: list[int] = []
    reserved: list[Optional[int]] = []
    peaks: list[Optional[int]] = []
    chunks: list[float] = []
    census: dict[str, Any] = {}
    switch_totals: list[tuple[int, float]] = []
    freed = None
    alive_buckets: list[int] = []
    level = 0
    if variant == "probe":  # the diagnostic: old buckets still alive after every switch, the whole run
        from tests.support.switch_leaks import FreedBySwitch

        freed = FreedBySwitch(loop.ddp, loop.probe)
        loop.before_switch.insert(0, freed.before)
    meter.take_peak()
    started = chunk_start = time.perf_counter()
    chunk_from = warmup
    for step in range(switches):
        loop.iterate(step)
        reading = meter.read()
        allocated.append(reading[0])
        reserved.append(reading[1])
        peaks.append(reading[2])
        if freed is not None:  # after --probe-grace-s at most (0: at once), while only buckets survive
            alive_buckets.append(len(freed.wait_freed(step + 1, args.probe_grace_s).storages))
        done = step + 1
        if done == warmup:
            meter.sync()
            census["warm"] = list(settled_reading(tensor_census))  # a comm thread may still hold a bucket
            level = meter.allocated()  # the post-warm-up level, once what collectives held was let go
            if loop.switcher is not None:
                switch_totals.append((loop.switcher.history.count, loop.switcher.history.seconds))
            meter.take_peak()
            started = chunk_start = time.perf_counter()
        elif done > warmup and ((done - warmup) % args.chunk == 0 or done == switches):
            meter.sync()
            now = time.perf_counter()
            chunks.append((now - chunk_start) / (done - chunk_from))
            chunk_start, chunk_from = now, done
    settled: dict[str, Any] = {"idle_s": args.idle_s, "end": meter.allocated()}
    meter.sync()
    elapsed = time.perf_counter() - started
    settled["synchronized"] = meter.allocated()
    time.sleep(args.idle_s / 5)
    settled["after_short_idle"] = meter.allocated()
    time.sleep(args.idle_s * 4 / 5)
    settled["after_idle"] = meter.allocated()
    if freed is not None:
        loop.before_switch.remove(freed.before)
    if loop.switcher is not None:
        switch_totals.append((loop.switcher.history.count, loop.switcher.history.seconds))
    census["end"] = list(settled_reading(tensor_census))
    phases = [loop.phase_after(i) for i in range(switches)]
    transient = {
        phase: max(
            (
                p - allocated[i - 1]
                for i, p in enumerate(peaks)
                if i >= warmup and p is not None and loop.trained_at(i) == phase
            ),
            default=None,
        )
        for phase in HALVES
    }
    result: dict[str, Any] = {
        "variant": variant,
        "rank": rank,
        "world_size": dist.get_world_size(),
        "device": device.type,
        "backend": dist.get_backend(),
        "switches": switches,
        "warmup": warmup,
        "baseline": baseline,
        "level_after_warmup": level,
        "level_at_warmup_switch": allocated[warmup - 1],
        "allocated": allocated,
        "reserved": reserved,
        "peaks": peaks,
        "phase_after": "".join(phases),
        # From the first reading after the warm-up census (on CPU the census itself moves RSS).
        "allocated_by_phase": _phase_summary(allocated, phases, warmup),
        "reserved_by_phase": (
            _phase_summary([r or 0 for r in reserved], phases, warmup) if device.type == "cuda" else None
        ),
        "peak_over_level": (max(p for p in peaks[warmup:] if p is not None) - level) if device.type == "cuda" else None,
        "peak_over_baseline": (max(p for p in peaks[warmup:] if p is not None) - baseline)
        if device.type == "cuda"
        else None,
        "transient_by_phase": transient,
        "instrumented_iteration_s": elapsed / max(1, switches - warmup),
        "chunk_iteration_s": chunks,
        "switch_s": (
            (switch_totals[1][1] - switch_totals[0][1]) / max(1, switch_totals[1][0] - switch_totals[0][0])
            if len(switch_totals) == 2
            else None
        ),
        "settled": settled,
        "census": census,
        "old_buckets_alive": alive_buckets or None,
    }
    step = switches
    if args.timed > 0:  # the time of an iteration with no reading in it: what the targets compare
        step, result["iteration_s"], result["timed_iterations"] = timed_block(loop, step, args.timed, meter)
    else:
        result["iteration_s"] = result["instrumented_iteration_s"]
    if variant in HF and args.tail > 0:
        result["tail"] = diagnostic_tail(loop, step, args.tail, meter, args.idle_s, args.probe_grace_s)
    result["digest"] = param_sha(model)
    loop.close()
    del loop, model, batches
    gc.collect()
    if device.type == "cuda":
        meter.sync()
        time.sleep(0.5)  # NCCL's watchdog lets go of what the last collectives used
        torch.cuda.empty_cache()
    return result


def timed_block(loop: SoakLoop, start: int, count: int, meter: Meter) -> tuple[int, float, int]:
    """``count`` iterations timed with nothing else in them (after 20 to get the device going again).

    Returns the next step, the mean iteration in seconds and ``count``.
    Synchronised at both ends only, as a training loop runs.
    """
    step = start
    for _ in range(20):
        loop.iterate(step)
        step += 1
    meter.sync()
    started = time.perf_counter()
    for _ in range(count):
        loop.iterate(step)
        step += 1
    meter.sync()
    return step, (time.perf_counter() - started) / count, count


def diagnostic_tail(
    loop: SoakLoop, start: int, count: int, meter: Meter, idle_s: float, grace_s: float = 0.0
) -> dict[str, Any]:
    """``count`` more switches with allocation stacks recorded: where the memory goes.

    Snapshots of the CUDA caching allocator (on CPU there are none: a note says
    so): A after ``count // 5`` switches (so the blocks of recent switches have
    their stacks), B after ``count`` (same phase), C once the device idled
    ``idle_s``. B - A: what accumulates while switching; B - C: what is held only
    for a while after it was used (NCCL's watchdog). After each switch, the old
    reducers still alive (weak references; ``probe``: the old bucket storages too,
    counted after up to ``grace_s`` seconds while only buckets survive).
    """
    from tests.support import memory_snapshots as snaps
    from tests.support.switch_leaks import FreedBySwitch

    out: dict[str, Any] = {"switches": count}
    note = snaps.start_recording()
    freed = FreedBySwitch(loop.ddp, loop.probe)
    loop.before_switch.insert(0, freed.before)
    alive_reducers: list[int] = []
    alive_buckets: list[int] = []
    groups: dict[str, Any] = {}
    first = (count // 5) // 2 * 2
    try:
        for i in range(count):
            loop.iterate(start + i)
            survivors = freed.wait_freed(start + i + 1, grace_s)
            alive_reducers.append(survivors.reducers)
            alive_buckets.append(len(survivors.storages))
            if note is None and i + 1 in (first, count):
                snap, note = snaps.snapshot()
                if snap is not None:
                    groups["A" if i + 1 == first else "B"] = snaps.block_groups(snap)
        meter.sync()
        time.sleep(idle_s)
        if note is None:
            snap, note = snaps.snapshot()
            if snap is not None:
                groups["C"] = snaps.block_groups(snap)
    finally:
        loop.before_switch.remove(freed.before)
        snaps.stop_recording()
    out["old_reducers_alive"] = {"max": max(alive_reducers), "mean": statistics.fmean(alive_reducers)}
    if loop.probe is not None:
        out["old_buckets_alive"] = {
            "max": max(alive_buckets),
            "mean": statistics.fmean(alive_buckets),
            "series": alive_buckets,
        }
    out["allocated_after_idle"] = meter.allocated()
    if note is not None:
        out["note"] = note
    if {"A", "B"} <= set(groups):
        out["B_minus_A"] = snaps.diff_groups(groups["A"], groups["B"])
        out["B_top"] = snaps.top_groups(groups["B"])
    if {"B", "C"} <= set(groups):
        out["B_minus_C"] = snaps.diff_groups(groups["C"], groups["B"])
    return out


def run_worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from hf_altparams.engine import shutdown

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0")) if args.backend == "nccl" else 0  # gloo: one GPU for all
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if args.backend == "nccl":
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.result)
    per_iteration: Optional[float] = None
    for spec in args.variants:
        variant, switches = _parse_variant(spec, args)
        extra = args.timed + 20 + (args.tail if variant in HF else 0)
        estimate = 12.0 + 2 * args.idle_s + (switches + extra) * per_iteration * 1.3 if per_iteration else 0.0
        left = args.deadline - time.time()
        decision = [bool(args.deadline) and (estimate > left or left <= 0)]
        dist.broadcast_object_list(decision, src=0)  # every rank skips alike (clocks differ a little)
        if decision[0]:
            if rank == 0:
                _write(
                    out / f"{variant}.skipped.json",
                    {
                        "variant": variant,
                        "skipped": f"the time budget (about {estimate:.0f} s needed, {max(0.0, left):.0f} s left)",
                    },
                )
            continue
        if rank == 0:
            print(f"switch_soak: {variant} ({switches} switches)", flush=True)
        result = run_variant(variant, switches, args, device)
        per_iteration = result["iteration_s"]
        if rank == 0:
            growth = {p: v["growth"] for p, v in result["allocated_by_phase"].items()}
            print(
                f"switch_soak: {variant} done: {1e3 * per_iteration:.3f} ms an iteration, growth by phase "
                f"{growth} B, held until idle {result['settled']['end'] - result['settled']['after_idle']} B",
                flush=True,
            )
        _write(out / f"{variant}.rank{rank}.json", result)
        dist.barrier()
    shutdown()


def _write(path: Path, data: dict[str, Any]) -> None:
    part = path.with_suffix(".part")
    part.write_text(json.dumps(data))
    part.replace(path)


def _parse_variant(spec: str, args: argparse.Namespace) -> tuple[str, int]:
    name, _, count = spec.partition(":")
    return name, int(count) if count else (args.switches if name in LONG else args.short_switches)


# ============================================================== driver
def tag_of(args: argparse.Namespace) -> str:
    return f"{args.device}_{args.ranks}r"


def run_driver(args: argparse.Namespace) -> None:
    from _rank_env import rank_env
    from hf_altparams.testing.launch import LaunchError, launch

    out = Path(args.out)
    raw = out / f"switch_soak_{tag_of(args)}_raw"
    raw.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.budget_s if args.budget_s else 0.0
    env = rank_env(args.device)
    launches: list[tuple[dict[str, str], list[str]]] = []
    for spec in args.variants:
        extra = VARIANT_ENV.get(spec.partition(":")[0], {})
        if launches and launches[-1][0] == extra:
            launches[-1][1].append(spec)
        else:
            launches.append((extra, [spec]))
    for extra, specs in launches:
        remaining = list(specs)
        if deadline and deadline - time.time() < 45:  # a fresh launch (imports, process group) and a variant
            for spec in remaining:
                name = spec.partition(":")[0]
                _write(
                    raw / f"{name}.skipped.json",
                    {
                        "variant": name,
                        "skipped": "the time budget (no time left "
                        f"for a launch of its own: {max(0.0, deadline - time.time()):.0f} s)",
                    },
                )
            remaining = []
        while remaining:
            common = [
                "--worker",
                "--result",
                str(raw),
                "--device",
                args.device,
                "--backend",
                args.backend,
                "--size-mib",
                str(args.size_mib),
                "--layers",
                str(args.layers),
                "--batch",
                str(args.batch),
                "--switches",
                str(args.switches),
                "--short-switches",
                str(args.short_switches),
                "--warmup",
                str(args.warmup),
                "--tail",
                str(args.tail),
                "--chunk",
                str(args.chunk),
                "--idle-s",
                str(args.idle_s),
                "--probe-grace-s",
                str(args.probe_grace_s),
                "--timed",
                str(args.timed),
                "--deadline",
                str(deadline),
                "--variants",
                *remaining,
            ]
            try:
                proc = launch(
                    __file__,
                    *common,
                    nproc=args.ranks,
                    launcher=args.launcher,
                    env={**env, **extra},
                    timeout=args.timeout,
                )
                print(
                    "\n".join(line for line in (proc.stdout or "").splitlines() if "switch_soak:" in line), flush=True
                )
                remaining = []
            except LaunchError as exc:  # a crash: record it, go on with the variants after it
                done = [s for s in remaining if _finished(raw, s.partition(":")[0], args.ranks)]
                crashed = next((s for s in remaining if s not in done), None)
                if crashed is None:
                    break
                name = crashed.partition(":")[0]
                _write(raw / f"{name}.crashed.json", {"variant": name, "crashed": str(exc)[-6000:]})
                print(f"switch_soak: {name} crashed; going on with the rest\n{str(exc)[-2000:]}", flush=True)
                remaining = remaining[remaining.index(crashed) + 1 :]
        summarize(args, quiet=True)  # what finished so far, in case a later launch is cut off
    summarize(args)


def _finished(raw: Path, name: str, ranks: int) -> bool:
    return (
        all((raw / f"{name}.rank{r}.json").is_file() for r in range(ranks)) or (raw / f"{name}.skipped.json").is_file()
    )


# ============================================================== summary
def load_raw(raw: Path, ranks: int) -> dict[str, Any]:
    """Every variant's readings (a list of ranks), or its ``skipped`` / ``crashed`` note."""
    runs: dict[str, Any] = {}
    for name in VARIANTS:
        files = [raw / f"{name}.rank{r}.json" for r in range(ranks)]
        if all(f.is_file() for f in files):
            runs[name] = [json.loads(f.read_text()) for f in files]
        for kind in ("skipped", "crashed"):
            note = raw / f"{name}.{kind}.json"
            if note.is_file() and name not in runs:
                runs[name] = json.loads(note.read_text())
    return runs


def _mib(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / MIB:.2f}"


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return None if value is None or not base else value / base


def summary_rows(runs: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant (rank 0's memory; every rank's digest), with the ratios to the single halves."""
    singles = [runs[s][0] for s in ("single_a", "single_b") if isinstance(runs.get(s), list)]
    single_step = statistics.fmean(s["iteration_s"] for s in singles) if singles else None
    single_peak = (
        statistics.fmean(s["peak_over_level"] for s in singles)
        if singles and all(s["peak_over_level"] is not None for s in singles)
        else None
    )
    single_transient = {s["variant"][-1]: s["transient_by_phase"][s["variant"][-1]] for s in singles}
    rows = []
    for name, data in runs.items():
        if not isinstance(data, list):
            rows.append(
                {
                    "variant": name,
                    "note": data.get("skipped") and f"skipped: {data['skipped']}" or "crashed (see the JSON)",
                }
            )
            continue
        r0 = data[0]
        by_phase = r0["allocated_by_phase"]
        growth = max((v["growth"] for v in by_phase.values()), default=None)
        excess = max((v["max_excess"] for v in by_phase.values()), default=None)
        ratios = [
            r0["transient_by_phase"][p] / single_transient[p]
            for p in single_transient
            if single_transient[p] and r0["transient_by_phase"].get(p) is not None
        ]
        transient_ratio = max(ratios) if ratios else None
        tail = r0.get("tail") or {}
        rows.append(
            {
                "variant": name,
                "switches": r0["switches"],
                "warmup": r0["warmup"],
                "growth_bytes": growth,
                "max_excess_bytes": excess,
                "distinct_values": {p: v["distinct"] for p, v in by_phase.items()},
                "reserved_growth_bytes": max(
                    (v["growth"] for v in (r0["reserved_by_phase"] or {}).values()), default=None
                ),
                "held_until_idle_bytes": r0["settled"]["end"] - r0["settled"]["after_idle"],
                "peak_over_level_bytes": r0["peak_over_level"],
                "peak_ratio": _ratio(r0["peak_over_level"], single_peak),
                "transient_ratio": transient_ratio,
                "iteration_ms": 1e3 * r0["iteration_s"],
                "iteration_ratio": _ratio(r0["iteration_s"], single_step),
                "switch_ms": None if r0["switch_s"] is None else 1e3 * r0["switch_s"],
                "census_equal": r0["census"]["warm"] == r0["census"]["end"],
                "old_reducers_alive_max": (tail.get("old_reducers_alive") or {}).get("max"),
                "old_buckets_alive_max": (tail.get("old_buckets_alive") or {}).get(
                    "max", max(r0["old_buckets_alive"]) if r0["old_buckets_alive"] else None
                ),
                "ranks_identical": len({rank["digest"] for rank in data}) == 1,
                "ranks": len(data),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], runs: dict[str, Any], title: str, cuda: bool) -> str:
    def fmt(value: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
        return "-" if value is None else f"{value:{spec}}{suffix}"

    memory = "`memory_allocated`" if cuda else "RSS"
    lines = [
        f"### {title}",
        "",
        f"| variant | switches | {memory} growth after warm-up (worst phase) | max above first | "
        "values per phase | held until idle | `memory_reserved` growth | peak over warm-up level | "
        "/ single | transient / single (per phase) | step + switch | / mean single | switch | "
        "old reducers alive | old buckets alive | gc census equal | ranks identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "note" in row:
            lines.append(f"| `{row['variant']}` | {row['note']} |" + " |" * 15)
            continue
        lines.append(
            f"| `{row['variant']}` | {row['switches']} (warm-up {row['warmup']}) | {_mib(row['growth_bytes'])} MiB "
            f"| {_mib(row['max_excess_bytes'])} MiB | {row['distinct_values']} | {_mib(row['held_until_idle_bytes'])} MiB "
            f"| {_mib(row['reserved_growth_bytes'])} MiB | {_mib(row['peak_over_level_bytes'])} MiB "
            f"| {fmt(row['peak_ratio'], '.2f', 'x')} | {fmt(row['transient_ratio'], '.2f', 'x')} "
            f"| {fmt(row['iteration_ms'], '.3f', ' ms')} | {fmt(row['iteration_ratio'], '.3f', 'x')} "
            f"| {fmt(row['switch_ms'], '.3f', ' ms')} | {fmt(row['old_reducers_alive_max'], 'd')} "
            f"| {fmt(row['old_buckets_alive_max'], 'd')} | {'yes' if row['census_equal'] else 'NO'} "
            f"| {'yes' if row['ranks_identical'] else 'NO'} ({row['ranks']}) |"
        )
    lines += ["", "Variants: " + "; ".join(f"`{name}`: {VARIANTS[name]}" for name in runs), ""]
    for name, data in runs.items():
        tail = data[0].get("tail") if isinstance(data, list) else None
        if not tail:
            continue
        lines.append(
            f"**Where the memory goes, `{name}`** ({tail['switches']} more switches, allocation stacks "
            f"recorded){': ' + tail['note'] if tail.get('note') else ''}"
        )
        for key, label in (
            ("B_minus_A", "grew while switching (B - A)"),
            ("B_minus_C", "held only until the device idled (B - C)"),
        ):
            for entry in tail.get(key, [])[:6]:
                lines.append(
                    f"* {label}: {entry['bytes'] / MIB:+.2f} MiB in {entry['blocks']:+d} block(s) "
                    f"from `{entry['site']}`"
                )
        lines.append("")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]], full: int) -> list[str]:
    """The issue's targets, for the variants that alternate."""
    out = []
    for row in rows:
        if "note" in row or row["variant"] not in ALTERNATING:
            continue

        def verdict(value: Optional[float], limit: float) -> str:
            return "n/a" if value is None else "met" if value <= limit else "MISSED"

        growth = (
            verdict(row["growth_bytes"], MIB)
            if row["switches"] >= full
            else f"not judged ({row['switches']} switches, the target is over {full})"
        )
        checks = [
            ("growth <= 1 MiB", growth),
            ("peak <= 1.10x one half", verdict(row["peak_ratio"], 1.10)),
            ("step + switch <= 1.05x", verdict(row["iteration_ratio"], 1.05)),
            ("ranks identical", "met" if row["ranks_identical"] else "MISSED"),
        ]
        out.append(f"{row['variant']}: " + ", ".join(f"{name} {result}" for name, result in checks))
    return out


def plot(runs: dict[str, Any], path: Path, title: str) -> Optional[str]:
    """``memory_allocated`` and ``memory_reserved`` (RSS on CPU) per switch, per variant; ``None`` or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"no plot: matplotlib is missing ({exc})"
    cuda = any(isinstance(d, list) and d[0]["device"] == "cuda" for d in runs.values())
    panels = [("allocated", "memory_allocated (MiB)" if cuda else "RSS (MiB)")]
    if cuda:
        panels.append(("reserved", "memory_reserved (MiB)"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, 4 * len(panels)), sharex=True, squeeze=False)
    for (key, label), axis in zip(panels, axes[:, 0]):
        for name, data in runs.items():
            if isinstance(data, list):
                values = [v / MIB for v in data[0][key] if v is not None]
                axis.plot(
                    range(1, len(values) + 1),
                    values,
                    label=name,
                    linewidth=0.8,
                    color=f"C{list(VARIANTS).index(name)}",
                    linestyle="--" if name in DIAGNOSTIC else "-",
                )
        warm = next((d[0]["warmup"] for d in runs.values() if isinstance(d, list)), None)
        if warm:
            axis.axvline(warm, color="grey", linestyle=":", linewidth=0.8)
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        if axis.get_lines():  # every variant skipped: an empty plot, no legend
            axis.legend(fontsize=7, ncol=3)
    axes[-1, 0].set_xlabel("switch (iteration)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def summarize(args: argparse.Namespace, quiet: bool = False) -> None:
    out = Path(args.out)
    tag = tag_of(args)
    runs = load_raw(out / f"switch_soak_{tag}_raw", args.ranks)
    if not runs:
        print(f"switch_soak: no results yet under {out}")
        return
    first = next((d[0] for d in runs.values() if isinstance(d, list)), None)
    where = _machine_line(args, first)
    title = (
        f"{where}; two halves of {args.layers} x Linear ({args.size_mib:g} MiB a half), batch {args.batch}; "
        "per-step alternation under DDP built by hand"
    )
    rows = summary_rows(runs)
    table = markdown(rows, runs, title, args.device == "cuda")
    goals = targets(rows, args.switches)
    note = plot(runs, out / f"switch_soak_{tag}.png", title)
    text = table + "\n" + "\n".join(f"* target: {line}" for line in goals) + ("\n* " + note if note else "") + "\n"
    (out / f"switch_soak_{tag}.md").write_text(text)
    (out / f"switch_soak_{tag}.json").write_text(
        json.dumps(
            {
                "machine": where,
                "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
                "rows": rows,
                "targets": goals,
                "plot": None if note else f"switch_soak_{tag}.png",
                "tails": {name: data[0].get("tail") for name, data in runs.items() if isinstance(data, list)},
            },
            indent=1,
        )
    )
    if not quiet:
        print(text, flush=True)


def _machine_line(args: argparse.Namespace, first: Optional[dict[str, Any]]) -> str:
    import torch

    from _machine import machine  # benchmarks/ is the script's folder

    backend = first["backend"] if first else args.backend
    if args.device == "cuda" and torch.cuda.is_available():
        return f"{args.ranks} rank(s) on one {torch.cuda.get_device_name(0)}, {backend}, torch {torch.__version__}"
    return machine("cpu", args.ranks) if args.device == "cpu" else f"{args.ranks} rank(s), {backend}"


# ============================================================== command line
def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=1, help="processes; on CUDA all on one GPU (gloo) when > 1")
    parser.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="auto: NCCL for one CUDA rank, gloo otherwise",
    )
    parser.add_argument("--size-mib", type=float, default=128.0, help="MiB of weights per half (the --size option)")
    parser.add_argument("--layers", type=int, default=2, help="square Linear layers per half")
    parser.add_argument("--batch", type=int, default=256, help="rows per rank and step")
    parser.add_argument("--switches", type=int, default=10_000, help="iterations of the long variants")
    parser.add_argument("--short-switches", type=int, default=2_000, help="iterations of the other variants")
    parser.add_argument("--warmup", type=int, default=500, help="switches before the post-warm-up level is taken")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"from {list(VARIANTS)}; name:N sets its switches (default: all that apply)",
    )
    parser.add_argument(
        "--tail",
        type=int,
        default=None,
        help="diagnostic tail switches after the measured ones (default 200 on CUDA, 0 on CPU)",
    )
    parser.add_argument(
        "--probe-grace-s",
        type=float,
        default=0.0,
        help="probe: count the old buckets alive after waiting up to this long while only buckets "
        "survive (0: at once; a gloo worker thread lets go of a bucket a moment late)",
    )
    parser.add_argument(
        "--idle-s",
        type=float,
        default=1.5,
        help="seconds the device idles before the last readings (NCCL's watchdog lets go)",
    )
    parser.add_argument("--chunk", type=int, default=100, help="iterations between synchronised time readings")
    parser.add_argument(
        "--timed",
        type=int,
        default=1000,
        help="iterations timed after the readings, with nothing else in them (0: time the readings' window instead)",
    )
    parser.add_argument("--budget-s", type=float, default=0.0, help="skip variants that would end after this")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per launch")
    parser.add_argument(
        "--launcher",
        choices=["torchrun", "forked"],
        default="torchrun",
        help="torchrun: fresh interpreters (the figures); forked: CPU ranks forked from a warm server "
        "(hf_altparams.testing, docs/testing.md): no start-up per launch, for the tests; the ranks share the "
        "server's pages, so RSS figures are not those of a fresh process",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--summarize", action="store_true", help="only rebuild the table and plot from raw files")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tail is None:
        args.tail = 200 if args.device == "cuda" else 0
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" and args.ranks == 1 else "gloo"
    if args.backend == "nccl" and (args.device != "cuda" or args.ranks != 1):
        parser.error("--backend nccl needs --device cuda and --ranks 1 (NCCL refuses two ranks on one GPU)")
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.launcher == "forked" and args.device != "cpu":
        parser.error(f"--launcher forked runs CPU ranks only: it needs --device cpu, got --device {args.device}")
    if args.variants is None:
        args.variants = [v for v in VARIANTS if v != "record_streams" or args.backend == "nccl"]
    unknown = [v for v in args.variants if v.partition(":")[0] not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)} (name or name:switches)")
    if args.variants and "record_streams" in [v.partition(":")[0] for v in args.variants] and args.backend != "nccl":
        parser.error("--variants record_streams changes an NCCL setting: it needs --device cuda with one rank")
    for spec in args.variants:
        switches = _parse_variant(spec, args)[1]
        if not 2 < args.warmup + 2 <= switches:
            parser.error(
                f"--warmup ({args.warmup}) must be >= 1 and at least 2 below the switches of {spec} ({switches})"
            )
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
    elif args.summarize:
        summarize(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
