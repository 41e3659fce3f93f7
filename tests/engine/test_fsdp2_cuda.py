"""FSDP2 on one GPU (NCCL, world size 1): idle shards really leave the device (skipped without CUDA).

World size 1 still runs FSDP2's machinery (DTensor parameters, all-gather into
unsharded parameters, reduce-scatter, mixed precision). Checked: under the
``offload`` policy the idle groups' Adam state (DTensor shards) lives in pinned
host memory and ``memory_allocated`` is lower than under ``keep`` by exactly
those bytes, with bit-identical training; under per-task residency the
non-resident head's parameter shards (FSDP2's own storage included) and state
leave the device, with training identical to the run that keeps them.
"""

from __future__ import annotations

import functools
import gc
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, shard_by_groups
from hf_altparams.engine.fsdp2._backend import local_tensor
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle

pytestmark = pytest.mark.cuda

WIDTH = 1024
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


@pytest.fixture(scope="module")
def nccl_world_1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    store: Path = tmp_path_factory.mktemp("nccl") / "store"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(store), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class TwoTasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.t0, self.t1 = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.task = "t0"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.task)(torch.tanh(self.trunk(x)))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}


def _state(opt: GroupedOptimizer, group: str) -> list[torch.Tensor]:
    return [
        v
        for p in opt.groups.params(group)
        for v in opt.inner[group].state.get(p, {}).values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    ]


def _settled_allocated(timeout: float = 5.0) -> int:
    """``memory_allocated`` once it stops moving (bounded wait).

    NCCL keeps the tensors of a finished asynchronous collective alive until
    its watchdog thread, which polls, notices the work completed; until then a
    reading includes buffers the switch already let go of. Garbage in cycles is
    collected first.
    """
    gc.collect()
    torch.cuda.synchronize()
    last, since, deadline = torch.cuda.memory_allocated(), time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = torch.cuda.memory_allocated()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.3:
            break
    return last


def _train(per_task: bool, **switcher_kwargs: Any) -> tuple[dict[str, torch.Tensor], list[int], Any]:
    """Six steps; returns full parameters, memory_allocated after each switch, and the objects.

    ``memory_allocated`` is taken over what was allocated before this run's model existed: the tests
    keep the objects of an earlier run alive (and so out of the comparison), and other tests in the
    same process may leave tensors behind.
    """
    base = _settled_allocated()
    model = TwoTasks().cuda()
    groups = shard_by_groups(model, ParamGroups(model, {"trunk": "trunk.*", "t0": "t0.*", "t1": "t1.*"}), mp_policy=MP)
    policy = switcher_kwargs.pop("policy", "keep")
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.Adam, lr=1e-3), state_policy=policy)
    schedule = PerTaskCycle(["trunk"], ["t0", "t1"], every=2) if per_task else Alternating(["trunk", "t0", "t1"])
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt, model=model, **switcher_kwargs)
    gen = torch.Generator(device="cuda").manual_seed(0)
    allocated, overshoot = [], []
    for step in range(6):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        switcher.step_to(step)
        torch.cuda.synchronize()
        now = _settled_allocated()
        allocated.append(now - base)
        overshoot.append(torch.cuda.max_memory_allocated() - max(before, now))
        model.task = switcher.current.task or ("t1" if step % 3 == 2 else "t0")
        model(torch.randn(8, WIDTH, device="cuda", generator=gen)).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _full(model), allocated, (model, opt, switcher, overshoot)


def test_cuda_offload_moves_idle_dtensor_state_to_pinned_host_and_equals_keep(nccl_world_1: None) -> None:
    # This is the process's first CUDA training: what a process allocates once, at its first
    # matmul and backward, and keeps for good (cuBLAS's workspace per stream, 32 MiB each on Hopper,
    # is the likely part) fell inside the keep run's readings and not the offload run's. On an H100,
    # keep - offload came out 84,951,040 B for 16,793,600 B of idle state: 68,157,440 B = exactly
    # 65 MiB more, while the residency test below (run later in the same process) matched to 1 %.
    # So a discarded run comes first.
    _train(False, policy="keep")
    gc.collect()
    keep, keep_alloc, first = _train(False, policy="keep")
    del first  # the keep run's model and state go before the offload run is measured
    offload, off_alloc, (model, opt, switcher, overshoot) = _train(False, policy="offload")
    assert all(torch.equal(keep[n], offload[n]) for n in keep)
    switcher.step_to(6)  # phase "trunk": t0 and t1 idle, both have Adam state
    idle = _state(opt, "t0") + _state(opt, "t1")
    assert idle and all(t.device.type == "cpu" and local_tensor(t).is_pinned() for t in idle)
    assert all(t.is_cuda for t in _state(opt, "trunk"))
    # at step 5 ("t1" active), "trunk" and "t0" are idle: their state is off the device
    idle_bytes = sum(local_tensor(t).nbytes for t in _state(opt, "trunk") + _state(opt, "t0"))
    assert keep_alloc[5] - off_alloc[5] == pytest.approx(idle_bytes, rel=0.01)
    # a switch moves the idle group's state out before the active one's comes back: no transient peak
    assert max(overshoot) <= 0.01 * idle_bytes, overshoot
    del model, opt, switcher


def test_cuda_residency_moves_non_resident_shards_and_fsdp2_storage_off_the_device(nccl_world_1: None) -> None:
    stay, stay_alloc, _ = _train(True, offload_device=None)
    moved, moved_alloc, (model, opt, switcher, _) = _train(True, offload_device="cpu")
    assert all(torch.equal(stay[n], moved[n]) for n in stay)
    switcher.step_to(6)  # t1 again: t0 non-resident
    backend = switcher.backend
    for param in model.t0.parameters():
        assert param.device.type == "cpu" and local_tensor(param).is_pinned()
        assert backend._fsdp_param_of[id(param)]._sharded_param_data.device.type == "cpu"
    assert all(t.device.type == "cpu" for t in _state(opt, "t0"))
    assert all(p.is_cuda for p in model.t1.parameters())
    # at step 2 ("t1" trains), t0's parameters and its Adam state (from steps 0-1) are on the host
    t0_bytes = sum(local_tensor(p).nbytes for p in model.t0.parameters()) * 3  # param + exp_avg + exp_avg_sq
    assert stay_alloc[2] - moved_alloc[2] == pytest.approx(t0_bytes, rel=0.01)
    del model, opt, switcher
