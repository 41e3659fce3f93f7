"""LISA under the 🤗 Trainer with DeepSpeed ZeRO-1/2/3 on 2 ranks: the usual callback, full fine-tuning and
``AlternatingFreeze``, side by side, one job.

The job (issue 37's): a Llama-style decoder built from a ``LlamaConfig`` (8
decoder layers, hidden 256, random weights, nothing downloaded), a synthetic
token data set, LISA with 2 layers re-drawn every 5 steps and the embeddings
(``emb``) and final norm + head (``head``) always trained, 30 steps, the
Trainer's default optimizer (AdamW, lr 1e-3, weight decay 0.01, gradient
clipping 1.0), ``TrainingArguments(deepspeed=...)`` with a ZeRO config of
stage 1, 2 or 3 (nothing else in it: the Trainer's settings fill it in). The
ways, each under every stage:

``full``
    full fine-tuning: every parameter trains every step (the yardstick of the
    ratio columns, at the same stage).
``naive``
    the usual callback (``NaiveLisa``, in ``_lisa_peers_ranks.py``: every
    decoder layer frozen at ``on_train_begin``, ``requires_grad`` flipped on the
    drawn layers every 5 steps).
``altparams``
    ``AlternatingFreeze(groups, lisa(...))``, the library's callback, with the
    Trainer's arguments unchanged (the schedule's default idle policy: idle
    groups' state dropped).

Every way draws the same layers at the same steps (the ``lisa`` schedule's
draws with this seed), and every row reads the same batches. On a CPU-only
machine Accelerate gives each rank a one-process state under DeepSpeed, so
every rank reads every batch (DeepSpeed's partitions and collectives still span
both ranks): the same in every row.

What a rank measures, per row, at the end of every optimizer step
(``_deepspeed_lisa_ranks.py``): every collective DeepSpeed issues through
``deepspeed.comm`` (calls and bytes per operation: the whole tensor each works
on, and what this rank puts in); the optimizer state this rank holds, read from
the DeepSpeed optimizer's own tensors (AdamW's moments and the fp32 partitions,
a partition that is the weights themselves not counted); a digest per group of
this rank's weights (whole at ZeRO-1/2, this rank's partition at ZeRO-3),
compared between ranks at ZeRO-1/2; the trainable bytes; the step's wall and
CPU time (the meter's own work left out); the logged loss.

From the digests at each window boundary (before the first step, then after
every 5th) the driver counts the **frozen layers that moved**: a decoder layer
not drawn for a window whose digest changed over it, on any rank.

Every row runs in fresh processes (its own ``torchrun`` launch: one DeepSpeed
engine per process), all rows one after the other in this one command, the
stages in order, in each stage ``full``, ``naive``, ``altparams``. The ratio
columns divide by ``full`` at the same stage. With ``--repeats N`` the rows run
N rounds (step times pooled over the rounds; every other figure is the first
round's).

    python benchmarks/deepspeed_lisa.py                  # the job above: 9 launches, about 25 minutes on 2 CPU cores
    python benchmarks/deepspeed_lisa.py --stages 2 --ways full altparams --steps 6 --every 2 --layers 4 \\
        --hidden 64 --intermediate 128 --vocab 256 --seq 16 --batch 2      # small

Plain ``torchrun``, no ``ACCELERATE_USE_CPU`` (it makes the Trainer drop
DeepSpeed silently). The first DeepSpeed run on a machine builds its CPU comm
op (minutes; cached in ``~/.cache/torch_extensions``). Output (``--out``,
default ``benchmarks/results/``): ``{name}.json`` (every rank's per-step
figures and the summary) and ``{name}.md`` (the tables). MiB are 2^20 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lisa_peers import Job as PeersJob  # noqa: E402  (the same job; stdlib only)

STAGES = (1, 2, 3)
#: The ways, in the order they run and are listed in each stage.
WAYS = ("full", "naive", "altparams")
WAY_LABELS = {"full": "full fine-tuning", "naive": "the usual callback", "altparams": "`AlternatingFreeze`"}
EXTRA_GROUPS = {"emb": "model.embed_tokens.*", "head": ["model.norm.*", "lm_head.*"]}
MiB = 2**20
RANKS_SCRIPT = Path(__file__).resolve().parent / "_deepspeed_lisa_ranks.py"


@dataclass(frozen=True)
class Job(PeersJob):
    """The training job every row runs: ``lisa_peers.py``'s model and data, issue 37's 30 steps, weight decay."""

    steps: int = 30
    weight_decay: float = 0.01


def meta_model(job: Job) -> Any:
    """The job's model on ``meta`` (for the planner): the ``LlamaConfig`` every rank builds, nothing allocated."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=job.vocab,
        hidden_size=job.hidden,
        intermediate_size=job.intermediate,
        num_hidden_layers=job.layers,
        num_attention_heads=job.heads,
        num_key_value_heads=job.heads,
        max_position_embeddings=max(job.seq, 64),
        tie_word_embeddings=False,
    )
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def lisa_schedule(job: Job) -> Any:
    """The job's schedule: ``lisa`` over the decoder layers, the embeddings and head always on."""
    from hf_altparams import lisa

    return lisa(job.group_names(), k=job.k, every=job.every, always=("emb", "head"), seed=job.seed)


