"""Alternating two large parameter groups under DDP: memory, bytes all-reduced, step and switch time.

One command runs every scenario side by side and writes a JSON file and a
markdown table::

    python benchmarks/alternating.py                    # 2 CPU ranks (gloo), + CUDA if present
    python benchmarks/alternating.py --size-mib 8 --steps 12 --devices cpu   # a quick run
    python benchmarks/alternating.py --diagnose --repeats 2   # + where the switch time goes
    python benchmarks/alternating.py --breakdown --devices cpu  # each part of a switch, gloo's floor

The model has two halves, ``layer1`` and ``layer2`` (one ``Linear`` each, about
``--size-mib`` MiB of fp32 weights). Scenarios:

* ``single``: ``layer1`` trained alone (``layer2`` frozen), one Adam: the baseline.
* ``single_other``: ``layer2`` trained alone; its backward stops at ``layer2``, so
  its step is cheaper than ``single``'s. Alternating does one step of each, so
  ``step + switch / mean single`` compares an iteration with their mean.
* ``naive``: the loop users write: every step unwrap the DDP, toggle
  ``requires_grad``, re-wrap in a new DDP; two Adam optimizers.
* ``find_unused``: one DDP built with both halves trainable and
  ``find_unused_parameters=True``; ``requires_grad`` toggled every step; two Adams.
* ``hf_keep`` / ``hf_offload`` / ``hf_drop``: hf_altparams alternating every step
  (``PhaseSwitcher`` + ``GroupedOptimizer`` with that idle-state policy), default
  settings (``release="auto"``, one small collective per switch).
* ``hf_keep_reducers``: ``hf_keep`` with ``keep_reducers=1``: the idle half's DDP
  reducer is kept (one more copy of its gradients: its buckets) and re-installed at
  the switch back, instead of a reducer built and freed at every switch.
* ``hf_keep_before`` / ``hf_offload_before`` / ``hf_drop_before``: the same with the
  settings of the previous release: a memory release (gc, ``empty_cache``,
  ``malloc_trim``) at every switch (``release=True``) and two small collectives per
  switch (agree, then "did any rank fail"; ``collective_free_apply=False``).
* with ``--diagnose``: ``hf_drop_release`` (only ``release=True``) and
  ``hf_drop_twocoll`` (only the two collectives), to attribute the difference.

Each scenario runs in FRESH processes (its own ``torchrun`` launch), so memory
does not carry over from one to the next. ``--launcher forked`` (CPU only, for
the tests) forks each launch's ranks from ``hf_altparams.testing``'s warm server
instead (``docs/testing.md``): no interpreter start-up per rank, but the ranks
share the server's pages copy-on-write, so their memory and page-fault figures
are not those of a fresh process. Per scenario and device:

* peak memory growth over the pre-training baseline (the model built, nothing
  else): on CPU the process's peak RSS (``VmHWM``, reset at the baseline) minus
  the baseline RSS; on CUDA ``max_memory_allocated`` minus the baseline
  allocation; the larger of the ranks;
* bytes all-reduced per step (a counting comm hook) / bytes of the trainable half;
* median step time (forward, backward, optimizer step, ``zero_grad``) and
  median switch time, both as ratios to the median step of ``single``; with
  ``single_other``, step + switch against the mean step of the two singles;
* minor page faults per iteration (rank 0's median).

Targets: bytes ratio 1.00; ``hf_drop`` memory <= 1.02 x ``single``; switch time
<= 1 % of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

import _breakdown  # noqa: E402  (benchmarks/ is the script's folder)
from _machine import machine  # noqa: E402
from _rank_env import rank_env  # noqa: E402
from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, mmap_large_host_allocations, register_comm_counter  # noqa: E402
from hf_altparams.engine.shutdown import shutdown  # noqa: E402
from hf_altparams.plan import Alternating, ParamGroups  # noqa: E402
from tests.support.meters import PeakMemory  # noqa: E402
from tests.support.models import TwoHalves  # noqa: E402

SCENARIOS = (
    "single",
    "single_other",
    "naive",
    "find_unused",
    "hf_keep",
    "hf_offload",
    "hf_drop",
    "hf_keep_reducers",
    "hf_keep_before",
    "hf_offload_before",
    "hf_drop_before",
)
#: ``--diagnose`` adds these, to attribute the difference between ``hf_drop`` and
#: ``hf_drop_before``: the release at every switch alone, the two collectives alone.
DIAGNOSTIC = ("hf_drop_release", "hf_drop_twocoll")
HALVES = ("layer1", "layer2")
MIB = 2**20


# ============================================================== worker (one rank)
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


#: Minor page faults of this process in each ``_timed`` region (fresh pages touched: a
#: cost on CPU when large tensors come from new memory instead of reused heap).
FAULTS: list[int] = []


def _timed(device: torch.device, fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` takes on this rank, started when every rank is ready.

    The barrier keeps one rank's lateness (say, a slower optimizer step) out of
    the next timed region, where it would show up as waiting in the region's
    first collective.
    """
    _sync(device)
    dist.barrier()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    started = time.perf_counter()
    fn()
    _sync(device)
    elapsed = time.perf_counter() - started
    FAULTS.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
    return elapsed


