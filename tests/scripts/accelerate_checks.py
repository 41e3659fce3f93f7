"""Two-rank checks of :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator`.

Usage (every rank runs it)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 accelerate_checks.py OUT_DIR

Several scenarios run one after another in the same processes (imports cost more
than the training); each rank writes its findings to ``OUT_DIR/rank{r}.json``
and the tests assert on them. The ``resume`` scenario also leaves a checkpoint
(``OUT_DIR/ckpt``) and the parameters of its uninterrupted run
(``OUT_DIR/uninterrupted_rank{r}.pt``) for ``accelerate_resume.py``.

Scenarios:

* ``ga1`` / ``ga2``: parameters against a one-process reference on the
  concatenated batch (gradient accumulation 1 and 2), ranks bit-identical,
  bytes all-reduced per step (comm counter) against the phase's trainable
  bytes, one model in ``accelerator._models`` and in ``save_state``, the switch
  records reaching a tracker, a second ``prepare`` of the raw model refused.
* ``comm_hook``: an fp16-compression comm hook from
  ``DistributedDataParallelKwargs`` still runs after every switch.
* ``per_task``: ``PerTaskCycle`` (a trunk and two task heads, one resident at a
  time) against a one-process reference; each step all-reduces the trunk and
  the current head only, and a forward through the other head is refused.
* ``unused``: a trainable parameter the forward never uses is reported before
  the step with ``find_unused_parameters=False``; ``True`` trains.
* ``resume``: the uninterrupted run, saving a checkpoint mid-phase.
* ``bf16_masters``: a bf16 model with a PrecisionOptimizer (fp32 masters,
  ``allreduce_dtype=torch.float32``) and gradient accumulation 3 through
  ``prepare`` and ``accumulate``: the parameters against ``precision_check``'s
  one-process reference (micro-steps summed in fp32, fp32 all-reduce), bytes
  all-reduced per step against trainable x 4.
* ``bf16``: ``mixed_precision="bf16"`` on CPU runs, switches and keeps ranks equal.
* ``fp16_scaler``: one GradScaler step and one unscale per optimizer step with
  two groups active: two Accelerate optimizers against one GroupedOptimizer, and
  against the user's own optimizers, one per group, each stepped.
* ``own_optimizers``: the seed user's loop, ``opt1 = Adam(layer1)``,
  ``opt2 = Adam(layer2)`` passed to ``prepare`` with the model, stepping both
  every iteration (no accumulation) or only the active one (accumulation 2),
  against the seed user's own one-process loop (``requires_grad`` toggled, the
  active group's Adam stepped); then ``prepare`` with only ``opt1`` (leaves
  ``layer2`` out) and with an optimizer spanning both groups, refused on every rank.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from accelerate.state import AcceleratorState
from accelerate.tracking import GeneralTracker
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError, SwitchError
from hf_altparams.integrations.accelerate import STATE_FILE, PhasedAccelerator
from hf_altparams.plan import Alternating, GradualUnfreeze, ParamGroups, PerTaskCycle, PhaseSequence, Schedule
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.digests import state_sha  # noqa: E402

SPECS = {"l0": "l0.*", "l1": "l1.*", "head": "head.*"}
LR = 1e-2
BATCH = 4
RESUME_STEPS, RESUME_SAVE_AT = 9, 4  # RESUME_SAVE_AT is inside the l1 phase (steps 3-4)
RESUME_SCHEDULE = {"l0": 3, "l1": 2, "head": 1}
RESUME_POLICY = {"l0": "offload", "l1": "drop", "head": "keep"}


class Net(nn.Module):
    """Three small layers; ``spare`` is used in the forward only when ``use_spare``."""

    def __init__(self, use_spare: bool = True) -> None:
        super().__init__()
        self.l0, self.l1 = nn.Linear(6, 16), nn.Linear(16, 16)
        self.head, self.spare = nn.Linear(16, 1), nn.Linear(16, 1)
        self.use_spare = use_spare

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        return self.head(h) + (self.spare(h) if self.use_spare else 0.0)


class ListTracker(GeneralTracker):
    """A tracker that keeps what ``accelerator.log`` sends it."""

    name = "list"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[tuple[Any, dict[str, Any]]] = []

    @property
    def tracker(self) -> list[tuple[Any, dict[str, Any]]]:
        return self.logs

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        pass

    def log(self, values: dict[str, Any], step: Any = None, **kwargs: Any) -> None:
        self.logs.append((step, dict(values)))


class CountDDPConstructions:
    """Counts ``DistributedDataParallel.__init__`` calls (each broadcasts every parameter and buffer)."""

    def __enter__(self) -> CountDDPConstructions:
        self.count, self._original = 0, nn.parallel.DistributedDataParallel.__init__
        counter = self

        def counting_init(ddp: Any, *args: Any, **kwargs: Any) -> None:
            counter.count += 1
            counter._original(ddp, *args, **kwargs)

        nn.parallel.DistributedDataParallel.__init__ = counting_init  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        nn.parallel.DistributedDataParallel.__init__ = self._original  # type: ignore[method-assign]


def loader(n_batches: int, seed: int = 7) -> torch.utils.data.DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * BATCH, 6, generator=gen)
    y = x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(n_batches * BATCH, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def fresh_model(**kwargs: Any) -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return Net(**kwargs)


Windows = list[list[tuple[torch.Tensor, ...]]]


def train(
    acc: PhasedAccelerator,
    model: nn.Module,
    opt: Any,
    dl: Any,
    clip: float | None = None,
    max_steps: int | None = None,
    on_sync: Callable[[], None] | None = None,
) -> Windows:
    """The stock Accelerate loop; returns the gathered (global) micro-batches of every optimizer step."""
    windows: Windows = [[]]
    for x, y in dl:
        with acc.accumulate(model):
            windows[-1].append(acc.gather((x, y)))
            loss = nn.functional.mse_loss(model(x).float(), y)
            acc.backward(loss)
            if acc.sync_gradients:
                if on_sync is not None:
                    on_sync()
                if clip is not None:
                    acc.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
        if acc.sync_gradients:
            windows.append([])
            if max_steps is not None and acc.schedule_step >= max_steps:
                break
    return [w for w in windows if w]


def reference(schedule: Schedule, windows: Windows, clip: float | None) -> nn.Module:
    """One process, no DDP, one AdamW per group; each step sees the whole global batch."""
    model = fresh_model()
    groups = ParamGroups(model, SPECS)
    opts = {g: torch.optim.AdamW(groups.params(g), lr=LR) for g in groups.names}
    for step, window in enumerate(windows):
        phase = schedule.phase_at(step)
        names = groups.trainable_param_names(phase.trainable)
        for name, p in groups.all_named_params():
            p.requires_grad_(name in names)
            p.grad = None
        x = torch.cat([xy[0] for xy in window])
        y = torch.cat([xy[1] for xy in window])
        nn.functional.mse_loss(model(x), y).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        for g in sorted(phase.trainable):
            opts[g].step()
    return model


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


def equivalence(name: str, schedule: Schedule, ga: int, clip: float | None, out: Path) -> dict[str, Any]:
    tracker = ListTracker()
    acc = PhasedAccelerator(schedule, count_comm=True, gradient_accumulation_steps=ga, log_with=[tracker])
    acc.init_trackers(name)
    model = fresh_model()
    groups = ParamGroups(model, SPECS)
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=LR))
    with CountDDPConstructions() as constructions:
        ddp, opt, dl = acc.prepare(model, opt, loader(2 * ga * 6))
        windows = train(acc, ddp, opt, dl, clip=clip)
    ref = reference(schedule, windows, clip)

    expected = [sum(groups.nbytes(g) for g in schedule.phase_at(s).trainable) for s in range(len(windows))]
    try:
        acc.prepare(model)
        reprepare_error = ""
    except AltParamsError as exc:
        reprepare_error = str(exc)
    ckpt = out / f"ckpt_{name}"
    acc.save_state(str(ckpt))
    result = {
        "steps": acc.schedule_step,
        "windows": len(windows),
        "max_abs_diff_vs_reference": max_diff(model, ref),
        "param_sha256": state_sha(model),
        "allreduce_bytes_measured": acc.comm_counter.history if acc.comm_counter else None,
        "allreduce_bytes_expected": expected,
        "record_bytes": [r.allreduce_bytes_per_step for r in acc.switch_records],
        "record_trainable_bytes": [r.trainable_bytes for r in acc.switch_records],
        "switch_phases": [r.phase for r in acc.switch_records],
        "switch_steps": [r.step for r in acc.switch_records],
        "models_registered": len(acc._models),
        "ddp_constructions": constructions.count,
        "ddp_is_wrapper_of_model": ddp.module is model,
        "find_unused_parameters": ddp.find_unused_parameters,
        "checkpoint_files": sorted(os.listdir(ckpt)),
        "reprepare_error": reprepare_error,
        "tracker_logs": [{"step": s, **{k: v for k, v in values.items()}} for s, values in tracker.logs],
    }
    acc.free_memory()
    return result


def comm_hook_scenario() -> dict[str, Any]:
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    acc = PhasedAccelerator(Alternating(["l0", "l1", "head"]), kwargs_handlers=[handler])
    model = fresh_model()
    opt = GroupedOptimizer(ParamGroups(model, SPECS), functools.partial(torch.optim.AdamW, lr=LR))
    ddp, opt, dl = acc.prepare(model, opt, loader(12))
    fp16_exact: list[bool] = []
    hooks: list[list[str]] = []

    def check() -> None:  # after the sync backward: grads went through the fp16 all-reduce
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        fp16_exact.append(bool(grads) and all(torch.equal(g, g.half().float()) for g in grads))
        hooks.append([h.__qualname__ for h, _ in ddp._comm_hooks])

    train(acc, ddp, opt, dl, on_sync=check)
    result = {
        "fp16_exact_per_step": fp16_exact,
        "hooks_per_step": hooks,
        "phases": [r.phase for r in acc.switch_records],
        "param_sha256": state_sha(model),
    }
    acc.free_memory()
    return result


class MultiTask(nn.Module):
    """A shared trunk and one head per task; the batch says which head runs."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.t0, self.t1 = nn.Linear(6, 16), nn.Linear(16, 1), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return getattr(self, task)(torch.tanh(self.trunk(x)))


