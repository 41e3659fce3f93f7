"""``python -m hf_altparams check``: the command line (flags, then a self-launch or one rank's run)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from ..errors import PlanError
from .launch import RESULTS_ENV, decide_on_rank0, launched, self_launch, write_result
from .rank import CheckOptions, RankResult, run_rank
from .verdict import Tolerances, Verdict, judge
from .workload import SCHEDULES, CheckSetup, builtin_setup, load_setup, model_setup, schedule_for

__all__ = ["build_parser", "main"]


def _positive(flag: str, kind: type = int):  # type: ignore[no-untyped-def]
    def parse(text: str):  # type: ignore[no-untyped-def]
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"`{flag}` must be a positive number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"`{flag}` must be positive, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m hf_altparams check`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m hf_altparams check",
        description="Train a short phased run on this machine's devices and ranks, then report: ranks "
                    "bit-identical after each switch, bytes all-reduced = trainable bytes, memory flat over "
                    "switches and within the plan, switch time. Exits 1 on a failure, naming the cause.",
        epilog="Without a launcher it starts its ranks itself (torchrun; accelerate launch with your config "
               "when one exists and --ranks is not given). Under torchrun or accelerate launch "
               "(`accelerate launch -m hf_altparams check ...`) it runs as one of the ranks.")
    what = p.add_argument_group("what to train (default: a built-in 8-layer Llama)")
    what.add_argument("--model", help="a transformers config JSON or checkpoint folder (read locally)")
    what.add_argument("--weights", action="store_true", help="load the checkpoint's weights (default: fresh)")
    what.add_argument("--model-class", default="AutoModelForCausalLM", help="transformers class for --model")
    what.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast --model to this dtype")
    what.add_argument("--layers", metavar="ATTR.PATH", help="the ModuleList to group (default: the largest)")
    what.add_argument("--per", type=_positive("--per"), default=1, help="layers per group")
    what.add_argument("--setup", metavar="MODULE:FUNCTION",
                      help="your own set-up: a function returning a CheckSetup or (groups, schedule)")
    sched = p.add_argument_group("the schedule (with the built-in model or --model)")
    sched.add_argument("--schedule", choices=SCHEDULES, default="lisa")
    sched.add_argument("--every", type=_positive("--every"), help="steps per phase (lisa/badam/gradual: 3, "
                                                                     "alternating: 2)")
    sched.add_argument("--k", type=_positive("--k"), default=2, help="lisa: layers drawn per phase")
    sched.add_argument("--always", help="groups trained in every phase, comma list (lisa: emb,head)")
    sched.add_argument("--seed", type=int, default=0, help="lisa/badam seed")
    run = p.add_argument_group("the run")
    run.add_argument("--steps", type=_positive("--steps"), default=60, help="optimizer steps (default 60)")
    run.add_argument("--ranks", type=_positive("--ranks"),
                     help="ranks to start (default: your Accelerate config, else the GPUs, else 2 CPU ranks)")
    run.add_argument("--fsdp2", action="store_true", help="shard with FSDP2 (also on CPU ranks)")
    run.add_argument("--warmup", type=int, default=2, help="switches left out of the memory judgement")
    run.add_argument("--timeout", type=_positive("--timeout", float), default=120.0,
                     help="seconds a rank waits for the others before reporting them lost")
    run.add_argument("--deadline", type=_positive("--deadline", float), default=900.0,
                     help="seconds the whole check may take (self-launched)")
    run.add_argument("--json", action="store_true", help="print the verdict as JSON (for CI)")
    run.add_argument("--json-out", metavar="FILE", help="also write the verdict as JSON to FILE")
    return p


def _setup_maker(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """A function building the set-up on a rank (called inside the rank's run, so its errors are reported)."""
    always = None if args.always is None else [a.strip() for a in args.always.split(",") if a.strip()]
    options = {"every": args.every, "k": args.k, "always": always, "seed": args.seed}

    def make() -> CheckSetup:
        if args.setup:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            return load_setup(args.setup, rank=rank, world=world)
        if args.model:
            model, groups = model_setup(args.model, weights=args.weights, model_class=args.model_class,
                                        dtype=args.dtype, layers=args.layers, per=args.per)
            return CheckSetup(groups, schedule_for(args.schedule, groups, **options),
                              description=f"{args.model} ({type(model).__name__}); {args.schedule}")
        return builtin_setup(args.schedule, **options)
    return make


def _check_flags(args: argparse.Namespace) -> None:
    if args.setup and args.model:
        raise PlanError("`--setup` and `--model` exclude each other: a --setup builds its own model")
    if args.weights and not args.model:
        raise PlanError("`--weights` loads the weights of `--model`; give --model PATH")
    if args.warmup < 0:
        raise PlanError(f"`--warmup` must be 0 or more, got {args.warmup}")


def _header(results: Sequence[Optional[RankResult]], how: str, args: argparse.Namespace) -> str:
    first = next((r for r in results if r is not None), None)
    if first is None:
        return f"hf_altparams check ({how}): no rank reported"
    if first.device == "?":
        return f"hf_altparams check: {first.world} rank(s) ({how}): stopped before training"
    switches = len(first.switches)
    return (f"hf_altparams check: {first.world} rank{'s' if first.world > 1 else ''} ({how}), {first.parallel} on "
            f"{first.device}; {first.description}; {len(first.steps)} of {args.steps} steps, {switches} "
            f"switches, {max(r.seconds for r in results if r is not None):.0f} s")


def _report(verdict: Verdict, args: argparse.Namespace, tail: str = "") -> int:
    print(verdict.json() if args.json else verdict.table())
    if args.json_out:
        Path(args.json_out).write_text(verdict.json())
    if not verdict.passed and tail and not args.json and any(r is None for r in verdict.ranks):
        print("\nlast lines of the launch:\n" + tail)
    return 0 if verdict.passed else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the check; returns the exit code (0 passed, 1 failed, 2 bad flags)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        _check_flags(args)
    except PlanError as err:
        print(f"python -m hf_altparams check: error: {err}", file=sys.stderr)
        return 2
    options = CheckOptions(steps=args.steps, fsdp2=args.fsdp2, timeout=args.timeout)
    if not launched():
        results, how, tail = self_launch(argv, args.ranks, args.deadline)
        verdict = judge(results, _tolerances(results, args), header=_header(results, how, args))
        return _report(verdict, args, tail)
    folder = os.environ.get(RESULTS_ENV)
    if folder:  # started by self_launch: write the result, the parent judges
        def write(result: RankResult) -> int:
            if result.rank == 0:
                (Path(folder) / "world").write_text(str(result.world))
            write_result(folder, result)
            return 0
        return run_rank(_setup_maker(args), options, write)

    def decide(results: list[Optional[RankResult]]) -> int:
        verdict = judge(results, _tolerances(results, args), header=_header(results, "launched", args))
        return _report(verdict, args)

    return run_rank(_setup_maker(args), options, lambda result: decide_on_rank0(result, decide, args.timeout))


def _tolerances(results: Sequence[Optional[RankResult]], args: argparse.Namespace) -> Optional[Tolerances]:
    first = next((r for r in results if r is not None), None)
    return None if first is None else Tolerances.for_source(first.memory_source, warmup=args.warmup)
