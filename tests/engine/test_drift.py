"""The drift check's pieces on one process: the digest, the comparison of gathered rows, the setting.

The check across real ranks (a rank with one changed element caught at the next
save, every N steps, at a switch) is in ``tests/integrations/test_integrity.py``
and ``tests/integrations/test_trainer_integrity.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.engine.digest import digest_many, digest_values, tensor_digest
from hf_altparams.engine.drift import UNGROUPED, find_drift, local_digests
from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1), nn.Linear(1, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_digest_sees_a_one_ulp_change_anywhere_and_nothing_else(dtype: torch.dtype) -> None:
    base = torch.randn(1000, 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    reference = int(tensor_digest(base))
    assert int(tensor_digest(base.clone())) == reference
    for position in (0, 18_499, 36_999):
        changed = base.clone()
        flat = changed.view(-1)
        flat[position] = torch.nextafter(flat[position].float(), torch.tensor(float("inf"))).to(dtype)
        if torch.equal(flat[position], base.view(-1)[position]):  # no representable step up in this dtype
            flat.view(
                torch.uint8 if dtype.itemsize == 1 else {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]
            )[position] += 1
        assert int(tensor_digest(changed)) != reference, position


def test_digest_is_exact_whatever_the_thread_count_and_layout() -> None:
    data = torch.randn(512, 300, generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = int(tensor_digest(data))
        torch.set_num_threads(max(2, threads))
        many = int(tensor_digest(data))
    finally:
        torch.set_num_threads(threads)
    assert one == many
    assert int(tensor_digest(data.t())) == int(tensor_digest(data.t().contiguous()))  # the logical order counts
    assert int(tensor_digest(data[1:])) == int(tensor_digest(data[1:].clone()))  # an unaligned view
    swapped = data.clone()
    swapped[[0, 400]] = swapped[[400, 0]]  # two rows trade places: the sum is equal, the digest is not
    assert int(tensor_digest(swapped)) != int(tensor_digest(data))


def test_digest_many_covers_small_and_large_tensors() -> None:
    tensors = [torch.zeros(3), torch.randn(600_000), torch.ones(5)]
    before = digest_values(digest_many(tensors))
    assert len(before) == 2  # the large one alone, the two small ones concatenated
    tensors[2][4] = 1.5
    after = digest_values(digest_many(tensors))
    assert after[0] == before[0] and after[1] != before[1]


def test_find_drift_names_the_odd_ranks_per_group() -> None:
    entries = ["a", "b", UNGROUPED]

    def row(a: int, b: int, u: int = 0) -> list[int]:
        return [a, 0, -1, b, 0, -1, u, 0, -1]

    assert find_drift(entries, [row(1, 2), row(1, 2), row(1, 2)]) == {}
    assert find_drift(entries, [row(1, 2), row(1, 3), row(1, 2)]) == {"b": [1]}  # the majority is the reference
    assert find_drift(entries, [row(1, 2), row(5, 3)]) == {"a": [1], "b": [1]}  # a tie: rank 0 is the reference
    assert find_drift(entries, [row(1, 2, 7), row(1, 2, 8), row(1, 2, 7), row(1, 2, 7)]) == {UNGROUPED: [1]}


def test_find_drift_compares_shards_only_between_ranks_that_hold_the_same_shard() -> None:
    # HSDP, 2 replicas x 2 shards: ranks 0 and 2 hold shard 0 (key 10), ranks 1 and 3 shard 1 (key 11)
    rows = [[0, 100, 10], [0, 200, 11], [0, 100, 10], [0, 201, 11]]
    assert find_drift(["layer"], rows) == {"layer": [3]}  # shard 1 differs between its replicas (tie: rank 1 wins)
    one_shard_each = [[0, 100, 10], [0, 200, 11]]  # FSDP2 on a 1-D mesh: no replica to compare
    assert find_drift(["layer"], one_shard_each) == {}


def test_local_digests_read_every_parameter_as_it_is_now() -> None:
    net = _net()
    groups = ParamGroups(net, {"a": "0.*", "b": "2.*"})  # net[3] is ungrouped (and frozen)
    before = local_digests(groups)
    assert len(before) == 3 * 3
    with torch.no_grad():
        net[3].bias.data.add_(1e-6)  # an ungrouped, frozen parameter: compared too
    after_ungrouped = local_digests(groups)
    assert after_ungrouped[:6] == before[:6] and after_ungrouped[6] != before[6]
    net[2].weight = nn.Parameter(net[2].weight.detach() + 1.0)  # a swapped Parameter object
    assert local_digests(groups)[3] != after_ungrouped[3]


@pytest.mark.parametrize("bad", ["sometimes", 0, -2, True, 1.5, None, "Save"])
def test_drift_check_setting_is_checked_at_construction(bad: Any) -> None:
    net = _net()
    with pytest.raises(PlanError, match=r"`drift_check` must be 'save' .* or False \(never\), got"):
        PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "2.*"}), Alternating(["a", "b"]), drift_check=bad)


@pytest.mark.parametrize("good", ["save", "switch", 1, 50, False])
def test_drift_check_settings_accepted(good: Any) -> None:
    net = _net()
    switcher = PhaseSwitcher(ParamGroups(net, {"a": "0.*", "b": "2.*"}), Alternating(["a", "b"]), drift_check=good)
    assert switcher.drift.setting == good and switcher.drift.at_save == (good is not False)
