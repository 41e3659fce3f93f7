"""Memory of alternating parameter groups and of per-task residency, side by side.

One command runs every scenario in fresh processes (one ``torchrun`` launch
each, so nothing carries over) and writes a markdown report and its JSON::

    python benchmarks/memory.py                         # CPU: 2 gloo ranks; CUDA too if present
    python benchmarks/memory.py --devices cpu --repeat 1 --size-mib 16   # quick
    python benchmarks/memory.py --devices cuda          # 1 GPU, NCCL world size 1, a 1 GiB model

The worker is ``tests/scripts/memory_peak.py`` (its docstring
defines every scenario and how memory is measured). Criteria checked here:

* CPU, 2 gloo ranks: ``alt_drop`` (alternating, idle optimizer state dropped)
  peak RSS growth <= 1.02 x the larger of ``alone_a`` / ``alone_b`` (one half
  trained alone). ``naive`` (DDP over everything, one optimizer per half) beside it.
* CPU, per-task residency: peak RSS growth of ``tasks`` with T heads minus
  T=2, compared with what the extra heads' CPU copies should add (their AdamW
  state under ``--task-policy keep``; their parameters are in the baseline).
  On CPU "off the device" is the same RAM, so this shows only that nothing
  *else* grows with the number of tasks (gradients, DDP buckets, state of the
  device); the device saving itself needs a GPU.
* CUDA, 1 GPU, NCCL world size 1: ``alt_offload`` ``max_memory_allocated``
  <= 1.02 x the larger single-group run, for >= 1 GiB of parameters; prefetch
  variants and ``naive`` beside it; ``tasks`` peak independent of T.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _machine import machine  # noqa: E402  (benchmarks/ is the script's folder)
from _rank_env import rank_env  # noqa: E402
from hf_altparams.testing.launch import launch, rank_results  # noqa: E402
from tests.scripts import script_path  # noqa: E402

MIB = 2**20
CPU_HALVES = ("alone_a", "alone_b", "naive", "alt_keep", "alt_drop")
CUDA_HALVES = (
    "alone_a",
    "alone_b",
    "naive",
    "alt_keep",
    "alt_drop",
    "alt_offload",
    "alt_offload_prefetch",
    "alt_offload_auto",
)


#: Extra environment for the launched ranks (``--malloc-mmap-threshold`` sets glibc's).
RANK_ENV: dict[str, str] = {}


def run_once(scenario: str, device: str, nproc: int, extra: list[str], timeout: float) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out:
        worker = [out, "--scenario", scenario, "--device", device, *extra]
        launch(
            script_path("memory_peak.py"), *worker, nproc=nproc, env={**rank_env(device), **RANK_ENV}, timeout=timeout
        )
        return rank_results(out, nproc)


def measure(scenario: str, device: str, nproc: int, extra: list[str], repeat: int, timeout: float) -> dict[str, Any]:
    """Median over ``repeat`` runs of the larger rank's peak growth and absolute peak."""
    runs = [run_once(scenario, device, nproc, extra, timeout) for _ in range(repeat)]
    growth = [max(r["peak_growth_bytes"] for r in ranks) for ranks in runs]
    peak = [max(r["peak_bytes"] for r in ranks) for ranks in runs]
    print(f"  [{device}] {scenario} {' '.join(extra)}: growth {[round(g / MIB) for g in growth]} MiB", flush=True)
    return {
        "scenario": scenario,
        "growth": statistics.median(growth),
        "peak": statistics.median(peak),
        "growth_runs": growth,
        "rank0": runs[-1][0],
    }


def halves_table(rows: dict[str, dict[str, Any]], device: str) -> tuple[list[str], dict[str, float]]:
    base = max(rows["alone_a"]["growth"], rows["alone_b"]["growth"])
    base_abs = max(rows["alone_a"]["peak"], rows["alone_b"]["peak"])
    absolute = "max_memory_allocated" if device == "cuda" else "peak RSS"
    lines = [
        f"| scenario | peak growth | growth / larger alone | {absolute} | / larger alone | runs (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['growth'] / MIB:.1f} MiB | {row['growth'] / base:.3f}x "
            f"| {row['peak'] / MIB:.0f} MiB | {row['peak'] / base_abs:.3f}x "
            f"| {', '.join(str(round(g / MIB)) for g in row['growth_runs'])} |"
        )
    ratios = {n: r["growth"] / base for n, r in rows.items()}
    ratios.update({f"{n}_abs": r["peak"] / base_abs for n, r in rows.items()})
    return lines, ratios


