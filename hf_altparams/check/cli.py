"""``python -m hf_altparams check``: the command line (flags, then a self-launch or one rank's run).

:func:`main` decides what this process is (:mod:`.launch`): a rank the check
started, a rank of the user's own launcher, the one process of ``accelerate
launch``, or the check itself, which announces its launch, prices it
(:mod:`.preflight`), starts it once and judges what the ranks wrote. Exit codes:
0 passed, 1 failed (a finding, a rank's error, the deadline, a run that cannot
fit), 2 bad flags or a launch refused, 128 + the signal when interrupted (130
Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..engine.strategies import strategy_named
from ..errors import AltParamsError, Cause, PlanError
from .launch import (
    RESULTS_ENV,
    Interrupted,
    LaunchRefused,
    alone_under_accelerate,
    deadline_left,
    decide_on_rank0,
    launched,
    plan_launch,
    self_launch,
    signals_interrupt,
    started_by_check,
    write_result,
)
from .preflight import price_check
from .rank import CheckOptions, RankResult, run_rank
from .verdict import CAUSES, Tolerances, Verdict, judge
from .watch import ProgressFile
from .workload import (
    CHECK_DEFAULTS,
    SCHEDULES,
    TASKS,
    CheckSetup,
    builtin_setup,
    load_setup,
    model_setup,
    model_task,
    schedule_for,
)
from .zero import deepspeed_config, refusal, stage_of, strategy_config, strategy_name

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
        epilog="Without a launcher it starts its ranks itself, once, and says how: --ranks N (torchrun) > an "
        "Accelerate config (--accelerate-config, else your default one: accelerate launch) > the GPUs > 2 "
        "CPU ranks (torchrun). A config that would start one process where it asks for several is refused "
        "(exit 2). Under torchrun or accelerate launch (`accelerate launch -m hf_altparams check ...`) it "
        "runs as one of the ranks, or as the one process such a launch started. Exit codes: 0 passed, 1 "
        "failed, 2 bad flags or launch refused, 130 Ctrl-C, 143 SIGTERM.",
    )
    what = p.add_argument_group("what to train (default: a built-in 8-layer Llama)")
    what.add_argument("--model", help="a transformers config JSON or checkpoint folder (read locally)")
    what.add_argument("--weights", action="store_true", help="load the checkpoint's weights (default: fresh)")
    what.add_argument(
        "--task",
        choices=list(TASKS),
        help="the head --model trains (default: from the config's architectures, else the first of these it has)",
    )
    what.add_argument("--model-class", help="transformers class for --model (default: the task's auto class)")
    what.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast --model to this dtype")
    what.add_argument("--layers", metavar="ATTR.PATH", help="the ModuleList to group (default: the largest)")
    what.add_argument("--per", type=_positive("--per"), default=1, help="layers per group")
    what.add_argument(
        "--setup",
        metavar="MODULE:FUNCTION",
        help="your own set-up: a function returning a CheckSetup or (groups, schedule)",
    )
    SCHEDULES.add_flags(
        p.add_argument_group(
            "the schedule (with the built-in model or --model)",
            "the kinds and flags of hf_altparams.plan.SCHEDULES, the same as the planner's, with check's own "
            "defaults (hf_altparams.check.workload.CHECK_DEFAULTS; docs/check.md)",
        ),
        CHECK_DEFAULTS,
    )
    run = p.add_argument_group("the run")
    run.add_argument("--steps", type=_positive("--steps"), default=60, help="optimizer steps (default 60)")
    run.add_argument(
        "--ranks",
        type=_positive("--ranks"),
        help="ranks to start with torchrun (with --accelerate-config: accelerate launch's "
        "--num_processes); default: your Accelerate config, else the GPUs, else 2 CPU ranks",
    )
    run.add_argument(
        "--accelerate-config",
        metavar="FILE",
        help="start the ranks with `accelerate launch --config_file FILE` (default: your default "
        "Accelerate config, where one exists and --ranks is not given)",
    )
    run.add_argument(
        "--no-preflight",
        action="store_true",
        help="start the ranks without pricing their memory first (the pre-flight refuses a run "
        "that cannot fit in this machine's memory)",
    )
    run.add_argument(
        "--strategy",
        metavar="{" + ",".join(CONFIGURABLE) + "}",
        help="the registered strategy to run (default: as Accelerate is configured); fsdp2: shard "
        "with FSDP2, also on CPU ranks; zero1, zero2: DeepSpeed ZeRO at that stage (as --deepspeed 1, 2)",
    )
    run.add_argument("--fsdp2", action="store_true", help="the same as --strategy fsdp2")
    run.add_argument(
        "--deepspeed",
        metavar="CONFIG|STAGE",
        help="train under DeepSpeed ZeRO through Accelerate's DeepSpeedPlugin, also on CPU ranks: a DeepSpeed "
        "config file (JSON) or a ZeRO stage (1, 2; the library refuses 3, and so does the check, with its "
        "reason); --strategy zero1 / zero2 is the same as the stage",
    )
    run.add_argument("--warmup", type=int, default=2, help="switches left out of the memory judgement")
    run.add_argument(
        "--run-steps",
        type=_positive("--run-steps"),
        default=10_000,
        help="optimizer steps of the run you plan: memory growing per step is projected to its end "
        "(default 10,000: a fine-tuning run of a few epochs)",
    )
    run.add_argument(
        "--timeout",
        type=_positive("--timeout", float),
        default=120.0,
        help="seconds a rank waits for the others before reporting them lost",
    )
    run.add_argument(
        "--deadline",
        type=_positive("--deadline", float),
        default=900.0,
        help="seconds the whole check may take (self-launched); past it every process is stopped "
        "and the check fails naming how far each rank got",
    )
    run.add_argument("--json", action="store_true", help="print the verdict as JSON (for CI)")
    run.add_argument("--json-out", metavar="FILE", help="also write the verdict as JSON to FILE")
    return p


def _setup_maker(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """A function building the set-up on a rank (called inside the rank's run, so its errors are reported)."""
    kind, options = SCHEDULES.given(args)
    name = kind if kind is not None else str(CHECK_DEFAULTS.schedule)

    def make() -> CheckSetup:
        if args.setup:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            return load_setup(args.setup, rank=rank, world=world)
        if args.model:
            model, groups = model_setup(
                args.model,
                weights=args.weights,
                model_class=args.model_class,
                task=args.task,
                dtype=args.dtype,
                layers=args.layers,
                per=args.per,
            )
            return CheckSetup(
                groups,
                schedule_for(name, groups, **options),
                description=f"{args.model} ({type(model).__name__}, {model_task(model) or 'no known head'}); {name}",
            )
        return builtin_setup(name, **options)

    return make


#: The strategies the check sets up itself through Accelerate (``--strategy``): plain DDP, FSDP2's plugin, or
#: DeepSpeed's plugin at a ZeRO stage (:data:`ZERO_STAGES`).
CONFIGURABLE = ("ddp", "fsdp2", "zero1", "zero2", "zero3")

#: The ZeRO stage of each DeepSpeed strategy ``--strategy`` names (zero3: set up, and refused as the library
#: refuses it, with its reason).
ZERO_STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def _check_flags(args: argparse.Namespace) -> None:
    if args.setup and args.model:
        raise PlanError("`--setup` and `--model` exclude each other: a --setup builds its own model")
    if args.weights and not args.model:
        raise PlanError("`--weights` loads the weights of `--model`; give --model PATH")
    if args.warmup < 0:
        raise PlanError(f"`--warmup` must be 0 or more, got {args.warmup}")
    kind, options = SCHEDULES.given(args)
    if args.setup and (kind or options):
        flags = (["--schedule"] if kind else []) + [SCHEDULES.option(o).flag for o in options]
        raise PlanError(f"`--setup` builds its own schedule: leave out {', '.join(flags)}")
    SCHEDULES.resolve(kind, options, CHECK_DEFAULTS)  # before any rank starts; the groups are checked on the ranks
    args.deepspeed_config = None if args.deepspeed is None else deepspeed_config(args.deepspeed)
    if args.strategy is not None:
        name = strategy_named(args.strategy, argument="`--strategy`").name
        if name not in CONFIGURABLE:
            raise PlanError(
                f"`--strategy {args.strategy}`: the check sets up {list(CONFIGURABLE)} through "
                f"Accelerate; run {name} under your own launcher and config instead"
            )
        if args.fsdp2 and name != "fsdp2":
            raise PlanError(f"`--fsdp2` and `--strategy {args.strategy}` disagree; give one of them")
        if args.deepspeed_config is not None and name != strategy_name(args.deepspeed_config):
            raise PlanError(
                f"`--deepspeed {args.deepspeed}` (ZeRO stage {stage_of(args.deepspeed_config)}) and "
                f"`--strategy {args.strategy}` disagree; give one of them"
            )
        if name in ZERO_STAGES and args.deepspeed_config is None:
            args.deepspeed_config = strategy_config(ZERO_STAGES[name])
        args.fsdp2 = name == "fsdp2"  # with deepspeed_config, the flags the rest of the check reads
    if args.fsdp2 and args.deepspeed_config is not None:
        raise PlanError("`--fsdp2` and `--deepspeed` exclude each other: FSDP2 or DeepSpeed ZeRO, not both")
    for flag in ("task", "model_class"):
        if getattr(args, flag) and not args.model:
            raise PlanError(f"`--{flag.replace('_', '-')}` says how to build `--model`; give --model PATH")


def _header(results: Sequence[Optional[RankResult]], how: str, args: argparse.Namespace) -> str:
    first = next((r for r in results if r is not None), None)
    if first is None:
        return f"hf_altparams check ({how}): no rank reported"
    if first.device == "?":
        return f"hf_altparams check: {first.world} rank(s) ({how}): stopped before training"
    switches = len(first.switches)
    model = f"{first.model_class}: " if first.model_class and first.model_class not in first.description else ""
    accumulation = f", {first.accumulation} micro-batches per step" if first.accumulation > 1 else ""
    return (
        f"hf_altparams check: {first.world} rank{'s' if first.world > 1 else ''} ({how}), {first.parallel} on "
        f"{first.device}; {model}{first.description}; {_precision(first)}; {len(first.steps)} of {args.steps} "
        f"steps{accumulation}, {switches} switches, {max(r.seconds for r in results if r is not None):.0f} s"
    )


def _precision(result: RankResult) -> str:
    """``fp32 weights, mixed precision no`` (the weights' dtypes, most first; Accelerate's mixed precision)."""
    if not result.precision:
        return "precision not read"
    dtypes = result.precision.get("dtypes", {})
    weights = " + ".join(name if share >= 0.9995 else f"{name} ({share:.0%})" for name, share in dtypes.items())
    mixed = result.precision.get("mixed_precision", "?")
    computes = {"bf16": " (autocast to bf16)", "fp16": " (autocast to fp16)"}.get(mixed, "")
    return f"{weights or '?'} weights, mixed precision {mixed}{computes}"


def _report(verdict: Verdict, args: argparse.Namespace, tail: str = "") -> int:
    print(verdict.json() if args.json else verdict.table())
    if args.json_out:
        Path(args.json_out).write_text(verdict.json())
    if not verdict.passed and tail and not args.json and any(r is None for r in verdict.ranks):
        print("\nlast lines of the launch:\n" + tail)
    return 0 if verdict.passed else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the check; returns the exit code (0 passed, 1 failed, 2 bad flags or launch refused, 128 + signal)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        _check_flags(args)
    except PlanError as err:
        print(f"python -m hf_altparams check: error: {err}", file=sys.stderr)
        return 2
    if args.deepspeed_config is not None and not started_by_check():
        refused = refusal(args.deepspeed_config)
        if refused is not None:  # the library's refusal table, before any rank starts (exit 2, as a bad flag)
            return _refuse(
                args, Cause.STRATEGY_REFUSED, refused, header="hf_altparams check: refused before any rank started"
            )
        if importlib.util.find_spec("deepspeed") is None:
            print(
                "python -m hf_altparams check: error: `--deepspeed` trains under DeepSpeed, which is not installed "
                "here: `pip install hf_altparams[deepspeed]`",
                file=sys.stderr,
            )
            return 2
    options = CheckOptions(steps=args.steps, fsdp2=args.fsdp2, timeout=args.timeout, deepspeed=args.deepspeed_config)
    if started_by_check():  # a rank of the check's own launch: train, write, never launch
        folder = os.environ[RESULTS_ENV]
        rank = int(os.environ.get("RANK", "0"))

        def write(result: RankResult) -> int:
            write_result(folder, result)
            return 0

        return run_rank(_setup_maker(args), options, write, progress=ProgressFile(folder, rank))
    if launched() or alone_under_accelerate():
        how = (
            "launched"
            if launched()
            else (
                "the one process accelerate launch started: it set no WORLD_SIZE, as it does for a config of "
                "distributed_type NO or MULTI_CPU; nothing else was started"
            )
        )

        def decide(results: list[Optional[RankResult]]) -> int:
            verdict = judge(results, _tolerances(results, args), header=_header(results, how, args))
            return _report(verdict, args)

        return run_rank(_setup_maker(args), options, lambda result: decide_on_rank0(result, decide, args.timeout))
    return _launch_and_judge(argv, args)


def _launch_and_judge(argv: Sequence[str], args: argparse.Namespace) -> int:
    """Announce the launch, price it, start it once, judge what the ranks wrote; stopped on a signal."""
    started = time.monotonic()
    try:
        with signals_interrupt():
            plan = plan_launch(argv, args.ranks, args.accelerate_config)
            print(plan.line(), file=sys.stderr, flush=True)
            priced = _preflight(args, plan.processes)
            outcome = self_launch(
                plan,
                deadline_left(started, args.deadline),
                args.steps,
                priced,
                allowed=args.deadline,
                deepspeed=args.deepspeed_config is not None,
            )
    except LaunchRefused as refused:  # the launch (exit 2) or the pre-flight (exit 1) refused it
        return _refuse(args, refused.cause, refused.detail)
    except (PlanError, AltParamsError) as err:
        print(f"python -m hf_altparams check: error: {err}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        print(
            f"hf_altparams check: interrupted by {stop}: stopped every process it started; no verdict",
            file=sys.stderr,
            flush=True,
        )
        if args.json:
            _refuse(
                args,
                Cause.INTERRUPTED,
                f"interrupted by {stop} after {time.monotonic() - started:.0f} s",
                header="hf_altparams check: interrupted",
            )
        return stop.exit_code
    results = outcome.results
    verdict = judge(
        results, _tolerances(results, args), header=_header(results, plan.how, args), stopped=outcome.stopped
    )
    return _report(verdict, args, outcome.tail)


def _preflight(args: argparse.Namespace, processes: int) -> Optional[str]:
    """Price the run (:mod:`.preflight`) and say so in one line; its price, or ``None`` when not priced.

    Raises:
        LaunchRefused: ``wont_fit`` (it cannot fit) or ``setup_refused`` (the flags build no model).
    """
    if args.no_preflight or args.setup:
        why = (
            "--no-preflight"
            if args.no_preflight
            else ("a --setup builds its model in your code, so it cannot be priced before it runs")
        )
        print(f"pre-flight: skipped ({why})", file=sys.stderr, flush=True)
        return None
    kind, options = SCHEDULES.given(args)
    try:
        price = price_check(
            args.model,
            ranks=processes,
            steps=args.steps,
            fsdp2=args.fsdp2,
            strategy=None if args.deepspeed_config is None else strategy_name(args.deepspeed_config),
            model_class=args.model_class,
            task=args.task,
            dtype=args.dtype if args.model else None,
            layers=args.layers,
            per=args.per,
            schedule=kind,
            schedule_options=options,
        )
    except PlanError as err:
        raise LaunchRefused(Cause.SETUP_REFUSED, str(err)) from err
    except Exception as err:  # a model the planner cannot price: the ranks will build it and say what fails
        print(
            f"pre-flight: this model cannot be priced ({type(err).__name__}: {str(err)[:300]}); skipped",
            file=sys.stderr,
            flush=True,
        )
        return None
    print(price.line(), file=sys.stderr, flush=True)
    if not price.fits:
        raise LaunchRefused(Cause.WONT_FIT, price.refusal(dtype=args.dtype, fsdp2=args.fsdp2))
    return price.summary()


def _refuse(
    args: argparse.Namespace, cause: Cause, detail: str, header: str = "hf_altparams check: stopped before training"
) -> int:
    """Report a check stopped before the ranks gave a verdict (refused, interrupted); its exit code.

    2 for a launch refused (like a bad flag): a config that starts one process, a
    strategy the library refuses (``--deepspeed 3``); 1 for what the pre-flight
    refused (a failure of the run: ``wont_fit``, ``setup_refused``).
    """
    failure: dict[str, Any] = {"cause": cause, "rank": None, "detail": detail}
    verdict = judge([], header=header, stopped=[failure])
    if args.json_out:
        Path(args.json_out).write_text(verdict.json())
    if args.json:
        print(verdict.json())
    else:
        title, fix = CAUSES[cause]
        print(f"{verdict.header}\n\nFAILED: {title} ({cause}): {detail}\n  fix: {fix}")
    return 2 if cause in (Cause.LAUNCH_STARTS_ONE_PROCESS, Cause.STRATEGY_REFUSED) else 1


def _tolerances(results: Sequence[Optional[RankResult]], args: argparse.Namespace) -> Optional[Tolerances]:
    first = next((r for r in results if r is not None), None)
    return (
        None
        if first is None
        else Tolerances.for_source(first.memory_source, warmup=args.warmup, run_steps=args.run_steps)
    )