def per_task_scenario() -> dict[str, Any]:
    specs = {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"}
    schedule = PerTaskCycle(["trunk"], ["t0", "t1"], every=2)
    acc = PhasedAccelerator(schedule, count_comm=True)
    torch.manual_seed(0)
    model = MultiTask()
    groups = ParamGroups(model, specs)
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=LR))
    ddp, opt, dl = acc.prepare(model, opt, loader(12))
    tasks, batches, refused = [], [], ""
    for x, y in dl:
        task = sorted(acc.phase.trainable - {"trunk"})[0] if acc.phase else "?"
        tasks.append(task)
        batches.append(acc.gather((x, y)))
        acc.backward(nn.functional.mse_loss(ddp(x, task), y))
        opt.step()
        opt.zero_grad()
    try:
        other = "t1" if acc.phase is not None and "t0" in acc.phase.trainable else "t0"
        with torch.no_grad():
            model(torch.zeros(1, 6), other)
    except SwitchError as exc:
        refused = str(exc)

    torch.manual_seed(0)
    reference = MultiTask()
    ref_groups = ParamGroups(reference, specs)
    ref_opts = {g: torch.optim.AdamW(ref_groups.params(g), lr=LR) for g in ref_groups.names}
    for step, (task, (x, y)) in enumerate(zip(tasks, batches)):
        trainable = schedule.phase_at(step).trainable
        for name, p in ref_groups.all_named_params():
            p.requires_grad_(ref_groups.group_of(name) in trainable)
            p.grad = None
        nn.functional.mse_loss(reference(x, task), y).backward()
        for g in sorted(trainable):
            ref_opts[g].step()
    expected = [sum(groups.nbytes(g) for g in schedule.phase_at(s).trainable) for s in range(len(tasks))]
    result = {
        "tasks": tasks,
        "allreduce_bytes_measured": acc.comm_counter.history if acc.comm_counter else None,
        "allreduce_bytes_expected": expected,
        "max_abs_diff_vs_reference": max_diff(model, reference),
        "param_sha256": state_sha(model),
        "refused": refused,
    }
    acc.free_memory()
    return result


