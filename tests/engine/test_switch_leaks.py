"""Per-step alternation under DDP frees, at every switch, the old reducer and its gradient buckets.

The CPU guard of what a switch must free (``tests/support/switch_leaks.py``):
weak references to the old reducer, its logger and its bucket storages, dead
right after the switch; the tensors Python can reach, and the storages a window
of switches created and still holds (C++ holders included), the same over
tens of switches.
Each check is first shown able to fail: a set-up that keeps the old reducers,
or the old buckets, must make it fail. No timing: what a switch frees it frees
by reference count, with the garbage collector off. What only a GPU run can see
(NCCL, the caching allocator) is in ``docs/switch.md`` ("Per-switch device memory").
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hf_altparams.testing import launch, rank_results
from tests.support.switch_leaks import (
    Alternation,
    BucketProbe,
    NewStorages,
    SwitchLeakError,
    guard_alternation,
    settled,
    storages_kept,
)

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "switch_leak_check.py"


def test_a_weak_reference_to_a_storage_dies_with_the_cpp_storage_not_with_its_python_object(
    gloo_world_1: dist.ProcessGroup,
) -> None:
    # What the guard relies on: torch keeps a storage's Python object while the C++ storage
    # lives, so dropping every Python reference leaves the weak reference alive as long as
    # C++ (here: a DDP reducer's bucket, reached through a gradient that is a view of it) holds it.
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ddp = DistributedDataParallel(net, gradient_as_bucket_view=True)
    reducer = weakref.ref(ddp.reducer)  # a reducer can be weakly referenced
    ddp(torch.ones(2, 4)).sum().backward()
    storage = net[0].weight.grad.untyped_storage()
    assert storage.nbytes() > net[0].weight.grad.numel() * 4  # the whole bucket, not the one gradient
    bucket = weakref.ref(storage)
    del storage
    for p in net.parameters():
        p.grad = None  # no Python reference to the bucket is left
    assert bucket() is not None and reducer() is not None  # the C++ reducer holds it
    ddp.reducer = None
    ddp.logger = None  # the logger holds the reducer
    # freed by reference count, no gc pass (read once settled: gloo's worker thread lets go of
    # the bucket it all-reduced a moment after the backward saw the all-reduce finish)
    assert settled(lambda: (reducer() is None, bucket() is None)) == (True, True)


def test_new_storages_sees_what_cpp_creates_and_holds(gloo_world_1: dist.ProcessGroup) -> None:
    held: list[torch.Tensor] = []
    assert storages_kept(lambda: held.append(torch.empty(1000))) == (1, 4000)
    assert storages_kept(lambda: torch.empty(1000)) == (0, 0)  # freed inside the window
    base = torch.zeros(10)
    assert storages_kept(lambda: held.append(base.add_(1).view(2, 5))) == (0, 0)  # in place, a view: not new
    # A DDP reducer allocates its bucket from C++: seen, and alive while the reducer lives.
    net = nn.Linear(4, 4)
    with NewStorages() as watch:
        ddp = DistributedDataParallel(net)
    assert watch.alive() == (1, sum(p.numel() * 4 for p in net.parameters()))
    ddp.reducer = None
    ddp.logger = None
    assert watch.alive() == (0, 0)


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy_grads", "bucket_view"])
def test_every_switch_frees_the_old_reducer_and_buckets_and_memory_stays_flat(
    gloo_world_1: dist.ProcessGroup, bucket_view: bool
) -> None:
    # Default settings; without bucket views only a comm hook sees the buckets, so a probe
    # hook (DDP's own all-reduce, plus a weak reference to each bucket) watches them.
    rig = Alternation(gradient_as_bucket_view=bucket_view, probe=not bucket_view)
    try:
        report = guard_alternation(rig, warmup=6, census_switches=40, windows=(6, 16))
    finally:
        rig.close()
    assert report.switches == 6 + 40 + 6 + 16
    assert report.census_end == report.census_warm
    # What each window keeps is what its last switch built: the live reducer's bucket, one
    # half's gradients.
    half = sum(p.numel() * p.element_size() for p in rig.model.a.parameters())
    assert report.kept == ((1, half), (1, half))


def test_the_default_path_without_a_hook_keeps_memory_flat(gloo_world_1: dist.ProcessGroup) -> None:
    # DDP's built-in all-reduce (no Python hook): the reducers are watched by weak reference,
    # the buckets through the storages each window created.
    rig = Alternation()
    try:
        report = guard_alternation(rig)
    finally:
        rig.close()
    assert report.kept[0] == report.kept[1] and report.kept[0][1] > 0


def test_kept_reducers_stay_bounded(gloo_world_1: dist.ProcessGroup) -> None:
    # keep_reducers=1 keeps the idle half's reducer by design: one may live, never more.
    rig = Alternation(switcher_options={"keep_reducers": 1}, probe=True)
    try:
        report = guard_alternation(rig, allowed_reducers=1)
    finally:
        rig.close()
    assert report.kept[0] == report.kept[1]


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy_grads", "bucket_view"])
def test_the_guard_fails_when_old_reducers_are_kept(gloo_world_1: dist.ProcessGroup, bucket_view: bool) -> None:
    rig = Alternation(gradient_as_bucket_view=bucket_view, leak="reducers")
    try:
        with pytest.raises(SwitchLeakError, match=r"switch 1: 1 DDP reducer"):
            guard_alternation(rig)
    finally:
        rig.close()


@pytest.mark.parametrize("bucket_view", [False, True], ids=["copy_grads", "bucket_view"])
def test_the_guard_fails_when_old_buckets_are_kept(gloo_world_1: dist.ProcessGroup, bucket_view: bool) -> None:
    # A gradient that is a bucket view kept by the loop, or a hook state holding its buckets:
    # the reducer goes, its bucket does not.
    rig = Alternation(gradient_as_bucket_view=bucket_view, leak="buckets")
    try:
        with pytest.raises(SwitchLeakError, match=r"switch 1: 1 gradient-bucket storage\(s\) of \d+ B still alive"):
            guard_alternation(rig, grace_s=0.05)
    finally:
        rig.close()


def test_the_memory_checks_catch_what_the_weak_references_do_not_watch(gloo_world_1: dist.ProcessGroup) -> None:
    # Kept reducers allowed (as with keep_reducers), so only the memory checks can fail: the
    # gc census cannot see a reducer's buckets (C++), the storages each window created can.
    rig = Alternation(leak="reducers")
    try:
        with pytest.raises(
            SwitchLeakError,
            match=r"created over 6 switches and still alive \(C\+\+ holders "
            r"included\): \d+ of \d+ B; over 16 switches: \d+ of \d+ B, "
            r"about \d+ B more per switch",
        ):
            guard_alternation(rig, census_switches=20, allowed_reducers=10**6)
    finally:
        rig.close()
    # Gradients (bucket views) kept by the loop: Python can reach them, so the census fails first.
    rig = Alternation(leak="buckets", gradient_as_bucket_view=True)
    try:
        with pytest.raises(SwitchLeakError, match=r"live tensors changed over 20 switches"):
            guard_alternation(rig, census_switches=20, allowed_reducers=10**6)
    finally:
        rig.close()


@pytest.mark.distributed
def test_two_ranks_free_every_old_reducer_and_bucket(tmp_out: Path) -> None:
    launch(SCRIPT, str(tmp_out), nproc=2, launcher="forked", timeout=240)
    ranks = rank_results(tmp_out, nproc=2)
    for rank in ranks:
        for mode in ("copy_grads", "bucket_view"):
            report = rank[mode]
            assert report["census_end"] == report["census_warm"], report
            assert report["kept"][0] == report["kept"][1], report
    assert ranks[0]["digest"] == ranks[1]["digest"]


def test_the_probe_hook_reduces_like_ddps_default(gloo_world_1: dist.ProcessGroup) -> None:
    torch.manual_seed(0)
    nets = [nn.Linear(3, 2), nn.Linear(3, 2)]
    nets[1].load_state_dict(nets[0].state_dict())
    plain, probed = (DistributedDataParallel(net) for net in nets)
    probe = BucketProbe()
    probe.register(probed)
    for ddp in (plain, probed):
        ddp(torch.ones(4, 3)).pow(2).sum().backward()
    assert torch.equal(nets[0].weight.grad, nets[1].weight.grad)
    assert len(probe.drain()) == 1
