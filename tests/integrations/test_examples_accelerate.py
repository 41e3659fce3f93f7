"""The Accelerate examples run on two CPU ranks and print what they claim.

The first runs under `accelerate launch`, as the examples' docstrings say; the
others as the ranks of a launcher forked from the suite's warm server with
``ACCELERATE_USE_CPU=1``, the state `accelerate launch` gives a CPU rank
(``tests/testing/test_forked.py`` checks that the two agree), to spare CI a
fresh interpreter per rank.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_altparams.testing import launch, rank_results

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.distributed
def test_alternating_layers_compares_the_loops_side_by_side() -> None:
    width = 256
    out = launch(
        EXAMPLES / "alternating_layers.py",
        "--width",
        str(width),
        "--max-steps",
        "4",
        "--warmup-steps",
        "1",
        "--batch-size",
        "8",
        nproc=2,
        launcher="accelerate",
        timeout=300,
    ).stdout

    assert "2 process(es) on cpu" in out and "idle-state policy: keep" in out  # auto: keep on CPU
    layer_bytes = width * (width + 1) * 4
    per_layer = re.search(r"by active layer: layer1 ([\d.]+) MiB, layer2 ([\d.]+) MiB", out)
    assert per_layer, out[-3000:]
    assert float(per_layer.group(1)) == float(per_layer.group(2)) == round(layer_bytes / 2**20, 2)
    rows = {
        m[0]: m[1:]
        for m in re.findall(
            r"^(naive|find_unused|hf_altparams|hf_drop|single)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)\s+"
            r"([\d.]+)\s+([\d.]+) -> ([\d.]+)",
            out,
            flags=re.MULTILINE,
        )
    }
    assert set(rows) == {"naive", "find_unused", "hf_altparams", "hf_drop", "single"}, out[-3000:]
    mib = {name: float(row[2]) for name, row in rows.items()}
    # DDP all-reduces one layer per step, except a DDP built over both with find_unused_parameters=True.
    assert mib["hf_altparams"] == mib["hf_drop"] == mib["naive"] == mib["single"] == round(layer_bytes / 2**20, 2)
    assert mib["find_unused"] == round(2 * layer_bytes / 2**20, 2)
    # DDP's constructor broadcasts the whole model: once at prepare, but at every step in the naive loop.
    model_mib = 2 * layer_bytes / 2**20
    broadcast = {name: float(row[3]) for name, row in rows.items()}
    assert broadcast["naive"] == round(4 * model_mib, 2)
    assert broadcast["hf_altparams"] == broadcast["find_unused"] == round(model_mib, 2)
    # The three loops that keep both AdamWs train the same model the same way: same losses.
    assert rows["hf_altparams"][5:] == rows["naive"][5:] == rows["find_unused"][5:]
    assert re.search(r"hf_altparams / find_unused: peak memory [\d.]+x, bytes all-reduced per step 0.50x", out)
    # Measured, not asserted by the script: the idle layer's AdamW moments at the end (keep: both, in RAM).
    idle = re.search(
        r"^hf_altparams: the idle layer's AdamW state at the end \(policy keep\): ([\d.]+) MiB on cpu",
        out,
        flags=re.MULTILINE,
    )
    assert idle and float(idle.group(1)) == round(2 * layer_bytes / 2**20, 1), out[-3000:]
    assert "hf_drop: the idle layer's AdamW state at the end (policy drop): none" in out


@pytest.mark.distributed
def test_gradual_unfreeze_minilm_allreduces_the_trainable_layers() -> None:
    out = launch(
        EXAMPLES / "gradual_unfreeze_accelerate.py",
        "--max-steps",
        "4",
        "--unfreeze-every",
        "2",
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},  # what `accelerate launch` gives a CPU rank
        timeout=300,
    ).stdout

    rows = re.findall(r"^(head[+\w]*)\s+(\d+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+|n/a)\s*$", out, flags=re.MULTILINE)
    assert [r[0] for r in rows[:2]] == ["head+layer5", "head+layer4+layer5"], out[-3000:]
    assert [int(r[1]) for r in rows[:2]] == [0, 2]
    params = [int(r[2].replace(",", "")) for r in rows]
    assert params == sorted(params) and len(set(params)) == len(params)
    measured = [r for r in rows if r[4] != "n/a"]
    assert len(measured) == 2
    assert all(r[3] == r[4] for r in measured), "bytes all-reduced per step must equal the trainable bytes"
    assert re.search(r"eval accuracy: [\d.]+ \(64 sentences\); 4 steps on 2 process\(es\)", out)


@pytest.mark.distributed
def test_gan_trains_each_player_only_in_its_phases_and_ranks_end_identical(tmp_path: Path) -> None:
    out = launch(
        EXAMPLES / "gan_accelerate.py",
        "--max-steps",
        "12",
        "--batch-size",
        "16",
        "--out",
        str(tmp_path),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},  # what `accelerate launch` gives a CPU rank
        timeout=300,
    ).stdout
    ranks = rank_results(tmp_path, nproc=2)
    assert ranks[0]["final"] == ranks[1]["final"], "ranks must end bit-identical"
    # 5 discriminator steps : 1 generator step, read at the top of each iteration (zero_grad comes first).
    expected = (["discriminator"] * 5 + ["generator"]) * 2
    for rank in ranks:
        assert [s["phase"] for s in rank["steps"]] == expected
        # Each step changes exactly the player whose phase it is: never the frozen one.
        assert all(s["changed"] == [s["phase"]] for s in rank["steps"]), rank["steps"]
    assert re.search(r"12 steps on 2 process\(es\): 10 discriminator, 2 generator \(5:1\)", out), out[-2000:]
    assert re.search(r"mean distance to the nearest mode: [\d.]+ -> [\d.]+", out)


@pytest.mark.distributed
def test_multitask_feeds_each_task_its_data_and_visits_every_head(tmp_path: Path) -> None:
    out = launch(
        EXAMPLES / "multitask_accelerate.py",
        "--max-steps",
        "6",
        "--every",
        "2",
        "--batch-size",
        "8",
        "--out",
        str(tmp_path),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},  # what `accelerate launch` gives a CPU rank
        timeout=300,
    ).stdout
    ranks = rank_results(tmp_path, nproc=2)
    assert ranks[0]["final"] == ranks[1]["final"], "ranks must end bit-identical"
    assert ranks[0]["eval"] == ranks[1]["eval"]
    for rank in ranks:
        assert [s["task"] for s in rank["steps"]] == ["sine", "sine", "sign", "sign", "norm", "norm"]
        # The trunk and the current head train; the other heads never move.
        assert all(s["changed"] == sorted(["trunk", s["task"]]) for s in rank["steps"]), rank["steps"]
    # The evaluation before and after reached all three heads (two of them non-resident) via visiting().
    rows = re.findall(r"^(sine|sign|norm)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$", out, flags=re.MULTILINE)
    assert [(r[0], int(r[1])) for r in rows] == [("sine", 2), ("sign", 2), ("norm", 2)], out[-2000:]


@pytest.mark.distributed
def test_peft_adapters_one_per_task_allreduce_the_active_adapter_and_save_each(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    save_dir, out_dir = tmp_path / "adapters", tmp_path / "out"
    out = launch(
        EXAMPLES / "peft_adapters_accelerate.py",
        "--max-steps",
        "4",
        "--every",
        "2",
        "--batch-size",
        "4",
        "--save-dir",
        str(save_dir),
        "--out",
        str(out_dir),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},  # what `accelerate launch` gives a CPU rank
        timeout=420,
    ).stdout
    ranks = rank_results(out_dir, nproc=2)
    assert ranks[0]["final"] == ranks[1]["final"], "ranks must end bit-identical"
    for rank in ranks:
        assert [s["task"] for s in rank["steps"]] == ["sentiment", "sentiment", "topic", "topic"]
        for step in rank["steps"]:
            assert step["active"] == [step["task"]], "the forward ran the adapter of the task being trained"
            assert step["allreduced"] == step["adapter_bytes"] > 0, "DDP all-reduced that adapter, nothing else"
    rows = re.findall(
        r"^\s*(\d+)\s+(sentiment|topic)\s+(sentiment|topic)\s+([\d,]+)\s+([\d,]+)\s+[\d.]+\s*$", out, flags=re.MULTILINE
    )
    assert [(r[1], r[2]) for r in rows] == [("sentiment", "sentiment")] * 2 + [("topic", "topic")] * 2, out[-3000:]
    assert all(r[3] == r[4] for r in rows)
    assert "every step all-reduced exactly its adapter's bytes: yes" in out
    assert "ranks identical: yes (2 ranks" in out
    for task in ("sentiment", "topic"):
        assert f"saved adapter '{task}' -> {save_dir / task} (reloads identical: yes)" in out
        assert (save_dir / task / "adapter_model.safetensors").is_file()
