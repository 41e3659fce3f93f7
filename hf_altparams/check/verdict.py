"""The judge of ``check``: every rank's readings in, a pass or a named failure out, as a table or JSON.

What is judged (each a :class:`Finding`, ``status`` pass / fail / info):

* **ranks start equal**: every group's digest compared across the ranks as the
  set-up built them, before ``prepare``. Different weights (a set-up that does
  not seed the model's construction) are a note under DDP, whose constructor
  copies rank 0's weights to every rank, and a failure (``unseeded_setup``)
  where nothing makes them equal (FSDP2 sharding each rank's own weights).
* **ranks identical**: the switch's drift check compared every parameter's
  digest across the ranks after every switch and at the end; a difference is a
  :class:`~hf_altparams.errors.DriftError` on every rank.
* **bytes all-reduced = trainable bytes**: per step, what the counting comm hook
  saw all-reduced against the bytes the trainable parameters' gradients hold
  (FSDP2: reduce-scattered against the switch's own figure for the phase). Any
  other figure means gradients of frozen parameters cross the network, or
  trainable ones do not.
* **memory flat after warm-up**: after each switch the rank's memory minus what
  the memory model predicts for the new phase (the residual, what the plan does
  not explain). Its trend over the switches after warm-up: the median of the
  last third against the median of the first third. Growth beyond the tolerance
  is a leak; the rank and the figure are named.
* **memory per step**: the memory held at the end of each optimizer step minus
  the plan's figure for its phase, over the later half of the steps after
  warm-up: its growth per step (the Theil-Sen slope, the median of the slopes
  between every two readings, which a few outliers cannot move; its lower
  confidence bound is what is projected), when it is steady (both halves of
  that window grow), projected to the end of the run the user plans
  (``--run-steps``). It fails
  (``memory_grows_per_step``) when the projection would take the memory held
  beyond what the plan allows, or beyond what the device has left.
* **memory against the plan**: the memory held at the end of each step
  (weights, gradients, optimizer state; activations gone) against the plan's
  figure for the phase (``expected_peak``), after warm-up. The detail says what
  the reading counts and, at the end of the run, what it is made of (the
  model's weights, gradients, optimizer state, other tensors, the rest).
* **idle groups unchanged**: each group's weights on each rank when it goes
  idle against the next reading (every switch, the end): a group that does
  not train must not change (``idle_group_changed``), which no comparison
  across ranks can see when every rank changes it alike.
* **idle optimizer state as its policy says**: after each switch, the state the
  optimizer itself holds on the training device for idle groups whose policy
  sends it away (``drop``; ``offload`` too on a GPU) must be none.
* **switch share**: switch seconds over step seconds (information).

Failures are named by cause (:data:`CAUSES`, one entry per
:class:`~hf_altparams.errors.Cause`): the cause the error or warning a rank
recorded carries (never read from its message), or what the launch itself saw
(the deadline, a rank the kernel killed, a launch or pre-flight refused:
:func:`judge`'s ``stopped``); each cause carries what usually produces it and
the fix.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from ..errors import Cause
from ..plan.groups import format_bytes
from .rank import Failure, RankResult, StepRow

__all__ = ["CAUSES", "Finding", "Tolerances", "Verdict", "classify", "judge"]

#: Failure causes: id -> (title, what to do); every :class:`~hf_altparams.errors.Cause` has one.
CAUSES: dict[Cause, tuple[str, str]] = {
    Cause.REQUIRES_GRAD_BEHIND_SCHEDULE: (
        "requires_grad changed behind the schedule",
        "code outside the schedule turns requires_grad on or off (a callback, `model.requires_grad_()`, peft's "
        "`set_adapter`); let the schedule own it: remove that code or put those parameters in the groups",
    ),
    Cause.OPTIMIZER_MISSES_PARAMETERS: (
        "the optimizer does not hold what the schedule trains",
        "build the optimizer over every parameter the schedule trains, frozen now or not "
        "(`AdamW(model.parameters())`), on the model that is prepared",
    ),
    Cause.SCHEDULE_DIFFERS_PER_RANK: (
        "the schedule differs between ranks",
        "build the same schedule on every rank: the same arguments and seed (not one derived from the rank)",
    ),
    Cause.RANKS_DRIFT: (
        "the ranks hold different weights",
        "something updates one rank's weights alone (a gradient DDP never reduced, user code writing weights on "
        "one rank); the message names the groups and ranks",
    ),
    Cause.TRAINABLE_PARAM_UNUSED: (
        "a trainable parameter got no gradient under DDP",
        "the forward skipped some of the phase's trainable parameters while DDP runs with "
        "`find_unused_parameters=False`, so their gradients were never all-reduced; if the forward skips them on "
        "purpose (a branch, a task head unused by the batch), pass `find_unused_parameters=True` "
        "(`PhasedAccelerator(find_unused_parameters=True)`, `TrainingArguments(ddp_find_unused_parameters=True)`, "
        "in the check `CheckSetup(ddp={'find_unused_parameters': True})`); "
        "if the loop ran the wrong branch or task for the phase, fix the loop; if they should not train in that "
        "phase, move them out of its groups",
    ),
    Cause.LOSS_REACHES_NO_TRAINABLE: (
        "the loss depends on no parameter the phase trains",
        "the step's forward skipped the phase's groups (another task or adapter active, the loss computed "
        "without grad, reentrant gradient checkpointing behind frozen layers); the message lists each cause "
        "with its fix",
    ),
    Cause.MEMORY_GROWS: (
        "memory grows from switch to switch",
        "something keeps memory at every switch (user code holding tensors, a leaking reducer); the figure is "
        "the growth after warm-up beyond what the plan predicts",
    ),
    Cause.MEMORY_GROWS_PER_STEP: (
        "memory grows from step to step",
        "something keeps memory at every optimizer step (user code holding tensors or losses with their graphs, "
        "a growing cache); the figures are the growth per step and where it takes the run by its last step",
    ),
    Cause.MEMORY_OVER_PLAN: (
        "memory held beyond the plan",
        "the rank holds more at the end of a step than the model's weights, gradients and optimizer state the "
        "plan counts: the detail says what the reading counts and what held it at the end (tensors of other "
        "code: a cache, a list, a copy of the weights; optimizer state the plan does not expect; the rest, "
        "memory that is no tensor)",
    ),
    Cause.IDLE_STATE_HELD: (
        "idle groups' optimizer state stays on the device",
        "the policy says drop (lisa, badam) or offload, but the optimizer still holds that state on the device: "
        "an optimizer whose state the library cannot see (a wrapper keeping its own), or a library fault",
    ),
    Cause.IDLE_GROUP_CHANGED: (
        "a group changed while it was idle",
        "code outside the schedule writes the weights of groups that do not train in the phase (weight decay "
        "or momentum applied to frozen parameters, an EMA, a load), or freezes groups itself where the "
        "optimizer still steps them (a LISA callback of one's own under DeepSpeed ZeRO, whose optimizer "
        "steps every partition it was built with); let the schedule freeze (hf_altparams' lisa / badam "
        "schedules) and only the phase's groups change",
    ),
    Cause.BYTES_MISMATCH: (
        "bytes all-reduced differ from the trainable bytes",
        "DDP reduces other gradients than the phase's: a wrapper built outside the library, or a comm hook",
    ),
    Cause.UNSEEDED_SETUP: (
        "the set-up builds something different on each rank",
        "seed what the set-up builds (`torch.manual_seed(0)` before the model, the same schedule seed on every "
        "rank), so that every rank starts from the same weights and phases",
    ),
    Cause.RANK_LOST: ("a rank stopped or stopped answering", "another rank failed or hangs; read that rank's failure"),
    Cause.SETUP_REFUSED: (
        "the set-up was refused before training",
        "the message names the argument and what is accepted",
    ),
    Cause.STRATEGY_REFUSED: (
        "the parallel strategy cannot run phases",
        "the message names the strategy or setting the phases cannot drive (DeepSpeed ZeRO-3, stage 0, offload "
        "or an `optimizer` section; FSDP1; a whole-model compile) and why; train with what it names instead: "
        "ZeRO-1/2 without offload (`--deepspeed 2`), FSDP2 (`FullyShardedDataParallelPlugin(fsdp_version=2)`) "
        "or plain DDP",
    ),
    Cause.OUT_OF_MEMORY: (
        "a rank ran out of memory",
        "the run needs more memory than the device (or host) has (the kernel's out-of-memory killer ends a process "
        "with SIGKILL): `python -m hf_altparams plan` shows the peak per phase; train fewer groups at once, offload "
        "idle state, or use a smaller batch; in the check: fewer `--ranks`, `--dtype bf16`, `--fsdp2`, or a "
        "smaller model",
    ),
    Cause.WONT_FIT: (
        "the run would not fit in memory",
        "the plan's peak for some phase (or the model each rank builds) exceeds the memory there is; train fewer "
        "groups at once, offload idle state, or use a smaller batch (`python -m hf_altparams plan`); in the "
        "check: fewer `--ranks`, `--dtype bf16`, `--fsdp2`, a smaller model, or `--no-preflight` to try anyway",
    ),
    Cause.DEADLINE: (
        "the check ran past its deadline",
        "a rank hangs (a collective some rank never reached) or the run is slower than `--deadline` allows; "
        "read each rank's last step, or give more time",
    ),
    Cause.INTERRUPTED: (
        "the check was interrupted",
        "it was stopped from outside (Ctrl-C, a signal) before the ranks reported; run it again",
    ),
    Cause.LAUNCH_STARTS_ONE_PROCESS: (
        "the launch starts one process where several ranks are wanted",
        "`accelerate launch` starts ONE process for a config of distributed_type NO or MULTI_CPU, and for "
        "`--cpu --num_processes N`: use distributed_type MULTI_GPU (or `--multi_gpu`) with ACCELERATE_USE_CPU=1 "
        "on a CPU machine, or torchrun (`ACCELERATE_USE_CPU=1 torchrun --nproc_per_node N`; `--ranks N` in the "
        "check)",
    ),
    Cause.ERROR: ("the run raised an error", "see the message"),
}


@dataclass(frozen=True)
class Tolerances:
    """What counts as flat and as within the plan, per memory source.

    Attributes:
        warmup: switches whose readings are left out (first-touch pages, caches).
        growth: bytes the residual may grow after warm-up.
        growth_share: plus this share of the largest prediction.
        over_plan_share: the memory held may exceed the plan by this share ...
        over_plan: ... plus these bytes (allocator blocks, library workspaces;
            on a CPU the pages of the libraries first touched by training).
        step_growth: growth per optimizer step left out of the projection. On a
            CPU the resident set grows a few KiB a step with the run's own
            records (the switch history, the check's rows: 4-7 KiB a step
            measured with a switch at every step), and in the first ~75 steps
            of an FSDP2 run by up to 60 KiB a step of memory that is not
            tensors, which then flattens (measured over 160 steps): neither
            is a leak.
        run_steps: the optimizer steps of the run the user plans: the growth per
            step is projected to its end (``--run-steps``; default 10,000, a
            fine-tuning run of a few epochs, where a leak of a few hundred KiB
            a step that 60 steps hide takes gigabytes).
    """

    warmup: int
    growth: int
    growth_share: float
    over_plan_share: float
    over_plan: int
    step_growth: int = 0
    run_steps: int = 10_000

    @classmethod
    def for_source(cls, source: str, warmup: int = 2, run_steps: int = 10_000) -> Tolerances:
        """The defaults for ``"torch.cuda.memory_allocated"`` (exact) or ``"RSS"`` (coarse)."""
        if source == "RSS":
            return cls(
                warmup=warmup,
                growth=16 << 20,
                growth_share=0.02,
                over_plan_share=0.25,
                over_plan=64 << 20,
                step_growth=64 << 10,
                run_steps=run_steps,
            )
        return cls(
            warmup=warmup,
            growth=2 << 20,
            growth_share=0.005,
            over_plan_share=0.10,
            over_plan=64 << 20,
            run_steps=run_steps,
        )

    def allowed(self, planned: int) -> float:
        """The most a step may hold against ``planned`` bytes: the share above it plus the slack."""
        return planned * (1 + self.over_plan_share) + self.over_plan


@dataclass
class Finding:
    """One judged property: ``status`` is ``"pass"``, ``"fail"`` or ``"info"``; ``cause`` names a failure."""

    check: str
    status: str
    detail: str
    cause: Optional[str] = None


@dataclass
class Verdict:
    """All findings, the failures named by cause, and the per-phase memory table."""

    passed: bool
    header: str
    findings: list[Finding] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    phases: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ranks: list[Optional[RankResult]] = field(default_factory=list)
    warnings: list[dict[str, Any]] = field(default_factory=list)

    @property
    def causes(self) -> list[str]:
        """The failure causes, in order found (empty when passed)."""
        return list(dict.fromkeys(f["cause"] for f in self.failures))

    def as_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "header": self.header,
            "causes": self.causes,
            "findings": [asdict(f) for f in self.findings],
            "failures": self.failures,
            "phases": self.phases,
            "notes": self.notes,
            "warnings": self.warnings,
            "ranks": [None if r is None else r.as_dict() for r in self.ranks],
        }

    def json(self) -> str:
        return json.dumps(self.as_dict(), indent=1)

    def table(self) -> str:
        """The human report: findings, per-phase memory, failures with their fixes."""
        lines = [self.header, ""]
        width = max([len(f.check) for f in self.findings] + [5])
        lines.append(f"  {'check':<{width}}  result  detail")
        for f in self.findings:
            lines.append(f"  {f.check:<{width}}  {f.status:<6}  {f.detail}")
        if self.phases:
            lines += [
                "",
                "  memory per phase (rank 0; after warm-up where marked *):",
                f"  {'phase':<28} {'visits':>6} {'plan':>10} {'held':>10} {'peak':>10}",
            ]
            shown = self.phases[:12]
            for row in shown:
                lines.append(
                    f"  {row['phase'][:28]:<28} {row['visits']:>6} {_size(row['plan']):>10} "
                    f"{_size(row['held']):>10}{'*' if row['judged'] else ' '}{_size(row['peak']):>10}"
                )
            if len(self.phases) > len(shown):
                lines.append(f"  ... {len(self.phases) - len(shown)} more phases (--json lists all)")
        for note in self.notes:
            lines += ["", f"  note: {note}"]
        if self.warnings:
            lines += ["", f"  warnings the ranks raised ({len(self.warnings)}, each once):"]
            for warning in self.warnings[:_SHOWN_WARNINGS]:
                lines.append(f"  - {_ranks(warning['ranks'])}: {_clip(warning['text'], 600)}")
            if len(self.warnings) > _SHOWN_WARNINGS:
                lines.append(f"  ... {len(self.warnings) - _SHOWN_WARNINGS} more (--json lists all)")
        lines.append("")
        if self.passed:
            lines.append("PASSED")
        else:
            for failure in self.failures:
                title, fix = CAUSES[failure["cause"]]
                lines.append(f"FAILED: {title} ({failure['cause']}): {failure['detail']}")
                lines.append(f"  fix: {fix}")
        return "\n".join(lines)


#: The warnings the table shows (``--json`` carries all).
_SHOWN_WARNINGS = 12


def _size(n: Optional[int]) -> str:
    return "-" if n is None else format_bytes(n)


def _signed(n: float) -> str:
    return f"{'+' if n >= 0 else '-'}{format_bytes(int(abs(n)))}"


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def classify(failure: Failure) -> Cause:
    """The cause (:data:`CAUSES`) of a rank's recorded failure: the one it carries.

    A result written before causes were recorded (or by a newer version, with a
    cause unknown here) is told by its exception's class alone: a drift check's
    error, else a plain error.

    Example:
        >>> classify(Failure("step", 3, "SwitchError", "ranks disagree on the phase at step 3 (...)",
        ...                  cause="schedule_differs_per_rank"))
        <Cause.SCHEDULE_DIFFERS_PER_RANK: 'schedule_differs_per_rank'>
    """
    if failure.cause in CAUSES:
        return Cause(failure.cause)
    return Cause.RANKS_DRIFT if failure.kind == "DriftError" else Cause.ERROR


#: What a warning's detail adds, by its cause: the library mended it this time.
_MENDED = {
    Cause.REQUIRES_GRAD_BEHIND_SCHEDULE: " (the library put the flags back this time, but this code changes "
    "them at every step)"
}


def _warning_causes(result: RankResult) -> list[tuple[str, str]]:
    """``(cause, detail)`` of each warning the rank caught that names a cause (an ``AltParamsWarning``)."""
    out = []
    for cause, line in result.warning_causes:
        if cause in CAUSES:
            out.append((cause, f"rank {result.rank}: {line[:600]}{_MENDED.get(Cause(cause), '')}"))
    return out


def _trend(values: Sequence[int]) -> Optional[int]:
    """Median of the last third minus median of the first third (``None`` under 3 values)."""
    if len(values) < 3:
        return None
    third = max(1, len(values) // 3)
    return int(statistics.median(values[-third:]) - statistics.median(values[:third]))


def _failures(results: Sequence[Optional[RankResult]], stopped: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [dict(f) for f in stopped]
    for rank in [i for i, r in enumerate(results) if r is None]:
        out.append(
            {
                "cause": "rank_lost",
                "rank": rank,
                "detail": f"rank {rank} wrote no result (it crashed, or was stopped when another rank failed)",
            }
        )
    for result in results:
        if result is None:
            continue
        for cause, detail in _warning_causes(result):
            out.append({"cause": cause, "rank": result.rank, "detail": detail})
        if result.failure is not None:
            f = result.failure
            where = f"step {f.step}" if f.stage == "step" else {"final": "final weight check"}.get(f.stage, f.stage)
            out.append(
                {
                    "cause": classify(f),
                    "rank": result.rank,
                    "stage": f.stage,
                    "detail": f"rank {result.rank}, {where}: {f.kind}: {f.message}",
                }
            )
    # A rank that lost its peers reports rank_lost; when another rank names the cause, that is the failure.
    named = [f for f in out if f["cause"] != "rank_lost"]
    return _dedupe(named or out)


def _dedupe(failures: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One failure per cause and message (the same error raised on every rank is one failure)."""
    seen: dict[tuple[str, str], dict[str, Any]] = {}
    for f in failures:
        key = (f["cause"], f["detail"].split(": ", 1)[-1])
        if key in seen:
            ranks = seen[key].setdefault("ranks", [seen[key]["rank"]])
            ranks.append(f["rank"])
        else:
            seen[key] = dict(f)
    return list(seen.values())


