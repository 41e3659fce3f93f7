"""Where a switch's time goes, part by part, on every rank: ``alternating.py --breakdown``.

The library is not changed: in each worker, :func:`activate` wraps (per
instance, once the switcher is attached) the calls the switch transaction makes
(:mod:`hf_altparams.engine.switch`) in timers, and each switch's time is split
into the parts of :data:`PARTS`. Timers nest: a part's time excludes the parts
called inside it, so the parts of one switch never add up to more than the
switch (``unattributed`` is what is left: the transaction's own lines,
snapshots, flag lists, and most of the timers' own cost, about 0.1 ms per
switch on the 2-core dev box).

Before each of the switch's collectives (``settle``, or ``agree`` and
``any_rank_failed`` on the two-collective path) a DIAGNOSTIC barrier runs, timed
as ``wait``: the time one rank waits for the slower one (plus a barrier's own
cost) lands there instead of in the all-gather, which then shows the
collective's own cost (``collective``). The measured switch includes that
barrier, so it is slower than without ``--breakdown`` by about one barrier.

After its loop each worker measures gloo's floor on the same process group:
the median time of a tiny all-gather (3 x int64 per rank, the ``settle`` row)
in a tight loop, of the tiny all-reduce that ``settle`` ran before 2026-11-27
(MAX over 4 x int64), of a barrier, of each collective right after a barrier
(the pattern the diagnostic barrier gives the switch), and of the all-gather
after 64 MiB were written and a barrier (cold caches, as after a step: what a
collective issued once per step meets).

Example (driver side; the worker side is wired into ``alternating.py``)::

    python benchmarks/alternating.py --breakdown --devices cpu --repeats 2
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from hf_altparams.engine import collective as _collective
from hf_altparams.engine import switch as switch_module
from hf_altparams.engine.collective import collective_device, is_distributed
from hf_altparams.engine.ddp import _surgery as _ddp

#: The parts of a switch, in transaction order, and what each times.
PARTS: dict[str, str] = {
    "plan": "phase_at, precondition checks (no_sync, pending gradients, comm hooks), backend snapshot",
    "residency": "residency: apply, non_resident, ignore_names, sync_returning, install_guards, offloaded_bytes",
    "flags": "_apply_flags: grad = None, requires_grad flipped",
    "rebuild_checks": "check_ddp_supported at each rebuild: torch version, private attributes, modes",
    "rebuild": "the rest of rebuild_reducer: old reducer and logger freed, grads cleared, ignore list, hooks",
    "rebuild_params": "reducer_inputs: parameters, names and buffers (DDP's own methods on a wrapper's first rebuild)",
    "rebuild_init": "DDP _ddp_init_helper: bucket assignment, new Reducer, Logger, construction log",
    "wait": "DIAGNOSTIC barrier before each switch collective: waiting for the slower rank",
    "collective": "the switch's all-gather(s) (gather_rows), ranks already aligned by `wait`",
    "collective_local": "rest of settle / agree / any_rank_failed: phase digest, flag tensor",
    "optimizer": "GroupedOptimizer.enter_phase: idle-state policy (drop / offload) and restore",
    "buffers": "buffer_sync.apply: buffer broadcast plan, frozen norm layers",
    "release": "release decision (expected footprints) + release_memory (gc, empty_cache, malloc_trim) when taken",
    "record": "prefetch start, SwitchRecord, history.append",
    "unattributed": "the transaction's own lines and the timers' overhead",
}
#: ``--breakdown`` without ``--scenarios`` runs these.
DEFAULT_SCENARIOS = ("single", "hf_keep", "hf_offload", "hf_drop")
#: Tight-loop iterations of each floor measurement (after 20 warm-up ones); the cold one runs a quarter.
FLOOR_ITERS = 200
#: The floor measurements: key in the JSON -> label in the table.
FLOORS = {
    "allgather_s": "all-gather, 3 x int64 per rank, the `settle` rows (tight loop)",
    "allreduce_s": "all-reduce MAX, 4 x int64, the settle of before 2026-11-27 (tight loop)",
    "barrier_s": "barrier (tight loop)",
    "allgather_after_barrier_s": "that all-gather right after a barrier",
    "allreduce_after_barrier_s": "that all-reduce right after a barrier",
    "allgather_cold_s": "that all-gather after writing 64 MiB (caches evicted, as by a step) and a barrier",
}


class Recorder:
    """Per-switch exclusive time of each part, on this rank."""

    def __init__(self) -> None:
        self.switches: list[dict[str, float]] = []
        self.group: Optional[dist.ProcessGroup] = None
        self.active = False  # activate() ran
        self._entry: Optional[dict[str, float]] = None
        self._stack: list[list[float]] = []  # per open timer: [started, time of timed parts inside]

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` with its exclusive time added to ``part`` of the switch in progress."""

        def run(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                elapsed = time.perf_counter() - frame[0]
                if self._entry is not None:
                    self._entry[part] += elapsed - frame[1]
                if self._stack:
                    self._stack[-1][1] += elapsed

        return run

    def whole_switch(self, step_to: Callable[..., Any]) -> Callable[..., Any]:
        """``step_to`` opening one entry per switch (a call that switches nothing is dropped)."""
        timed_step_to = self.timed("unattributed", step_to)

        def run(*args: Any, **kwargs: Any) -> Any:
            entry = self._entry = dict.fromkeys(PARTS, 0.0)
            started = time.perf_counter()
            try:
                record = timed_step_to(*args, **kwargs)
            finally:
                self._entry = None
            entry["switch"] = time.perf_counter() - started
            if record is not None:
                self.switches.append(entry)
            return record

        return run

    def with_barrier(self, collective: Callable[..., Any]) -> Callable[..., Any]:
        """A switch collective (first argument: the group) preceded by the timed diagnostic barrier."""
        barrier = self.timed("wait", dist.barrier)

        def run(group: Optional[dist.ProcessGroup], *args: Any, **kwargs: Any) -> Any:
            if is_distributed(group):
                barrier(group=group)
            return collective(group, *args, **kwargs)

        return self.timed("collective_local", run)


RECORDER = Recorder()


def _wrap(obj: Any, name: str, part: str) -> None:
    setattr(obj, name, RECORDER.timed(part, getattr(obj, name)))


def _instrument(switcher: Any) -> None:
    """Wrap the attached ``switcher``'s per-instance calls (its backend exists only after attach)."""
    if getattr(switcher, "_breakdown_timed", False):  # attached again: already wrapped
        return
    switcher._breakdown_timed = True
    rec = RECORDER
    rec.group = switcher.process_group
    switcher.step_to = rec.whole_switch(switcher.step_to)
    for name in ("phase_at",):
        _wrap(switcher, name, "plan")
    for name in ("pending_grads_error", "unattached_error"):
        setattr(switch_module.invariants, name, rec.timed("plan", getattr(switch_module.invariants, name)))
    _wrap(switcher.backend, "snapshot", "plan")
    for name in ("apply", "non_resident", "ignore_names", "sync_returning", "install_guards", "offloaded_bytes"):
        _wrap(switcher.residency, name, "residency")
    _wrap(switcher, "_apply_flags", "flags")
    _wrap(switcher.backend, "apply", "rebuild")
    if switcher.ddp is not None:
        _wrap(switcher.ddp, "_ddp_init_helper", "rebuild_init")
    grouped = switcher.grouped_optimizer
    if grouped is not None:
        _wrap(grouped, "enter_phase", "optimizer")
    _wrap(switcher.buffer_sync, "apply", "buffers")
    _wrap(switcher, "expected_peak", "release")  # the release decision's footprints (cached per phase)
    _wrap(switcher, "_start_prefetch", "record")
    _wrap(switcher.history, "append", "record")


def activate() -> None:
    """Time every switch of this process from the next ``PhaseSwitcher.attach`` on (worker side).

    Module-level names the transaction looks up at call time are wrapped here,
    the switcher's own calls when it is attached. For a benchmark process only:
    nothing is restored.
    """
    rec = RECORDER
    if rec.active:
        return
    rec.active = True
    for name in ("settle", "agree", "any_rank_failed"):
        setattr(switch_module, name, rec.with_barrier(getattr(switch_module, name)))
    switch_module.release_memory = rec.timed("release", switch_module.release_memory)
    switch_module.SwitchRecord = rec.timed("record", switch_module.SwitchRecord)
    _collective.gather_rows = rec.timed("collective", _collective.gather_rows)
    _ddp.check_ddp_supported = rec.timed("rebuild_checks", _ddp.check_ddp_supported)
    _ddp.reducer_inputs = rec.timed("rebuild_params", _ddp.reducer_inputs)  # _surgery's own name for it
    attach = switch_module.PhaseSwitcher.attach

    def attach_and_instrument(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = attach(self, *args, **kwargs)
        _instrument(self)
        return result

    switch_module.PhaseSwitcher.attach = attach_and_instrument  # type: ignore[method-assign]


def _floor_samples(
    op: Callable[[], None], device: torch.device, before: Optional[Callable[[], None]] = None, iters: int = FLOOR_ITERS
) -> list[float]:
    samples = []
    for i in range(20 + iters):
        if before is not None:
            before()
        started = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 20:
            samples.append(time.perf_counter() - started)
    return samples


def gloo_floor(group: Optional[dist.ProcessGroup]) -> dict[str, list[float]]:
    """Seconds per operation of :data:`FLOORS`, on ``group``.

    The cold one is what a collective issued once per step meets: caches
    evicted by the step's tensors, the ranks aligned by a barrier first.
    """
    device = collective_device(group)
    flags = torch.zeros(4, dtype=torch.int64, device=device)  # the settle vector before 2026-11-27
    row = torch.zeros(3, dtype=torch.int64, device=device)  # settle's row since
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size(group))]
    evict = torch.empty(16 * 2**20, device=device)  # 64 MiB of fp32

    def cold() -> None:
        evict.fill_(1.0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        barrier()

    def allreduce() -> None:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)

    def allgather() -> None:
        dist.all_gather(rows, row, group=group)

    def barrier() -> None:
        dist.barrier(group=group)

    barrier()
    return {
        "allgather_s": _floor_samples(allgather, device),
        "allreduce_s": _floor_samples(allreduce, device),
        "barrier_s": _floor_samples(barrier, device),
        "allgather_after_barrier_s": _floor_samples(allgather, device, before=barrier),
        "allreduce_after_barrier_s": _floor_samples(allreduce, device, before=barrier),
        "allgather_cold_s": _floor_samples(allgather, device, before=cold, iters=FLOOR_ITERS // 4),
    }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def worker_result(warmup: int) -> dict[str, Any]:
    """This rank's per-switch parts (warm-up left out; seconds, to 0.1 us) and gloo's floor (its median,
    p90 and min per operation); a collective (the floor)."""
    samples = gloo_floor(RECORDER.group) if is_distributed(RECORDER.group) else {}
    floor = {
        key: {"median_s": statistics.median(v), "p90_s": _percentile(v, 0.9), "min_s": min(v), "n": len(v)}
        for key, v in samples.items()
    }
    switches = [{part: round(v, 7) for part, v in entry.items()} for entry in RECORDER.switches[warmup:]]
    return {"switches": switches, "floor": floor}


# ============================================================== driver side
def _stats(values: list[float], step_s: float, p90: Optional[list[float]] = None) -> dict[str, float]:
    """Median and p90 of ``values`` (of ``p90`` when given: per-rank p90s) in ms, the median as % of ``step_s``."""
    median = statistics.median(values) if values else 0.0
    high = statistics.median(p90) if p90 else _percentile(values, 0.9)
    return {"median_ms": 1e3 * median, "p90_ms": 1e3 * high, "pct_of_step": 100 * median / step_s if step_s else 0.0}


def summarize(runs: dict[str, list[list[dict[str, Any]]]], step_s: float) -> dict[str, Any]:
    """Per hf_* scenario: each part's median, p90 and % of ``step_s``, both ranks and every repeat pooled.

    Also per rank the part medians, the sum of the parts, the measured switch
    and gloo's floor.
    """
    out: dict[str, Any] = {}
    for scenario, repeats in runs.items():
        if not scenario.startswith("hf_"):
            continue
        ranks = [r for ranks in repeats for r in ranks]
        entries = [e for r in ranks for e in r["breakdown"]["switches"]]
        parts = {p: _stats([e[p] for e in entries], step_s) for p in PARTS}
        parts["sum_of_parts"] = _stats([sum(e[p] for p in PARTS) for e in entries], step_s)
        parts["switch"] = _stats([e["switch"] for e in entries], step_s)
        world = max(r["rank"] for r in ranks) + 1
        per_rank = {
            str(k): {
                p: 1e3
                * statistics.median(
                    [e[p] for r in ranks if r["rank"] == k for e in r["breakdown"]["switches"]] or [0.0]
                )
                for p in list(PARTS) + ["switch"]
            }
            for k in range(world)
        }
        floors = [r["breakdown"]["floor"] for r in ranks if r["breakdown"]["floor"]]
        floor = {
            key: {
                **_stats([f[key]["median_s"] for f in floors], step_s, [f[key]["p90_s"] for f in floors]),
                "min_ms": 1e3 * min((f[key]["min_s"] for f in floors), default=0.0),
            }
            for key in FLOORS
        }
        out[scenario] = {"switches": len(entries), "parts": parts, "rank_median_ms": per_rank, "floor": floor}
    return out


def markdown(summary: dict[str, Any], step_s: float, title: str) -> str:
    """The parts table and the floor table, one column pair per scenario."""
    names = list(summary)
    head = "| part | " + " | ".join(f"{s}: median (p90) | % of step" for s in names) + " |"
    rule = "|---|" + "---|---|" * len(names)
    lines = [
        f"### Switch breakdown: {title}",
        "",
        f"Median step of `single` {1e3 * step_s:.1f} ms (1 % = {10 * step_s:.2f} ms); both ranks pooled; times in ms.",
        "",
        head,
        rule,
    ]

    def cell(s: dict[str, float]) -> str:
        low = f" [min {s['min_ms']:.3f}]" if "min_ms" in s else ""
        return f"{s['median_ms']:.3f} ({s['p90_ms']:.3f}){low} | {s['pct_of_step']:.2f} %"

    for part in list(PARTS) + ["sum_of_parts", "switch"]:
        label = {"sum_of_parts": "**sum of parts**", "switch": "**switch (measured)**"}.get(part, f"`{part}`")
        lines.append(f"| {label} | " + " | ".join(cell(summary[s]["parts"][part]) for s in names) + " |")
    lines += [
        "",
        f"gloo's floor on the same process group ({FLOOR_ITERS} iterations per rank, "
        f"{FLOOR_ITERS // 4} for the cold one; the median over ranks and repeats of each rank's median (p90) [the smallest sample]):",
        "",
        head.replace("part", "operation"),
        rule,
    ]
    for key, label in FLOORS.items():
        lines.append(f"| {label} | " + " | ".join(cell(summary[s]["floor"][key]) for s in names) + " |")
    return "\n".join(lines)
