"""2 gloo ranks: PhaseSwitcher on a fully_shard model, against one process, for several schedules.

Writes rank{r}.json: max abs difference to the single-process reference on the
concatenated batch (fp32), reduce-scatter bytes counted per step vs the
backend's trainable figure, a digest of the full parameters, and whether the bf16
MixedPrecisionPolicy run (units frozen at first forward, unfrozen later) trained.
"""

import hashlib
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.plan import Alternating, GradualUnfreeze, ParamGroups, RandomBlocks
from hf_altparams.testing import write_rank_result


class Counting(DefaultReduceScatter):
    """Counts the bytes each rank feeds to reduce-scatter (public set_custom_reduce_scatter)."""

    total = 0

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # type: ignore[override]
        Counting.total += input_tensor.numel() * input_tensor.element_size()
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def build() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 6), torch.nn.Tanh(),
                               torch.nn.Linear(6, 3))


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
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.named_parameters()}


def shard(model, mp=None):
    for unit in (model[0], model[2], model[4], model):
        fully_shard(unit, mp_policy=mp or MixedPrecisionPolicy())
        unit.set_custom_reduce_scatter(Counting())
    return model


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
    bf16 = shard(build(), MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    before = full(bf16)
    bf16_counted, bf16_expected = train(bf16, 4, True, rank, world)
    after = full(bf16)
    bf16_moved = {n: bool((after[n] - before[n]).abs().max() > 0) for n in after}
    write_rank_result(sys.argv[1], {"schedules": results, "bf16_counted": bf16_counted,
                                    "bf16_expected": bf16_expected, "bf16_moved": bf16_moved})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