def judge(
    results: Sequence[Optional[RankResult]],
    tolerances: Optional[Tolerances] = None,
    header: str = "",
    stopped: Sequence[dict[str, Any]] = (),
) -> Verdict:
    """Judge the ranks' results (``None``: a rank that wrote none) into a :class:`Verdict`.

    ``stopped``: failures the launch itself found (``{"cause", "rank", "detail"}``: the
    deadline, a rank the kernel killed, a launch refused), listed first; a rank
    that wrote nothing is then not also reported lost.

    Example::

        verdict = judge([rank0, rank1])
        print(verdict.table()); sys.exit(0 if verdict.passed else 1)
    """
    present = [r for r in results if r is not None]
    failures = _failures(results, stopped)
    verdict = Verdict(passed=False, header=header, ranks=list(results))
    if not present:
        verdict.failures = failures
        return verdict
    tol = tolerances or Tolerances.for_source(present[0].memory_source)
    start = _start(present, failures)
    if start is not None:
        verdict.findings.append(start)
    verdict.findings.append(_identical(present))
    verdict.findings.append(_bytes(present, failures))
    growth, rows = _memory(present, tol, failures)
    verdict.findings += [growth, _per_step(present, tol, failures), rows]
    verdict.findings.append(_idle_changes(present, failures))
    verdict.findings.append(_idle_state(present, failures))
    verdict.findings.append(_switch_share(present))
    verdict.phases = _phase_table(present[0], tol)
    verdict.notes += _notes(present)
    verdict.warnings = _warnings(present)
    verdict.failures = failures
    verdict.passed = not failures and all(f.status != "fail" for f in verdict.findings)
    return verdict


