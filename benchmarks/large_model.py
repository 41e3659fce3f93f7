"""Large models: plain DDP vs hf_altparams fp32 storage vs bf16 storage + fp32 masters, side by side.

A Llama-style decoder built from a transformers ``LlamaConfig`` (random
weights, nothing downloaded), one group per decoder layer plus ``emb`` and
``head``, trained BAdam-style (one block at a time, in order) with AdamW.
Scenarios, each in a fresh ``torchrun`` launch:

* ``ddp_full``: plain DDP, fp32, AdamW over every parameter (full fine-tuning).
* ``alt_fp32``: hf_altparams, fp32 parameters, ``state_policy="drop"``.
* ``bf16_offload`` / ``bf16_drop``: parameters stored in bf16,
  :class:`~hf_altparams.engine.PrecisionOptimizer` with fp32 masters and
  optimizer state for the active block only, idle masters offloaded / dropped.
* ``bf16_drop_fp32wire``: ``bf16_drop`` with ``allreduce_dtype=torch.float32``
  (the bf16 gradients all-reduced in fp32).

Per scenario: the model state measured directly on the rank
(:class:`~tests.support.meters.ModelStateMeter`: the storages of the
parameters, buffers, gradients, DDP buckets, optimizer state and fp32 masters,
each once, sampled after every inner optimizer step, where the planner puts
its peak; Adam's 0-d step counters listed apart) next to the planner's model
state for the same run (``plan_cost`` with ``storage_dtype``): the planner is
compared with that, not with a process-wide figure. On CUDA only what lies on
the GPU is counted there (the planner's device bytes, beside the peak
allocation); what the run keeps on the host (idle fp32 masters under
``offload``) is its own column. On CPU both are one RAM: device + host. Peak memory per rank
(CPU: peak RSS growth over the process after a warm-up; CUDA:
``max_memory_allocated``) is reported beside it with what lies beyond the model
state: the largest transient of a forward + backward (activations, autograd)
and of an optimizer step (AdamW's per-parameter temporaries, the gradient
casts) over the memory held before each. Also: bytes DDP all-reduced per step
(comm hook) and the median step time. Then the planner's figures for the Llama-2-7B shape (8 ranks)
and the largest square-ish model (layers x hidden) whose model state fits a
budget per scenario.

    python benchmarks/large_model.py                   # CPU: 2 gloo ranks, a scaled-down model
    python benchmarks/large_model.py --quick           # fewer steps (smoke)
    python benchmarks/large_model.py --device cuda     # 1 GPU: 7B shape, 24 GB emulated (see --help)
    python benchmarks/large_model.py --device cuda --scenarios bf16_offload   # one scenario

On CPU AdamW runs with ``foreach=False`` (per-parameter temporaries only), so
the measured peak is the model state plus small activations: that is what the
planner is compared with. On CUDA the 7B shape runs with
``torch.cuda.set_per_process_memory_fraction`` emulating a 24 GB card,
sequence 512, batch 1, gradient checkpointing; ``ddp_full`` and ``alt_fp32``
are expected to run out of memory there (reported as such).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SCENARIOS = ("ddp_full", "alt_fp32", "bf16_offload", "bf16_drop", "bf16_drop_fp32wire")
MIB, GIB = 2**20, 2**30
CPU_SHAPE = {"layers": 8, "hidden": 512, "intermediate": 1376, "heads": 8, "vocab": 4096}
EXTRA = {"emb": "model.embed_tokens.*", "head": ["model.norm.*", "lm_head.*"]}


def _groups(model: torch.nn.Module) -> Any:
    from hf_altparams.plan import ParamGroups

    return ParamGroups.from_layers(model, "model.layers", extra=EXTRA)


def _schedule(groups: Any, steps_per_block: int) -> Any:
    from hf_altparams.plan import badam

    return badam([*[n for n in groups.names if n.startswith("layer")], "emb", "head"], steps_per_block=steps_per_block)


def plan_for(
    scenario: str,
    shape: dict[str, int],
    world: int,
    steps_per_block: int = 1,
    bucket_as_view: bool = False,
    steps: int | None = None,
) -> Any:
    """The planner's view of ``scenario`` for a model of ``shape`` (built on meta)."""
    from hf_altparams.planner import plan_cost
    from tests.support.models import llama_decoder

    model = llama_decoder(**shape, device="meta")
    groups = _groups(model)
    storage = torch.bfloat16 if scenario.startswith("bf16") else None
    master = scenario.split("_")[1] if storage is not None else "offload"
    return plan_cost(
        model,
        groups,
        _schedule(groups, steps_per_block),
        optimizer="adamw",
        state_policy="drop",
        world_size=world,
        storage_dtype=storage,
        master_policy=master,
        bucket_as_view=bucket_as_view,
        steps=steps,
        allreduce_dtype=torch.float32 if scenario.endswith("fp32wire") else None,
    )


