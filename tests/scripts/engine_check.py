"""Multi-process checks of the phase-switch engine (every rank runs this script).

Usage::

    python -m torch.distributed.run --nproc_per_node 2 engine_check.py OUT_DIR [--only NAME ...]

Each rank writes ``OUT_DIR/rank{r}.json`` (and ``OUT_DIR/{case}_rank{r}.pt``
with the final parameters of every schedule case); ``tests/engine`` reads them.

The module is also imported by the tests (by path): :func:`train` with
``distributed=False`` is the single-process reference that a 2-rank DDP run
must reproduce. A reference step sees the concatenation of the ranks' half
batches and a mean loss, which is exactly what DDP's gradient average computes.

Scenarios:

* ``cases``: every schedule kind (plus an empty phase, ``static_graph``, a
  failed-and-rolled-back switch, an fp16 comm hook) trained with the engine;
  per step the bytes the comm hook counted, the switch records, and whether
  the gradients were fp16-exact.
* ``plain_ddp``: the same unfreeze / freeze done on a plain DDP (no library),
  documenting that the ranks diverge / the bytes never drop.
* ``buckets``: storage lifetime of ``gradient_as_bucket_view`` buckets across switches.
* ``rss``: process memory over hundreds of switches.
* ``settings``: DDP settings and comm hooks kept by the in-place rebuild,
  compared with a DDP freshly built in each phase.
* ``bad_inputs``: every refusal, on every rank, without a hang.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.parallel.distributed import _MixedPrecision

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, register_comm_counter, rss_bytes
from hf_altparams.engine.ddp import _surgery as _ddp
from hf_altparams.engine.ddp import free_reducer
from hf_altparams.engine.memory import malloc_trim
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import SwitchError
from hf_altparams.plan import (
    Alternating,
    Chain,
    FnSchedule,
    GradualUnfreeze,
    ParamGroups,
    PerTaskCycle,
    Phase,
    PhaseSequence,
    ProgressiveFreeze,
    RandomBlocks,
    Schedule,
)

#: Group name -> index of its layer in :func:`build_model` (sizes differ on purpose).
GROUP_LAYERS: dict[str, int] = {"l0": 0, "l1": 2, "l2": 4, "head": 6}
GLOBAL_BATCH = 8
IN_FEATURES, OUT_FEATURES = 6, 3


def build_model(seed: int = 0) -> nn.Sequential:
    """Four linear layers of different sizes (so every phase has distinct gradient bytes)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 16), nn.Tanh(),
        nn.Linear(16, 16), nn.Tanh(),
        nn.Linear(16, 24), nn.Tanh(),
        nn.Linear(24, OUT_FEATURES),
    )  # fmt: skip


#: Group name -> submodule path, for each model kind.
SEQ_GROUPS: dict[str, str] = {g: str(i) for g, i in GROUP_LAYERS.items()}
TASK_GROUPS: dict[str, str] = {"l0": "trunk.0", "l1": "trunk.2", "t0": "heads.0", "t1": "heads.1"}