def run_worker(args: argparse.Namespace) -> None:
    if args.mmap_threshold:  # before anything large is allocated
        mmap_large_host_allocations(args.mmap_threshold)
    if args.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TwoHalves(args.size_mib, layers=args.layers).to(device)
    half_bytes = {h: sum(p.numel() * p.element_size() for p in getattr(model, h).parameters()) for h in HALVES}
    gen = torch.Generator(device=device).manual_seed(rank)
    width = model.width
    batches = [torch.randn(args.batch, width, generator=gen, device=device) for _ in range(2)]
    ddp_kwargs: dict[str, Any] = {"device_ids": [device.index]} if device.type == "cuda" else {}
    ddp_kwargs["gradient_as_bucket_view"] = args.bucket_view

    if args.breakdown:
        _breakdown.activate()  # times each part of every switch (see benchmarks/_breakdown.py)
    memory = PeakMemory(device)
    memory.mark_baseline()
    loop = SCENARIO_LOOPS[args.scenario]
    step_s, switch_s, sent, trainable = loop(model, batches, args.steps, ddp_kwargs, half_bytes, device)
    peak = memory.peak_growth()
    breakdown = _breakdown.worker_result(args.warmup) if args.breakdown else None  # collective: every rank

    warm = args.warmup
    per_iteration = len(FAULTS) // args.steps  # timed regions per iteration: step, and switch if any
    result = {
        "scenario": args.scenario,
        "device": device.type,
        "world_size": world,
        "rank": rank,
        "half_bytes": half_bytes["layer1"],
        "peak_growth_bytes": peak,
        "baseline_bytes": memory.baseline,
        "step_s": step_s[warm:],
        "switch_s": switch_s[warm:],
        "bytes_per_step": sent[warm:],
        "trainable_bytes_per_step": trainable[warm:],
        "minor_faults_per_step": [
            sum(FAULTS[i : i + per_iteration]) for i in range(warm * per_iteration, len(FAULTS), per_iteration)
        ],
        "breakdown": breakdown,
    }
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


Loop = Callable[..., tuple[list[float], list[float], list[int], list[int]]]


def _train_step(
    model: nn.Module,
    x: torch.Tensor,
    step: list[torch.optim.Optimizer],
    zero: Optional[list[torch.optim.Optimizer]] = None,
) -> None:
    model(x).pow(2).mean().backward()
    for opt in step:
        opt.step()
    for opt in zero or step:
        opt.zero_grad(set_to_none=True)


