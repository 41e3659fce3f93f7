"""Smoke check of the multi-process set-up: gloo all-reduce and one DDP step.

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 2 smoke_allreduce.py OUT_DIR
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 smoke_allreduce.py OUT_DIR

Both launchers set ``LOCAL_RANK`` and the rendezvous variables, so the script
initialises the gloo process group from the environment. Run by plain
``python`` it falls back to ``accelerate.PartialState`` and, if that leaves no
process group, to a one-rank gloo group.

Each rank seeds its model differently on purpose: DDP's construction must
broadcast rank 0's parameters, and the data differs per rank, so identical
parameters after the step show that gradients were averaged.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.testing.launch import free_port, write_rank_result


def init_group() -> None:
    if "LOCAL_RANK" in os.environ:  # torchrun, or accelerate launch (which runs torchrun's launcher)
        dist.init_process_group(backend="gloo")
        return
    from accelerate import PartialState

    PartialState(cpu=True)
    if not dist.is_initialized():  # plain `python smoke_allreduce.py OUT_DIR`
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


def main() -> None:
    out_dir = sys.argv[1]
    init_group()
    rank, world = dist.get_rank(), dist.get_world_size()

    # 1. all-reduce: sum of (rank + 1) over ranks is world * (world + 1) / 2.
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value, op=dist.ReduceOp.SUM)

    # 2. one DDP step on a tiny model, seeded differently per rank.
    torch.manual_seed(1234 + rank)
    model = nn.Linear(3, 2)
    before_ddp = [sha256(p) for p in model.parameters()]
    ddp = DDP(model)  # init_sync broadcasts rank 0's parameters
    reference = copy.deepcopy(model)  # same weights, no DDP: its gradient is purely local

    x = torch.full((4, 3), float(rank + 1))
    ddp(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()

    # DDP's gradient must equal the average of the local gradients.
    grads_ok = True
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None
        averaged = q.grad.clone()
        dist.all_reduce(averaged, op=dist.ReduceOp.SUM)
        averaged /= world
        grads_ok = grads_ok and torch.allclose(p.grad, averaged, rtol=1e-6, atol=1e-7)

    torch.optim.SGD(model.parameters(), lr=0.1).step()

    write_rank_result(
        out_dir,
        {
            "world_size": world,
            "backend": str(dist.get_backend()),
            "pid": os.getpid(),
            "accelerate_use_cpu_env": os.environ.get("ACCELERATE_USE_CPU"),
            "cuda_available": torch.cuda.is_available(),
            "allreduce_sum": value.item(),
            "param_sha256_before_ddp": before_ddp,
            "param_sha256": [sha256(p) for p in model.parameters()],
            "param_sums": [p.detach().double().sum().item() for p in model.parameters()],
            "grad_sha256": [sha256(p.grad) for p in model.parameters() if p.grad is not None],
            "grad_is_average": bool(grads_ok),
        },
        rank=rank,
    )
    dist.barrier()
    shutdown()  # gloo threads finish, then the group goes (see hf_altparams.engine.shutdown)


if __name__ == "__main__":
    main()