def ds_config(stage: int) -> dict[str, Any]:
    """The DeepSpeed config of every row: the ZeRO stage; the rest ``auto`` (from the Trainer's arguments)."""
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": False},
    }


# --------------------------------------------------------------------------- summary


def timed(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steps whose times count: the first carries the start of training, left out when others ran."""
    return steps[1:] if len(steps) > 1 else steps


def frozen_moved(run: list[dict[str, Any]], draws: list[list[int]], job: Job) -> dict[str, Any]:
    """Windows in which a decoder layer not drawn for the window changed, from every rank's digests."""
    windows, pairs, moved_pairs = 0, 0, []
    for w, drawn in enumerate(draws):
        last = min((w + 1) * job.every, job.steps)
        if any(len(rank["steps"]) < last for rank in run):
            break
        windows += 1
        for layer in (i for i in range(job.layers) if i not in drawn):
            pairs += 1
            name = f"layer{layer}"
            before = [
                rank["initial_digests"] if w == 0 else rank["steps"][w * job.every - 1]["digests"] for rank in run
            ]
            after = [rank["steps"][last - 1]["digests"] for rank in run]
            if any(b[name] != a[name] for b, a in zip(before, after)):
                moved_pairs.append([w, name])
    return {
        "windows": windows,
        "windows_moved": len({w for w, _ in moved_pairs}),
        "layer_windows": pairs,
        "layer_windows_moved": len(moved_pairs),
        "moved": moved_pairs,
    }


def summarize(row: str, rounds: list[list[dict[str, Any]]], job: Job) -> dict[str, Any]:
    """One row from its ranks' records (``rounds[i][rank]``); figures of the first round, times of every round."""
    ranks = [r["run"] for r in rounds[0]]
    first = ranks[0]
    steps = first["steps"]
    error = next((r["error"] for r in ranks if r["error"] is not None), None)
    bytes_per_step = [s["comm_bytes"] for s in steps]
    own_per_step = [s["comm_own_bytes"] for s in steps]
    state = [s["state"]["adam_state"] + s["state"]["fp32_partitions"] for rank in ranks for s in rank["steps"]]
    seconds = [s["seconds"] for rnd in rounds for r in rnd for s in timed(r["run"]["steps"])]
    cpu = [s["cpu_seconds"] for rnd in rounds for r in rnd for s in timed(r["run"]["steps"])]
    losses = first["losses"]
    tail = [x["loss"] for x in losses[-5:]]
    identical = [s["ranks_identical"] for s in steps]
    completed = min(r["completed_steps"] for rnd in rounds for r in (x["run"] for x in rnd))
    return {
        "row": row,
        "stage": first["stage"],
        "way": first["way"],
        "zero_optimizer": first["zero_optimizer"],
        "completed_steps": completed,
        "error": error,
        "outcome": outcome(error, completed),
        "frozen_moved": frozen_moved(ranks, rounds[0][0]["draws"], job) if first["way"] != "full" and steps else None,
        "comm_bytes_per_step": bytes_per_step,
        "comm_own_bytes_per_step": own_per_step,
        "comm_bytes_mean": statistics.fmean(bytes_per_step) if bytes_per_step else None,
        "comm_bytes_median": statistics.median(bytes_per_step) if bytes_per_step else None,
        "comm_own_bytes_median": statistics.median(own_per_step) if own_per_step else None,
        "comm_equal_on_ranks": all([s["comm_bytes"] for s in r["steps"]] == bytes_per_step for r in ranks),
        "comm_by_op_last": steps[-1]["comm"] if steps else {},
        "comm_by_op_first": steps[0]["comm"] if steps else {},
        "trainable_bytes_per_step": [s["trainable_bytes"] for s in steps],
        "trainable_bytes_mean": statistics.fmean(s["trainable_bytes"] for s in steps) if steps else None,
        "state_per_step": [[s["state"] for s in r["steps"]] for r in ranks],
        "state_max": max(state, default=None),
        "adam_state_max": max((s["state"]["adam_state"] for r in ranks for s in r["steps"]), default=None),
        "fp32_partitions_max": max((s["state"]["fp32_partitions"] for r in ranks for s in r["steps"]), default=None),
        "ranks_identical": None if first["stage"] == 3 or not steps else all(identical),
        "first_divergent_step": next((s["step"] for s in steps if s["ranks_identical"] is False), None),
        "median_step_seconds": statistics.median(seconds) if seconds else None,
        "median_step_cpu_seconds": statistics.median(cpu) if cpu else None,
        "step_samples": len(seconds),
        "losses": losses,
        "loss_last5": statistics.fmean(tail) if tail else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "altparams_logs": first["altparams_logs"],
    }


def outcome(error: Optional[dict[str, Any]], completed: int) -> str:
    if error is None:
        return f"completed {completed} steps"
    when = "refused before the first step" if error["step"] == 0 else f"stopped in step {error['step']}"
    return f"{when}: {error['type']}: {first_line(error['message'])}"


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's bytes per step, optimizer state and step time over full fine-tuning's at the same stage."""
    full = {r["stage"]: r for r in rows if r["way"] == "full" and r["error"] is None}
    for r in rows:
        yard = full.get(r["stage"])
        for key, out in (
            ("comm_bytes_median", "bytes_vs_full"),
            ("state_max", "state_vs_full"),
            ("median_step_seconds", "step_vs_full"),
            ("median_step_cpu_seconds", "cpu_vs_full"),
        ):
            mine, theirs = r.get(key), yard.get(key) if yard else None
            r[out] = mine / theirs if mine is not None and theirs else None


def first_line(message: str, limit: int = 140) -> str:
    line = message.strip().splitlines()[0] if message.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def mib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / MiB:.2f} MiB"


def times(r: Optional[float]) -> str:
    return "" if r is None else f" ({r:.2f}x)"


def table(rows: list[dict[str, Any]]) -> str:
    """The side-by-side table, one row per stage and way."""
    head = (
        "| ZeRO | way | frozen layers that moved: windows (layer-windows) | collective bytes / step (median), "
        "whole tensors (x full FT) | this rank's input / step (median) | optimizer state / rank: AdamW + fp32 partitions "
        "(x full FT) | ranks identical | median step: wall, CPU (x full FT) | loss (mean of last 5) | outcome |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        fm = r["frozen_moved"]
        moved = (
            "- (nothing frozen)"
            if r["way"] == "full"
            else "n/a"
            if fm is None
            else f"{fm['windows_moved']} of {fm['windows']} ({fm['layer_windows_moved']} of {fm['layer_windows']})"
        )
        comm = mib(r["comm_bytes_median"]) + ("" if r["way"] == "full" else times(r["bytes_vs_full"]))
        state = (
            "n/a"
            if r["state_max"] is None
            else f"{r['adam_state_max'] / MiB:.2f} + {r['fp32_partitions_max'] / MiB:.2f} MiB = {mib(r['state_max'])}"
            + ("" if r["way"] == "full" else times(r["state_vs_full"]))
        )
        if r["ranks_identical"] is None:
            ident = "n/a (ZeRO-3: each rank holds its partitions)" if r["stage"] == 3 else "n/a"
        elif r["ranks_identical"]:
            ident = "yes, every step"
        else:
            ident = f"no: from step {r['first_divergent_step']}"
        step = (
            "n/a"
            if r["median_step_seconds"] is None
            else (
                f"{r['median_step_seconds']:.2f} s{'' if r['way'] == 'full' else times(r['step_vs_full'])}, "
                f"{r['median_step_cpu_seconds']:.2f} s{'' if r['way'] == 'full' else times(r['cpu_vs_full'])}"
            )
        )
        loss = "n/a" if r["loss_last5"] is None else f"{r['loss_last5']:.3f}"
        outcome = r["outcome"].replace("|", "\\|")
        lines.append(
            f"| {r['stage']} | {WAY_LABELS[r['way']]} | {moved} | {comm} | {mib(r['comm_own_bytes_median'])} "
            f"| {state} | {ident} | {step} | {loss} | {outcome} |"
        )
    return head + "\n".join(lines) + "\n"


def ops_table(rows: list[dict[str, Any]]) -> str:
    """What carried the bytes: per row, each collective's calls and whole-tensor MiB in the first and last step."""

    def ops(calls: dict[str, list[int]]) -> str:
        return ", ".join(f"{op} {n} x {full / MiB:.2f}" for op, (n, full, _own) in sorted(calls.items()) if n) or "n/a"

    lines = [
        "| ZeRO | way | DeepSpeed optimizer | collectives in the last step: calls x whole-tensor MiB | in the "
        "first step | trainable MiB / step (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['stage']} | {WAY_LABELS[r['way']]} | {r['zero_optimizer'] or 'n/a'} "
            f"| {ops(r['comm_by_op_last'])} | {ops(r['comm_by_op_first'])} | {mib(r['trainable_bytes_mean'])} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the planner beside the measurement


def planned(job: Job, stages: Sequence[int], nproc: int) -> dict[str, Any]:
    """What ``plan_cost`` prices for the LISA phases of this job under each ZeRO stage (per rank), or why not.

    Returned per stage: the strategy priced, and per LISA phase the optimizer
    state (moments and fp32 masters) and the bytes fed to the collective per step.
    """
    from hf_altparams import ParamGroups
    from hf_altparams.engine.strategies import registered
    from hf_altparams.errors import AltParamsError
    from hf_altparams.planner import plan_cost

    model = meta_model(job)
    groups = ParamGroups.from_layers(model, "model.layers", extra=EXTRA_GROUPS)
    schedule = lisa_schedule(job)
    out: dict[str, Any] = {}
    for stage in stages:
        names = [s.name for s in registered() for n in (s.name, *s.aliases) if n in zero_names(stage)]
        if not names:
            out[str(stage)] = {
                "error": f"no registered strategy prices ZeRO-{stage} (looked for {list(zero_names(stage))})"
            }
            continue
        try:
            plan = plan_cost(model, groups, schedule, world_size=nproc, steps=job.steps, backend=names[0])
        except AltParamsError as err:
            out[str(stage)] = {"error": f"{type(err).__name__}: {err}"}
            continue
        out[str(stage)] = {
            "strategy": names[0],
            "state_policy": plan.state_policy,
            "phases": {p.phase: priced(p) for p in plan.phases},
            "everything": priced(plan.everything),
        }
    return out


def priced(row: Any) -> dict[str, int]:
    """A plan row's figures the benchmark measures: state per rank, bytes per step (whole tensors)."""
    gathered = getattr(row, "gather_bytes", 0)
    return {
        "optimizer_bytes": row.optimizer_bytes,
        "master_bytes": row.master_bytes,
        "state_bytes": row.optimizer_bytes + row.master_bytes,
        "allreduce_bytes": row.allreduce_bytes,
        "gather_bytes": gathered,
        "comm_bytes": row.allreduce_bytes + gathered,
    }


def planner_table(rows: list[dict[str, Any]], plans: dict[str, Any]) -> str:
    """The planner's price (``plan --strategy zeroN``) beside the measurement: full fine-tuning and the library."""
    lines = [
        "| ZeRO | way | optimizer state / rank: measured (max), planned (max over phases) | collective bytes / "
        "step: measured (median), planned (max over phases) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        plan = plans.get(str(r["stage"]), {})
        if r["way"] == "naive":
            continue  # the planner prices what the library runs
        if "error" in plan:
            lines.append(f"| {r['stage']} | {WAY_LABELS[r['way']]} | not priced: {plan['error']} | |")
            continue
        figures = [plan["everything"]] if r["way"] == "full" else list(plan["phases"].values())
        state = max(f["state_bytes"] for f in figures)
        comm = max(f["comm_bytes"] for f in figures)
        lines.append(
            f"| {r['stage']} | {WAY_LABELS[r['way']]} | {mib(r['state_max'])}, {mib(state)} "
            f"| {mib(r['comm_bytes_median'])}, {mib(comm)} |"
        )
    return "\n".join(lines) + "\n"


def zero_names(stage: int) -> tuple[str, ...]:
    """The names a ZeRO stage's strategy may be registered under."""
    return (f"zero{stage}", f"zero-{stage}", f"deepspeed-zero{stage}", f"deepspeed-zero-{stage}")


# --------------------------------------------------------------------------- driver


def library_revision() -> str:
    from lisa_peers import library_revision as revision

    return revision()


def loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def driver(args: argparse.Namespace, job: Job) -> int:
    """Launch every row's ranks, then write the JSON and the tables; print the tables."""
    from _machine import machine
    from hf_altparams.testing import LaunchError, launch, rank_results

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_run = [(s, w) for s in STAGES if s in args.stages for w in WAYS if w in args.ways]
    records: dict[str, list[list[dict[str, Any]]]] = {f"z{s}_{w}": [] for s, w in rows_run}
    failures: dict[str, str] = {}
    load_before, started = loadavg(), time.perf_counter()
    for round_ in range(args.repeats):
        for stage, way in rows_run:
            row = f"z{stage}_{way}"
            print(f"[{time.strftime('%H:%M:%S')}] round {round_ + 1}/{args.repeats}: ZeRO-{stage}, {way}", flush=True)
            with tempfile.TemporaryDirectory() as ranks_dir:
                try:
                    launch(
                        RANKS_SCRIPT,
                        "--worker",
                        ranks_dir,
                        "--stage",
                        str(stage),
                        "--way",
                        way,
                        *job_args(job),
                        nproc=args.nproc,
                        timeout=args.timeout,
                        env={"OMP_NUM_THREADS": str(args.threads)},
                    )
                    records[row].append(rank_results(ranks_dir, nproc=args.nproc))
                except LaunchError as err:  # a crashed launch is reported, the other rows still run
                    failures.setdefault(row, str(err)[-4000:])
                    print(f"  launch failed: {first_line(str(err))}", flush=True)
    wall, load_after = time.perf_counter() - started, loadavg()
    any_rank = next(iter(r[0][0] for r in records.values() if r), None)
    payload = {
        "machine": machine("cpu", args.nproc),
        "library_revision": library_revision(),
        "versions": any_rank["versions"] if any_rank else {},
        "threads_per_rank": args.threads,
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "cpu_count": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime(time.time() - wall)) + " UTC",
        "wall_seconds": wall,
        "job": asdict(job),
        "stages": sorted(args.stages),
        "nproc": args.nproc,
        "repeats": args.repeats,
        "layer_draws": any_rank["draws"] if any_rank else None,
        "model_bytes": any_rank["model_bytes"] if any_rank else None,
        "group_bytes": any_rank["group_bytes"] if any_rank else None,
        "launch_failures": failures,
        "records": records,
    }
    return render(payload, out, args.name)


def render(payload: dict[str, Any], out: Path, name: str) -> int:
    """Summarise the ranks' records of ``payload``, price the job with the planner, write ``{name}.json`` and ``.md``.

    The planner's figures are those of the library installed now (``--summarize`` re-prices a past run).
    """
    job = Job(**payload["job"])
    records = payload["records"]
    rows = [summarize(row, rounds, job) for row, rounds in records.items() if rounds]
    add_ratios(rows)
    plans = planned(job, payload["stages"], payload["nproc"])
    payload = {**payload, "rows": rows, "planned": plans, "planner_revision": library_revision()}
    (out / f"{name}.json").write_text(json.dumps(payload, default=str))
    before, after, versions = payload["loadavg_before"], payload["loadavg_after"], payload["versions"]
    load = (
        f" Load average {before[0]:.1f} before, {after[0]:.1f} after, on {payload['cpu_count']} cores."
        if before and after
        else ""
    )
    header = (
        f"{payload['machine']}, deepspeed {versions.get('deepspeed')}, transformers "
        f"{versions.get('transformers')}, accelerate {versions.get('accelerate')}, hf_altparams at "
        f"{payload['library_revision']}; {payload['threads_per_rank']} thread(s) per rank; {job.steps} steps, "
        f"LISA k={job.k} every {job.every}, {job.layers} layers, hidden {job.hidden}, batch {job.batch} x "
        f"{job.seq} tokens; {payload['repeats']} round(s); started {payload['started']}, wall "
        f"{payload['wall_seconds'] / 60:.0f} min; MiB = 2^20 bytes.{load}\n\n"
    )
    failures = payload["launch_failures"]
    report = (
        header
        + table(rows)
        + "\n"
        + ops_table(rows)
        + "\n"
        + f"Planner (`plan --strategy zero<N>`) at {payload['planner_revision']}:\n\n"
        + planner_table(rows, plans)
    )
    if failures:
        report += "\nLaunches that failed: " + ", ".join(f"`{r}`" for r in failures) + " (tails in the JSON)\n"
    (out / f"{name}.md").write_text(report)
    print(report + f"wrote {out / name}.{{json,md}}")
    return 0


def job_args(job: Job) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in asdict(job).items()]


def parse(argv: Optional[Sequence[str]] = None) -> tuple[argparse.Namespace, Job]:
    default = Job()
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    for name, value in asdict(default).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    p.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=STAGES)
    p.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    p.add_argument("--repeats", type=int, default=1, help="rounds of every row (step times pooled)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--name", default="deepspeed_lisa_cpu", help="stem of the output files")
    p.add_argument(
        "--summarize",
        metavar="JSON",
        help="write the tables of a past run's JSON again (to --out, "
        "--name), the planner's figures re-priced by the library installed now; nothing is launched",
    )
    p.add_argument("--worker", metavar="RANKS_DIR", help=argparse.SUPPRESS)
    p.add_argument("--stage", type=int, choices=STAGES, help=argparse.SUPPRESS)  # a rank's row
    p.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)
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
    if args.summarize:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        return render(json.loads(Path(args.summarize).read_text()), out, args.name)
    return driver(args, job)


if __name__ == "__main__":
    sys.exit(main())