def _single(half: str) -> Loop:
    """Train ``half`` alone (the other frozen from the start): the baseline of one group alone.

    ``single`` trains ``layer1``, whose backward also runs through ``layer2``
    (its input gradient); ``single_other`` trains ``layer2``, whose backward
    stops there. An alternating run does one of each per two steps, so its fair
    baseline is the mean of the two (the ``/ mean single`` column).
    """

    def loop(
        model: TwoHalves,
        batches: list[torch.Tensor],
        steps: int,
        ddp_kwargs: dict[str, Any],
        half_bytes: dict[str, int],
        device: torch.device,
    ) -> tuple[list[float], list[float], list[int], list[int]]:
        for other in HALVES:
            getattr(model, other).requires_grad_(other == half)
        ddp = DDP(model, **ddp_kwargs)
        counter = register_comm_counter(ddp)
        opt = torch.optim.Adam(getattr(model, half).parameters(), lr=1e-4)
        step_s, switch_s, sent, trainable = [], [], [], []
        for step in range(steps):
            step_s.append(_timed(device, lambda: _train_step(ddp, batches[step % 2], [opt])))
            switch_s.append(0.0)
            sent.append(counter.end_step())
            trainable.append(half_bytes[half])
        return step_s, switch_s, sent, trainable

    return loop


def loop_naive(
    model: TwoHalves,
    batches: list[torch.Tensor],
    steps: int,
    ddp_kwargs: dict[str, Any],
    half_bytes: dict[str, int],
    device: torch.device,
) -> tuple[list[float], list[float], list[int], list[int]]:
    opts = {h: torch.optim.Adam(getattr(model, h).parameters(), lr=1e-4) for h in HALVES}
    state: dict[str, Any] = {"ddp": None}
    step_s, switch_s, sent, trainable = [], [], [], []

    def rewrap(active: str) -> None:
        inner = model if state["ddp"] is None else state["ddp"].module  # unwrap
        for h in HALVES:
            getattr(inner, h).requires_grad_(h == active)
        state["ddp"] = DDP(inner, **ddp_kwargs)  # re-wrap (the old wrapper is dropped)
        state["counter"] = register_comm_counter(state["ddp"])

    for step in range(steps):
        active = HALVES[step % 2]
        switch_s.append(_timed(device, lambda: rewrap(active)))
        step_s.append(_timed(device, lambda: _train_step(state["ddp"], batches[step % 2], [opts[active]])))
        sent.append(state["counter"].end_step())
        trainable.append(half_bytes[active])
    return step_s, switch_s, sent, trainable


def loop_find_unused(
    model: TwoHalves,
    batches: list[torch.Tensor],
    steps: int,
    ddp_kwargs: dict[str, Any],
    half_bytes: dict[str, int],
    device: torch.device,
) -> tuple[list[float], list[float], list[int], list[int]]:
    ddp = DDP(model, find_unused_parameters=True, **ddp_kwargs)
    counter = register_comm_counter(ddp)
    opts = {h: torch.optim.Adam(getattr(model, h).parameters(), lr=1e-4) for h in HALVES}
    step_s, switch_s, sent, trainable = [], [], [], []

    def toggle(active: str) -> None:
        for h in HALVES:
            getattr(model, h).requires_grad_(h == active)

    for step in range(steps):
        active = HALVES[step % 2]
        switch_s.append(_timed(device, lambda: toggle(active)))
        step_s.append(_timed(device, lambda: _train_step(ddp, batches[step % 2], [opts[active]], list(opts.values()))))
        sent.append(counter.end_step())
        trainable.append(half_bytes[active])
    return step_s, switch_s, sent, trainable


