"""Phases under DeepSpeed ZeRO-1/2 on 2 CPU ranks, through the Trainer and Accelerate (one launch for every test).

``tests/scripts/deepspeed_check.py`` runs every configuration in one process
group, on 2 ranks forked from the suite's warm server (``launcher="forked"``:
the environment of plain ``torchrun``'s ranks, without ``ACCELERATE_USE_CPU``,
which makes the Trainer drop DeepSpeed), with ``TORCH_EXTENSIONS_DIR`` an empty
folder: no C++ op is built. The tests below assert on what it recorded. The
user's command, DeepSpeed ranks of a real ``torchrun``, runs in
``tests/check/test_check_deepspeed.py`` (the check's own launch of ZeRO-2).
Skipped without deepspeed (``pip install hf_altparams[deepspeed]``).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.distributed

NPROC = 2
STAGES = (1, 2)
KINDS = ("lisa", "badam", "alternating")
DROP = ("lisa", "badam")  # their schedules' idle_state: idle groups' state and fp32 partitions dropped
TRAINER_RUNS = [f"zero{s}_{k}" for s, k in itertools.product(STAGES, KINDS)]
ACCELERATE_RUNS = [f"acc_zero{s}_{k}" for s, k in itertools.product(STAGES, KINDS)]
BF16 = "acc_zero2_lisa_bf16"  # DeepSpeed's bf16: bf16 weights and gradients, fp32 partitions
DS_RUNS = TRAINER_RUNS + ACCELERATE_RUNS + [BF16, "zero2_lisa_resumed", "acc_zero2_lisa_resumed"]
#: fp32 round-off on weights of size ~0.02-1 after a few AdamW steps (eps 1e-3): a few units in the last place
ROUND_OFF = 1e-6


@pytest.fixture(scope="module")
def extensions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch_extensions")


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory, extensions: Path) -> Path:
    out = tmp_path_factory.mktemp("deepspeed_check")
    # The folder goes as an argument and ACCELERATE_USE_CPU is overridden only when this environment sets it:
    # either in the launch's environment would key a fork server of its own (a fresh import of everything).
    cpu = {"ACCELERATE_USE_CPU": "false"} if "ACCELERATE_USE_CPU" in os.environ else None
    launch(
        script_path("deepspeed_check.py"),
        str(out),
        str(extensions),
        nproc=NPROC,
        launcher="forked",
        timeout=600,
        env=cpu,
    )
    return out


@pytest.fixture(scope="module")
def ranks(out_dir: Path) -> list[dict[str, Any]]:
    results = rank_results(out_dir, nproc=NPROC)
    assert all(r["world_size"] == NPROC for r in results)
    return results


def run(ranks: list[dict[str, Any]], name: str, rank: int = 0) -> dict[str, Any]:
    record = ranks[rank]["runs"][name]
    assert "error" not in record, f"{name} failed on rank {rank}: {record['error']}"
    return record


def weights(out_dir: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(out_dir / f"{name}.pt")


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def test_no_cpp_op_is_built(ranks: list[dict[str, Any]], extensions: Path) -> None:
    assert list(extensions.iterdir()) == []  # DeepSpeed's shared-memory comm op skipped (gloo does the work)


@pytest.mark.parametrize(
    "name", DS_RUNS + [f"ddp_{k}" for k in KINDS] + [f"acc_ddp_{k}" for k in KINDS] + ["zero1_full", "zero2_full"]
)
def test_every_run_trained(ranks: list[dict[str, Any]], name: str) -> None:
    for rank in range(NPROC):
        record = run(ranks, name, rank)
        assert record["steps"], name


@pytest.mark.parametrize(("stage", "kind"), list(itertools.product(STAGES, KINDS)))
def test_the_trainer_on_zero_equals_the_ddp_run_of_the_same_schedule(
    ranks: list[dict[str, Any]], out_dir: Path, stage: int, kind: str
) -> None:
    ds, ddp = run(ranks, f"zero{stage}_{kind}"), run(ranks, f"ddp_{kind}")
    assert [s["trainable"] for s in ds["steps"]] == [s["trainable"] for s in ddp["steps"]]
    assert max_diff(weights(out_dir, f"zero{stage}_{kind}"), weights(out_dir, f"ddp_{kind}")) < ROUND_OFF


@pytest.mark.parametrize(("stage", "kind"), list(itertools.product(STAGES, KINDS)))
def test_accelerate_on_zero_equals_its_ddp_run(
    ranks: list[dict[str, Any]], out_dir: Path, stage: int, kind: str
) -> None:
    ds, ddp = run(ranks, f"acc_zero{stage}_{kind}"), run(ranks, f"acc_ddp_{kind}")
    assert [s["trainable"] for s in ds["steps"]] == [s["trainable"] for s in ddp["steps"]]
    assert max_diff(weights(out_dir, f"acc_zero{stage}_{kind}"), weights(out_dir, f"acc_ddp_{kind}")) < ROUND_OFF


@pytest.mark.parametrize("name", TRAINER_RUNS + ACCELERATE_RUNS + [BF16])
def test_groups_outside_the_phase_stay_bit_unchanged_weights_and_fp32_partitions(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for rank in range(NPROC):
        record = run(ranks, name, rank)
        before, fp32_before = record["initial"], None
        moved = set()
        for step in record["steps"]:
            idle = set(before) - set(step["trainable"])
            assert all(step["weights"][g] == before[g] for g in idle), (rank, step["step"])
            if fp32_before is not None:
                assert all(step["fp32"][g] == fp32_before[g] for g in idle), (rank, step["step"])
            moved |= {g for g in step["trainable"] if step["weights"][g] != before[g]}
            before, fp32_before = step["weights"], step["fp32"]
        assert moved == {g for s in record["steps"] for g in s["trainable"]}  # what trains does move


@pytest.mark.parametrize("name", DS_RUNS)
def test_ranks_stay_bit_identical(ranks: list[dict[str, Any]], name: str) -> None:
    assert all(step["ranks_identical"] for step in run(ranks, name)["steps"])


@pytest.mark.parametrize(("stage", "kind"), list(itertools.product(STAGES, KINDS)))
def test_bytes_per_step_scale_with_the_trainable_share(ranks: list[dict[str, Any]], stage: int, kind: str) -> None:
    full = run(ranks, f"zero{stage}_full")["steps"][-1]
    for step in run(ranks, f"zero{stage}_{kind}")["steps"]:
        share = step["trainable_bytes"] / full["trainable_bytes"]
        assert share < 1
        assert step["comm_bytes"] <= share * full["comm_bytes"] * 1.1, step["step"]


@pytest.mark.parametrize(
    "name", [f"{i}zero{s}_{k}" for i, s, k in itertools.product(("", "acc_"), STAGES, DROP)] + [BF16]
)
def test_idle_groups_hold_no_optimizer_state_nor_fp32_partition_under_drop(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for rank in range(NPROC):
        for step in run(ranks, name, rank)["steps"]:
            census, active = step["census"], set(step["after"])  # after the step's switch
            assert all(census[g] == {"state": 0, "master": 0} for g in census if g not in active), step["step"]
            assert all(census[g]["master"] > 0 for g in active), step["step"]


def test_idle_groups_keep_their_state_and_fp32_partition_under_keep(ranks: list[dict[str, Any]]) -> None:
    trained: set[str] = set()
    for step in run(ranks, "zero2_alternating")["steps"]:  # idle_state="keep"
        trained |= set(step["trainable"])
        census = step["census"]
        assert all(census[g]["master"] > 0 for g in census)  # every fp32 partition stays
        assert all(census[g]["state"] > 0 for g in trained), step["step"]  # state of every group trained so far


def test_idle_groups_fp32_partitions_leave_the_device_and_their_state_stays_by_default(
    ranks: list[dict[str, Any]],
) -> None:
    trained: set[str] = set()
    for step in run(ranks, "zero1_alternating")["steps"]:  # the default: state kept, fp32 masters offloaded
        trained |= set(step["trainable"])
        census, active = step["census"], set(step["after"])
        assert all(census[g]["master"] == 0 for g in census if g not in active), step["step"]
        assert all(census[g]["master"] > 0 for g in active)
        assert all(census[g]["state"] > 0 for g in trained), step["step"]


@pytest.mark.parametrize(("name", "saved"), [("zero2_lisa", 3), ("acc_zero2_lisa", 3)])
def test_resuming_from_deepspeeds_own_checkpoint_is_exact(
    ranks: list[dict[str, Any]], out_dir: Path, name: str, saved: int
) -> None:
    assert max_diff(weights(out_dir, f"{name}_resumed"), weights(out_dir, name)) == 0.0
    for rank in range(NPROC):
        first = {s["step"]: s for s in run(ranks, name, rank)["steps"]}
        resumed = run(ranks, f"{name}_resumed", rank)["steps"]
        assert [s["step"] for s in resumed] == [k for k in sorted(first) if k > saved]
        for step in resumed:
            assert step["weights"] == first[step["step"]]["weights"]
            assert step["fp32"] == first[step["step"]]["fp32"]
            assert step["census"] == first[step["step"]]["census"]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("optimizers_given", r"`Trainer\(optimizers=\(optimizer, ...\)\)` with DeepSpeed: the Trainer ignores"),
        (
            "optimizer_section",
            r"cannot drive a DeepSpeed config with an `optimizer` section.*Remove the `optimizer` sec",
        ),
        ("zero3", r"cannot drive DeepSpeed ZeRO-3.*gathers every weight.*Use ZeRO-2"),
        ("offload", r"cannot drive DeepSpeed's `offload_optimizer` \(device 'cpu'\).*Leave `offload_optimizer`"),
        ("unsplit_engine", r"param group\(s\) of the DeepSpeed optimizer .* are not one library group's"),
    ],
)
def test_what_is_not_driven_is_refused_before_any_step(ranks: list[dict[str, Any]], case: str, expected: str) -> None:
    import re

    for rank in range(NPROC):
        found = ranks[rank]["runs"]["refusals"][case]
        assert found is not None, f"{case} was not refused"
        assert re.search(expected, found["message"]), found["message"]
