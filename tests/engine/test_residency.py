"""Per-task residency: non-resident groups are out of DDP, guarded, and come back intact.

On a CPU-only machine "moving to the CPU" moves no bytes, so these tests check
what residency changes that a user would notice on any device: DDP's ignore
list, the bytes DDP all-reduces and broadcasts, the values of parameters DDP
must not touch, the guard's error, the rollback of a failed switch, and the
equivalence with a single-process reference. The byte moves themselves are
checked by the CUDA test at the end (skipped here) and by benchmarks/memory.py.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, ResidencyManager, non_resident_groups
from hf_altparams.errors import PlanError, SwitchError
from hf_altparams.plan import ParamGroups, PerTaskCycle, Phase
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2


def _load_check_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_altparams_memory_checks", script_path("memory_checks.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


check = _load_check_module()


def head_names(task: int) -> set[str]:
    """Names DDP must ignore for a head, read from the model (not from the library)."""
    model = check.build_model()
    prefix = f"heads.{task}."
    return {n for n, _ in [*model.named_parameters(), *model.named_buffers()] if n.startswith(prefix)}


# -- two ranks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("memory_residency")
    launch(
        script_path("memory_checks.py"), str(out), "--only", "residency", nproc=NPROC, launcher="forked", timeout=300
    )
    results = rank_results(out, nproc=NPROC)
    assert all(r["world_size"] == NPROC for r in results)
    return [r["residency"] for r in results]


@pytest.mark.distributed
def test_ddp_ignores_exactly_the_non_resident_heads(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        # At the wrap (task 0 trains): heads 1 and 2 are ignored, nothing else.
        assert set(run["ignore_at_wrap"]) == head_names(1) | head_names(2)
        for entry in run["steps"]:
            others = set().union(*(head_names(t) for t in range(check.TASKS) if t != entry["task"]))
            assert set(entry["ignore"]) == others, entry["step"]


@pytest.mark.distributed
def test_non_resident_heads_are_not_all_reduced(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        for entry in run["steps"]:
            # expected = trunk + the current head's gradient bytes, from the model's own tensors
            assert entry["allreduced"] == entry["expected_allreduce"], entry


@pytest.mark.distributed
def test_non_resident_heads_are_not_broadcast(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    # Rank 1 started with other values everywhere. DDP's constructor broadcast the
    # resident trunk and head 0, and none of the non-resident heads.
    assert rank0["heads_after_wrap"][0] == rank1["heads_after_wrap"][0]
    assert rank0["heads_after_wrap"][1] != rank1["heads_after_wrap"][1]
    assert rank0["heads_after_wrap"][2] != rank1["heads_after_wrap"][2]
    # Per forward, DDP broadcasts only the current head's buffer, never the others'.
    scale = check.Head(check.DIM).scale
    scale_bytes = scale.numel() * scale.element_size()
    for run in ranks:
        assert all(entry["broadcast"] == [scale_bytes] for entry in run["steps"])
        # ... and each switch reports the per-forward bytes the two absent heads no longer cost.
        records = [e["record"] for e in run["steps"] if "record" in e]
        assert all(r["buffer_broadcast_bytes"] == scale_bytes for r in records)
        assert all(r["buffer_broadcast_saved_bytes"] == (check.TASKS - 1) * scale_bytes for r in records)


@pytest.mark.distributed
def test_each_head_is_synced_once_when_it_first_becomes_resident(ranks: list[dict[str, Any]]) -> None:
    head_bytes = sum(
        t.numel() * t.element_size() for t in [*check.Head(check.DIM).parameters(), *check.Head(check.DIM).buffers()]
    )
    for run in ranks:
        synced = [e["record"]["synced_bytes"] for e in run["steps"] if "record" in e]
        # heads 1 and 2 at their first residency, then never again
        assert synced[:2] == [head_bytes, head_bytes]
        assert all(s == 0 for s in synced[2:])


@pytest.mark.distributed
def test_ranks_end_bit_identical_and_equal_the_single_process_reference(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert rank0["digest"] == rank1["digest"]
    reference, _ = check.train_tasks(distributed=False, world=NPROC)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(torch.tensor(rank0["params"][name]), param.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_heads_return_bit_identical(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        returns = [e["returned_identical"] for e in run["steps"] if "returned_identical" in e]
        assert len(returns) >= check.TASKS and all(returns)


@pytest.mark.distributed
def test_forward_through_a_non_resident_head_names_it(ranks: list[dict[str, Any]]) -> None:
    for run in ranks:
        absent = run["guard_absent_task"]
        message = run["guard_error"]
        assert message is not None
        assert f"'heads.{absent}.weight'" in message
        assert f"phase {run['phase_at_end']!r}" in message
        assert "not resident" in message
        assert run["visiting_output_shape"] == [check.BATCH, 1]


# -- one process -------------------------------------------------------------------------------


def tiny() -> tuple[nn.Module, ParamGroups]:
    model = check.build_model()
    return model, check.make_groups(model)


def test_non_resident_groups() -> None:
    phase = Phase({"t0", "trunk"}, resident={"trunk"})
    assert non_resident_groups(phase, ["trunk", "t0", "t1", "t2"]) == {"t1", "t2"}
    assert non_resident_groups(Phase({"t0"}), ["trunk", "t0"]) == frozenset()


def test_switch_writes_the_ignore_list_ddp_reads_before_the_wrap() -> None:
    model, groups = tiny()
    switcher = PhaseSwitcher(groups, check.make_schedule())
    switcher.step_to(0)
    assert set(model._ddp_params_and_buffers_to_ignore) == head_names(1) | head_names(2)
    switcher.step_to(check.EVERY)  # task 1
    assert set(model._ddp_params_and_buffers_to_ignore) == head_names(0) | head_names(2)


def test_user_ignore_list_is_kept() -> None:
    model, groups = tiny()
    model._ddp_params_and_buffers_to_ignore = ["heads.0.scale"]
    switcher = PhaseSwitcher(groups, check.make_schedule())
    switcher.step_to(0)  # head 0 resident, but the user's own entry stays
    assert set(model._ddp_params_and_buffers_to_ignore) == {"heads.0.scale"} | head_names(1) | head_names(2)
    # A second switcher on the same module does not mistake our entries for the user's.
    again = PhaseSwitcher(check.make_groups(model), check.make_schedule())
    again.step_to(check.EVERY)
    assert set(model._ddp_params_and_buffers_to_ignore) == {"heads.0.scale"} | head_names(0) | head_names(2)


def test_guard_follows_the_phase_and_visiting_lifts_it() -> None:
    model, groups = tiny()
    switcher = PhaseSwitcher(groups, check.make_schedule())
    switcher.step_to(0)
    x = torch.ones(2, check.DIM)
    model(x, 0)
    with pytest.raises(
        SwitchError, match=r"'heads\.1\.weight' \(group 't1'\).*phase 't0'|phase 't0'.*'heads\.1\.weight'"
    ):
        model(x, 1)
    with switcher.residency.visiting(["t1"]):
        assert model(x, 1).shape == (2, 1)
    with pytest.raises(SwitchError):
        model(x, 1)
    switcher.step_to(check.EVERY)
    model(x, 1)
    with pytest.raises(SwitchError, match="heads.0.weight"):
        model(x, 0)


def test_guard_can_be_turned_off() -> None:
    model, groups = tiny()
    switcher = PhaseSwitcher(groups, check.make_schedule(), guard_offloaded=False)
    switcher.step_to(0)
    assert model(torch.ones(1, check.DIM), 2).shape == (1, 1)


def test_failed_switch_rolls_residency_back(monkeypatch: pytest.MonkeyPatch) -> None:
    model, groups = tiny()
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    switcher = PhaseSwitcher(groups, check.make_schedule(), optimizer=opt)
    switcher.step_to(0)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    real_apply_flags = switcher._apply_flags

    def failing(trainable: frozenset[str]) -> None:
        real_apply_flags(trainable)
        raise RuntimeError("injected failure after the moves")

    monkeypatch.setattr(switcher, "_apply_flags", failing)
    with pytest.raises(SwitchError, match="injected failure"):
        switcher.step_to(check.EVERY)
    assert switcher.residency.offloaded == {"t1", "t2"}
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert set(model._ddp_params_and_buffers_to_ignore) == head_names(1) | head_names(2)
    with pytest.raises(SwitchError, match="heads.1.weight"):  # guard still on the old phase
        model(torch.ones(1, check.DIM), 1)
    model(torch.ones(1, check.DIM), 0)


def test_record_reports_offloaded_bytes() -> None:
    model, groups = tiny()
    switcher = PhaseSwitcher(groups, check.make_schedule())
    record = switcher.step_to(0)
    assert record is not None
    heads = model.heads
    assert record.offloaded_bytes == sum(p.numel() * p.element_size() for t in (1, 2) for p in heads[t].parameters())
    assert record.as_log()["altparams/offloaded_bytes"] == record.offloaded_bytes


def test_bad_devices_are_refused() -> None:
    _, groups = tiny()
    with pytest.raises(PlanError, match="`offload_device`"):
        ResidencyManager(groups, offload_device="not-a-device")
    with pytest.raises(PlanError, match="`device`"):
        ResidencyManager(groups, device=42)  # type: ignore[arg-type]
    with pytest.raises(SwitchError, match="`prefetch`"):
        PhaseSwitcher(groups, check.make_schedule(), prefetch="sometimes")


# -- CUDA: the bytes really move -------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_non_resident_groups_live_on_the_host_and_come_back_bit_identical() -> None:
    model, groups = tiny()
    model.cuda()
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=0.01))
    switcher = PhaseSwitcher(groups, PerTaskCycle(["trunk"], ["t0", "t1", "t2"], every=1), optimizer=opt)
    switcher.step_to(0)
    assert model.heads[1].weight.device.type == "cpu" and model.heads[1].weight.is_pinned()
    assert model.heads[1].scale.device.type == "cpu"
    assert model.heads[0].weight.is_cuda and model.trunk[0].weight.is_cuda
    before = model.heads[0].weight.detach().clone()
    x = torch.randn(4, check.DIM, device="cuda")
    model(x, 0).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    trained = model.heads[0].weight.detach().clone()
    assert not torch.equal(trained, before)
    switcher.step_to(1)  # head 0 leaves with its AdamW state
    assert model.heads[0].weight.device.type == "cpu"
    state = opt.inner["t0"].state[model.heads[0].weight]
    assert state["exp_avg"].device.type == "cpu"
    switcher.step_to(3)  # back to task 0
    assert model.heads[0].weight.is_cuda and torch.equal(model.heads[0].weight.detach(), trained)
    assert opt.inner["t0"].state[model.heads[0].weight]["exp_avg"].is_cuda
    with pytest.raises(SwitchError, match="heads.1.weight"):
        model(x, 1)
