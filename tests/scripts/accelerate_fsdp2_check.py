"""2 gloo ranks: PhasedAccelerator on Accelerate's own FSDP2 path, against one process; checkpoint resume.

Usage (the tests launch it)::

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 accelerate_fsdp2_check.py OUT_DIR
    torchrun --nproc_per_node 1 accelerate_fsdp2_check.py OUT_DIR   # on a GPU: Accelerate's FSDP2 for real

Accelerate picks MULTI_CPU on CPU, so there the accelerator is switched to FSDP
with its FSDP2 plugin after construction (:func:`hf_altparams.testing.fsdp2.use_accelerate_fsdp2`);
``prepare``, ``save_state`` and ``load_state`` then run Accelerate's FSDP2 code
(``fully_shard`` per ``Linear``, DCP sharded checkpoints). Writes rank{r}.json:
max abs difference to the single-process reference (same schedule, concatenated
batch), reduce-scatter bytes counted per step vs the switcher's figure, the switch
log's keys, and whether a run resumed from a mid-phase checkpoint ends bitwise
equal to the uninterrupted one.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import os
import sys
import weakref

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.fsdp2 import fresh_accelerator_state, use_accelerate_fsdp2
from hf_altparams.testing.launch import write_rank_result

SPECS = {"a": "0.*", "b": "2.*", "c": "4.*"}
SCHEDULE = {"a": 2, "b": 1, "c": 2}
POLICY = {"a": "keep", "b": "drop", "c": "offload"}
STEPS, SAVE_AT, ACCUM = 8, 3, 2  # SAVE_AT is inside phase "b"... then "c" (steps 3-4)
LR = 0.05


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 8, generator=g) for _ in range(STEPS * ACCUM)]


def optimizer(groups: ParamGroups, policy: object = POLICY) -> GroupedOptimizer:
    return GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=LR), state_policy=policy)


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for n, p in model.named_parameters()
    }


def reference(policy: object = POLICY) -> dict[str, torch.Tensor]:
    """One process, no sharding: the same schedule on the concatenated batch."""
    model = build()
    groups = ParamGroups(model, SPECS)
    opt = optimizer(groups, policy)
    switcher = PhaseSwitcher(groups, Alternating(SCHEDULE), optimizer=opt)
    switcher.attach(model)  # trains in this process alone, on purpose
    data = batches()
    for step in range(STEPS):
        switcher.step_to(step)
        for micro in range(ACCUM):
            (model(data[step * ACCUM + micro]).pow(2).mean() / ACCUM).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return full(model)


def runs_fsdp2(acc: PhasedAccelerator) -> bool:
    """Whether Accelerate chose FSDP2 itself (its ``is_fsdp2`` raises when no FSDP plugin was kept)."""
    try:
        return bool(acc.is_fsdp2)
    except AttributeError:
        return False


def accelerator(schedule: dict[str, int] = SCHEDULE, **kwargs: object) -> PhasedAccelerator:
    fresh_accelerator_state()  # the accelerator reads its own FSDP plugin
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["Linear"]
    )
    acc = PhasedAccelerator(
        Alternating(schedule), count_comm=True, gradient_accumulation_steps=ACCUM, fsdp_plugin=plugin, **kwargs
    )
    acc.forced_fsdp2 = not runs_fsdp2(acc)  # type: ignore[attr-defined]
    if acc.forced_fsdp2:  # type: ignore[attr-defined]  # CPU ranks, or a single GPU: Accelerate skips FSDP
        use_accelerate_fsdp2(acc, plugin)
    assert acc.is_fsdp2
    return acc


def train(
    acc: PhasedAccelerator, model: nn.Module, opt: object, start: int, stop: int, save_to: str | None = None
) -> tuple[list[int], list[int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches()
    expected = []
    for step in range(start, stop):
        expected.append(acc.switcher.allreduce_bytes_per_step())
        for micro in range(ACCUM):
            x = data[step * ACCUM + micro].chunk(world)[rank].to(acc.device)
            with acc.accumulate(model):
                acc.backward(model(x).pow(2).mean())
                opt.step()
                opt.zero_grad()
        if save_to is not None and acc.schedule_step == SAVE_AT:
            acc.save_state(save_to)
    return acc.comm_counter.history[-(stop - start) :], expected


def bf16_run() -> dict[str, object]:
    """``mixed_precision="bf16"``: Accelerate's bf16 MixedPrecisionPolicy; units b, c frozen at the first forward."""
    acc = accelerator({"a": 1, "b": 1, "c": 1}, mixed_precision="bf16")
    model = build()
    opt = optimizer(ParamGroups(model, SPECS))
    model, prepared_opt = acc.prepare(model, opt)
    groups = acc.groups
    assert groups is not None
    before = {
        g: torch.cat([p.full_tensor().detach().float().flatten() for p in groups.params(g)]) for g in groups.names
    }
    counted, expected = train(acc, model, prepared_opt, 0, 4)
    after = {g: torch.cat([p.full_tensor().detach().float().flatten() for p in groups.params(g)]) for g in groups.names}
    changed = [g for g in groups.names if not torch.equal(after[g], before[g])]
    final = full(model)
    return {
        "changed": changed,
        "counted": counted,
        "expected": expected,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "digest": hashlib.sha256(b"".join(t.float().numpy().tobytes() for t in final.values())).hexdigest(),
    }


