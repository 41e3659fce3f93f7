"""LISA under the 🤗 Trainer on 2 ranks: the ways people write it, side by side, one job.

One job, four ways of training it. The job: a Llama-style decoder built from a
``LlamaConfig`` (8 decoder layers, random weights, nothing downloaded), a
synthetic token data set, LISA with 2 layers re-drawn every 5 steps and the
embeddings and head always trained, 40 steps, the Trainer's default optimizer
(AdamW), one seed, 2 gloo ranks on the CPU. The variants:

``naive``
    ``NaiveLisa`` (in ``_lisa_peers_ranks.py``), a plain ``TrainerCallback``
    of our own: every decoder layer frozen when training starts, then every 5
    steps ``requires_grad=True`` on the 2 drawn layers and ``False`` on the
    rest; ``ddp_find_unused_parameters=False`` (what the Trainer picks with
    gradient checkpointing on).
``naive_find_unused``
    the same callback with ``ddp_find_unused_parameters=True``.
``hf_altparams``
    ``AlternatingFreeze(groups, lisa(...))`` with the Trainer's default optimizer.
``hf_altparams_drop``
    the same with ``optimizers=(grouped_optimizer(groups, ..., state_policy="drop"), None)``:
    the same optimizer class and settings as the Trainer's default, one per group,
    idle groups' state freed.

Every variant draws the same layers at the same steps (the draws of the
``lisa`` schedule with this seed), so losses and final weights compare.

What a rank measures, per variant, at the end of every optimizer step
(``Meter`` in ``_lisa_peers_ranks.py``, the code every rank runs: a callback
listed after the variant's own): a SHA-256 of all its parameters, all-gathered,
and the largest absolute difference between the ranks' parameters when the
digests differ (on a process group of its own, so DDP's collectives are not
disturbed); the bytes the Trainer's own DDP wrapper all-reduced (a counting
comm hook, ``hf_altparams.register_comm_counter``, put on the wrapper at its
first call); the bytes of the parameters with ``requires_grad`` during the
step; the bytes of every tensor in the Trainer's optimizer state, per group,
and the part on groups that did not train in the step; the time between the
ends of consecutive steps (the meter's own work left out) and the process's
CPU time over it (less sensitive than the wall time to a loaded machine); the
loss the Trainer logs. A variant that raises is recorded with its error and the
step it was in; its DDP wrapper is freed and the next variant runs.

All variants run in one ``torchrun`` launch (2 processes; ``--launcher
forked`` forks them from ``hf_altparams.testing``'s warm server instead, for
the tests), one after the other, ``naive`` last (its DDP error must not touch
the others), for ``--repeats`` rounds; the order of the others rotates by one
each round. Step times: the median over the steps after the first, both ranks
and every round pooled; the ratio to ``naive_find_unused`` is the median over
the rounds of the ratio of the two medians measured in the same round.
Correctness figures (digests, bytes, optimizer state) are the first round's;
the JSON says whether the final digests of every round agree.

    python benchmarks/lisa_peers.py                    # the job above, about 2 minutes on 2 CPU cores
    python benchmarks/lisa_peers.py --steps 8 --every 2 --hidden 64 --intermediate 128 --vocab 256 --seq 16

Output (``--out``, default ``benchmarks/results/``): ``{name}.json`` (every
rank's per-step figures and the summary), ``{name}.md`` (the table) and
``{name}.png`` (optimizer state held over the steps, per variant). MB are 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

#: In the order of the table.
VARIANTS = ("naive", "naive_find_unused", "hf_altparams", "hf_altparams_drop")
#: In the order they run: the naive variant's DDP error comes last.
RUN_ORDER = ("naive_find_unused", "hf_altparams", "hf_altparams_drop", "naive")
#: The variant whose final weights the others are compared with (correct, and plain transformers).
REFERENCE = "naive_find_unused"
EXTRA_GROUPS = {"emb": "model.embed_tokens.*", "head": ["model.norm.*", "lm_head.*"]}
MB = 1e6
#: What every rank runs (torch, transformers, hf_altparams); this file imports the standard library only.
RANKS_SCRIPT = Path(__file__).resolve().parent / "_lisa_peers_ranks.py"


# --------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class Job:
    """The training job every variant runs."""

    steps: int = 40
    every: int = 5
    k: int = 2
    layers: int = 8
    hidden: int = 256
    intermediate: int = 1024
    heads: int = 4
    vocab: int = 1000
    seq: int = 64
    batch: int = 4
    lr: float = 1e-3
    seed: int = 0

    def group_names(self) -> list[str]:
        return [f"layer{i}" for i in range(self.layers)]


# --------------------------------------------------------------------------- summary, table, plot


def fmt_mb(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / MB:.2f} MB"


def timed_steps(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps whose times count: the first carries the start of training, left out when others ran."""
    return steps[1:] if len(steps) > 1 else steps