def _notes(results: Sequence[RankResult]) -> list[str]:
    """The idle-state summary, the bf16 verdict, the unseeded set-up that DDP made equal (each once)."""
    out = []
    idle = next((r.idle_state for r in results if r.idle_state), [])
    if idle:
        out.append(idle[0])
    bf16 = next((r.bf16 for r in results if r.bf16 and r.bf16.get("warning")), None)
    if bf16:
        out.append(str(bf16["warning"]))
    differs = next((r for r in results if r.start_differs and r.start_equalized), None)
    if differs is not None:
        out.append(
            f"the set-up builds different weights on each rank ({_groups(differs.start_differs)} differ before "
            f"`prepare`: the model's construction is not seeded). {differs.parallel} makes them equal here "
            f"({'DeepSpeed' if differs.parallel.startswith('DeepSpeed') else 'DDP'}'s "
            f"{'engine' if differs.parallel.startswith('DeepSpeed') else 'constructor'} copies rank 0's parameters "
            "and buffers to every rank; the check made that copy before its first comparison), "
            "so this run trains from rank 0's weights, as yours will. "
            "Seed it anyway (`torch.manual_seed(0)` before building the model): FSDP2 shards each rank's own "
            "weights, and a drift check before DDP is built (`drift_check='switch'`) would see them differ."
        )
    return out


