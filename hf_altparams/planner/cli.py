"""``python -m hf_altparams plan`` (``python -m hf_altparams.planner``): the planner's command line.

Parses the flags, builds the model on ``meta`` (:func:`~hf_altparams.planner.build_model`),
its parameter groups and the schedule (its kinds and flags are those of the one schedule
registry, :data:`hf_altparams.plan.SCHEDULES`, which ``check`` reads too), and prints what
:func:`~hf_altparams.planner.plan_cost` reports. :mod:`hf_altparams.planner`
re-exports :func:`main`, :func:`build_from_argv` and :func:`plan_from_argv`.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import PlanError
from ..plan import SCHEDULES, ParamGroups, Schedule, TrainShareWarning
from .cost import DEFAULT_PCIE_GBPS, OPTIMIZER_STATES, POLICIES, OptimizerSpec, backends, plan_cost
from .hardware import BF16_ENV
from .model import build_model, dtype_from_name
from .report import CostPlan

__all__ = ["SCHEDULES", "build_from_argv", "build_parser", "main", "plan_from_argv"]

_DTYPE_METAVAR = "{bf16,fp16,fp32,bfloat16,float16,float32}"


def _dtype_flag(flag: str) -> Callable[[str], torch.dtype]:
    """An argparse ``type=`` for a dtype flag: the names :func:`dtype_from_name` accepts."""

    def parse(text: str) -> torch.dtype:
        try:
            return dtype_from_name(text, f"`{flag}`")
        except PlanError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = flag  # argparse names the type in some messages
    return parse


def _device_flag(text: str) -> Optional[str]:
    """An argparse ``type=`` for ``--device``: ``plan_cost``'s ``bf16_check`` (``none``: ``None``)."""
    value = text.strip().lower()
    if value == "none":
        return None
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"`--device` must be auto, cpu, cuda, cuda:N or none, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m hf_altparams plan`` argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m hf_altparams plan",
        description="Print what a schedule costs per phase: trainable parameters, bytes all-reduced per "
        "step and device memory, against training everything. The model is built on the "
        "meta device (no memory).",
    )
    p.add_argument("--model", required=True, help="config JSON, checkpoint folder, or pkg.module:factory")
    p.add_argument("--model-class", default="AutoModel", help="transformers class for a config (AutoModel)")
    p.add_argument(
        "--dtype", type=_dtype_flag("--dtype"), metavar=_DTYPE_METAVAR, help="cast the parameters to this dtype"
    )
    p.add_argument(
        "--group",
        action="append",
        default=[],
        metavar="NAME=PATTERN[,PATTERN...]",
        help="a parameter group (repeatable); globs, or 're:' regexes",
    )
    p.add_argument("--layers", metavar="ATTR.PATH", help="one group per --per layers of this ModuleList")
    p.add_argument("--per", type=int, default=1, help="layers per group with --layers")
    p.add_argument("--prefix", default="layer", help="layer group name prefix with --layers")
    p.add_argument("--ungrouped", choices=["frozen", "trainable", "error"], default="frozen")
    p.add_argument("--steps", type=int, help="positions to list (default: one period or up to the last phase)")
    p.add_argument(
        "--optimizer",
        default="adamw",
        help=f"one of {', '.join(OPTIMIZER_STATES)}, or state bytes per parameter (e.g. 2)",
    )
    p.add_argument(
        "--state-policy",
        choices=list(POLICIES),
        help="idle groups' optimizer state (default: the run's: drop for lisa and badam, else keep)",
    )
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument(
        "--grad-dtype",
        type=_dtype_flag("--grad-dtype"),
        metavar=_DTYPE_METAVAR,
        help="gradient dtype (default: the parameters')",
    )
    p.add_argument(
        "--storage-dtype",
        type=_dtype_flag("--storage-dtype"),
        metavar=_DTYPE_METAVAR,
        help="low-precision storage (PrecisionOptimizer): params and grads in this dtype, fp32 "
        "masters and optimizer state for the groups that train",
    )
    p.add_argument(
        "--master-policy",
        choices=list(POLICIES),
        help="with --storage-dtype: where an idle group's fp32 master goes (default: the run's: drop "
        "for lisa and badam, else offload)",
    )
    p.add_argument(
        "--allreduce-dtype",
        type=_dtype_flag("--allreduce-dtype"),
        metavar=_DTYPE_METAVAR,
        help="all-reduce the gradients in this dtype (PrecisionOptimizer allreduce_dtype; "
        "default: the gradients' dtype)",
    )
    p.add_argument("--bucket-as-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    p.add_argument(
        "--strategy",
        default=None,
        metavar="{" + ",".join(backends()) + "}",
        help="the registered strategy to price (default: ddp); fsdp2: bytes per rank with the model "
        "sharded by fully_shard over --world-size ranks, next to DDP's; local: one process",
    )
    p.add_argument("--fsdp2", action="store_true", help="the same as --strategy fsdp2")
    p.add_argument(
        "--nonresident-on-device",
        action="store_true",
        help="non-resident groups stay on the device (PhaseSwitcher offload_device=None)",
    )
    p.add_argument("--pcie-gbps", type=float, default=DEFAULT_PCIE_GBPS, help="host<->device GB/s assumed")
    p.add_argument(
        "--device",
        type=_device_flag,
        default="auto",
        metavar="{auto,cpu,cuda,cuda:N,none}",
        help="where the run computes, checked for bf16 speed when the plan computes in bf16 "
        "(--storage-dtype bf16 or --dtype bf16): auto (a visible GPU, else this CPU), cpu, cuda, "
        f"cuda:N, or none (planning for another machine: no check); {BF16_ENV}=fast|slow "
        "forces the verdict",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    SCHEDULES.add_flags(
        p.add_argument_group(
            "the schedule", "the kinds and flags of hf_altparams.plan.SCHEDULES, the same in `check` (docs/planner.md)"
        )
    )
    return p


def _names(text: Optional[str]) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def _groups_from_args(args: argparse.Namespace, model: nn.Module) -> ParamGroups:
    specs: dict[str, list[str]] = {}
    for item in args.group:
        name, eq, patterns = item.partition("=")
        if not eq or not name.strip() or not _names(patterns):
            raise PlanError(f"`--group` must look like NAME=PATTERN[,PATTERN...], got {item!r}")
        specs[name.strip()] = _names(patterns)
    if args.layers:
        return ParamGroups.from_layers(
            model, args.layers, per=args.per, prefix=args.prefix, extra=specs, ungrouped=args.ungrouped
        )
    if not specs:
        raise PlanError("no groups: pass `--group NAME=PATTERN` (repeatable) and/or `--layers ATTR.PATH`")
    return ParamGroups(model, specs, ungrouped=args.ungrouped)


def _schedule_from_args(args: argparse.Namespace, groups: ParamGroups) -> Schedule:
    """The schedule the flags name, built through the schedule registry (no defaults of the planner's own)."""
    kind, given = SCHEDULES.given(args)
    return SCHEDULES.build(kind, groups, given)


def _optimizer_arg(text: str) -> OptimizerSpec:
    try:
        return float(text)
    except ValueError:
        return text


def build_from_argv(
    argv: Sequence[str], *, device: str = "meta"
) -> tuple[argparse.Namespace, nn.Module, ParamGroups, Schedule]:
    """Parse ``plan`` arguments and build the model (on ``device``), its groups and the schedule.

    Raises:
        PlanError: on any invalid flag value (the message names the flag).
        SystemExit: on argparse errors (unknown flag, bad choice).
    """
    args = build_parser().parse_args(list(argv))
    model = build_model(args.model, model_class=args.model_class, dtype=args.dtype, device=device)
    groups = _groups_from_args(args, model)
    return args, model, groups, _schedule_from_args(args, groups)


def plan_from_argv(argv: Sequence[str]) -> tuple[argparse.Namespace, CostPlan]:
    """Parse ``plan`` arguments, build the model on ``meta`` and cost the schedule.

    Example:
        >>> args, plan = plan_from_argv(["--model", "torch.nn:PReLU", "--group", "slope=weight",
        ...                               "--schedule", "sequence", "--phase", "slope:10"])
        >>> [(row.phase, row.ranges, row.allreduce_bytes) for row in plan.phases]
        [('slope', [(0, 10)], 4)]
    """
    args, model, groups, schedule = build_from_argv(argv)
    plan = plan_cost(
        model,
        groups,
        schedule,
        optimizer=_optimizer_arg(args.optimizer),
        state_policy=args.state_policy,
        steps=args.steps,
        world_size=args.world_size,
        grad_dtype=args.grad_dtype,
        bucket_as_view=args.bucket_as_view,
        pcie_gbps=args.pcie_gbps,
        offload_nonresident=not args.nonresident_on_device,
        storage_dtype=args.storage_dtype,
        master_policy=args.master_policy,
        backend=_strategy_arg(args.strategy, args.fsdp2),
        allreduce_dtype=args.allreduce_dtype,
        bf16_check=args.device,
    )
    return args, plan


def _strategy_arg(strategy: Optional[str], fsdp2: bool) -> str:
    """``--strategy`` (default ``ddp``), or ``fsdp2`` for the old ``--fsdp2``; refused when they disagree."""
    if fsdp2 and strategy not in (None, "fsdp2"):
        raise PlanError(f"`--fsdp2` and `--strategy {strategy}` disagree; give one of them")
    return "fsdp2" if fsdp2 else (strategy or "ddp")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hf_altparams plan ...``: print the cost table (or JSON); exit 2 on bad input.

    Example::

        python -m hf_altparams plan --model path/to/checkpoint --layers encoder.layer \\
            --group emb='embeddings.*' --schedule gradual --every 100 --state-policy offload
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        with warnings.catch_warnings():  # the table and the JSON ("trained": {"warning": ...}) carry it
            warnings.simplefilter("ignore", TrainShareWarning)
            args, plan = plan_from_argv(argv)
    except PlanError as err:
        build_parser().error(str(err))
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.table())
    return 0
