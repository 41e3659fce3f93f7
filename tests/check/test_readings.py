"""The memory gauge's garbage collection: what the rebase freezes, what a reading still frees, and the thaw."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_altparams.check.readings import MemoryGauge, live_tensor_bytes


class _Cycle:
    """An object in a reference cycle, holding a tensor: only the cyclic collector frees it."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.me = self
        self.tensor = tensor


def test_after_the_rebase_a_reading_still_frees_new_cycles_and_the_thaw_gives_the_frozen_objects_back() -> None:
    gauge = MemoryGauge(torch.device("cpu"))
    gauge.start()
    gauge.rebase()
    try:
        assert gauge.frozen and gc.get_freeze_count() > 0  # what was alive at the rebase is left out of collections
        with pytest.raises(RuntimeError, match="thaw"):
            live_tensor_bytes()  # it would not see the frozen objects
        cycle = _Cycle(torch.ones(4 << 20))  # 16 MiB, written: resident
        holding = gauge.level()
        del cycle
        assert holding - gauge.level() >= 12 << 20  # the reading's collection freed the cycle made since
    finally:
        gauge.thaw()
    assert not gauge.frozen and gc.get_freeze_count() == 0
    kept = torch.ones(1 << 18)  # 1 MiB
    assert sum(live_tensor_bytes().values()) >= kept.numel() * kept.element_size()


def test_objects_frozen_before_the_check_runs_are_counted_by_the_rebase() -> None:
    # A process may have frozen objects before the check starts (a worker forked from a server that froze its
    # imports, or the user's own gc.freeze()): the rebase's census must still see their tensors.
    held = _Cycle(torch.ones(1 << 18))  # 1 MiB, reachable only through the frozen generation's cycle
    gc.collect()
    gc.freeze()
    gauge = MemoryGauge(torch.device("cpu"))
    try:
        gauge.start()
        gauge.rebase()  # raised "cannot see frozen objects" before
        assert gauge.frozen and gc.get_freeze_count() > 0
    finally:
        gauge.thaw()
        gc.unfreeze()
    assert sum(live_tensor_bytes().values()) >= held.tensor.numel() * held.tensor.element_size()


class _Computed:
    """An object whose ``__class__`` is computed on reading, as torch.distributed's deprecated names warn then."""

    reads = 0

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        _Computed.reads += 1
        return _Computed


def test_the_census_reads_no_attribute_of_the_objects_it_walks() -> None:
    # in a rank with torch.distributed imported, reading ``__class__`` of its deprecated ``reduce_op`` printed a
    # FutureWarning into every check run
    walked = _Computed()
    kept = torch.ones(1 << 18)
    _Computed.reads = 0
    assert sum(live_tensor_bytes().values()) >= kept.numel() * kept.element_size()
    assert _Computed.reads == 0
    del walked