def _warnings(results: Sequence[RankResult]) -> list[dict[str, Any]]:
    """Every warning the ranks raised, once, with the ranks that raised it (in order of first appearance)."""
    seen: dict[str, list[int]] = {}
    for r in results:
        for line in r.warnings:
            ranks = seen.setdefault(line, [])
            if r.rank not in ranks:
                ranks.append(r.rank)
    return [{"text": text, "ranks": ranks} for text, ranks in seen.items()]


def _groups(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:6])
    more = f" and {len(names) - 6} more" if len(names) > 6 else ""
    return f"group{'s' if len(names) > 1 else ''} {shown}{more}"


def _start(results: Sequence[RankResult], failures: list[dict[str, Any]]) -> Optional[Finding]:
    name = "ranks start from the same weights"
    if results[0].world == 1:
        return None
    differs = next((r for r in results if r.start_differs), None)
    if differs is None:
        if not any(r.steps for r in results):
            return Finding(name, "info", "not compared (the run stopped before `prepare`)")
        return Finding(
            name,
            "pass",
            f"every group's digest equal on the {results[0].world} ranks as the set-up built them, before `prepare`",
        )
    what = f"{_groups(differs.start_differs)} differ between the ranks as the set-up built them"
    if differs.start_equalized:
        return Finding(
            name,
            "info",
            f"{what}; {differs.parallel}'s constructor copies rank 0's weights to every "
            "rank, so the run starts equal (see the note)",
        )
    detail = (
        f"{what}, before `prepare`, and under {differs.parallel} nothing makes them equal: each rank keeps "
        "its own shard of its own weights, so the model trained is a mix of the ranks' initialisations; "
        "the check stopped before training"
    )
    return _judged(name, detail, True, "unseeded_setup", differs.rank, failures)