def tasks_table(rows: dict[tuple[str, int], dict[str, Any]], device: str) -> list[str]:
    lines = [
        "| scenario | tasks | peak growth | absolute peak | params off the device (report) |",
        "|---|---|---|---|---|",
    ]
    for (name, tasks), row in sorted(rows.items()):
        off = row["rank0"]["report"].get("params_offloaded", 0)
        lines.append(
            f"| {name} | {tasks} | {row['growth'] / MIB:.1f} MiB | {row['peak'] / MIB:.0f} MiB | {off / MIB:.1f} MiB |"
        )
    return lines


def run_device(device: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    nproc = args.cpu_ranks if device == "cpu" else 1
    size = args.size_mib if args.size_mib else (32.0 if device == "cpu" else 512.0)
    trunk = args.trunk_mib if args.trunk_mib else (32.0 if device == "cpu" else 512.0)
    head = args.head_mib if args.head_mib else (16.0 if device == "cpu" else 256.0)
    common = ["--steps", str(args.steps), "--every", str(args.every), "--batch", str(args.batch)]
    scenarios = CPU_HALVES if device == "cpu" else CUDA_HALVES
    print(f"{machine(device, nproc)}", flush=True)
    halves = {
        s: measure(s, device, nproc, [*common, "--size-mib", str(size)], args.repeat, args.timeout) for s in scenarios
    }
    tasks: dict[tuple[str, int], dict[str, Any]] = {}
    for count in args.tasks:
        for name in ("tasks", "tasks_resident"):
            extra = [
                *common,
                "--tasks",
                str(count),
                "--trunk-mib",
                str(trunk),
                "--head-mib",
                str(head),
                "--policy",
                args.task_policy,
            ]
            tasks[(name, count)] = measure(name, device, nproc, extra, args.repeat, args.timeout)

    lines, ratios = halves_table(halves, device)
    group_mib = halves["alone_a"]["rank0"]["group_bytes"] / MIB
    allocator = (
        f"; glibc `MALLOC_MMAP_THRESHOLD_={RANK_ENV['MALLOC_MMAP_THRESHOLD_']}`" if device == "cpu" and RANK_ENV else ""
    )
    title = (
        f"### {machine(device, nproc)}\n\nTwo halves of {group_mib:.0f} MiB (fp32, AdamW), alternating every "
        f"{args.every} step(s), {args.steps} steps, batch {args.batch}/rank; median of {args.repeat} "
        f"fresh runs, larger rank{allocator}.\n"
    )
    verdict = []
    if device == "cpu":
        verdict.append(
            f"- `alt_drop` growth / larger single group: **{ratios['alt_drop']:.3f}x** "
            f"(target <= 1.02); naive loop: {ratios['naive']:.3f}x."
        )
    else:
        verdict.append(
            f"- `alt_offload` max_memory_allocated / larger single group: "
            f"**{ratios['alt_offload_abs']:.3f}x** (target <= 1.02; growth ratio "
            f"{ratios['alt_offload']:.3f}x); naive loop: {ratios['naive_abs']:.3f}x; "
            f"prefetch=True: {ratios['alt_offload_prefetch_abs']:.3f}x; "
            f"prefetch='auto': {ratios['alt_offload_auto_abs']:.3f}x."
        )
    if not tasks:
        text = "\n".join([title, *lines, "", *verdict, ""])
        return text, {"machine": machine(device, nproc), "halves": halves, "tasks": {}, "ratios": ratios}
    head_bytes = tasks[("tasks", args.tasks[0])]["rank0"]["head_bytes"]
    lo, hi = min(args.tasks), max(args.tasks)
    grow = tasks[("tasks", hi)]["growth"] - tasks[("tasks", lo)]["growth"]
    if device == "cpu":
        # Parameters are in the baseline; under "keep" each extra head adds its AdamW state
        # (two moments; the step counters are a few bytes) to RAM.
        expected = (hi - lo) * 2 * head_bytes if args.task_policy == "keep" else 0
        verdict.append(
            f"- `tasks`: growth with {hi} tasks minus with {lo}: {grow / MIB:.1f} MiB; the extra "
            f"heads' CPU copies account for {expected / MIB:.1f} MiB (their AdamW state); residual "
            f"{(grow - expected) / MIB:+.1f} MiB, i.e. {(grow - expected) / head_bytes:+.2f} heads."
        )
    else:
        verdict.append(
            f"- `tasks`: max_memory_allocated with {hi} tasks minus with {lo}: {grow / MIB:+.1f} MiB "
            f"(one head is {head_bytes / MIB:.0f} MiB); without residency (`tasks_resident`): "
            f"{(tasks[('tasks_resident', hi)]['peak'] - tasks[('tasks_resident', lo)]['peak']) / MIB:+.1f} MiB."
        )
    text = "\n".join(
        [
            title,
            *lines,
            "",
            f"Per-task residency: trunk {trunk:.0f} MiB, heads {head_bytes / MIB:.0f} MiB "
            f"each, every {args.every} step(s), task optimizer state policy `{args.task_policy}`.",
            "",
            *tasks_table(tasks, device),
            "",
            *verdict,
            "",
        ]
    )
    payload = {
        "machine": machine(device, nproc),
        "halves": halves,
        "tasks": {f"{n}:{t}": v for (n, t), v in tasks.items()},
        "ratios": ratios,
    }
    return text, payload


PREAMBLE = """\
Peak memory growth over a baseline taken after the model is built (and, for the two-halves
model, placed on the device), before DDP is constructed: what training adds (gradients, DDP
buckets, optimizer state, activations, and whatever a switch leaves behind). CPU: the process's
peak RSS (`VmHWM`, reset at the baseline) minus the baseline RSS. CUDA: `max_memory_allocated`
minus the baseline allocation; the absolute `max_memory_allocated` is given too. Every scenario
runs in fresh processes; each figure is the median of the runs of the larger rank.

What the CPU measurement can and cannot show: on a CPU "the device" and "the offload device"
are the same RAM, so `offload` and residency move no bytes there. The CPU runs show that the
alternating run with `drop` costs what one group alone costs (gradients, buckets and optimizer
state of one group only), and that with per-task residency nothing *else* grows with the number
of tasks (no gradients, DDP buckets or device-side state for absent tasks): the growth with more
tasks is their own CPU copies (here: their AdamW state under the `keep` policy; their parameters
are in the baseline). That device memory stays flat while the absent tasks sit in host memory
can only be measured on a GPU (the CUDA section).
"""

NOT_RUN = """\
### CUDA

Not run: no GPU was available where this file was produced. On one CUDA GPU (NCCL, world size 1)
`python benchmarks/memory.py --devices cuda` measures a 1 GiB two-halves model (512 MiB per half)
with `alone_a`/`alone_b`, `naive`, `alt_keep`, `alt_drop`, `alt_offload` (target:
`max_memory_allocated` <= 1.02 x the larger single group), `alt_offload_prefetch` and
`alt_offload_auto`, and per-task residency with a 512 MiB trunk and 2 / 8 heads of 256 MiB.
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=["auto"], choices=["auto", "cpu", "cuda"])
    parser.add_argument("--cpu-ranks", type=int, default=2)
    parser.add_argument("--size-mib", type=float, default=0, help="per half (default 32 on CPU, 512 on CUDA)")
    parser.add_argument("--trunk-mib", type=float, default=0, help="default 32 on CPU, 512 on CUDA")
    parser.add_argument("--head-mib", type=float, default=0, help="default 16 on CPU, 256 on CUDA")
    parser.add_argument(
        "--tasks",
        type=int,
        nargs="*",
        default=[2, 8],
        help="numbers of tasks for the residency scenarios (none: skip them)",
    )
    parser.add_argument("--task-policy", default="keep", choices=["keep", "offload", "drop"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--name", default="memory", help="file name (without suffix) of the outputs")
    parser.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=0,
        help="CPU: fix glibc's mmap threshold in the ranks (MALLOC_MMAP_THRESHOLD_=N bytes), "
        "so freed large blocks go back to the OS instead of staying in the heap",
    )
    args = parser.parse_args()
    if args.malloc_mmap_threshold:
        RANK_ENV["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    devices = args.devices
    if devices == ["auto"]:
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    sections, payload = [], {}
    for device in devices:
        text, data = run_device(device, args)
        print(text, flush=True)
        sections.append(text)
        payload[device] = data
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1, default=str))
    if "cuda" not in devices:
        sections.append(NOT_RUN)
    (args.out / f"{args.name}.md").write_text(
        "## Memory (benchmarks/memory.py)\n\n" + PREAMBLE + "\n" + "\n".join(sections)
    )


if __name__ == "__main__":
    main()