def planned_peak(
    scenario: str, shape: dict[str, int], world: int, steps: int | None = None, host_too: bool = False
) -> int:
    """The planner's peak model state per rank; ``host_too``: device + host (on CPU both are RAM)."""
    plan = plan_for(scenario, shape, world, steps=steps)
    if scenario == "ddp_full":
        return plan.everything.device_bytes
    return max(r.device_bytes + (r.host_bytes if host_too else 0) for r in plan.phases)


# ----------------------------------------------------------------------------------------- worker
def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.optim.optimizer import register_optimizer_step_post_hook

    from hf_altparams.engine import CommCounter, GroupedOptimizer, PhaseSwitcher, PrecisionOptimizer
    from hf_altparams.engine.comm import counting_allreduce_hook
    from hf_altparams.engine.memory import rss_bytes
    from hf_altparams.testing.launch import write_rank_result
    from tests.support.meters import ModelStateMeter, PeakMemory, total_state
    from tests.support.models import llama_decoder

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if args.memory_gb:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_gb * 1e9 / total), device)
    shape = json.loads(args.shape)
    # Warm-up on a tiny model of the same kind: imports, kernels and autograd's threads are
    # in the baseline, so the peak growth is the model state plus activations.
    tiny = llama_decoder(layers=1, hidden=64, intermediate=128, heads=2, vocab=64, device=str(device))
    tiny(input_ids=torch.zeros(1, 8, dtype=torch.long, device=device)).logits.float().sum().backward()
    del tiny
    meter = PeakMemory(device)
    meter.mark_baseline()
    result: dict[str, Any] = {"scenario": args.scenario, "world_size": world}
    try:
        bf16 = args.scenario.startswith("bf16")
        model = llama_decoder(
            **shape,
            max_positions=max(args.seq, 64),
            device=str(device),
            dtype=torch.bfloat16 if bf16 else torch.float32,
        )
        if args.checkpointing:
            model.gradient_checkpointing_enable()
        model.config.use_cache = False
        adamw = functools.partial(torch.optim.AdamW, lr=1e-5, foreach=cuda)
        groups = _groups(model)
        switcher = None
        if args.scenario == "ddp_full":
            optimizer: torch.optim.Optimizer = adamw(model.parameters())
        else:
            if bf16:
                optimizer = PrecisionOptimizer(
                    groups,
                    adamw,
                    storage_dtype=torch.bfloat16,
                    master_policy=args.scenario.split("_")[1],
                    state_policy="drop",
                    allreduce_dtype=torch.float32 if args.scenario.endswith("fp32wire") else None,
                )
            else:
                optimizer = GroupedOptimizer(groups, adamw, state_policy="drop")
            switcher = PhaseSwitcher(groups, _schedule(groups, args.steps_per_block), optimizer=optimizer)
            switcher.step_to(0)
        ddp = DDP(model, device_ids=[device.index] if cuda else None, init_sync=False)
        # On a GPU the model state compared with the device's allocation and the planner's device
        # bytes is what lies on the GPU; what the run keeps on the host (idle fp32 masters with
        # master_policy="offload") is measured apart. On CPU both are this RAM: counted together.
        state = ModelStateMeter(model, optimizer, device_type="cuda" if cuda else None)
        host_state = ModelStateMeter(model, optimizer, device_type="cpu") if cuda else None

        def recording_hook(counter, bucket):  # type: ignore[no-untyped-def]  # (DDP checks real annotations)
            state.note_bucket(bucket.buffer())
            return counting_allreduce_hook(counter, bucket)

        # before attach: a PrecisionOptimizer with allreduce_dtype then sets its dtype on this counter
        counter = CommCounter(process_group=ddp.process_group)
        ddp.register_comm_hook(counter, recording_hook)
        if switcher is not None:
            switcher.attach(ddp)
        in_step: list[int] = []  # model state after each inner optimizer step of this step

        def sample(*_: Any) -> None:
            in_step.append(total_state(state.sample()))
            if host_state is not None:
                host_state.sample()

        sampling = register_optimizer_step_post_hook(sample)
        gen = torch.Generator().manual_seed(rank)
        times, sent = [], []
        rss_peak, fwd_bwd_extra, step_extra = 0, 0, 0
        for step in range(args.steps):
            ids = torch.randint(0, shape["vocab"], (args.batch, args.seq), generator=gen).to(device)
            if cuda:
                torch.cuda.synchronize()
            if not cuda:
                meter.reset_peak()
            start = time.perf_counter()
            logits = ddp(input_ids=ids).logits
            F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
            del logits
            if not cuda:  # the RSS peak of forward + backward over the model state held after it
                fwd_bwd_peak, after_backward = meter.peak(), total_state(state.measure())
                meter.reset_peak()
            in_step.clear()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            else:  # the RSS peak of the step over the largest model state sampled in it
                step_peak = meter.peak()
                rss_peak = max(rss_peak, fwd_bwd_peak, step_peak)
                fwd_bwd_extra = max(fwd_bwd_extra, fwd_bwd_peak - meter.baseline - after_backward)
                step_extra = max(step_extra, step_peak - meter.baseline - max(in_step, default=0))
            times.append(time.perf_counter() - start)
            sent.append(counter.end_step())
            state.forget_buckets()  # a switch may rebuild them; the next backward notes them again
            if switcher is not None:
                switcher.step_to(step + 1)
            if not cuda:  # the switch's own peak (state moved or dropped, buckets rebuilt) counts too
                rss_peak = max(rss_peak, meter.peak())
        sampling.remove()
        result.update(
            peak_growth_bytes=(rss_peak if not cuda else meter.peak()) - meter.baseline,
            peak_bytes=rss_peak if not cuda else meter.peak(),
            rss_after_bytes=rss_bytes() - meter.baseline if not cuda else None,
            fwd_bwd_extra_bytes=fwd_bwd_extra,
            step_extra_bytes=step_extra,
            model_state=state.peak,
            model_state_bytes=total_state(state.peak),
            host_state=host_state.peak if host_state is not None else None,
            host_state_bytes=total_state(host_state.peak) if host_state is not None else None,
            step_seconds=statistics.median(times[1:] or times),
            allreduce_bytes=max(sent),
            params=sum(p.numel() for p in model.parameters()),
            oom=False,
        )
        del ddp, switcher
    except torch.cuda.OutOfMemoryError as err:
        result.update(
            oom=True, error=str(err).splitlines()[0], peak_bytes=meter.peak(), peak_growth_bytes=meter.peak_growth()
        )
    write_rank_result(args.out, result, rank=rank)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- driver
