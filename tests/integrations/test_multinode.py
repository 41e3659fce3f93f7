"""Two simulated nodes of two ranks each (``torchrun --nnodes 2``, static rendezvous on 127.0.0.1).

One launch of ``multinode_checks.py`` (module fixture) feeds the distributed
tests here: ranks whose local rank differs from their global rank, equivalence
with one process on the concatenated batch (the engine alone and
``PhasedAccelerator``), bytes all-reduced, and checkpoints with
``save_on_each_node`` true (a folder per node, the last save torn on node 1)
and false (a shared folder; and a folder per node, which must fail the same way
on every rank). One more small launch checks that ``launch_nodes`` stops every
node when one fails.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_altparams.errors import AltParamsError
from hf_altparams.integrations.accelerate_checkpoints import COMPLETE_MARKER, STATE_FILE, agreed_checkpoint
from hf_altparams.testing import LaunchError, rank_results
from hf_altparams.testing.launch import launch_nodes
from tests.scripts import engine_check, script_path

NNODES, PER_NODE = 2, 2
WORLD = NNODES * PER_NODE


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("multinode")
    # ACCELERATE_USE_CPU: under torchrun on a machine without CUDA, Accelerate otherwise sees
    # DistributedType.NO and runs every rank as a world of one (the switcher then refuses the run).
    launch_nodes(
        script_path("multinode_checks.py"),
        str(out),
        nnodes=NNODES,
        nproc_per_node=PER_NODE,
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return out


@pytest.fixture(scope="module")
def ranks(out_dir: Path) -> list[dict[str, Any]]:
    return rank_results(out_dir, nproc=WORLD)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, c in engine_check.CASES.items() if c.reference])
def test_engine_on_two_nodes_equals_one_process(name: str, out_dir: Path, ranks: list[dict[str, Any]]) -> None:
    reference = engine_check.train(engine_check.CASES[name], distributed=False)["model"]
    for rank in range(WORLD):
        got = torch.load(out_dir / f"node{rank // PER_NODE}" / f"{name}_rank{rank}.pt")
        for param_name, param in reference.named_parameters():
            torch.testing.assert_close(
                got[param_name],
                param.detach(),
                rtol=0,
                atol=1e-6,
                msg=lambda m: f"{name}, rank {rank}, {param_name}: {m}",
            )
    assert len({r["engine"][name]["params_sha256"] for r in ranks}) == 1


@pytest.mark.distributed
@pytest.mark.parametrize("name", [n for n, c in engine_check.CASES.items() if c.hook == "count"])
def test_engine_on_two_nodes_reduces_trainable_bytes(name: str, ranks: list[dict[str, Any]]) -> None:
    case = engine_check.CASES[name]
    model = case.build()
    for r in ranks:
        for s in r["engine"][name]["steps"]:
            trainable = sum(
                p.numel() * p.element_size()
                for g in s["trainable"]
                for p in model.get_submodule(case.group_modules[g]).parameters()
            )
            assert s["bytes_counted"] == trainable, (name, s)


@pytest.mark.distributed
def test_local_rank_differs_from_global_rank_on_the_second_node(ranks: list[dict[str, Any]]) -> None:
    seen = [(r["ranks"]["RANK"], r["ranks"]["LOCAL_RANK"], r["ranks"]["GROUP_RANK"]) for r in ranks]
    assert seen == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    for r in ranks:
        info = r["ranks"]
        assert info["process_index"] == info["RANK"] and info["local_process_index"] == info["LOCAL_RANK"]
        assert info["is_local_main_process"] == (info["LOCAL_RANK"] == 0)
        assert info["num_processes"] == WORLD and info["backend"] == "gloo"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ga1", "per_task"])
def test_four_ranks_on_two_nodes_equal_one_process_and_reduce_trainable_bytes(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for r in ranks:
        res = r[name]
        assert res["max_abs_diff_vs_reference"] < 1e-6, res["max_abs_diff_vs_reference"]
        assert res["allreduce_bytes_measured"] == res["allreduce_bytes_expected"]
    assert len(set(ranks[0]["ga1"]["allreduce_bytes_expected"])) > 1, "the phases must differ in size"
    assert len({r[name]["param_sha256"] for r in ranks}) == 1


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["each_node", "shared"])
def test_resume_on_both_nodes_takes_the_same_checkpoint_and_is_bitwise_exact(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for r in ranks:
        # each_node: load_state() while checkpoint_1 is complete on node 0 only (torn on node 1):
        # every rank takes checkpoint_0; shared: load_state(checkpoint_0)
        res = r[name]["resumes"][0]
        assert res["load_error"] == ""
        assert (res["step_after_load"], res["phase_after_load"]) == (3, "l1")
        assert res["resumed_steps"] == r[name]["steps"] == 9
        assert res["bitwise_equal_to_uninterrupted"], (r["rank"], name, res["max_abs_diff"])
    assert len({r[name]["resumes"][0]["resumed_sha256"] for r in ranks}) == 1
    if name == "each_node":  # the skipped checkpoint is named, on every rank
        for r in ranks:
            res = r[name]["resumes"][0]
            assert "checkpoint(s) [1]" in " ".join(res["load_warnings"])
            assert res["latest_checkpoint"] == "checkpoint_0"  # latest_checkpoint() agrees with load_state()
            assert res["next_save_iteration"] == 2  # after the highest folder on any node


@pytest.mark.distributed
def test_automatic_resume_takes_the_latest_checkpoint_and_matches_to_rounding(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        res = r["shared"]["resumes"][1]  # load_state(): checkpoint_1, saved mid-phase
        assert res["load_error"] == ""
        assert (res["step_after_load"], res["phase_after_load"]) == (4, "l1")
        # four ranks: the first step after a mid-phase resume sums in DDP's initial bucket order
        assert res["max_abs_diff"] < 1e-6, res["max_abs_diff"]
    assert len({r["shared"]["resumes"][1]["resumed_sha256"] for r in ranks}) == 1


@pytest.mark.distributed
def test_save_on_each_node_writes_the_state_and_marker_on_every_node(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        res, local_main = r["each_node"], r["ranks"]["LOCAL_RANK"] == 0
        assert res["writes"] == (["state_file", "marker"] * 2 if local_main else []), r["rank"]
        node = r["ranks"]["GROUP_RANK"]
        # each node's own folder holds everything it needs, and only its own ranks' RNG files
        expected = {
            STATE_FILE,
            COMPLETE_MARKER,
            "model.safetensors",
            "optimizer.bin",
            f"random_states_{2 * node}.pkl",
            f"random_states_{2 * node + 1}.pkl",
        }
        assert set(res["files_seen"]) == expected, res["files_seen"]


@pytest.mark.distributed
def test_main_process_only_writes_once_into_shared_storage(ranks: list[dict[str, Any]]) -> None:
    # two saves (checkpoint_0 and checkpoint_1), each written by rank 0 alone
    assert [r["shared"]["writes"] for r in ranks] == [["state_file", "marker"] * 2, [], [], []]
    assert {f"random_states_{i}.pkl" for i in range(WORLD)} <= set(ranks[3]["shared"]["files_seen"])


@pytest.mark.distributed
def test_main_process_only_on_separate_disks_fails_alike_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    # every rank raised (none went on training), each naming its own node's folder, all alike otherwise
    errors = {
        r["main_only_separate"]["resumes"][0]["load_error"].replace(f"/node{r['ranks']['GROUP_RANK']}/", "/NODE/")
        for r in ranks
    }
    assert len(errors) == 1 and "" not in errors, errors
    (error,) = errors
    assert "rank 2: []; rank 3: []" in error and "save_on_each_node=True" in error


# A rank of node 1 dies before the rendezvous completes; node 0's ranks would wait in
# init_process_group (gloo's 30-minute default). The launcher must stop everything.
_ONE_NODE_FAILS = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], "pid" + os.environ["RANK"]).write_text(str(os.getpid()))
if os.environ["RANK"] == "2":
    raise RuntimeError("boom from rank 2")
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.distributed
def test_one_failed_node_stops_the_others_soon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules["hf_altparams.testing.launch"], "_GRACE_AFTER_FAILURE", 2.0)
    script = tmp_path / "one_node_fails.py"
    script.write_text(_ONE_NODE_FAILS)
    started = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch_nodes(script, str(tmp_path), timeout=120)
    assert time.monotonic() - started < 60, "the surviving node was left to the timeout"
    message = str(info.value)
    assert "failed" in message and "timed out" not in message
    assert "boom from rank 2" in message and "--node-rank 1" in message
    pids = [int(p.read_text()) for p in tmp_path.glob("pid*")]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids and not any(_alive(pid) for pid in pids)


# --------------------------------------------------------------------------- one process
def _checkpoint(root: Path, n: int, complete: bool) -> Path:
    folder = root / "checkpoints" / f"checkpoint_{n}"
    folder.mkdir(parents=True)
    if complete:
        (folder / COMPLETE_MARKER).write_text("{}")
    return folder


def test_agreed_checkpoint_in_one_process_takes_the_latest_complete(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 0, True)
    _checkpoint(tmp_path, 1, False)
    _checkpoint(tmp_path, 10, False)
    chosen = agreed_checkpoint(None, str(tmp_path / "checkpoints"))
    assert chosen == str(tmp_path / "checkpoints" / "checkpoint_0")
    assert agreed_checkpoint(None, None) is None


def test_agreed_checkpoint_refuses_an_incomplete_folder(tmp_path: Path) -> None:
    torn = _checkpoint(tmp_path, 3, False)
    with pytest.raises(AltParamsError, match="refuses"):
        agreed_checkpoint(str(torn), None)
    with pytest.raises(AltParamsError, match="no complete checkpoint"):
        agreed_checkpoint(None, str(tmp_path / "checkpoints"))