def _idle_changes(results: Sequence[RankResult], failures: list[dict[str, Any]]) -> Finding:
    name = "idle groups unchanged"
    if not any(r.steps for r in results):
        return Finding(name, "info", "no step was trained")
    changed = [r for r in results if r.idle_changed]
    if not changed:
        return Finding(
            name,
            "pass",
            "every group's weights unchanged on every rank while it did not train (read "
            "at every switch and at the end)",
        )
    r = changed[0]
    spans = "; ".join(
        f"{c.group!r} {'frozen by its requires_grad flags' if c.frozen else 'idle'} in phase {c.phase!r}, "
        f"changed between steps {c.since} and {c.until}"
        for c in r.idle_changes[:4]
    )
    groups = sorted({c.group for c in r.idle_changes})
    frozen = sorted({c.group for c in r.idle_changes if c.frozen})
    detail = (
        f"rank {r.rank}: {_groups(groups)} changed while not training ({r.idle_changed} time(s)): {spans}"
        f"{'; ...' if r.idle_changed > 4 else ''}. Likely: an optimizer that updates every parameter it holds, "
        "gradient or not (weight decay or momentum without a gradient; torch's own optimizers skip a "
        "parameter whose `.grad` is None), per-step code that writes every weight (`p.mul_()`, a weight "
        "constraint), or an EMA or a checkpoint copied back into the model"
    )
    if frozen:
        detail += (
            f". {_groups(frozen)} had every `requires_grad` off while the schedule trained them: code outside "
            "the schedule froze them (a LISA callback of one's own: freeze all, unfreeze the drawn layers), "
            f"and {r.parallel}'s optimizer still stepped them"
            + (
                " (DeepSpeed ZeRO steps every partition it was built with: a frozen parameter gets a zero "
                "gradient, and weight decay and the optimizer's moments move it)"
                if r.parallel.startswith("DeepSpeed")
                else ""
            )
            + "; let the schedule freeze them (hf_altparams' lisa schedule, AlternatingFreeze or PhasedAccelerator)"
        )
    return _judged(name, detail, True, "idle_group_changed", r.rank, failures)


def _identical(results: Sequence[RankResult]) -> Finding:
    name = "ranks bit-identical after each switch"
    world = results[0].world
    if world == 1:
        return Finding(name, "info", "one rank: nothing to compare")
    drift = [r for r in results if r.failure is not None and r.failure.kind == "DriftError"]
    if drift:
        return Finding(name, "fail", drift[0].failure.message[:300] if drift[0].failure else "", "ranks_drift")
    compared = min(r.weights_compared for r in results)
    ended = all(r.failure is None for r in results)
    detail = (
        f"every parameter's digest compared across {world} ranks {compared} times "
        f"({'after each switch and at the end' if ended else 'until the run stopped'}): all equal"
    )
    return Finding(name, "pass" if compared else "info", detail if compared else "no comparison was reached")