def per_group_run() -> tuple[float, int]:
    """One AdamW per group, ``prepare(model, opt_a, opt_b, opt_c)``: max difference to the reference.

    And how many of the parameters from before ``fully_shard`` are still alive once
    ``prepare`` is done (the groups given to the accelerator are the only ones that
    could hold them: a whole unsharded copy of the model on every rank).
    """
    model = build()
    acc = accelerator(groups=ParamGroups(model, SPECS))
    before = [weakref.ref(p) for p in model.parameters()]
    opts = [torch.optim.AdamW(model[i].parameters(), lr=LR) for i in (0, 2, 4)]
    model, *handles = acc.prepare(model, *opts)
    gc.collect()
    alive = sum(ref() is not None for ref in before)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = batches()
    for step in range(STEPS):
        for micro in range(ACCUM):
            with acc.accumulate(model):
                acc.backward(model(data[step * ACCUM + micro].chunk(world)[rank].to(acc.device)).pow(2).mean())
                for handle in handles:  # the loop steps every optimizer; idle groups' do nothing
                    handle.step()
                for handle in handles:
                    handle.zero_grad()
    got, ref = full(model), reference("keep")
    return max(float((got[n] - ref[n]).abs().max()) for n in ref), alive


def check(out: str) -> dict[str, object]:
    """Run the checks (every rank); the rank's results."""
    acc = accelerator()
    model = build()
    opt = optimizer(ParamGroups(model, SPECS))
    model, prepared_opt = acc.prepare(model, opt)
    sharded_units = sum(1 for m in model.modules() if type(m).__name__.startswith("FSDP"))
    counted, expected = train(acc, model, prepared_opt, 0, STEPS, save_to=os.path.join(out, "ckpt"))
    first_metrics = acc.switch_metrics(acc.switch_records[0])
    got = full(model)
    ref = reference()
    diff = max(float((got[n] - ref[n]).abs().max()) for n in ref)

    # Resume: a fresh model and accelerator load the mid-run checkpoint and train to the end.
    acc2 = accelerator()
    model2 = build()
    opt2 = optimizer(ParamGroups(model2, SPECS))
    model2, prepared_opt2 = acc2.prepare(model2, opt2)
    acc2.load_state(os.path.join(out, "ckpt"))
    loaded_step, loaded_phase = acc2.schedule_step, acc2.phase.name if acc2.phase else None
    train(acc2, model2, prepared_opt2, SAVE_AT, STEPS)
    resumed = full(model2)
    return {
        "sharded_units": sharded_units,
        "device": str(acc.device),
        "forced_fsdp2": acc.forced_fsdp2,  # type: ignore[attr-defined]
        "max_diff": diff,
        "counted": counted,
        "expected": expected,
        "trainable_bytes_first": first_metrics.get("altparams/trainable_bytes"),
        "reduce_scatter_first": first_metrics.get("altparams/reduce_scatter_bytes_per_step"),
        "loaded_step": loaded_step,
        "loaded_phase": loaded_phase,
        "resume_bitwise_equal": all(torch.equal(resumed[n], got[n]) for n in got),
        "resume_max_diff": max(float((resumed[n] - got[n]).abs().max()) for n in got),
        "ckpt_files": sorted(os.listdir(os.path.join(out, "ckpt"))),
        "bf16": bf16_run(),
        **dict(zip(("per_group_max_diff", "pre_shard_alive"), per_group_run())),
    }


def main() -> None:
    write_rank_result(sys.argv[1], check(sys.argv[1]), rank=dist.get_rank())


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
