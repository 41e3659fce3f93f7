"""Multi-process checks of low-precision storage (every rank runs this script).

Usage::

    python -m torch.distributed.run --nproc_per_node N precision_check.py OUT_DIR

The model is stored in bf16; :class:`~hf_altparams.engine.PrecisionOptimizer`
keeps fp32 masters for the active groups (``master_policy`` per case). Each
rank writes ``OUT_DIR/rank{r}.json`` and ``OUT_DIR/{case}_rank{r}.pt`` (final
parameters). ``tests/engine/test_precision_distributed.py`` compares them with
:func:`train` run in one process (``distributed=False``), which does the same
arithmetic: per-shard bf16 forward/backward, each shard's gradient divided by
the world size in bf16 and summed (what DDP's all-reduce computes), fp32
master update.

Cases with ``accumulation > 1`` run that many micro-steps per optimizer step
(all but the last inside ``no_sync``), summed in fp32 by PrecisionOptimizer;
``allreduce_dtype="float32"`` all-reduces the bf16 buckets in fp32 (the
reference sums the per-rank fp32 gradients / world in fp32 and the master gets
that sum unrounded).

Scenarios per case: the plain run; a run interrupted mid-phase (state saved,
everything rebuilt from a fresh model, state loaded) that must end equal to
the plain run; the bytes DDP all-reduced per step.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import io
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import PhaseSwitcher, PrecisionOptimizer, register_comm_counter
from hf_altparams.plan import Alternating, ParamGroups, RandomBlocks, Schedule

GLOBAL_BATCH = 8
IN_FEATURES, OUT_FEATURES = 6, 3
GROUPS = {"l0": "0.*", "l1": "2.*", "l2": "4.*", "head": "6.*"}
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


@dataclass
class Case:
    name: str
    master_policy: str
    state_policy: str
    schedule: str  # "alternating" or "lisa"
    steps: int = 10
    resume_at: int = 5  # mid-phase for every=2 alternation starting at 0
    accumulation: int = 1  # micro-steps per optimizer step
    allreduce_dtype: Optional[str] = None  # "float32": all-reduce the bf16 buckets in fp32
    loss_over_accumulation: bool = False  # each micro-step's loss / accumulation (Accelerate's backward)
    bucket_view: bool = False  # DDP's gradient_as_bucket_view

    @property
    def wire_dtype(self) -> torch.dtype:
        return getattr(torch, self.allreduce_dtype) if self.allreduce_dtype else torch.bfloat16

    def build_schedule(self) -> Schedule:
        if self.schedule == "lisa":
            return RandomBlocks(["l0", "l1", "l2"], k=1, every=2, seed=3, always=["head"])
        return Alternating(["l0", "l1", "l2", "head"], every=2)


CASES = {
    c.name: c
    for c in [
        Case("offload", "offload", "offload", "alternating"),
        Case("drop", "drop", "drop", "lisa"),
        Case("accum3_fp32_wire", "offload", "offload", "alternating", accumulation=3, allreduce_dtype="float32"),
        Case("accum2", "drop", "drop", "lisa", accumulation=2),
        Case(
            "accum2_fp32_wire_view", "drop", "drop", "lisa", accumulation=2, allreduce_dtype="float32", bucket_view=True
        ),
    ]
}
#: the cases run at each world size (4 ranks on 2 CI cores are slow: the fp32-wire accumulation only)
CASES_AT = {2: list(CASES), 4: ["offload", "drop", "accum3_fp32_wire"]}


def build_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 24),
        nn.Tanh(),
        nn.Linear(24, OUT_FEATURES),
    ).to(torch.bfloat16)


def batch(step: int, rank: int, world: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + 100 * micro + step)
    x = torch.randn(GLOBAL_BATCH, IN_FEATURES, generator=gen)
    y = torch.randn(GLOBAL_BATCH, OUT_FEATURES, generator=gen)
    share = GLOBAL_BATCH // world
    rows = slice(rank * share, (rank + 1) * share)
    return x[rows].to(torch.bfloat16), y[rows].to(torch.bfloat16)


class Run:
    """Model, optimizer and switcher of one case; DDP when ``world`` ranks are live."""

    def __init__(self, case: Case, distributed: bool, world: int, seed: int = 0) -> None:
        self.case, self.distributed, self.world = case, distributed, world
        self.model = build_model(seed)
        self.groups = ParamGroups(self.model, GROUPS)
        self.optimizer = PrecisionOptimizer(
            self.groups,
            ADAMW,
            storage_dtype=torch.bfloat16,
            master_policy=case.master_policy,
            state_policy=case.state_policy,
            allreduce_dtype=getattr(torch, case.allreduce_dtype) if case.allreduce_dtype else None,
        )
        self.switcher = PhaseSwitcher(self.groups, case.build_schedule(), optimizer=self.optimizer)
        self.switcher.step_to(0)
        self.wrapped: nn.Module = self.model
        self.counter = None
        if distributed:
            self.wrapped = DDP(self.model, gradient_as_bucket_view=self.case.bucket_view)
            self.switcher.attach(self.wrapped)
            self.counter = register_comm_counter(self.wrapped)

    def step(self, step: int) -> dict[str, Any]:
        rank = dist.get_rank() if self.distributed else 0
        if self.distributed:
            assert isinstance(self.wrapped, DDP)
            for micro in range(self.case.accumulation):
                last = micro == self.case.accumulation - 1
                with nullcontext() if last else self.wrapped.no_sync():
                    x, y = batch(step, rank, self.world, micro)
                    F.mse_loss(self.wrapped(x), y).backward()
        else:
            assert self.case.accumulation == 1 and self.case.allreduce_dtype is None, (
                "reference() covers these"
            )  # what DDP computes: per-shard bf16 grads, each / world in bf16, summed
            shards = []
            for r in range(self.world):
                x, y = batch(step, r, self.world)
                F.mse_loss(self.model(x), y).backward()
                shards.append(
                    {n: p.grad.div(self.world) for n, p in self.model.named_parameters() if p.grad is not None}
                )
                self.optimizer.zero_grad(set_to_none=True)
            for n, p in self.model.named_parameters():
                if n in shards[0]:
                    total = torch.zeros_like(shards[0][n], dtype=torch.float32)
                    for s in shards:
                        total += s[n].float()
                    p.grad = total.to(p.dtype)
        trainable = sum(p.numel() for p in self.model.parameters() if p.grad is not None)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sent = self.counter.end_step() if self.counter is not None else None
        self.switcher.step_to(step + 1)
        return {"bytes": sent, "trainable_numel": trainable, "master_bytes": self.optimizer.master_bytes()}

    def state(self) -> bytes:
        buf = io.BytesIO()
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "switcher": self.switcher.state_dict(),
            },
            buf,
        )
        return buf.getvalue()

    def load(self, blob: bytes, step: int) -> None:
        saved = torch.load(io.BytesIO(blob), weights_only=False)
        self.model.load_state_dict(saved["model"])
        self.switcher.load_state_dict(saved["switcher"])
        self.switcher.step_to(step)
        self.optimizer.load_state_dict(saved["optimizer"])


def train(case: Case, *, distributed: bool, world: int, resume: bool = False) -> dict[str, Any]:
    """Train ``case``; with ``resume`` stop at ``case.resume_at``, rebuild everything and continue."""
    run = Run(case, distributed, world)
    steps = []
    restored_exact = None
    for step in range(case.steps):
        if resume and step == case.resume_at:
            blob = run.state()
            before = state_digest(run)
            del run
            run = Run(case, distributed, world, seed=1)  # different weights: the load must restore all
            run.load(blob, step)
            restored_exact = state_digest(run) == before
        steps.append(run.step(step))
    return {"model": run.model, "steps": steps, "restored_exact": restored_exact}


def state_digest(run: Run) -> str:
    """sha256 of the parameters, fp32 masters and optimizer state (values and dtypes)."""
    h = hashlib.sha256()

    def feed(key: str, value: Any) -> None:
        if isinstance(value, dict):
            for k in sorted(value, key=str):
                feed(f"{key}/{k}", value[k])
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                feed(f"{key}/{i}", v)
        elif isinstance(value, torch.Tensor):
            h.update(f"{key}:{value.dtype}".encode())
            h.update(value.detach().cpu().float().numpy().tobytes())
        else:
            h.update(f"{key}={value!r}".encode())

    feed("model", {n: p for n, p in run.model.named_parameters()})
    feed("optimizer", run.optimizer.state_dict())
    return h.hexdigest()


def reference(case: Case, world: int) -> nn.Module:
    """The same training written out by hand, without the library (no switcher, no PrecisionOptimizer).

    A bf16 model; per group an fp32 master and a plain ``AdamW`` on it; per step the
    schedule's phase; a group leaving the phase loses its Adam state (``state_policy="drop"``)
    and, with ``master_policy="drop"``, its master (re-created from the bf16 weights).
    Per rank the micro-steps' bf16 gradients are summed in fp32; the ranks' sums are
    divided by the world size and summed in the all-reduce dtype (bf16: rounded once
    first, as DDP's bf16 bucket is; fp32: the master gets the fp32 sum).
    """
    model = build_model()
    schedule = case.build_schedule()
    members = {g: [p for n, p in model.named_parameters() if n.startswith(pat[:-1])] for g, pat in GROUPS.items()}
    masters: dict[str, list[torch.Tensor]] = {}
    optims: dict[str, torch.optim.Optimizer] = {}
    active: frozenset[str] = frozenset()
    for step in range(case.steps):
        phase = frozenset(schedule.phase_at(step).trainable)
        for g in active - phase:
            if case.master_policy == "drop":
                masters.pop(g, None)
            if case.state_policy == "drop" and g in optims:
                optims[g].state.clear()
        for g in phase:
            if g not in masters:
                masters[g] = [p.detach().float().clone() for p in members[g]]
                state = optims[g].state if g in optims else None
                optims[g] = ADAMW(masters[g])
                if state:  # kept state re-keyed onto the re-created masters
                    for old, new in zip(list(state), masters[g]):
                        optims[g].state[new] = state[old]
        active = phase
        shards = []
        for r in range(world):
            local: list[list[torch.Tensor]] = []
            for micro in range(case.accumulation):
                x, y = batch(step, r, world, micro)
                model.zero_grad(set_to_none=True)
                loss = F.mse_loss(model(x), y)
                (loss / case.accumulation if case.loss_over_accumulation else loss).backward()
                grads = [[p.grad.float() for p in members[g]] for g in sorted(phase)]
                local = grads if not local else [[a + b for a, b in zip(la, ga)] for la, ga in zip(local, grads)]
            shards.append([[(t.to(case.wire_dtype) / world).float() for t in ts] for ts in local])
        model.zero_grad(set_to_none=True)
        for gi, g in enumerate(sorted(phase)):
            for pi, (param, master) in enumerate(zip(members[g], masters[g])):
                total = shards[0][gi][pi]
                for s in shards[1:]:
                    total = total + s[gi][pi]
                master.grad = total.to(case.wire_dtype).float()
            optims[g].step()
            for param, master in zip(members[g], masters[g]):
                master.grad = None
                param.detach().copy_(master)
    return model


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def digest(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].float().numpy().tobytes())
    return h.hexdigest()


def main(argv: Optional[list[str]] = None) -> None:
    from hf_altparams.testing.launch import write_rank_result

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--cases", help="comma list (default: CASES_AT[world size], else every case)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"world_size": world, "cases": {}}
    names = args.cases.split(",") if args.cases else CASES_AT.get(world, list(CASES))
    for name in names:
        case = CASES[name]
        plain = train(case, distributed=True, world=world)
        resumed = train(case, distributed=True, world=world, resume=True)
        params = params_of(plain["model"])
        torch.save(params, args.out_dir / f"{name}_rank{rank}.pt")
        torch.save(params_of(resumed["model"]), args.out_dir / f"{name}_resumed_rank{rank}.pt")
        result["cases"][name] = {
            "steps": plain["steps"],
            "sha256": digest(params),
            "resumed_sha256": digest(params_of(resumed["model"])),
            "restored_exact": resumed["restored_exact"],
            "dtypes": sorted({str(p.dtype) for p in plain["model"].parameters()}),
            "wire_itemsize": case.wire_dtype.itemsize,
        }
        del plain, resumed
    gc.collect()  # free the DDP wrappers before the process group (a live one can abort the exit)
    write_rank_result(args.out_dir, result, rank=rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