def unused_scenario() -> dict[str, Any]:
    result: dict[str, Any] = {}
    for find_unused in (None, True):
        acc = PhasedAccelerator(PhaseSequence([(("l1", "spare"), 1)]), find_unused_parameters=find_unused)
        model = fresh_model(use_spare=False)
        groups = ParamGroups(model, {**SPECS, "spare": "spare.*"})
        opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=LR))
        ddp, opt, dl = acc.prepare(model, opt, loader(8))
        key = "true" if find_unused else "default"
        result[f"{key}_find_unused_parameters"] = ddp.find_unused_parameters
        try:
            train(acc, ddp, opt, dl, max_steps=2)
            result[f"{key}_error"] = ""
            result[f"{key}_steps"] = acc.schedule_step
        except AltParamsError as exc:
            result[f"{key}_error"] = str(exc)
        acc.free_memory()
    return result


def resume_scenario(out: Path) -> dict[str, Any]:
    """The uninterrupted run; it saves a checkpoint after RESUME_SAVE_AT steps, mid-phase."""
    acc = PhasedAccelerator(Alternating(RESUME_SCHEDULE), gradient_accumulation_steps=2)
    model = fresh_model()
    opt = GroupedOptimizer(
        ParamGroups(model, SPECS), functools.partial(torch.optim.AdamW, lr=LR), state_policy=RESUME_POLICY
    )
    ddp, opt, dl = acc.prepare(model, opt, loader(2 * 2 * RESUME_STEPS))
    saved: dict[str, Any] = {}

    def save_mid_phase() -> None:
        if acc.schedule_step == RESUME_SAVE_AT and not saved:
            saved["phase"] = acc.phase.name if acc.phase else None
            acc.save_state(str(out / "ckpt"))
            saved["files"] = sorted(os.listdir(out / "ckpt"))

    for x, y in dl:
        save_mid_phase()  # at the top of an iteration: after a sync step, a boundary
        with acc.accumulate(ddp):
            acc.backward(nn.functional.mse_loss(ddp(x), y))
            opt.step()
            opt.zero_grad()
        if acc.schedule_step >= RESUME_STEPS:
            break
    final = {k: v.clone() for k, v in model.state_dict().items()}
    torch.save(final, out / f"uninterrupted_rank{acc.process_index}.pt")
    result = {
        "steps": acc.schedule_step,
        "saved_phase": saved.get("phase"),
        "saved_files": saved.get("files"),
        "param_sha256": state_sha(model),
    }
    acc.free_memory()
    return result


