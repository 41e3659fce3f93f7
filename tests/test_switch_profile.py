"""``benchmarks/switch_profile.py``: the BERT model, ``--compare-inputs`` and ``--compare-kept`` run end to end.

One process, tiny models and few switches (no timing thresholds: the box is
shared); what is checked is that both ways of building the reducer's inputs
(or both reducer settings) ran on the same number of switches and that the
report names the model. Each run is one rank forked from the warm server of
``hf_altparams.testing`` (the script as ``torchrun --nproc_per_node 1`` runs it:
world size 1, as ``python benchmarks/switch_profile.py`` runs it), so no run
pays an interpreter's start-up and the test process keeps no process group.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_altparams.testing.launch import launch, launch_ranks

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "switch_profile.py"


def _run(*args: str) -> str:
    return launch(SCRIPT, *args, nproc=1, launcher="forked", timeout=300).stdout


@pytest.mark.parametrize("model", [["--model", "halves", "--size-mib", "0.05"], ["--model", "bert", "--layers", "2"]])
def test_compare_inputs_times_both_ways_on_equal_halves_of_the_switches(model: list[str]) -> None:
    out = _run(*model, "--switches", "8", "--warmup", "2", "--compare-inputs")
    assert ("BERT, 2 layers" in out) == (model[1] == "bert")
    match = re.search(
        r"median switch ([\d.]+) ms .*\n.*DDP's own methods: median switch ([\d.]+) ms.*"
        r"= ([\d.]+)x \((\d+) and (\d+) switches, interleaved\)",
        out,
    )
    assert match is not None, out
    ours, theirs, ratio = (float(match.group(i)) for i in (1, 2, 3))
    assert ours > 0 and theirs > 0 and ratio == pytest.approx(ours / theirs, rel=0.01)  # printed values are rounded
    assert match.group(4) == match.group(5) == "4"


def test_compare_kept_times_both_reducer_settings_on_equal_halves_of_the_switches() -> None:
    # BERT: its pooler is trained and used (an unused trainable parameter refuses the switch).
    out = _run("--model", "bert", "--layers", "2", "--switches", "8", "--warmup", "4", "--compare-kept")
    match = re.search(
        r"keep_reducers=0: median step ([\d.]+) ms, median switch ([\d.]+) ms .*\n"
        r"  keep_reducers=1: median step ([\d.]+) ms, median switch ([\d.]+) ms .*"
        r"switch ([\d.]+)x, step ([\d.]+)x \((\d+) and (\d+) switches, interleaved\)",
        out,
    )
    assert match is not None, out
    built_step, built, kept_step, kept, ratio, step_ratio = (float(match.group(i)) for i in range(1, 7))
    assert ratio == pytest.approx(kept / built, rel=0.01) and step_ratio == pytest.approx(
        kept_step / built_step, rel=0.01
    )
    assert match.group(7) == match.group(8) == "4"


def test_bert_needs_two_layers_to_alternate() -> None:
    (proc,) = launch_ranks(SCRIPT, "--model", "bert", "--layers", "1", nproc=1, timeout=120)
    assert proc.returncode == 2 and "--layers >= 2" in proc.stdout and "got 1" in proc.stdout


def test_check_cost_times_the_invariant_check_as_a_share_of_the_step() -> None:
    out = _run("--model", "bert", "--layers", "2", "--switches", "4", "--warmup", "2", "--top", "0", "--check-cost")
    step = re.search(r"median step ([\d.]+) ms", out)
    match = re.search(
        r"invariant check before each step: median ([\d.]+) us over 2000 calls \(([\d.]+) % of a step\)", out
    )
    assert step is not None and match is not None, out
    check_us, share = float(match.group(1)), float(match.group(2))
    assert check_us > 0
    assert share == pytest.approx(100 * check_us / 1000 / float(step.group(1)), abs=0.01 + 0.02 * share)