def run_scenario(scenario: str, args: argparse.Namespace, shape: dict[str, int], nproc: int) -> list[dict[str, Any]]:
    from _rank_env import rank_env
    from hf_altparams.testing import launch, rank_results

    env = rank_env(args.device)
    if args.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # glibc's dynamic mmap threshold otherwise serves large tensors from a fragmenting heap
        # (see RESULTS.md, "Reading the CPU figures"): RSS would measure the allocator, not the state
        env["MALLOC_MMAP_THRESHOLD_"] = "1048576"
    with tempfile.TemporaryDirectory() as out:
        worker = [
            "--worker",
            "--scenario",
            scenario,
            "--out",
            out,
            "--device",
            args.device,
            "--shape",
            json.dumps(shape),
            "--steps",
            str(args.steps),
            "--seq",
            str(args.seq),
            "--batch",
            str(args.batch),
            "--steps-per-block",
            str(args.steps_per_block),
            "--memory-gb",
            str(args.memory_gb),
        ]
        worker += ["--checkpointing"] if args.checkpointing else []
        launch(__file__, *worker, nproc=nproc, env=env, timeout=args.timeout)
        return rank_results(out, nproc)


def largest_fitting(scenario: str, budget: int, world: int) -> tuple[int, int, int]:
    """Largest (layers, hidden) of a Llama-style shape (layers = hidden / 128) whose model state fits."""
    best = (0, 0, 0)
    for hidden in range(1024, 16385, 512):
        layers = hidden // 128
        shape = {
            "layers": layers,
            "hidden": hidden,
            "intermediate": int(hidden * 2.6875) // 64 * 64,
            "heads": hidden // 128,
            "vocab": 32000,
        }
        if planned_peak(scenario, shape, world) > budget:
            break
        best = (layers, hidden, sum(_numel(shape).values()))
    return best


