"""The Accelerate examples run under `accelerate launch` with two CPU processes, and print what they claim."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hf_altparams.testing import launch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.distributed
def test_alternating_layers_allreduces_one_layer_per_step() -> None:
    width = 256
    out = launch(EXAMPLES / "alternating_layers.py", "--width", str(width), "--max-steps", "4",
                 "--warmup-steps", "1", "--batch-size", "8", nproc=2, launcher="accelerate", timeout=300).stdout

    assert "2 process(es) on cpu" in out
    layer_mib = width * (width + 1) * 4 / 2**20
    per_layer = re.search(r"by active layer: layer1 ([\d.]+) MiB, layer2 ([\d.]+) MiB", out)
    assert per_layer, out[-3000:]
    assert float(per_layer.group(1)) == float(per_layer.group(2)) == round(layer_mib, 2)
    ratio = re.search(r"bytes all-reduced per step ratio alternating/single: ([\d.]+)", out)
    assert ratio and float(ratio.group(1)) == 1.0, out[-3000:]
    rows = dict(re.findall(r"^(alternating|single)\s+([\d.]+)\s+", out, flags=re.MULTILINE))
    assert set(rows) == {"alternating", "single"} and all(float(v) >= 0 for v in rows.values())
    assert re.search(r"peak memory ratio alternating/single \(RSS growth\): ([\d.]+|n/a)", out)


@pytest.mark.distributed
def test_gradual_unfreeze_minilm_allreduces_the_trainable_layers() -> None:
    out = launch(EXAMPLES / "gradual_unfreeze_accelerate.py", "--max-steps", "4", "--unfreeze-every", "2",
                 nproc=2, launcher="accelerate", timeout=300).stdout

    rows = re.findall(r"^(head[+\w]*)\s+(\d+)\s+([\d,]+)\s+([\d.]+)\s+([\d.]+|n/a)\s*$", out, flags=re.MULTILINE)
    assert [r[0] for r in rows[:2]] == ["head+layer5", "head+layer4+layer5"], out[-3000:]
    assert [int(r[1]) for r in rows[:2]] == [0, 2]
    params = [int(r[2].replace(",", "")) for r in rows]
    assert params == sorted(params) and len(set(params)) == len(params)
    measured = [r for r in rows if r[4] != "n/a"]
    assert len(measured) == 2
    assert all(r[3] == r[4] for r in measured), "bytes all-reduced per step must equal the trainable bytes"
    assert re.search(r"eval accuracy: [\d.]+ \(64 sentences\); 4 steps on 2 process\(es\)", out)