def round_median(ranks: list[dict[str, Any]], variant: str, round_: int, key: str = "seconds") -> Optional[float]:
    """Median of ``key`` (wall or CPU seconds per step) of ``variant`` in round ``round_``, both ranks pooled."""
    values = [s[key] for r in ranks for s in timed_steps(r["runs"][variant][round_]["steps"])]
    return statistics.median(values) if values else None


def library_figures(run: dict[str, Any], steps: int) -> list[Optional[int]]:
    """``altparams/allreduce_bytes_per_step`` the callback logged for each step (its reducer's figure; None: no log)."""
    logged = {log["step"]: log.get("altparams/allreduce_bytes_per_step") for log in run["altparams_logs"]}
    return [logged.get(step) for step in range(1, steps + 1)]


def summarize(variant: str, ranks: list[dict[str, Any]], final_vs_reference: Optional[float]) -> dict[str, Any]:
    """One row: what every rank measured over the variant's runs."""
    runs = [r["runs"][variant] for r in ranks]  # [rank][repeat]
    first = [rank_runs[0] for rank_runs in runs]
    steps0 = first[0]["steps"]
    errors = [run["error"] for rank_runs in runs for run in rank_runs if run["error"] is not None]
    identical = all(s["ranks_identical"] for run in first for s in run["steps"])
    diverged = [s["step"] for s in steps0 if not s["ranks_identical"]]
    reduced = [s["allreduce_bytes"] for s in steps0]
    trainable = [s["trainable_bytes"] for s in steps0]
    wire = [a / t for a, t in zip(reduced, trainable) if a is not None and t]
    seconds = [s["seconds"] for rank_runs in runs for run in rank_runs for s in timed_steps(run["steps"])]
    cpu = [s["cpu_seconds"] for rank_runs in runs for run in rank_runs for s in timed_steps(run["steps"])]
    rounds = len(runs[0])
    has_reference = REFERENCE in ranks[0]["runs"]

    def ratios(key: str) -> list[float]:
        pairs = [
            (round_median(ranks, variant, i, key), round_median(ranks, REFERENCE, i, key) if has_reference else None)
            for i in range(rounds)
        ]
        return [a / b for a, b in pairs if a is not None and b]

    per_round = [round_median(ranks, variant, i) for i in range(rounds)]
    ratios_step, ratios_cpu = ratios("seconds"), ratios("cpu_seconds")
    losses = first[0]["losses"]
    completed = min(run["completed_steps"] for rank_runs in runs for run in rank_runs)
    error = errors[0] if errors else None
    if error is not None:
        outcome = f"stopped in step {error['step']}: {error['type']}: {first_line(error['message'])}"
    else:
        outcome = f"completed {completed} steps"
    return {
        "variant": variant,
        "ranks_identical": bool(steps0) and identical,
        "ranks_identical_steps": [s["ranks_identical"] for s in steps0],
        "first_divergent_step": diverged[0] if diverged else None,
        "max_abs_diff": max((s["max_abs_diff"] for run in first for s in run["steps"]), default=0.0),
        "max_abs_diff_per_step": [s["max_abs_diff"] for s in steps0],
        "allreduce_bytes_per_step": reduced,
        "library_allreduce_bytes_per_step": library_figures(first[0], len(steps0)),
        "allreduce_equal_on_ranks": all([s["allreduce_bytes"] for s in run["steps"]] == reduced for run in first),
        "trainable_bytes_per_step": trainable,
        "allreduce_over_trainable": (min(wire), max(wire)) if wire else None,
        "optimizer_state_bytes_per_step": [s["state_bytes"] for s in steps0],
        "optimizer_state_frozen_bytes_per_step": [s["state_frozen_bytes"] for s in steps0],
        "optimizer_state_by_group_end": steps0[-1]["state_by_group"] if steps0 else {},
        "optimizer_state_end": steps0[-1]["state_bytes"] if steps0 else None,
        "optimizer_state_frozen_end": steps0[-1]["state_frozen_bytes"] if steps0 else None,
        "median_step_seconds": statistics.median(seconds) if seconds else None,
        "step_samples": len(seconds),
        "median_step_seconds_per_round": per_round,
        "step_over_reference_per_round": ratios_step,
        "step_over_reference": statistics.median(ratios_step) if ratios_step else None,
        "median_step_cpu_seconds": statistics.median(cpu) if cpu else None,
        "cpu_over_reference_per_round": ratios_cpu,
        "cpu_over_reference": statistics.median(ratios_cpu) if ratios_cpu else None,
        "losses": losses,
        "final_loss": losses[-1]["loss"] if losses else None,
        "final_loss_step": losses[-1]["step"] if losses else None,
        "completed_steps": completed,
        "error": error,
        "outcome": outcome,
        "final_weights_max_abs_diff_vs_reference": final_vs_reference,
        "final_digest_same_in_every_round": len(
            {run["steps"][-1]["digest"] if run["steps"] else None for run in runs[0]}
        )
        == 1,
    }