def _hf_loop(policy: str, release: Any = "auto", two_collectives: bool = False, keep_reducers: int = 0) -> Loop:
    def loop(
        model: TwoHalves,
        batches: list[torch.Tensor],
        steps: int,
        ddp_kwargs: dict[str, Any],
        half_bytes: dict[str, int],
        device: torch.device,
    ) -> tuple[list[float], list[float], list[int], list[int]]:
        groups = ParamGroups(model, {h: f"{h}.*" for h in HALVES})
        opt = GroupedOptimizer(groups, lambda params: torch.optim.Adam(params, lr=1e-4), state_policy=policy)
        switcher = PhaseSwitcher(
            groups, Alternating(list(HALVES)), optimizer=opt, release=release, keep_reducers=keep_reducers
        )
        switcher.step_to(0)
        ddp = DDP(model, **ddp_kwargs)
        switcher.attach(ddp)
        if two_collectives:  # the previous transaction: agree, apply, then "did any rank fail?"
            switcher.backend.collective_free_apply = False
        counter = register_comm_counter(ddp)
        step_s, switch_s, sent, trainable = [], [], [], []
        for step in range(steps):
            active = HALVES[step % 2]
            step_s.append(_timed(device, lambda: _train_step(ddp, batches[step % 2], [opt])))
            sent.append(counter.end_step())
            trainable.append(half_bytes[active])
            switch_s.append(_timed(device, lambda: switcher.step_to(step + 1)))
        # The switcher holds the wrapper (and keep_reducers its idle reducers): free them
        # here, not whenever gc gets to them, so none outlives the process group.
        shutdown(ddp, destroy=False)
        return step_s, switch_s, sent, trainable

    return loop


SCENARIO_LOOPS: dict[str, Loop] = {
    "single": _single("layer1"),
    "single_other": _single("layer2"),
    "naive": loop_naive,
    "find_unused": loop_find_unused,
    "hf_keep": _hf_loop("keep"),
    "hf_offload": _hf_loop("offload"),
    "hf_drop": _hf_loop("drop"),
    "hf_keep_reducers": _hf_loop("keep", keep_reducers=1),
    "hf_keep_before": _hf_loop("keep", release=True, two_collectives=True),
    "hf_offload_before": _hf_loop("offload", release=True, two_collectives=True),
    "hf_drop_before": _hf_loop("drop", release=True, two_collectives=True),
    "hf_drop_release": _hf_loop("drop", release=True),
    "hf_drop_twocoll": _hf_loop("drop", two_collectives=True),
}


# ============================================================== driver
def _launch(scenario: str, device: str, nproc: int, args: argparse.Namespace, result: Path) -> list[dict[str, Any]]:
    from hf_altparams.testing import launch

    worker = (
        [
            "--worker",
            scenario,
            "--device",
            device,
            "--result",
            str(result),
            "--size-mib",
            str(args.size_mib),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--batch",
            str(args.batch),
            "--layers",
            str(args.layers),
            "--mmap-threshold",
            str(args.mmap_threshold),
        ]
        + (["--bucket-view"] if args.bucket_view else [])
        + (["--breakdown"] if args.breakdown else [])
    )
    # forked: CPU only (parse_args), ranks forked from hf_altparams.testing's warm server
    launch(
        __file__, *worker, nproc=nproc, launcher=args.launcher, env=rank_env(device, args.threads), timeout=args.timeout
    )
    return json.loads(result.read_text())


