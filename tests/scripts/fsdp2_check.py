"""2 or 4 gloo ranks: PhaseSwitcher on a fully_shard model, against one process, for several schedules.

Writes rank{r}.json: max abs difference to the single-process reference on the
concatenated batch (fp32), reduce-scatter bytes counted per step vs the
backend's trainable figure, a digest of the full parameters, and whether the bf16
MixedPrecisionPolicy run (units frozen at first forward, unfrozen later) trained.
Then, on DTensor optimizer state and residency ("state" entry): a
GroupedOptimizer (Adam) with each idle-state policy against the same optimizer
in one process, idle groups' state bytes on this rank, and a per-task cycle
whose idle groups' shards are moved to fresh storage and back at every switch
(FSDP2's padded storage swapped; on CPU the offload device is the compute
device, so this is the move a GPU run makes, minus the device).
"""

import functools
import gc
import hashlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, memory_report, shard_by_groups
from hf_altparams.engine.memory.transfer import to_host
from hf_altparams.plan import Alternating, GradualUnfreeze, ParamGroups, PerTaskCycle, RandomBlocks
from hf_altparams.planner import plan_cost
from hf_altparams.testing import write_rank_result


class Counting(DefaultReduceScatter):
    """Counts the bytes each rank feeds to reduce-scatter (public set_custom_reduce_scatter)."""

    total = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[override]
        Counting.total += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def build() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    )


def batches(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(steps)]


SCHEDULES = {
    "alternating": lambda: Alternating(["a", "b", "c"]),
    "gradual_unfreeze": lambda: GradualUnfreeze(["a", "b", "c"], every=2),
    "random_blocks": lambda: RandomBlocks(["a", "b", "c"], k=1, every=1, seed=3),
}


def train(model, steps, sharded, rank, world, schedule="alternating"):
    groups = ParamGroups(model, {"a": "0.*", "b": "2.*", "c": "4.*"})
    switcher = PhaseSwitcher(groups, SCHEDULES[schedule](), model=model if sharded else None)
    if not sharded:
        switcher.attach(model)  # the reference trains in this process alone, on purpose
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counted, expected = [], []
    for step, x in enumerate(batches(steps)):
        switcher.step_to(step)
        if sharded:
            x = x.chunk(world)[rank]
        Counting.total = 0
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        counted.append(Counting.total)
        expected.append(switcher.allreduce_bytes_per_step())
    return counted, expected


def full(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
        for n, p in model.named_parameters()
    }


def shard(model, mp=None):
    for unit in (model[0], model[2], model[4], model):
        fully_shard(unit, mp_policy=mp or MixedPrecisionPolicy())
        unit.set_custom_reduce_scatter(Counting())
    return model


class TwoTasks(torch.nn.Module):
    """A trunk and one head per task; the forward uses the head of ``self.task``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.t0, self.t1 = torch.nn.Linear(8, 6), torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)
        self.task = "t0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.task)(torch.tanh(self.trunk(x)))


def train_state(sharded, rank, world, policy=None, per_task=False):
    """Adam through GroupedOptimizer; alternating (policy) or a per-task cycle with shard moves."""
    model = TwoTasks()
    spec = {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"}
    groups = ParamGroups(model, spec)
    if sharded:
        groups = shard_by_groups(model, groups)
    schedule = PerTaskCycle(["trunk"], ["t0", "t1"], every=2) if per_task else Alternating(["trunk", "t0"])
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.Adam, lr=0.05), state_policy=policy or "keep")
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt, model=model if sharded else None)
    if not sharded:
        switcher.attach(model)
    idle_bytes = []
    for step, x in enumerate(batches(8)):
        record = switcher.step_to(step)
        if per_task and record is not None and sharded:
            for group in sorted(switcher.residency.non_resident(switcher.current)):
                for param in groups.params(group):  # the offload round trip, as fresh storage
                    switcher.backend.place_data(param, to_host(param.data, torch.device("cpu")))  # type: ignore[attr-defined]
        model.task = switcher.current.task or "t0"
        if sharded:
            x = x.chunk(world)[rank]
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        idle = [g for g in groups.names if g not in switcher.current.trainable]
        idle_bytes.append(sum(sum(opt.state_bytes(g).values()) for g in idle))
    if sharded:  # memory_report counts this rank's shards: parameters and optimizer state
        held = sum(p.to_local().nbytes for p in model.parameters()) + sum(
            v.to_local().nbytes if hasattr(v, "to_local") else v.nbytes
            for s in opt.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        idle_bytes.append(memory_report(switcher).total() - held)
    return full(model), idle_bytes


def state_checks(rank, world):
    out = {}
    for name, kwargs in {
        "keep": {"policy": "keep"},
        "offload": {"policy": "offload"},
        "drop": {"policy": "drop"},
        "per_task": {"per_task": True},
    }.items():
        got, idle_bytes = train_state(True, rank, world, **kwargs)
        ref, _ = train_state(False, rank, world, **kwargs)
        out[name] = {
            "max_diff": max(float((got[n] - ref[n]).abs().max()) for n in ref),
            "digest": hashlib.sha256(b"".join(t.numpy().tobytes() for t in got.values())).hexdigest(),
            "idle_state_bytes": idle_bytes,
        }
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = 6
    results = {}
    for schedule in SCHEDULES:
        sharded = shard(build())
        counted, expected = train(sharded, steps, True, rank, world, schedule)
        got = full(sharded)
        reference = build()
        train(reference, steps, False, rank, world, schedule)
        diff = max(float((got[n] - p.detach()).abs().max()) for n, p in reference.named_parameters())
        digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in got.values())).hexdigest()
        results[schedule] = {"max_diff": diff, "counted": counted, "expected": expected, "digest": digest}
    # the planner's FSDP2 mode against this run: reduce-scatter bytes per step, rank 0's parameter shards
    plain = build()
    plan = plan_cost(
        plain,
        ParamGroups(plain, {"a": "0.*", "b": "2.*", "c": "4.*"}),
        SCHEDULES["alternating"](),
        world_size=world,
        backend="fsdp2",
        optimizer="sgd",
    )
    results["planner"] = {
        "reduce_scatter": [plan.row(SCHEDULES["alternating"]().phase_at(s).name).allreduce_bytes for s in range(steps)],
        "param_bytes": plan.phases[0].param_bytes,
        "local_param_bytes": sum(p.to_local().nbytes for p in shard(build()).parameters()),
    }
    bf16 = shard(build(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    before = full(bf16)
    bf16_counted, bf16_expected = train(bf16, 4, True, rank, world)
    after = full(bf16)
    bf16_moved = {n: bool((after[n] - before[n]).abs().max() > 0) for n in after}
    write_rank_result(
        sys.argv[1],
        {
            "schedules": results,
            "bf16_counted": bf16_counted,
            "bf16_expected": bf16_expected,
            "bf16_moved": bf16_moved,
            "state": state_checks(rank, world),
            "world": world,
        },
    )
    del bf16  # FSDP2 states hold reference cycles: free every sharded model before the group goes
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
