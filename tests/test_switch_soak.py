"""``benchmarks/switch_soak.py`` on CPU: every variant runs, the raw readings, the table, the JSON and the plot.

Tiny halves and few switches on gloo (RSS instead of CUDA memory): what is
checked is the shape of the output and what holds on any machine (a reading
after every switch, the ranks' digests equal, the Python-visible tensors the
same after the warm-up, every old bucket freed), never a timing. The GPU
figures come from ``benchmarks/gpu.sh`` (real launches). Here the driver runs
in the test's process and its ranks are forked from the warm server
(``--launcher forked``): the subject is what the ranks read and what the
driver writes, not the launcher.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.benchmark_cli import benchmark_main

TINY = [
    "--device",
    "cpu",
    "--launcher",
    "forked",
    "--timeout",
    "600",
    "--size-mib",
    "0.05",
    "--layers",
    "1",
    "--batch",
    "8",
    "--warmup",
    "6",
    "--idle-s",
    "0.1",
    "--timed",
    "8",
]


def _run(*args: str) -> None:
    benchmark_main("switch_soak", *args)


def _refused(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """argparse's message for arguments the command line refuses (exit code 2, as the script exits)."""
    with pytest.raises(SystemExit) as exit_:
        _run(*args)
    assert exit_.value.code == 2
    return capsys.readouterr().err


