"""Measure, in a real DDP run, what the planner estimates: bytes all-reduced and memory by category.

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 2 planner_check.py OUT_DIR SCENARIOS_JSON

``SCENARIOS_JSON`` maps a scenario name to the argument list of
``python -m hf_altparams plan`` (it must give ``--steps``). Each scenario builds
that model for real on the CPU, with those groups and that schedule, and trains
it with the engine: :class:`PhaseSwitcher`, :class:`GroupedOptimizer` (the
``--optimizer`` and ``--state-policy`` asked for), DDP with
``gradient_as_bucket_view`` = ``--bucket-as-view``. After ``--steps`` steps it
switches to every group and runs one more step (the "train everything" row).

At every step, after ``optimizer.step()`` (gradients still set), it records:

* ``allreduce``: bytes DDP all-reduced in that step, counted by the engine's
  :func:`counting_allreduce_hook` (wrapped so that it also notes each bucket's storage);
* a census of distinct tensor storages (bytes): ``params``, ``buffers``, ``grads``,
  ``bucket_extra`` (DDP bucket storage that no gradient is a view of),
  ``optimizer`` (state tensors of one or more dimensions), ``optimizer_counters``
  (0-d state such as Adam's ``step``) and ``total`` (all of them, each storage once).
"""

# No `from __future__ import annotations`: DDP checks the comm hook's annotations are real types.
import functools
import json
import os
import sys
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import CommCounter, GroupedOptimizer, PhaseSwitcher, counting_allreduce_hook
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.plan import Phase
from hf_altparams.planner import build_from_argv
from hf_altparams.testing import write_rank_result

OPTIMIZERS = {
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-3),
    "adam": functools.partial(torch.optim.Adam, lr=1e-3),
    "sgd": functools.partial(torch.optim.SGD, lr=0.1),
    "sgd-momentum": functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9),
}

# Storages (data_ptr -> bytes) of the buckets all-reduced in the current step.
_BUCKETS: dict[int, int] = {}


def census_hook(state: CommCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The engine's counting hook, noting the bucket's storage first."""
    storage = bucket.buffer().untyped_storage()
    _BUCKETS[storage.data_ptr()] = storage.nbytes()
    return counting_allreduce_hook(state, bucket)


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def census(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = _storages(model.parameters())
    buffers = _storages(model.buffers())
    grads = _storages(p.grad for p in model.parameters() if p.grad is not None)
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tensors = _storages(v for v in state if v.dim() > 0)
    counters = _storages(v for v in state if v.dim() == 0)
    every = {**params, **buffers, **grads, **_BUCKETS, **tensors, **counters}
    return {
        "params": sum(params.values()),
        "buffers": sum(buffers.values()),
        "grads": sum(grads.values()),
        "bucket_extra": sum(n for ptr, n in _BUCKETS.items() if ptr not in grads),
        "optimizer": sum(tensors.values()),
        "optimizer_counters": sum(counters.values()),
        "total": sum(every.values()),
    }


def forward_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """A loss that reaches every parameter of a transformers encoder (pooler included)."""
    vocab = model.module.config.vocab_size
    generator = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, vocab, (4, 8), generator=generator)
    out = model(input_ids=ids)
    loss = out.last_hidden_state.pow(2).mean()
    if getattr(out, "pooler_output", None) is not None:
        loss = loss + out.pooler_output.pow(2).mean()
    return loss


def run_scenario(argv: list[str], rank: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    args, model, groups, schedule = build_from_argv(argv, device="cpu")
    if args.steps is None:
        raise SystemExit(f"scenario {argv} must give --steps")
    optimizer = GroupedOptimizer(groups, OPTIMIZERS[args.optimizer], state_policy=args.state_policy)
    switcher = PhaseSwitcher(groups, schedule, optimizer=optimizer)
    switcher.step_to(0)  # before wrapping: DDP's constructor needs the first phase's flags
    ddp = DDP(model, gradient_as_bucket_view=args.bucket_as_view)
    switcher.attach(ddp)
    counter = CommCounter(process_group=ddp.process_group)
    ddp.register_comm_hook(counter, census_hook)

    records = []
    for step in range(args.steps + 1):
        if step == args.steps:
            switcher.switch(Phase(groups.names, label="train everything"), step=step)
        _BUCKETS.clear()
        forward_loss(ddp, rank, step).backward()
        optimizer.step()
        assert switcher.current is not None
        records.append(
            {"step": step, "phase": switcher.current.name, "allreduce": counter.end_step(), **census(model, optimizer)}
        )
        optimizer.zero_grad(set_to_none=True)
        if step + 1 < args.steps:
            switcher.step_to(step + 1)
    return records


def main() -> None:
    out_dir, scenarios = sys.argv[1], json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {name: run_scenario(argv, rank) for name, argv in scenarios.items()}
    write_rank_result(out_dir, {"world_size": dist.get_world_size(), "pid": os.getpid(), "scenarios": results})
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


if __name__ == "__main__":
    main()