def _bytes(results: Sequence[RankResult], failures: list[dict[str, Any]]) -> Finding:
    name = "bytes all-reduced = trainable bytes"
    parallel = results[0].parallel
    if parallel.startswith("none"):
        return Finding(name, "info", "one process: nothing is all-reduced")
    zero = parallel.startswith("DeepSpeed")
    verb = "reduce-scattered" if parallel == "FSDP2" else ("communicated" if zero else "all-reduced")
    checked, wrong = 0, []
    for r in results:
        for row in r.steps:
            if row.reduced_bytes is None or row.expected_reduced is None:
                continue
            checked += 1
            over = row.reduced_bytes - row.expected_reduced
            if not 0 <= over <= row.reduced_slack:
                wrong.append((r.rank, row))
    if not checked:
        return Finding(name, "info", "no step was counted")
    if wrong:
        rank, row = wrong[0]
        against = (
            f"{format_bytes(row.expected_reduced or 0)} that {parallel} declares for the phase's "
            f"{format_bytes(row.grad_bytes)} of trainable gradients (their reduction and the all-gather of the "
            "updated partitions)"
            if zero
            else f"{format_bytes(row.expected_reduced or 0)} of trainable gradients"
        )
        detail = (
            f"{len(wrong)} of {checked} rank-steps differ; e.g. rank {rank} step {row.step} (phase "
            f"{row.phase!r}): {format_bytes(row.reduced_bytes or 0)} {verb} against {against}"
        )
        return _judged(name, detail, True, "bytes_mismatch", rank, failures)
    sizes = sorted({row.reduced_bytes or 0 for r in results for row in r.steps if row.reduced_bytes is not None})
    span = format_bytes(sizes[0]) if len(sizes) == 1 else f"{format_bytes(sizes[0])} to {format_bytes(sizes[-1])}"
    everything = results[0].trainable_everything
    share = f" (the whole model: {format_bytes(everything)})" if everything else ""
    if not zero:
        return Finding(
            name, "pass", f"{checked} rank-steps: {span} {verb} per step, equal to the trainable gradients{share}"
        )
    overs = sorted(
        {
            (row.reduced_bytes or 0) - (row.expected_reduced or 0)
            for r in results
            for row in r.steps
            if row.reduced_bytes is not None and row.expected_reduced is not None
        }
    )
    extra = f"{overs[0]}" if len(overs) == 1 else f"{overs[0]} to {overs[-1]}"
    return Finding(
        name,
        "pass",
        f"{checked} rank-steps: {span} of DeepSpeed collectives per step, what {parallel} declares for the "
        f"phase's trainable gradients{share}: their reduction and the all-gather of the updated partitions, plus "
        f"{extra} bytes of its scalar collectives (gradient norms, the overflow flag) and partition padding, "
        "under the smallest group's bytes",
    )


def _memory(results: Sequence[RankResult], tol: Tolerances, failures: list[dict[str, Any]]) -> tuple[Finding, Finding]:
    flat, plan = "memory flat after warm-up", "memory held vs plan"
    source = results[0].memory_source
    worst_growth: Optional[tuple[int, int, int]] = None  # growth, rank, readings
    worst_over: Optional[tuple[float, RankResult, StepRow, int]] = None  # ratio, rank, step, planned
    limit_growth = 0
    for r in results:
        after = r.switches[tol.warmup :]
        limit = tol.growth + int(tol.growth_share * max([s.predicted for s in r.switches] + [0]))
        limit_growth = max(limit_growth, limit)
        growth = _trend([s.level - s.predicted for s in after])
        if growth is not None and (worst_growth is None or growth > worst_growth[0]):
            worst_growth = (growth, r.rank, len(after))
        for row, planned in _held_vs_plan(r, tol):
            if row.held is None:
                continue
            ratio = row.held / planned if planned else float("inf")
            if worst_over is None or ratio > worst_over[0]:
                worst_over = (ratio, r, row, planned)
    if worst_growth is None:
        first = Finding(
            flat,
            "info",
            f"fewer than {tol.warmup + 3} switches: too few to judge a trend (--steps more, or --every fewer)",
        )
    else:
        growth, rank, count = worst_growth
        detail = (
            f"{_signed(growth)} over {count} switches after "
            f"{tol.warmup} of warm-up (worst rank {rank}; {source} minus the plan; tolerance "
            f"{format_bytes(limit_growth)})"
        )
        first = _judged(flat, detail, growth > limit_growth, "memory_grows", rank, failures)
    if worst_over is None:
        return first, Finding(plan, "info", "no step after warm-up was read")
    ratio, r, row, planned = worst_over
    over = row.held is not None and row.held > tol.allowed(planned)
    detail = (
        f"worst {ratio:.2f}x: rank {r.rank}, phase {row.phase!r}, step {row.step}: "
        f"{format_bytes(row.held or 0)} held at the end of the step against {format_bytes(planned)} planned "
        f"({source}; allowed {1 + tol.over_plan_share:.2f}x + {format_bytes(tol.over_plan)})"
    )
    if over:
        detail += f". {_what_is_read(source)}.{_made_of(r)}"
    return first, _judged(plan, detail, over, "memory_over_plan", r.rank, failures)