def first_line(message: str, limit: int = 110) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table, one row per variant."""
    head = (
        "| variant | ranks identical | all-reduced per step / trainable | optimizer state at the end "
        "(on frozen layers) | median step: wall, CPU (x `naive_find_unused`) | final loss | outcome |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row in rows:
        if row["ranks_identical"]:
            ident = "yes (bit-identical)"
        elif row["first_divergent_step"] is not None:
            ident = f"no: differ from step {row['first_divergent_step']}, max diff {row['max_abs_diff']:.1e}"
        else:
            ident = "no"
        reduced = [a for a in row["allreduce_bytes_per_step"] if a is not None]
        trainable = row["trainable_bytes_per_step"]
        if reduced and row["allreduce_over_trainable"]:
            low, high = row["allreduce_over_trainable"]
            ratio = f"{low:.2f}x" if abs(high - low) < 5e-3 else f"{low:.2f}-{high:.2f}x"
            span = (
                fmt_mb(reduced[0]) if len(set(reduced)) == 1 else f"{min(reduced) / MB:.2f}-{max(reduced) / MB:.2f} MB"
            )
            tspan = (
                fmt_mb(trainable[0])
                if len(set(trainable)) == 1
                else f"{min(trainable) / MB:.2f}-{max(trainable) / MB:.2f} MB"
            )
            comm = f"{span} / {tspan} ({ratio})"
        else:
            comm = "n/a"
        state = (
            f"{fmt_mb(row['optimizer_state_end'])} ({fmt_mb(row['optimizer_state_frozen_end'])})"
            if row["optimizer_state_end"] is not None
            else "n/a"
        )
        step = step_cell(row)
        loss = f"{row['final_loss']:.3f}" if row["final_loss"] is not None else "n/a"
        if row["final_loss"] is not None and row["error"] is not None:
            loss += f" (step {row['final_loss_step']})"
        outcome = row["outcome"].replace("|", "\\|")
        lines.append(f"| `{row['variant']}` | {ident} | {comm} | {state} | {step} | {loss} | {outcome} |")
    return head + "\n".join(lines) + "\n"


def step_cell(row: dict[str, Any]) -> str:
    """Median wall and CPU time per step; against the reference, the median of the per-round ratios."""
    if row["median_step_seconds"] is None:
        return "n/a"

    def one(seconds: float, ratio: Optional[float]) -> str:
        return f"{seconds * 1e3:.0f} ms" + (
            f" ({ratio:.2f}x)"
            if ratio is not None and row["variant"] != REFERENCE and row["completed_steps"] > 1
            else ""
        )

    cell = (
        f"{one(row['median_step_seconds'], row['step_over_reference'])}, "
        f"{one(row['median_step_cpu_seconds'], row['cpu_over_reference'])}"
    )
    return cell + (" (step 1 only, with the start of training)" if row["completed_steps"] == 1 else "")


def plot(rows: list[dict[str, Any]], job: Job, path: Path, title: str) -> None:
    """Optimizer state held after every step, total and on frozen layers, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    # Equal curves would hide each other: each variant its own dash and width, widest first.
    looks = [("-", 4.0), ("--", 2.6), (":", 2.2), ("-.", 1.6)]
    for row, (dash, width) in zip(rows, looks):
        held = row["optimizer_state_bytes_per_step"]
        frozen = row["optimizer_state_frozen_bytes_per_step"]
        steps = list(range(1, len(held) + 1))
        style = {"marker": "x" if row["error"] else None, "markersize": 9, "linestyle": dash, "linewidth": width}
        label = row["variant"] + (" (stopped)" if row["error"] else "")
        top.plot(steps, [b / MB for b in held], label=label, **style)
        bottom.plot(steps, [b / MB for b in frozen], label=label, **style)
    for ax in (top, bottom):
        for s in range(job.every, job.steps, job.every):
            ax.axvline(s + 0.5, color="0.85", linewidth=0.8, zorder=0)
        ax.grid(axis="y", color="0.9")
    top.set_ylabel("optimizer state held (MB)")
    bottom.set_ylabel("of it on groups not trained\nin the step (MB)")
    bottom.set_xlabel(f"end of optimizer step (after the switch, if any; grey: LISA re-draws every {job.every} steps)")
    top.set_title(title, fontsize=10)
    top.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def library_revision() -> str:
    """The commit of this checkout, marked when ``hf_altparams/`` has uncommitted changes (the figures depend on it)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "hf_altparams"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + (" with uncommitted changes to hf_altparams/" if dirty else "")


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def driver(args: argparse.Namespace, job: Job) -> int:
    """Launch the ranks, then write the JSON, the table and the plot; print the table."""
    from _machine import machine
    from hf_altparams.testing import launch, rank_results

    variants = [v for v in VARIANTS if v in args.variants]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load_before, started = loadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as ranks_dir:
        launch(
            RANKS_SCRIPT,
            "--worker",
            ranks_dir,
            "--variants",
            *variants,
            "--repeats",
            str(args.repeats),
            *job_args(job),
            nproc=args.nproc,
            launcher=args.launcher,
            timeout=args.timeout,
            env={"OMP_NUM_THREADS": str(args.threads)},
        )
        ranks = rank_results(ranks_dir, nproc=args.nproc)
    wall, load_after = time.perf_counter() - started, loadavg()
    rows = [summarize(v, ranks, ranks[0]["final_vs_reference"].get(v)) for v in variants]
    where, revision, versions = machine("cpu", args.nproc), library_revision(), ranks[0]["versions"]
    payload = {
        "machine": where,
        "library_revision": revision,
        "versions": versions,
        "threads_per_rank": args.threads,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "cpu_count": os.cpu_count(),
        "wall_seconds": wall,
        "job": asdict(job),
        "variants": variants,
        "repeats": args.repeats,
        "reference": REFERENCE,
        "layer_draws": ranks[0]["draws"],
        "model_bytes": ranks[0]["model_bytes"],
        "rows": rows,
        "ranks": slim(ranks),
    }
    (out / f"{args.name}.json").write_text(json.dumps(payload, default=str))
    load = (
        f" Load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, on {os.cpu_count()} cores."
        if load_before and load_after
        else ""
    )
    header = (
        f"{where}, transformers {versions['transformers']}, accelerate {versions['accelerate']}, "
        f"hf_altparams at {revision}; {args.threads} thread(s) per rank; {job.steps} steps, LISA k={job.k} "
        f"every {job.every}, {job.layers} layers, hidden {job.hidden}, batch {job.batch} x {job.seq} tokens "
        f"per rank; {args.repeats} round(s); MB = 10^6 bytes.{load}\n\n"
    )
    notes = "".join(
        f"- `{r['variant']}` final weights vs `{REFERENCE}`: max abs diff "
        f"{r['final_weights_max_abs_diff_vs_reference']:.3g}\n"
        for r in rows
        if r["final_weights_max_abs_diff_vs_reference"] is not None and r["variant"] != REFERENCE
    )
    report = header + table(rows) + ("\n" + notes if notes else "")
    (out / f"{args.name}.md").write_text(report)
    plot(
        rows,
        job,
        out / f"{args.name}.png",
        f"LISA, {job.layers}-layer Llama, Trainer, {args.nproc} gloo ranks: optimizer state held",
    )
    print(report + f"wrote {out / args.name}.{{json,md,png}} ({wall:.0f} s)")
    return 0


def slim(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ranks' records for the JSON: every figure of the first round; of the later ones, times and digests."""
    kept = ("step", "digest", "seconds", "cpu_seconds")
    out = []
    for rank in ranks:
        runs = {
            v: [runs[0]]
            + [
                {
                    **run,
                    "steps": [{k: s[k] for k in kept} for s in run["steps"]],
                    "error": run["error"] and {k: run["error"][k] for k in ("type", "step")},
                }
                for run in runs[1:]
            ]
            for v, runs in rank["runs"].items()
        }
        out.append({**rank, "runs": runs})
    return out


def job_args(job: Job) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(job).items()]


def parse(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, Job]:
    default = Job()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, value in asdict(default).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every variant (step times pooled)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument(
        "--launcher",
        choices=["torchrun", "forked"],
        default="torchrun",
        help="torchrun: fresh interpreters (the figures); forked: ranks forked from a warm server "
        "(hf_altparams.testing, docs/testing.md): no start-up per rank, for the tests",
    )
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default="lisa_peers_cpu", help="stem of the output files")
    p.add_argument("--worker", metavar="RANKS_DIR", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    job = Job(**{k: getattr(args, k) for k in asdict(default)})
    if job.k > job.layers or job.every < 1 or job.steps < 1 or args.repeats < 1:
        p.error(
            f"need 1 <= --k <= --layers, --every >= 1, --steps >= 1, --repeats >= 1; got "
            f"k={job.k}, layers={job.layers}, every={job.every}, steps={job.steps}, repeats={args.repeats}"
        )
    return args, job


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, job = parse(argv)
    if args.worker:
        raise SystemExit(f"--worker is for {RANKS_SCRIPT.name}, which the launch runs on every rank")
    return driver(args, job)


if __name__ == "__main__":
    sys.exit(main())