@pytest.mark.distributed
def test_every_variant_reports_a_reading_per_switch_a_table_and_a_plot(tmp_path: Path) -> None:
    variants = ["default", "single_a", "single_b", "keep_reducers", "find_unused", "release", "probe", "waited"]
    _run(
        *TINY,
        "--switches",
        "24",
        "--short-switches",
        "16",
        "--tail",
        "8",
        "--variants",
        *variants,
        "--probe-grace-s",
        "5",
        "--out",
        str(tmp_path),
    )
    summary = json.loads((tmp_path / "switch_soak_cpu_1r.json").read_text())
    rows = {row["variant"]: row for row in summary["rows"]}
    assert list(rows) == variants
    assert rows["default"]["switches"] == rows["keep_reducers"]["switches"] == 24  # the long variants
    assert rows["single_a"]["switches"] == rows["probe"]["switches"] == 16
    for name in variants:
        raw = json.loads((tmp_path / "switch_soak_cpu_1r_raw" / f"{name}.rank0.json").read_text())
        assert len(raw["allocated"]) == len(raw["phase_after"]) == raw["switches"]
        assert raw["device"] == "cpu" and raw["backend"] == "gloo" and len(raw["digest"]) == 64
        assert rows[name]["census_equal"], (name, raw["census"])  # the Python-visible tensors, after the warm-up
    assert set(rows["default"]["distinct_values"]) == {"a", "b"} and set(rows["single_b"]["distinct_values"]) == {"b"}
    # gloo holds no old bucket past its switch (its worker thread may let go a moment late: up to 5 s allowed)
    assert rows["probe"]["old_buckets_alive_max"] == 0
    # The diagnostic tail ran for every hf_altparams variant: old reducers counted (keep_reducers
    # keeps one by design); on CPU there is no CUDA snapshot, and the note says why.
    tails = summary["tails"]
    assert set(name for name, tail in tails.items() if tail) == {
        "default",
        "keep_reducers",
        "release",
        "probe",
        "waited",
    }
    assert (
        tails["default"]["old_reducers_alive"]["max"] == 0 and tails["keep_reducers"]["old_reducers_alive"]["max"] == 1
    )
    assert tails["probe"]["old_buckets_alive"]["max"] == 0
    assert "unavailable" in tails["default"]["note"] and "B_minus_A" not in tails["default"]
    assert rows["default"]["iteration_ratio"] == pytest.approx(
        rows["default"]["iteration_ms"] / ((rows["single_a"]["iteration_ms"] + rows["single_b"]["iteration_ms"]) / 2),
        rel=1e-6,
    )
    table = (tmp_path / "switch_soak_cpu_1r.md").read_text()
    assert "| `default` | 24 (warm-up 6) |" in table and "RSS growth after warm-up" in table
    assert "target: default: growth <= 1 MiB not judged (24 switches, the target is over 24)" not in table
    assert (tmp_path / "switch_soak_cpu_1r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["plot"] == "switch_soak_cpu_1r.png"
    # The table and the plot can be rebuilt from the raw readings alone (e.g. after a cut-off GPU run).
    (tmp_path / "switch_soak_cpu_1r.md").unlink()
    _run("--summarize", *TINY, "--switches", "24", "--short-switches", "16", "--out", str(tmp_path))
    assert (tmp_path / "switch_soak_cpu_1r.md").read_text() == table


@pytest.mark.distributed
def test_two_ranks_stay_identical_and_skip_alike_what_the_budget_cannot_hold(tmp_path: Path) -> None:
    # single_a's million switches cannot fit the 120 s budget once default showed the time an
    # iteration takes: both ranks skip it together (rank 0 decides, the others follow).
    _run(
        *TINY,
        "--ranks",
        "2",
        "--switches",
        "12",
        "--budget-s",
        "120",
        "--variants",
        "default",
        "single_a:1000000",
        "--out",
        str(tmp_path),
    )
    rows = json.loads((tmp_path / "switch_soak_cpu_2r.json").read_text())["rows"]
    assert [(row["variant"], row.get("ranks"), row.get("ranks_identical")) for row in rows] == [
        ("default", 2, True),
        ("single_a", None, None),
    ]
    assert rows[1]["note"].startswith("skipped: the time budget (about ")


@pytest.mark.distributed
def test_a_spent_time_budget_skips_variants_and_says_so(tmp_path: Path) -> None:
    _run(*TINY, "--switches", "12", "--budget-s", "0.01", "--variants", "default", "single_a", "--out", str(tmp_path))
    rows = json.loads((tmp_path / "switch_soak_cpu_1r.json").read_text())["rows"]
    assert [row["variant"] for row in rows] == ["default", "single_a"]
    assert all(row["note"].startswith("skipped: the time budget (no time left for a launch") for row in rows)


def test_bad_arguments_are_refused_before_anything_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = ["--out", str(tmp_path)]
    assert "unknown ['defualt']" in _refused(capsys, "--device", "cpu", "--variants", "defualt", *out)
    assert "--backend nccl needs --device cuda and --ranks 1" in _refused(
        capsys, "--device", "cpu", "--backend", "nccl", *out
    )
    assert "--warmup (9)" in _refused(
        capsys, "--device", "cpu", "--switches", "10", "--warmup", "9", "--variants", "default", *out
    )
    assert "--launcher forked runs CPU ranks only" in _refused(capsys, "--device", "cuda", "--launcher", "forked", *out)
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_snapshot_sites_name_the_code_that_allocated_and_the_diff_finds_what_grew() -> None:
    # The CUDA diagnostic's pure half, on a snapshot shaped like torch.cuda.memory._snapshot()'s.
    from tests.support.memory_snapshots import NO_FRAMES, block_groups, diff_groups

    init = [
        {"name": "_ddp_init_helper", "filename": "/x/torch/nn/parallel/distributed.py", "line": 1},
        {"name": "rebuild_reducer", "filename": "/repo/hf_altparams/engine/ddp/_surgery.py", "line": 9},
        {"name": "step_to", "filename": "/repo/hf_altparams/engine/switch.py", "line": 5},
    ]
    adam = [
        {"name": "_single_tensor_adam", "filename": "/x/torch/optim/adam.py", "line": 2},
        {"name": "step", "filename": "/x/torch/optim/adam.py", "line": 3},
    ]

    def snap(buckets: int) -> dict:
        blocks = [{"size": 128, "state": "active_allocated", "frames": init} for _ in range(buckets)]
        blocks += [
            {"size": 64, "state": "active_allocated", "frames": adam},
            {"size": 32, "state": "active_allocated", "frames": []},
            {"size": 999, "state": "inactive", "frames": init},
        ]  # cached, not live: not counted
        return {"segments": [{"blocks": blocks}]}

    before, after = block_groups(snap(1)), block_groups(snap(4))
    site = "_ddp_init_helper (distributed.py:1) < rebuild_reducer (_surgery.py:9)"
    assert before == {
        site: {"bytes": 128, "blocks": 1},
        "_single_tensor_adam (adam.py:2) < step (adam.py:3)": {"bytes": 64, "blocks": 1},
        NO_FRAMES: {"bytes": 32, "blocks": 1},
    }
    assert diff_groups(before, after) == [{"site": site, "bytes": 384, "blocks": 3}]