def _what_is_read(source: str) -> str:
    """What a memory reading counts, and what the plan does (the detail of a ``memory_over_plan``)."""
    planned = (
        "Planned: the memory model's weights, gradients, optimizer state and DDP buckets for the phase "
        "(activations excluded)"
    )
    if source == "RSS":
        return (
            "Held: the process's resident memory above its baseline, the memory that is not a tensor once "
            "the first step has run (imports, kernels, libraries): every tensor the process holds, the "
            "model's, the optimizer's and any other code's, plus non-tensor memory grown since. " + planned
        )
    return f"Held: {source}, every tensor on the device. " + planned


def _made_of(result: RankResult) -> str:
    """Rank ``result``'s memory at the end of the run, by what holds it (empty when it was not read)."""
    if not result.census:
        return ""
    parts = ", ".join(
        f"{name} {_signed(n) if name == 'rest' else format_bytes(n)}" for name, n in result.census.items()
    )
    other = result.census.get("other tensors", 0)
    model = sum(v for k, v in result.census.items() if k not in ("other tensors", "rest"))
    hint = (
        " Other tensors are held by code outside the model and its optimizer (a list or cache of user code, "
        "a second copy of the weights such as parameters from before fully_shard that something still "
        "references)."
        if other > model / 10
        else ""
    )
    return (
        f" At the end of the run rank {result.rank} held: {parts} (the rest: memory no tensor Python holds "
        f"accounts for: libraries, DDP's buckets, the allocator, graphs kept alive).{hint}"
    )


#: The fewest readings after warm-up from which growth per step is judged.
_MIN_STEP_READINGS = 10
#: The confidence of the lower bound of the growth per step that is projected (z of a normal: 99.7 %).
_SLOPE_Z = 3.0


def _slopes(points: Sequence[tuple[int, int]]) -> list[float]:
    """The slopes between every two points (bytes per step), sorted."""
    return sorted((b[1] - a[1]) / (b[0] - a[0]) for i, a in enumerate(points) for b in points[i + 1 :] if b[0] != a[0])