def bf16_masters_scenario() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    import precision_check as check  # the engine test's model, batches and one-process reference

    from hf_altparams.engine import PrecisionOptimizer

    AcceleratorState._reset_state()
    case = check.Case(
        "accelerate",
        "offload",
        "offload",
        "alternating",
        steps=6,
        accumulation=3,
        allreduce_dtype="float32",
        loss_over_accumulation=True,
    )
    acc = PhasedAccelerator(case.build_schedule(), gradient_accumulation_steps=case.accumulation, count_comm=True)
    model = check.build_model()
    groups = ParamGroups(model, check.GROUPS)
    opt = PrecisionOptimizer(
        groups,
        check.ADAMW,
        master_policy=case.master_policy,
        state_policy=case.state_policy,
        allreduce_dtype=torch.float32,
    )
    ddp, prepared = acc.prepare(model, opt)
    trainable = []
    for step in range(case.steps):
        for micro in range(case.accumulation):
            x, y = check.batch(step, acc.process_index, acc.num_processes, micro)
            with acc.accumulate(ddp):
                acc.backward(nn.functional.mse_loss(ddp(x), y))
                if acc.sync_gradients:
                    trainable.append(sum(p.numel() for p in model.parameters() if p.requires_grad))
                prepared.step()
                prepared.zero_grad()
    reference = check.reference(case, world=acc.num_processes)
    diff = max(float((p.float() - q.float()).abs().max()) for p, q in zip(model.parameters(), reference.parameters()))
    result = {
        "steps": acc.schedule_step,
        "max_abs_diff_vs_reference": diff,
        "param_sha256": check.digest(check.params_of(model)),
        "allreduce_bytes_measured": acc.comm_counter.history if acc.comm_counter else None,
        "trainable_numel": trainable,
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    acc.free_memory()
    return result


class SeedNet(nn.Module):
    """The seed user's model: two layers, an optimizer each."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(6, 16), nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


def seed_pair() -> tuple[SeedNet, torch.optim.Adam, torch.optim.Adam]:
    torch.manual_seed(0)
    model = SeedNet()
    return model, torch.optim.Adam(model.layer1.parameters(), lr=LR), torch.optim.Adam(model.layer2.parameters(), lr=LR)


def own_optimizers_scenario() -> dict[str, Any]:
    """The seed user's two Adams through PhasedAccelerator, against their own one-process loop."""
    schedule = Alternating({"layer1": 2, "layer2": 1})
    result: dict[str, Any] = {}
    for style, ga in (("step_both", 1), ("active_only", 2)):
        model, opt1, opt2 = seed_pair()
        acc = PhasedAccelerator(
            schedule,
            groups=ParamGroups(model, {"layer1": "layer1.*", "layer2": "layer2.*"}),
            gradient_accumulation_steps=ga,
        )
        ddp, h1, h2, dl = acc.prepare(model, opt1, opt2, loader(2 * ga * 6))
        windows: Windows = [[]]
        for x, y in dl:
            with acc.accumulate(ddp):
                windows[-1].append(acc.gather((x, y)))
                acc.backward(nn.functional.mse_loss(ddp(x), y))
                if style == "step_both":
                    h1.step()
                    h2.step()
                    h1.zero_grad()
                    h2.zero_grad()  # noqa: E702
                else:
                    active = h1 if acc.phase is not None and "layer1" in acc.phase.trainable else h2
                    active.step()
                    active.zero_grad()
            if acc.sync_gradients:
                windows.append([])
        windows = [w for w in windows if w]

        ref, ref1, ref2 = seed_pair()  # the seed user's loop, one process, the whole global batch per step
        for step, window in enumerate(windows):
            first = "layer1" in schedule.phase_at(step).trainable
            for layer, trains in ((ref.layer1, first), (ref.layer2, not first)):
                for p in layer.parameters():
                    p.requires_grad_(trains)
            x, y = torch.cat([xy[0] for xy in window]), torch.cat([xy[1] for xy in window])
            nn.functional.mse_loss(ref(x), y).backward()
            (ref1 if first else ref2).step()
            ref1.zero_grad()
            ref2.zero_grad()
        result[style] = {
            "steps": acc.schedule_step,
            "windows": len(windows),
            "optimizers_prepared": len(acc._optimizers),
            "adam_steps": [float(o.state[o.param_groups[0]["params"][0]]["step"]) for o in (opt1, opt2)],
            "reference_adam_steps": [float(o.state[o.param_groups[0]["params"][0]]["step"]) for o in (ref1, ref2)],
            "max_abs_diff_vs_reference": max_diff(model, ref),
            "param_sha256": state_sha(model),
        }
        acc.free_memory()
    # Case 6 on every rank: an optimizer set that leaves a group out is refused at `prepare`, before anything.
    model, opt1, opt2 = seed_pair()
    acc = PhasedAccelerator(schedule, groups=ParamGroups(model, {"layer1": "layer1.*", "layer2": "layer2.*"}))
    for name, passed in (("leaves_out", (opt1,)), ("spans", (torch.optim.Adam(model.parameters()), opt2))):
        try:
            acc.prepare(model, *passed)
            result[name] = {"error": ""}
        except AltParamsError as exc:
            result[name] = {"error": str(exc)}
        result[name].update(
            phase=None if acc.phase is None else acc.phase.name,
            models=len(acc._models),
            optimizers=len(acc._optimizers),
            requires_grad=[p.requires_grad for p in model.parameters()],
        )
    return result


def bf16_scenario() -> dict[str, Any]:
    AcceleratorState._reset_state()  # mixed precision is process-wide state in Accelerate
    schedule = Alternating(["l0", ("l1", "head")])
    acc = PhasedAccelerator(schedule, mixed_precision="bf16", gradient_accumulation_steps=2)
    model = fresh_model()
    opt = GroupedOptimizer(ParamGroups(model, SPECS), functools.partial(torch.optim.AdamW, lr=LR))
    ddp, opt, dl = acc.prepare(model, opt, loader(16))
    before = state_sha(model)
    out_dtype: list[str] = []
    with torch.no_grad(), acc.autocast():
        out_dtype.append(str(model.l0(torch.zeros(1, 6)).dtype))
    train(acc, ddp, opt, dl, clip=1.0)
    result = {
        "mixed_precision": acc.mixed_precision,
        "autocast_dtype": out_dtype[0],
        "steps": acc.schedule_step,
        "phases": [r.phase for r in acc.switch_records],
        "changed": state_sha(model) != before,
        "param_sha256": state_sha(model),
        "models_registered": len(acc._models),
    }
    acc.free_memory()
    return result


def fp16_scaler_scenario() -> dict[str, Any]:
    """Two groups active in one step under a GradScaler, with clip_grad_norm_ (which unscales first).

    Accelerate makes no GradScaler on CPU; the scenario hands the accelerator a CPU one before
    ``prepare`` (so AcceleratedOptimizer gets it) and turns on ``native_amp`` after it (so
    ``unscale_gradients`` runs, while the forward stays fp32 and the loss scale is an exact power
    of two). The same ``backward`` / ``clip_grad_norm_`` / ``AcceleratedOptimizer.step`` code as on
    CUDA then runs. SGD makes a double unscale visible in the update.
    """
    AcceleratorState._reset_state()
    init_scale = 2.0**10
    results: dict[str, Any] = {}
    for mode in ("two_optimizers", "grouped", "own_optimizers"):
        both = PhaseSequence([(("l0", "l1", "head"), 1)])
        model = fresh_model()
        groups = ParamGroups(model, SPECS)
        from accelerate import Accelerator

        acc_any: Any = (
            Accelerator(mixed_precision="fp16")
            if mode == "two_optimizers"
            else PhasedAccelerator(both, mixed_precision="fp16", groups=groups)
        )
        acc_any.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
        sgd = functools.partial(torch.optim.SGD, lr=0.1)
        x, y = next(iter(loader(1)))
        if mode == "grouped":
            opt = GroupedOptimizer(groups, sgd)
            ddp, opt = acc_any.prepare(model, opt)
            opts = [opt]
        elif mode == "own_optimizers":  # one plain SGD per group; every handle steps: one scaler step
            ddp, *opts = acc_any.prepare(model, *(sgd(groups.params(g)) for g in groups.names))
        else:
            first, second = sgd(groups.params("l0")), sgd(groups.params("l1") + groups.params("head"))
            ddp, *opts = acc_any.prepare(model, first, second)
        acc_any.native_amp = True
        acc_any.backward(nn.functional.mse_loss(ddp(x), y))
        acc_any.clip_grad_norm_(ddp.parameters(), 1e6)  # unscales every prepared optimizer once; clips nothing
        for o in opts:
            o.step()
        results[mode] = {
            "params": {k: v.clone() for k, v in model.state_dict().items()},
            "scale_after": float(acc_any.scaler.get_scale()),
        }
        for o in opts:
            o.zero_grad()
        acc_any.native_amp = False
        acc_any.free_memory()
    # fp32 reference without a scaler.
    model = fresh_model()
    x, y = next(iter(loader(1)))
    ref_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    nn.functional.mse_loss(model(x), y).backward()
    # DDP averages identical gradients (every rank uses the same batch here): the mean equals the local one.
    ref_opt.step()
    ref = model.state_dict()
    out: dict[str, Any] = {"init_scale": init_scale}
    for mode, res in results.items():
        out[mode] = {
            "scale_after": res["scale_after"],
            "max_abs_diff_by_param": {
                k: float((res["params"][k] - ref[k]).abs().max()) for k in ref if not k.startswith("spare")
            },
        }
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    scenarios: dict[str, Callable[[], dict[str, Any]]] = {
        "ga1": lambda: equivalence("ga1", Alternating({"l0": 2, "l1": 1, "head": 1}), ga=1, clip=None, out=out),
        "ga2": lambda: equivalence(
            "ga2", GradualUnfreeze(["l0", "l1"], every=2, always=("head",)), ga=2, clip=0.5, out=out
        ),
        "comm_hook": comm_hook_scenario,
        "per_task": per_task_scenario,
        "unused": unused_scenario,
        "resume": lambda: resume_scenario(out),
        "own_optimizers": own_optimizers_scenario,
        "bf16_masters": bf16_masters_scenario,
        "bf16": bf16_scenario,  # resets Accelerate's process-wide mixed-precision state: keep it late
        "fp16_scaler": fp16_scaler_scenario,
    }
    results: dict[str, Any] = {"state_file": STATE_FILE, "seconds": {}}
    for name, scenario in scenarios.items():
        started = time.perf_counter()
        results[name] = scenario()
        results["seconds"][name] = round(time.perf_counter() - started, 3)
    write_rank_result(out, results, rank=int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    try:
        main()
    finally:
        # Let the gloo threads finish before interpreter exit, then destroy the group
        # (hf_altparams.engine.shutdown explains the "terminate called" abort it prevents).
        shutdown()