def summarize(runs: dict[str, list[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per scenario: ratios to ``single``.

    ``runs[scenario]`` holds one entry per repeat, each the list of ranks'
    results. Memory: the larger rank, median over repeats. Times: rank 0's
    samples of every repeat, median.
    """

    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    def pooled(ranks_per_repeat: list[list[dict[str, Any]]], key: str) -> list[Any]:
        return [v for ranks in ranks_per_repeat for v in ranks[0][key]]

    def memory(ranks_per_repeat: list[list[dict[str, Any]]]) -> float:
        return med([max(r["peak_growth_bytes"] for r in ranks) for ranks in ranks_per_repeat])

    base_mem = memory(runs["single"])
    base_step = med(pooled(runs["single"], "step_s"))
    # What an alternating run would cost if each step cost what training its group alone costs.
    pair_step = (base_step + med(pooled(runs["single_other"], "step_s"))) / 2 if "single_other" in runs else None
    rows = []
    for scenario, repeats in runs.items():
        r0 = {key: pooled(repeats, key) for key in ("step_s", "switch_s", "bytes_per_step", "trainable_bytes_per_step")}
        mem = memory(repeats)
        iteration = med(r0["step_s"]) + med(r0["switch_s"])
        ratio = [s / t for s, t in zip(r0["bytes_per_step"], r0["trainable_bytes_per_step"])]
        # Per repeat, against the `single` run of the same round (side by side in time).
        per_repeat = [med(ranks[0]["step_s"]) / med(base[0]["step_s"]) for ranks, base in zip(repeats, runs["single"])]
        rows.append(
            {
                "scenario": scenario,
                "peak_growth_mib": mem / MIB,
                "memory_ratio": mem / base_mem,
                "bytes_per_step_mib": med(r0["bytes_per_step"]) / MIB,
                "bytes_ratio_min": min(ratio),
                "bytes_ratio_max": max(ratio),
                "step_ms": med(r0["step_s"]) * 1e3,
                "step_ratio": med(r0["step_s"]) / base_step,
                "step_ratio_repeats_min": min(per_repeat),
                "step_ratio_repeats_median": med(per_repeat),
                "switch_ms": med(r0["switch_s"]) * 1e3,
                "switch_ratio": med(r0["switch_s"]) / base_step,
                "iteration_ratio": iteration / base_step,
                "minor_faults_per_step": med(pooled(repeats, "minor_faults_per_step"))
                if all("minor_faults_per_step" in ranks[0] for ranks in repeats)
                else None,
                "iteration_ratio_pair": iteration / pair_step if pair_step else None,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    pair = all(r.get("iteration_ratio_pair") for r in rows)
    head = (
        "| scenario | peak memory growth | memory / single | all-reduced per step | bytes / trainable "
        "| step | step / single | per round: min, median | switch | switch / single step |"
        + (" step + switch / mean single |" if pair else "")
        + " page faults / step |"
    )
    lines = [f"### {title}", "", head, "|" + "---|" * (12 if pair else 11)]
    for r in rows:
        lo, hi = r["bytes_ratio_min"], r["bytes_ratio_max"]
        bytes_ratio = f"{lo:.2f}" if abs(hi - lo) < 5e-3 else f"{lo:.2f}-{hi:.2f}"
        lines.append(
            f"| {r['scenario']} | {r['peak_growth_mib']:.0f} MiB | {r['memory_ratio']:.2f}x "
            f"| {r['bytes_per_step_mib']:.1f} MiB | {bytes_ratio} | {r['step_ms']:.1f} ms "
            f"| {r['step_ratio']:.3f}x | {r['step_ratio_repeats_min']:.3f}x, {r['step_ratio_repeats_median']:.3f}x "
            f"| {r['switch_ms']:.2f} ms | {100 * r['switch_ratio']:.2f} % |"
            + (f" {r['iteration_ratio_pair']:.3f}x |" if pair else "")
            + (f" {r['minor_faults_per_step']:,.0f} |" if r.get("minor_faults_per_step") is not None else " - |")
        )
    return "\n".join(lines)


def run_driver(args: argparse.Namespace) -> None:
    devices = args.devices
    if devices == ["auto"]:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for device in devices:
        nproc = args.cpu_ranks if device == "cpu" else (args.gpus or torch.cuda.device_count())
        runs: dict[str, list[list[dict[str, Any]]]] = {s: [] for s in args.scenarios}
        load_before = os.getloadavg()
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):  # round robin: load drift hits every scenario alike
                for scenario in args.scenarios:
                    print(f"[{device}] {scenario} (run {repeat + 1}/{args.repeats}) ...", flush=True)
                    runs[scenario].append(_launch(scenario, device, nproc, args, Path(tmp) / f"{scenario}.json"))
        load = (load_before[0], os.getloadavg()[0])
        rows = summarize(runs)
        half = runs["single"][0][0]["half_bytes"] / MIB
        title = (
            f"{machine(device, nproc)}; two halves of {half:.1f} MiB"
            f"{f' ({args.layers} layers each)' if args.layers > 1 else ''}, batch {args.batch}/rank, "
            f"gradient_as_bucket_view={args.bucket_view}, "
            f"{f'mmap_large_host_allocations({args.mmap_threshold}), ' if args.mmap_threshold else ''}"
            f"{args.repeats} x {args.steps - args.warmup} measured steps after {args.warmup} warm-up; "
            f"1-min load average {load[0]:.1f} before, {load[1]:.1f} after"
        )
        table = markdown(rows, title)
        print(table, flush=True)
        payload = {
            "machine": machine(device, nproc),
            "device": device,
            "world_size": nproc,
            "args": {k: v for k, v in vars(args).items() if k not in ("worker", "result")},
            "load_average": load,
            "rows": rows,
            "runs": runs,
        }
        if args.breakdown:  # its own files: the diagnostic barrier slows every hf_* switch
            step_s = next(r["step_ms"] for r in rows if r["scenario"] == "single") / 1e3
            payload["breakdown"] = _breakdown.summarize(runs, step_s)
            table += "\n\n" + _breakdown.markdown(payload["breakdown"], step_s, title)
            print(table[table.index("### Switch breakdown") :], flush=True)
        stem = f"alternating_{device}" + ("_breakdown" if args.breakdown else "")
        (out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
        (out_dir / f"{stem}.md").write_text(table + "\n")
    print(f"\nwrote {out_dir}/alternating_*.json and .md")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=float, default=32.0, help="size of each half in MiB (fp32)")
    parser.add_argument("--steps", type=int, default=24, help="steps per scenario, warm-up included")
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the statistics")
    parser.add_argument("--batch", type=int, default=16, help="rows per rank per step")
    parser.add_argument(
        "--bucket-view",
        action="store_true",
        help="build every DDP with gradient_as_bucket_view=True (gradients are bucket views)",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=1,
        help="Linear layers per half (>1: several DDP buckets, to see docs/design.md, fact 3)",
    )
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        default=0,
        help="bytes: each rank calls mmap_large_host_allocations(N) first (glibc mmaps host "
        "blocks >= N); 0: glibc's default heap",
    )
    parser.add_argument(
        "--devices",
        nargs="+",
        default=["auto"],
        choices=["auto", "cpu", "cuda"],
        help="auto: cpu, plus cuda when a GPU is visible",
    )
    parser.add_argument("--cpu-ranks", type=int, default=2, help="gloo ranks for the CPU run")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs (NCCL ranks) for the CUDA run; 0: all visible")
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh launches per scenario, run round robin (medians pool them)"
    )
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS + DIAGNOSTIC)
    parser.add_argument(
        "--diagnose", action="store_true", help=f"also run {', '.join(DIAGNOSTIC)} (where the switch time goes)"
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="time each part of every hf_* switch and gloo's floor (benchmarks/_breakdown.py); "
        f"default scenarios then {' '.join(_breakdown.DEFAULT_SCENARIOS)}; writes "
        "alternating_<device>_breakdown.json/.md",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="folder for JSON and markdown")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per scenario launch")
    parser.add_argument(
        "--launcher",
        choices=["torchrun", "forked"],
        default="torchrun",
        help="torchrun: fresh interpreters (the figures); forked: CPU ranks forked from a warm server "
        "(hf_altparams.testing, docs/testing.md): no start-up per rank, for the tests; the ranks share the "
        "server's pages, so memory and page-fault figures are not comparable",
    )
    parser.add_argument("--worker", choices=SCENARIOS + DIAGNOSTIC, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cpu", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    if args.breakdown and args.scenarios == list(SCENARIOS):
        args.scenarios = list(_breakdown.DEFAULT_SCENARIOS)
    if args.diagnose:
        args.scenarios += [d for d in DIAGNOSTIC if d not in args.scenarios]
    if "single" not in args.scenarios:
        parser.error("--scenarios must include 'single' (the baseline of every ratio)")
    if args.launcher == "forked" and args.devices != ["cpu"]:
        parser.error(
            f"--launcher forked runs CPU ranks only: it needs --devices cpu, got --devices {' '.join(args.devices)}"
        )
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.worker:
        args.scenario = args.worker
        run_worker(args)
    else:
        run_driver(args)


if __name__ == "__main__":
    main()