class TwoTasks(nn.Module):
    """A shared trunk and one head per task; ``forward(x, task)`` runs only that task's head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(IN_FEATURES, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(16, OUT_FEATURES), nn.Linear(16, 2 * OUT_FEATURES)])

    def forward(self, x: torch.Tensor, task: int) -> torch.Tensor:
        return self.heads[task](self.trunk(x))[:, :OUT_FEATURES]


def make_groups(model: nn.Module, spec: Optional[dict[str, str]] = None) -> ParamGroups:
    return ParamGroups(model, {g: f"{path}.*" for g, path in (spec or SEQ_GROUPS).items()})


def _plain_forward(model: nn.Module, x: torch.Tensor, phase: Phase) -> torch.Tensor:
    return model(x)


def _task_forward(model: nn.Module, x: torch.Tensor, phase: Phase) -> torch.Tensor:
    return model(x, 0 if "t0" in phase.trainable else 1)


def batch(step: int, rank: int = 0, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch, or rank ``rank``'s equal share of it."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=gen)
    share = GLOBAL_BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    return x[rows], y[rows]


def _every_step_fn(step: int, epoch: int) -> list[str]:
    return [["head"], ["l1", "l2"], ["l0", "head"]][step % 3]


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=1e-2)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
OptimizerBuilder = Callable[[ParamGroups], torch.optim.Optimizer]


def grouped(factory: Any, policy: Any = "keep") -> OptimizerBuilder:
    return lambda groups: GroupedOptimizer(groups, factory, state_policy=policy)


def single(factory: Callable[..., torch.optim.Optimizer]) -> OptimizerBuilder:
    return lambda groups: factory(groups.module.parameters())


@dataclass
class Case:
    """One schedule trained with the engine (and, if ``reference``, compared with one process)."""

    name: str
    schedule: Callable[[], Schedule]
    optimizer: OptimizerBuilder
    steps: int = 12
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    hook: str = "count"  # "count" (register_comm_counter) or "fp16" (fp16_compress_hook)
    fail_switch_at: Optional[int] = None  # inject a one-off rebuild failure on rank 1 at this switch
    reference: bool = True
    build: Callable[[], nn.Module] = build_model
    group_modules: dict[str, str] = field(default_factory=lambda: dict(SEQ_GROUPS))
    forward: Callable[[nn.Module, torch.Tensor, Phase], torch.Tensor] = _plain_forward
    switcher_kwargs: dict[str, Any] = field(default_factory=dict)


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        Case(
            "PhaseSequence",
            lambda: PhaseSequence([("head", 2), (["l2", "head"], 3), (["l0", "l1"], 2)], repeat=True),
            grouped(SGD, "keep"),
        ),
        Case(
            "Alternating",
            lambda: Alternating({("l0", "l1"): 2, "l2": 1, "head": 1}),
            grouped(ADAM, {"l0": "keep", "l1": "offload", "l2": "drop", "head": "keep"}),
        ),
        Case("GradualUnfreeze", lambda: GradualUnfreeze(["l0", "l1", "l2"], every=3, always=["head"]), single(ADAMW)),
        Case(
            "ProgressiveFreeze",
            lambda: ProgressiveFreeze(["l0", "l1", "l2", "head"], every=3),
            grouped({"l0": SGD, "l1": SGD, "l2": ADAM, "head": ADAM}, "drop"),
        ),
        Case(
            "PerTaskCycle",
            lambda: PerTaskCycle(["l0", "l1"], ["t0", "t1"], every=2),
            grouped(ADAMW, "offload"),
            build=TwoTasks,
            group_modules=dict(TASK_GROUPS),
            forward=_task_forward,
        ),
        Case(
            "RandomBlocks",
            lambda: RandomBlocks(["l0", "l1", "l2"], k=1, every=2, seed=3, always=["head"]),
            grouped(ADAM, "drop"),
        ),
        Case(
            "FnSchedule", lambda: FnSchedule(_every_step_fn, groups=list(GROUP_LAYERS), name="every_step"), single(SGD)
        ),
        Case(
            "Chain",
            lambda: Chain(
                [(GradualUnfreeze(["l1", "l2"], every=2, always=["head"]), 4), (Alternating(["l0", "head"]), None)]
            ),
            grouped(ADAM, "keep"),
        ),
        # A phase that trains nothing: DDP is a pass-through, then training resumes.
        Case(
            "EmptyPhase",
            lambda: PhaseSequence([("l1", 2), (Phase([]), 3), (["l0", "head"], 4)], allow_empty=True),
            grouped(SGD, "keep"),
            steps=9,
        ),
        # Frozen when DDP was built, unfrozen later (plain DDP silently never syncs it).
        Case(
            "UnfreezeLater",
            lambda: PhaseSequence([(["l0", "l1", "head"], 3), (list(GROUP_LAYERS), 3)]),
            single(SGD),
            steps=6,
        ),
        Case(
            "StaticGraph",
            lambda: Alternating(["l2", ("l0", "head")], every=2),
            grouped(ADAM, "keep"),
            ddp_kwargs={"static_graph": True},
        ),
        # Rank 1's rebuild raises once at the switch into step 4; the loop retries the switch.
        Case(
            "Rollback", lambda: Alternating(["l1", "head"], every=2), grouped(ADAM, "keep"), steps=9, fail_switch_at=4
        ),
        Case(
            "Fp16Hook", lambda: Alternating(["l0", "l2"]), grouped(SGD, "keep"), steps=6, hook="fp16", reference=False
        ),
        # keep_reducers: idle phases' reducers re-installed at a switch back. Three phases
        # every step, ``head`` in two of them (an idle reducer's hooks fire on it).
        Case(
            "KeptReducers",
            lambda: FnSchedule(_every_step_fn, groups=list(GROUP_LAYERS), name="every_step"),
            grouped(ADAM, "keep"),
            switcher_kwargs={"keep_reducers": 2},
        ),
        Case(
            "KeptReducersBucketView",
            lambda: Alternating(["l0", ("l2", "head")]),
            grouped(SGD, "drop"),
            steps=10,
            ddp_kwargs={"gradient_as_bucket_view": True},
            switcher_kwargs={"keep_reducers": 1},
        ),
        Case(
            "KeptReducersRollback",
            lambda: Alternating(["l1", "head"]),
            grouped(ADAM, "keep"),
            steps=9,
            fail_switch_at=5,
            switcher_kwargs={"keep_reducers": 1},
        ),
    ]
}


def sha256(tensors: list[torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _fp16_exact(params: list[nn.Parameter]) -> bool:
    return all(bool(torch.equal(p.grad, p.grad.half().float())) for p in params if p.grad is not None)


def _fail_rebuild_once() -> None:
    """Make the next ``_ddp.rebuild_reducer`` call raise (this process only), then restore it."""
    original = _ddp.rebuild_reducer

    def failing(ddp: DDP, ignore: Any = None, **state: Any) -> None:
        _ddp.rebuild_reducer = original
        raise RuntimeError("injected rebuild failure")

    _ddp.rebuild_reducer = failing  # type: ignore[assignment]


def _state(model: nn.Module, ddp: Optional[DDP]) -> dict[str, Any]:
    return {
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "reduced": []
        if ddp is None
        else sorted(n for n, p in model.named_parameters() if any(p is q for q in _ddp.reduced_parameters(ddp))),
    }


def train(case: Case, *, distributed: bool) -> dict[str, Any]:
    """Train ``case``; DDP on the process group if ``distributed``, else one process, full batch.

    Returns the model, and per step the phase, bytes all-reduced (comm hook)
    and the switch record.
    """
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    model = case.build()
    groups = make_groups(model, case.group_modules)
    optimizer = case.optimizer(groups)
    switcher = PhaseSwitcher(groups, case.schedule(), optimizer=optimizer, **case.switcher_kwargs)
    switcher.step_to(0)
    wrapped: nn.Module = model
    counter = None
    if distributed:
        wrapped = DDP(model, **case.ddp_kwargs)
        switcher.attach(wrapped)
        if case.hook == "count":
            counter = register_comm_counter(wrapped)
        else:
            wrapped.register_comm_hook(None, fp16_compress_hook)
    steps: list[dict[str, Any]] = []
    rollback: dict[str, Any] = {}
    for step in range(case.steps):
        x, y = batch(step, rank, world)
        phase = switcher.current
        assert phase is not None
        fp16_exact = None
        if phase.trainable:
            F.mse_loss(case.forward(wrapped, x, phase), y).backward()
            fp16_exact = _fp16_exact(list(model.parameters()))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():  # nothing trains: DDP must be a pass-through
                case.forward(wrapped, x, phase)
        sent = counter.end_step() if counter is not None else None
        if distributed and case.fail_switch_at == step + 1:
            rollback = _failed_switch(case, switcher, wrapped, model, optimizer, counter, step, rank, world)
        record = switcher.step_to(step + 1)
        steps.append(
            {
                "step": step,
                "trainable": sorted(phase.trainable),
                "bytes_counted": sent,
                "fp16_exact_grads": fp16_exact,
                "switch": None
                if record is None
                else {
                    "phase": sorted(record.trainable_groups),
                    "allreduce_bytes_per_step": record.allreduce_bytes_per_step,
                    "trainable_bytes": record.trainable_bytes,
                    "seconds": record.seconds,
                },
            }
        )
    kept = switcher.backend.cache if isinstance(wrapped, DDP) else None
    return {
        "model": model,
        "steps": steps,
        "rollback": rollback,
        "records": len(switcher.records),
        "reducers_reused": kept.hits if kept is not None else 0,
        "kept_reducer_bytes": switcher.backend.kept_reducer_bytes(),
        "final_phase": sorted(switcher.current.trainable) if switcher.current is not None else None,
    }


def _failed_switch(
    case: Case,
    switcher: PhaseSwitcher,
    ddp: nn.Module,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    counter: Any,
    step: int,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """Switch with a rebuild failure injected on rank 1; probe the restored reducer; no update."""
    assert isinstance(ddp, DDP)
    before = _state(model, ddp)
    if rank == 1:
        _fail_rebuild_once()
    error = None
    try:
        switcher.step_to(step + 1)
    except SwitchError as exc:
        error = str(exc)
    after = _state(model, ddp)
    # Probe: one backward through the restored reducer (then discard the gradients).
    x, y = batch(step, rank, world)
    F.mse_loss(case.forward(ddp, x, switcher.current), y).backward()
    probe_bytes = counter.end_step()
    with_grad = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    optimizer.zero_grad(set_to_none=True)
    return {
        "error": error,
        "before": before,
        "after": after,
        "probe_bytes": probe_bytes,
        "probe_params_with_grad": with_grad,
        "phase_after": sorted(switcher.current.trainable),
    }


def run_cases(out_dir: Path, rank: int, world: int) -> dict[str, Any]:
    results = {}
    for name, case in CASES.items():
        run = train(case, distributed=True)
        model = run.pop("model")
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, out_dir / f"{name}_rank{rank}.pt")
        run["params_sha256"] = sha256(list(model.parameters()))
        results[name] = run
    return results


# ---------------------------------------------------------------- plain DDP (no library)
def run_plain_ddp(rank: int, world: int) -> dict[str, Any]:
    """What the library fixes: requires_grad toggled on a plain DDP."""
    out: dict[str, Any] = {}
    for what in ("unfreeze", "freeze"):
        model = build_model()
        l2 = list(model[GROUP_LAYERS["l2"]].parameters())
        l0 = list(model[GROUP_LAYERS["l0"]].parameters())
        if what == "unfreeze":
            for p in l2:
                p.requires_grad_(False)
            ddp = DDP(model)
        else:  # freezing later needs find_unused_parameters=True or DDP raises at the next step
            ddp = DDP(model, find_unused_parameters=True)
        counter = register_comm_counter(ddp)
        opt = SGD(model.parameters())
        sent = []
        for step in range(6):
            if step == 3:
                for p in l2 if what == "unfreeze" else l0:
                    p.requires_grad_(what == "unfreeze")
            x, y = batch(step, rank, world)
            F.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sent.append(counter.end_step())
        out[what] = {
            "bytes_counted": sent,
            "group_sha256": {g: sha256(list(model[i].parameters())) for g, i in GROUP_LAYERS.items()},
        }
    return out


# ---------------------------------------------------------------- bucket lifetime
def run_buckets(rank: int, world: int) -> list[dict[str, Any]]:
    """Do old gradient buckets (``gradient_as_bucket_view=True``) die at a switch?"""
    model = build_model()
    groups = make_groups(model)
    opt = GroupedOptimizer(groups, SGD)
    switcher = PhaseSwitcher(groups, Alternating(["l0", "l2", ("l1", "head")]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model, gradient_as_bucket_view=True)
    switcher.attach(ddp)
    log = []
    for step in range(6):
        x, y = batch(step, rank, world)
        F.mse_loss(ddp(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        storages = {id(g.untyped_storage()): g.untyped_storage() for g in grads}
        grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        refs = [StorageWeakRef(s) for s in storages.values()]
        storage_bytes = sum(s.nbytes() for s in storages.values())
        del grads, storages
        opt.step()
        opt.zero_grad(set_to_none=True)
        alive_before = [not r.expired() for r in refs]
        record = switcher.step_to(step + 1)
        expired_at_switch = [r.expired() for r in refs]
        # gloo's worker thread may drop its reference to the last all-reduced bucket
        # a moment after the future completed; wait (no training step) up to 2 s.
        deadline = time.monotonic() + 2.0
        while not all(r.expired() for r in refs) and time.monotonic() < deadline:
            time.sleep(0.01)
        log.append(
            {
                "switched": record is not None,
                "n_storages": len(refs),
                "grad_bytes": grad_bytes,
                "storage_bytes": storage_bytes,
                "alive_after_zero_grad": alive_before,
                "expired_at_switch": expired_at_switch,
                "expired_after_switch": [r.expired() for r in refs],
            }
        )
    return log


# ---------------------------------------------------------------- memory over many switches
def run_rss(rank: int, world: int, steps: int = 600, warmup: int = 100) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
    opt = GroupedOptimizer(groups, ADAM, state_policy="keep")
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model, gradient_as_bucket_view=True)
    switcher.attach(ddp)
    counter = register_comm_counter(ddp)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    y = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank + 10))
    rss: dict[int, int] = {}
    for step in range(steps):
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter.end_step()
        counter.history.clear()  # the test's own bookkeeping must not count as growth
        switcher.step_to(step + 1)
        if step + 1 in (warmup, steps):
            gc.collect()
            malloc_trim()
            rss[step + 1] = rss_bytes()
    return {
        "rss_warm": rss[warmup],
        "rss_end": rss[steps],
        "warmup": warmup,
        "steps": steps,
        "switches": switcher.history.count,
        "records_kept": len(switcher.records),
        "window": switcher.history.window,
    }


# ---------------------------------------------------------------- DDP settings
class SpareModel(nn.Module):
    """The test model plus a buffer and a parameter that forward never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.seq = build_model()
        self.spare = nn.Linear(2, 2)
        self.register_buffer("marker", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


SETTINGS: dict[str, dict[str, Any]] = {
    # The unused `spare` parameter trains in the "head" phase: needs find_unused_parameters.
    "A": {
        "find_unused_parameters": True,
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 0.002,
        "broadcast_buffers": False,
    },
    "B": {"static_graph": True, "broadcast_buffers": True, "bucket_cap_mb": 0.003},
}
SETTINGS_PHASES = [["l0", "l1"], ["l2", "head"], ["l0", "l1", "l2"]]


def _settings_groups(model: SpareModel, variant: str) -> ParamGroups:
    spec: dict[str, Any] = {g: f"seq.{i}.*" for g, i in GROUP_LAYERS.items()}
    if variant == "A":
        spec["head"] = [spec["head"], "spare.*"]
    return ParamGroups(model, spec)


def _ddp_view(ddp: DDP) -> dict[str, Any]:
    return {
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "broadcast_buffers": ddp.broadcast_buffers,
        "comm_hooks": [h.__qualname__ for h, _ in ddp._comm_hooks],
    }


def _train_steps(
    ddp: DDP, model: SpareModel, counter: Any, opt: torch.optim.Optimizer, first: int, n: int, rank: int, world: int
) -> list[int]:
    buckets = []
    for step in range(first, first + n):
        x, y = batch(step, rank, world)
        F.mse_loss(ddp(x), y).backward()
        buckets.append(counter.buckets_pending)
        counter.end_step()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return buckets


def run_settings(rank: int, world: int) -> dict[str, Any]:
    """Rebuilt DDP vs a DDP freshly built in each phase: same settings, same buckets."""
    out: dict[str, Any] = {}
    per_phase = 3
    for variant, kwargs in SETTINGS.items():
        model = SpareModel()
        groups = _settings_groups(model, variant)
        opt = GroupedOptimizer(groups, SGD)
        schedule = PhaseSequence([(p, per_phase) for p in SETTINGS_PHASES])
        switcher = PhaseSwitcher(groups, schedule, optimizer=opt)
        switcher.step_to(0)
        ddp = DDP(model, **kwargs)
        switcher.attach(ddp)
        counter = register_comm_counter(ddp)
        model.marker.fill_(float(rank))  # after DDP's constructor (which broadcast it)
        views, buckets, fresh_buckets = [_ddp_view(ddp)], [], []
        for index in range(len(SETTINGS_PHASES)):
            first = index * per_phase
            if index:
                switcher.step_to(first)
                views.append(_ddp_view(ddp))
            # A fresh DDP on a copy in the same phase (same requires_grad), same settings.
            twin = copy.deepcopy(model)
            twin_ddp = DDP(twin, **kwargs)
            twin_counter = register_comm_counter(twin_ddp)
            twin_opt = SGD([p for p in twin.parameters() if p.requires_grad])
            fresh_buckets.append(_train_steps(twin_ddp, twin, twin_counter, twin_opt, first, per_phase, rank, world))
            del twin_ddp, twin
            buckets.append(_train_steps(ddp, model, counter, opt, first, per_phase, rank, world))
        out[variant] = {
            "views": views,
            "buckets": buckets,
            "fresh_buckets": fresh_buckets,
            "marker": float(model.marker.item()),
            "params_sha256": sha256(list(model.parameters())),
        }
    return out


# ---------------------------------------------------------------- bad inputs
def _outcome(fn: Callable[[], Any]) -> dict[str, Optional[str]]:
    try:
        fn()
    except Exception as exc:  # recorded for the test to judge
        return {"type": type(exc).__name__, "message": str(exc), "cause": str(getattr(exc, "cause", ""))}
    return {"type": None, "message": None, "cause": None}


def run_bad_inputs(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = build_model()
    groups = make_groups(model)
    opt = GroupedOptimizer(groups, SGD)
    switcher = PhaseSwitcher(groups, Alternating(["l0", "l1", "head"]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model)
    switcher.attach(ddp)

    def one_step(step: int) -> None:
        x, y = batch(step, rank, world)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step(0)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}

    def in_no_sync(ranks: tuple[int, ...]) -> None:
        if rank in ranks:
            with ddp.no_sync():
                switcher.step_to(1)
        else:
            switcher.step_to(1)

    out["no_sync_all"] = _outcome(lambda: in_no_sync((0, 1)))
    out["no_sync_rank1"] = _outcome(lambda: in_no_sync((1,)))
    out["disagree"] = _outcome(lambda: switcher.switch(Phase(["l0"] if rank == 0 else ["head"]), step=1))
    # Different steps (both leave the current phase: the switch is a collective).
    out["disagree_step"] = _outcome(lambda: switcher.step_to(1 if rank == 0 else 2))

    def pending(ranks: tuple[int, ...]) -> None:
        if rank in ranks:
            p = model[GROUP_LAYERS["l0"]].weight
            p.grad = torch.ones_like(p)
        try:
            switcher.step_to(1)
        finally:
            opt.zero_grad(set_to_none=True)

    out["pending_all"] = _outcome(lambda: pending((0, 1)))
    one_step(1)  # two iterations: both reducers have re-bucketed (docs/design.md, fact 3)
    one_step(2)
    out["pending_rank1"] = _outcome(lambda: pending((1,)))
    out["flags_unchanged"] = flags == {n: p.requires_grad for n, p in model.named_parameters()}
    out["records_after_refusals"] = len(switcher.records)
    # `pending_rank1`: rank 0 applied and rolled back (its reducer is fresh and re-buckets,
    # with a broadcast, after its first iteration) while rank 1 refused; rank 1 must have
    # rebuilt too, or these steps pair mismatched collectives.
    out["steps_after_refusal"] = _outcome(lambda: [one_step(s) for s in (3, 4, 5)])
    out["params_after_refusal"] = sha256(list(model.parameters()))
    # After all refusals, the run goes on: a switch and a step work.
    out["recovered"] = _outcome(lambda: (switcher.step_to(1), one_step(1)))

    # A trainable head the forward never uses (every rank alike), find_unused_parameters=False:
    # its bucket is never all-reduced; the switch that would replace the reducer refuses.
    tasks = TwoTasks()
    task_groups = make_groups(tasks, TASK_GROUPS)
    task_opt = GroupedOptimizer(task_groups, SGD)
    task_switcher = PhaseSwitcher(task_groups, Alternating([("l0", "t0", "t1"), "l1"]), optimizer=task_opt)
    task_switcher.step_to(0)
    task_ddp = DDP(tasks)
    task_switcher.attach(task_ddp)
    x, y = batch(0, rank, world)
    F.mse_loss(task_ddp(x, 0), y).backward()
    task_opt.step()
    task_opt.zero_grad(set_to_none=True)
    out["unused_all"] = _outcome(lambda: task_switcher.step_to(1))
    out["unused_phase_after"] = sorted(task_switcher.current.trainable)
    free_reducer(task_ddp)

    mp_model = build_model()
    mp_ddp = DDP(mp_model, mixed_precision=_MixedPrecision(param_dtype=torch.bfloat16))
    out["mixed_precision"] = _outcome(
        lambda: PhaseSwitcher(make_groups(mp_model), Alternating(["l0", "head"]), model=mp_ddp)
    )
    mp_ddp = None  # freed before the next check

    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = "python_reducer"
    try:
        py_model = build_model()
        py_ddp = DDP(py_model)
    finally:
        torch._dynamo.config.optimize_ddp = saved
    out["python_reducer_detected"] = bool(py_ddp._use_python_reducer)
    out["python_reducer"] = _outcome(
        lambda: PhaseSwitcher(make_groups(py_model), Alternating(["l0", "head"])).attach(py_ddp)
    )
    return out


SCENARIOS: dict[str, Callable[[int, int], Any]] = {
    "plain_ddp": run_plain_ddp,
    "buckets": run_buckets,
    "settings": run_settings,
    "bad_inputs": run_bad_inputs,
    "rss": run_rss,
}


def main(argv: Optional[list[str]] = None) -> None:
    from hf_altparams.testing.launch import write_rank_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--only", nargs="*", default=None, help=f"scenarios to run (default all): cases {' '.join(SCENARIOS)}"
    )
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    wanted = args.only or ["cases", *SCENARIOS]
    result: dict[str, Any] = {"world_size": world, "torch": torch.__version__, "seconds": {}}
    started = time.perf_counter()
    if "cases" in wanted:
        result["cases"] = run_cases(args.out_dir, rank, world)
        result["seconds"]["cases"] = time.perf_counter() - started
    for name, fn in SCENARIOS.items():
        if name in wanted:
            started = time.perf_counter()
            result[name] = fn(rank, world)
            result["seconds"][name] = time.perf_counter() - started
    write_rank_result(args.out_dir, result, rank=rank)
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


if __name__ == "__main__":
    main()