def _theil_sen(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """``(slope, lower bound)``: the median of the slopes between every two points, and its confidence bound.

    The Theil-Sen estimator: a trend that a few outliers cannot move. The lower
    bound is Sen's: the slope below which, were the readings independent noise
    around the trend, the true slope lies with probability under 0.15 %
    (:data:`_SLOPE_Z` standard deviations of Kendall's statistic).
    """
    slopes = _slopes(points)
    if not slopes:
        return 0.0, 0.0
    n = len(points)
    spread = _SLOPE_Z * math.sqrt(n * (n - 1) * (2 * n + 5) / 18)
    lower = int((len(slopes) - spread) / 2)
    return float(statistics.median(slopes)), slopes[max(0, min(lower, len(slopes) - 1))]


def _step_residuals(result: RankResult, tol: Tolerances) -> list[tuple[int, int]]:
    """``(step, held - planned)`` of each step after warm-up whose memory was read."""
    return [(row.step, row.held - planned) for row, planned in _held_vs_plan(result, tol) if row.held is not None]


def _growth(result: RankResult, tol: Tolerances) -> Optional[dict[str, Any]]:
    """Rank ``result``'s growth per step, and where it leads by the end of the run (``None``: too few readings).

    Judged on the later half of the steps after warm-up: in the earlier half the
    memory that is not tensors still grows as phases are visited for the first
    time (the allocator's arenas, gloo's buffers, first kernels: up to 120 KiB a
    step measured in a correct run), and flattens.
    """
    after = _step_residuals(result, tol)
    points = after[len(after) // 2 :]
    if len(points) < _MIN_STEP_READINGS:
        return None
    slope, lower = _theil_sen(points)
    half = len(points) // 2
    halves = (_theil_sen(points[: half + 1])[0], _theil_sen(points[half:])[0])
    excess = lower - tol.step_growth
    both = min(halves) >= slope / 3  # both halves grow alike: not a rise once (a cache filled, a first touch)
    steady = excess > 0 and both
    why = (
        ""
        if steady
        else (
            "within the growth not judged"
            if excess <= 0
            else "not steady: the two halves of the window do not both grow (a rise once, not per step)"
        )
    )
    remaining = max(0, tol.run_steps - points[-1][0] - 1)
    plans = [planned for _, planned in _planned_steps(result) if planned is not None]
    largest = max(plans, default=0)
    return {
        "slope": slope,
        "lower": lower,
        "steady": steady,
        "why": why,
        "projected": max(0.0, excess) * remaining,
        "room": tol.allowed(largest) - (points[-1][1] + largest),
        "available": result.available,
        "last": points[-1][0],
        "readings": len(points),
        "excess": excess,
    }


def _per_step(results: Sequence[RankResult], tol: Tolerances, failures: list[dict[str, Any]]) -> Finding:
    name = "memory per step"
    found = [(r, g) for r in results for g in [_growth(r, tol)] if g is not None]
    if not found:
        return Finding(
            name,
            "info",
            f"fewer than {2 * _MIN_STEP_READINGS} steps read after warm-up: too few to "
            "judge growth per step (--steps more)",
        )

    def reach(item: tuple[RankResult, dict[str, Any]]) -> float:
        g = item[1]
        budget = min([g["room"]] + ([g["available"]] if g["available"] is not None else []))
        return g["projected"] / max(1.0, budget) if g["steady"] else g["lower"] / (1 << 40)

    r, g = max(found, key=reach)
    over_plan = g["steady"] and g["projected"] > g["room"]
    out_of_memory = g["steady"] and g["available"] is not None and g["projected"] > g["available"]
    detail = (
        f"{_signed(g['slope'])} per step, at least {_signed(g['lower'])} (rank {r.rank}; Theil-Sen slope of "
        f"the memory held minus the plan over the last {g['readings']} steps; growth under "
        f"{format_bytes(tol.step_growth)} a step is not judged)"
    )
    if not g["steady"]:
        return Finding(name, "pass", f"{detail}: {g['why']}")
    detail += (
        f": {_signed(g['projected'])} more by step {tol.run_steps:,} of the run (--run-steps), against "
        f"{format_bytes(int(max(0, g['room'])))} left before the plan's allowance"
        + (f" and {format_bytes(g['available'])} available" if g["available"] is not None else "")
    )
    if out_of_memory:
        detail += f"; it runs out of memory around step {g['last'] + int(g['available'] / g['excess']):,}"
    return _judged(name, detail, over_plan or out_of_memory, "memory_grows_per_step", r.rank, failures)


def _judged(check: str, detail: str, failed: bool, cause: str, rank: int, failures: list[dict[str, Any]]) -> Finding:
    """A pass, or a fail also listed among the failures with its cause and rank."""
    if not failed:
        return Finding(check, "pass", detail)
    failures.append({"cause": cause, "rank": rank, "detail": detail})
    return Finding(check, "fail", detail, cause)


def _planned_steps(result: RankResult) -> list[tuple[StepRow, Optional[int]]]:
    """Every step with the plan of its phase (the prediction made when the phase was entered)."""
    plans = {s.step: s.predicted for s in result.switches}
    out, planned = [], result.first_prediction
    for row in result.steps:
        planned = plans.get(row.step, planned)
        out.append((row, planned))
    return out


def _held_vs_plan(result: RankResult, tol: Tolerances) -> list[tuple[StepRow, int]]:
    """The steps after warm-up, each with the plan of its phase."""
    if len(result.switches) <= tol.warmup:
        return []
    start = result.switches[tol.warmup - 1].step if tol.warmup else 0
    return [(row, planned or 0) for row, planned in _planned_steps(result) if row.step >= start]


def _idle_state(results: Sequence[RankResult], failures: list[dict[str, Any]]) -> Finding:
    name = "idle optimizer state as its policy says"
    checked = sum(s.idle_checked for r in results for s in r.switches)
    if not checked:
        return Finding(
            name,
            "info",
            "no idle group's policy sends its state away here (keep; offload on a CPU "
            "stays on the host, which is the device)",
        )
    for r in results:
        for s in r.switches:
            if s.idle_held:
                detail = (
                    f"rank {r.rank}, after the switch to {s.phase!r} at step {s.step}: idle group(s) "
                    f"{s.idle_held_groups} still hold {format_bytes(s.idle_held)} of optimizer state on "
                    f"{r.device}, against their policy"
                )
                return _judged(name, detail, True, "idle_state_held", r.rank, failures)
    return Finding(
        name,
        "pass",
        f"{checked} idle group-switches checked on every rank: none held state on the "
        "device that its policy sends away",
    )


def _switch_share(results: Sequence[RankResult]) -> Finding:
    name = "switch time share"
    worst: Optional[tuple[float, int, int, float]] = None
    for r in results:
        steps = sum(row.seconds for row in r.steps)
        switches = sum(s.seconds for s in r.switches)
        if steps > 0 and (worst is None or switches / steps > worst[0]):
            worst = (switches / steps, r.rank, len(r.switches), switches)
    if worst is None or not worst[2]:
        return Finding(name, "info", "no switch")
    share, rank, count, seconds = worst
    return Finding(
        name, "info", f"{share:.1%} of step time (rank {rank}: {count} switches, {1000 * seconds / count:.1f} ms each)"
    )


def _phase_table(result: RankResult, tol: Tolerances) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    judged = {id(row) for row, _ in _held_vs_plan(result, tol)}
    for row, planned in _planned_steps(result):
        entry = rows.setdefault(
            row.phase, {"phase": row.phase, "visits": 0, "plan": planned, "held": None, "peak": None, "judged": False}
        )
        if row.held is not None and id(row) in judged:
            entry["judged"] = True
            entry["held"] = max(entry["held"] or 0, row.held)
        elif row.held is not None and not entry["judged"]:
            entry["held"] = max(entry["held"] or 0, row.held)
    for phase, peak in result.peaks:
        if phase in rows:
            rows[phase]["visits"] += 1
            if peak is not None:
                rows[phase]["peak"] = max(rows[phase]["peak"] or 0, peak)
    return list(rows.values())
