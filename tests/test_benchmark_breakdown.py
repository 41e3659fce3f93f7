"""``benchmarks/alternating.py --breakdown``: every part of every switch timed, and gloo's floor.

End to end on 2 gloo ranks with tiny halves and few steps (no timing
thresholds: the box is shared), plus the timers' nesting with a fake clock.
The driver runs in the test's process and forks each scenario's ranks from the
warm server (``--launcher forked``): what is checked is what the ranks time
and what the driver writes, not the launcher (``benchmarks/gpu.sh`` runs it
under torchrun).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest

from tests.support.benchmark_cli import benchmark_main, load_benchmark

SCENARIOS = ("hf_drop", "hf_keep_before")  # one all-reduce per switch; two, and a release at every switch
STEPS, WARMUP = 6, 2


def _breakdown_module() -> Any:
    return load_benchmark("_breakdown")


@pytest.fixture(scope="module")
def breakdown_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("breakdown")
    benchmark_main(
        "alternating",
        "--breakdown",
        "--devices",
        "cpu",
        "--launcher",
        "forked",
        "--size-mib",
        "0.05",
        "--steps",
        str(STEPS),
        "--warmup",
        str(WARMUP),
        "--timeout",
        "240",
        "--out",
        str(out),
        "--scenarios",
        "single",
        *SCENARIOS,
    )
    return out, json.loads((out / "alternating_cpu_breakdown.json").read_text())


@pytest.mark.distributed
def test_every_part_of_every_switch_is_timed_on_every_rank(breakdown_run: tuple[Path, dict[str, Any]]) -> None:
    parts = list(_breakdown_module().PARTS)
    _, payload = breakdown_run
    for scenario in SCENARIOS:
        ranks = payload["runs"][scenario][0]
        assert sorted(r["rank"] for r in ranks) == [0, 1]
        for r in ranks:
            switches = r["breakdown"]["switches"]
            assert len(switches) == STEPS - WARMUP, (scenario, r["rank"])
            for entry in switches:
                assert set(parts) <= set(entry), (scenario, set(parts) - set(entry))
                # Every part runs at every switch here (DDP, a GroupedOptimizer, 2 ranks): a timer
                # reading 0 was not installed; `unattributed` is the remainder and may be ~0.
                assert all(entry[p] > 0 for p in parts if p != "unattributed"), (scenario, entry)
                assert entry["unattributed"] >= 0, (scenario, entry)
                assert sum(entry[p] for p in parts) <= entry["switch"] + 5e-5, (scenario, entry)
        summary = payload["breakdown"][scenario]
        assert summary["switches"] == 2 * (STEPS - WARMUP)
        assert set(parts) | {"sum_of_parts", "switch"} == set(summary["parts"])
        assert all(s["median_ms"] >= 0 and s["p90_ms"] >= s["median_ms"] for s in summary["parts"].values())
        assert summary["parts"]["sum_of_parts"]["median_ms"] <= summary["parts"]["switch"]["median_ms"] + 0.05


@pytest.mark.distributed
def test_gloo_floor_is_measured_on_every_rank_and_reported(breakdown_run: tuple[Path, dict[str, Any]]) -> None:
    out, payload = breakdown_run
    for scenario in SCENARIOS:
        for r in payload["runs"][scenario][0]:
            floor = r["breakdown"]["floor"]
            for key in _breakdown_module().FLOORS:
                assert floor[key]["n"] > 0 and 0 < floor[key]["min_s"] <= floor[key]["median_s"], (scenario, key)
        assert all(0 < s["min_ms"] <= s["median_ms"] for s in payload["breakdown"][scenario]["floor"].values())
    table = (out / "alternating_cpu_breakdown.md").read_text()
    assert "Switch breakdown" in table and "barrier" in table
    assert all(f"`{p}`" in table for p in _breakdown_module().PARTS)
    # The diagnostic barrier slows the switches: the plain results file is left alone.
    assert not (out / "alternating_cpu.json").exists()


def test_nested_timers_count_exclusive_time(monkeypatch: pytest.MonkeyPatch) -> None:
    breakdown = _breakdown_module()
    clock = [0.0]
    monkeypatch.setattr(breakdown.time, "perf_counter", lambda: clock[0])
    recorder = breakdown.Recorder()

    def advancing(seconds: float, inner: Callable[[], Any] = lambda: None) -> Callable[[], Any]:
        def run() -> Any:
            clock[0] += seconds
            return inner()

        return run

    init = recorder.timed("rebuild_init", advancing(3.0))
    rebuild = recorder.timed("rebuild", advancing(2.0, init))
    step_to = recorder.whole_switch(advancing(1.0, lambda: (rebuild(), "a record")[1]))
    assert step_to() == "a record"
    recorder.whole_switch(advancing(1.0, lambda: None))()  # no switch (phase unchanged): no entry
    assert len(recorder.switches) == 1
    entry = recorder.switches[0]
    assert (entry["rebuild_init"], entry["rebuild"], entry["unattributed"], entry["switch"]) == (3.0, 2.0, 1.0, 6.0)
    assert sum(entry[p] for p in breakdown.PARTS) == entry["switch"]


def test_the_forked_launcher_is_refused_for_cuda_ranks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        benchmark_main("alternating", "--devices", "cuda", "--launcher", "forked", "--out", str(tmp_path))
    assert exit_.value.code == 2 and "--launcher forked runs CPU ranks only" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