def _numel(shape: dict[str, int]) -> dict[str, int]:
    h, i, v = shape["hidden"], shape["intermediate"], shape["vocab"]
    return {"layers": shape["layers"] * (4 * h * h + 3 * h * i + 2 * h), "emb": v * h, "head": v * h + h}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scenario", choices=SCENARIOS)
    parser.add_argument(
        "--scenarios",
        nargs="+",
        choices=SCENARIOS,
        default=list(SCENARIOS),
        help="which scenarios to run (default: all)",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", help="JSON LlamaConfig shape (default: CPU scaled-down / CUDA 7B)")
    parser.add_argument("--nproc", type=int, help="ranks (CPU default 2, CUDA 1)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps-per-block", type=int, default=1)
    parser.add_argument("--memory-gb", type=float, default=0.0, help="CUDA: emulate a card of this size")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing")
    parser.add_argument("--budget-gib", type=float, default=16.0, help="model-state budget for 'largest fitting'")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0

    from _machine import machine
    from tests.support.models import LLAMA_7B

    cuda = args.device == "cuda"
    if cuda:
        args.memory_gb = args.memory_gb or 24.0
        args.checkpointing = True
    shape = json.loads(args.shape) if args.shape else (dict(LLAMA_7B) if cuda else dict(CPU_SHAPE))
    nproc = args.nproc or (1 if cuda else 2)
    args.steps = args.steps or (4 if args.quick else (2 * (shape["layers"] + 2) if not cuda else 8))
    args.seq = args.seq or (512 if cuda else 32)
    where = machine(args.device, nproc)
    print(where, flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for scenario in args.scenarios:
        ranks = run_scenario(scenario, args, shape, nproc)
        worst = max(ranks, key=lambda r: r.get("peak_growth_bytes", 0))
        worst["planned_bytes"] = planned_peak(scenario, shape, nproc, steps=args.steps, host_too=not cuda)
        worst["model_state_by_rank"] = [r.get("model_state_bytes") for r in ranks]
        rows[scenario] = worst
        print(f"  {scenario}: {json.dumps({k: v for k, v in worst.items() if k != 'error'})}", flush=True)

    lines = [
        f"### Large model, {where}",
        "",
        f"Llama-style decoder {shape}, {nproc} rank(s), batch {args.batch} x seq {args.seq}, {args.steps} "
        f"steps, one block at a time (BAdam order, {args.steps_per_block} step(s) per block), AdamW"
        + (
            f", {args.memory_gb:g} GB emulated, gradient checkpointing"
            if cuda
            else ", foreach=False, glibc MALLOC_MMAP_THRESHOLD_=1048576"
        )
        + ".",
        "",
        "| scenario | model state measured"
        + (" on the GPU" if cuda else "")
        + " | planner: model state"
        + (" (device + host)" if not cuda else " on the GPU")
        + " | planner / measured | peak "
        + ("RSS growth" if not cuda else "allocated")
        + " | beyond model state "
        "| beyond it in fwd+bwd | beyond it in the step | all-reduced per step | step time | vs ddp_full step |"
        + (" kept on the host (not in the GPU figures) |" if cuda else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else ""),
    ]
    base_time = rows["ddp_full"].get("step_seconds") if "ddp_full" in rows else None
    for name, row in rows.items():
        if row.get("oom"):
            lines.append(
                f"| {name} | - | {row['planned_bytes'] / MIB:.0f} MiB | - | out of memory | - | - | - | - | - | - |"
                + (" - |" if cuda else "")
            )
            continue
        growth = row["peak_growth_bytes"] if not cuda else row["peak_bytes"]
        state = row["model_state_bytes"]
        ratio = f"{row['planned_bytes'] / state:.5f}" if state else "-"
        rel = f"{row['step_seconds'] / base_time:.2f}x" if base_time else "-"
        transients = (
            f"{row['fwd_bwd_extra_bytes'] / MIB:.1f} MiB | {row['step_extra_bytes'] / MIB:.1f} MiB"
            if not cuda
            else "- | -"
        )
        lines.append(
            f"| {name} | {state / MIB:.1f} MiB | {row['planned_bytes'] / MIB:.1f} MiB | {ratio} "
            f"| {growth / MIB:.1f} MiB | {(growth - state) / MIB:.1f} MiB | {transients} "
            f"| {row['allreduce_bytes'] / MIB:.2f} MiB | {1e3 * row['step_seconds']:.0f} ms | {rel} |"
            + (f" {row['host_state_bytes'] / MIB:.1f} MiB |" if cuda else "")
        )
    lines += [
        "",
        "Model state measured at its peak, by kind (MiB"
        + ("; on the GPU" if cuda else "")
        + "; Adam's 0-d step counters apart, the planner leaves them out):",
        "",
        "| scenario | params | buffers | DDP buckets | grads | optimizer | fp32 masters | step counters |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        if not row.get("oom"):
            kinds = row["model_state"]
            lines.append(
                f"| {name} | "
                + " | ".join(
                    f"{kinds[k] / MIB:.2f}"
                    for k in ("params", "buffers", "buckets", "grads", "optimizer", "masters", "step_counters")
                )
                + " |"
            )
    lines += [
        "",
        "Planner, Llama-2-7B shape, 8 ranks (model state per rank, before activations):",
        "",
        "| scenario | model state per rank | all-reduced per step |",
        "|---|---|---|",
    ]
    for name in SCENARIOS:
        plan = plan_for(name, dict(LLAMA_7B), 8)
        row = plan.everything if name == "ddp_full" else max(plan.phases, key=lambda r: r.device_bytes)
        lines.append(f"| {name} | {row.device_bytes / GIB:.1f} GiB | {row.allreduce_bytes / GIB:.2f} GiB |")
    budget = int(args.budget_gib * GIB)
    lines += [
        "",
        f"Largest Llama-style model whose model state fits {args.budget_gib:g} GiB per rank (planner, "
        "layers = hidden / 128, vocab 32000, 8 ranks):",
        "",
        "| scenario | layers x hidden | params |",
        "|---|---|---|",
    ]
    for name in SCENARIOS:
        layers, hidden, params = largest_fitting(name, budget, 8)
        lines.append(f"| {name} | {layers} x {hidden} | {params / 1e9:.2f} B |")
    report = "\n".join(lines) + "\n"
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"large_model_{args.device}"
    stem += "" if args.scenarios == list(SCENARIOS) else "_" + "_".join(args.scenarios)
    (out / f"{stem}.md").write_text(report)
    (out / f"{stem}.json").write_text(json.dumps({"machine": where, "shape": shape, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
