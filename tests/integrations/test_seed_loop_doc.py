"""The converted seed loop of docs/accelerate.md: the "after" side runs as printed, the stated line counts are the diff's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

DOC = Path(__file__).resolve().parents[2] / "docs" / "accelerate.md"


def _seed_diff() -> list[str]:
    text = DOC.read_text()
    start = text.index("```diff\n", text.index("Here is the loop this replaces")) + len("```diff\n")
    return text[start : text.index("\n```", start)].splitlines()


def test_the_stated_numbers_of_changed_lines_are_the_diffs() -> None:
    lines = _seed_diff()
    removed, added = sum(line.startswith("-") for line in lines), sum(line.startswith("+") for line in lines)
    stated = re.search(r"(\d+) lines removed, (\d+) added", DOC.read_text())
    assert stated is not None and (int(stated.group(1)), int(stated.group(2))) == (removed, added)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer1, self.layer2 = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_converted_loop_runs_as_printed_and_alternates_the_two_adams() -> None:
    after = "\n".join(line[1:] for line in _seed_diff() if not line.startswith("-"))
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 4, generator=gen), torch.randn(48, 1, generator=gen))
    scope = {"Net": Net, "loss_fn": nn.functional.mse_loss, "loader": torch.utils.data.DataLoader(data, batch_size=8)}
    exec(compile(after, str(DOC), "exec"), scope)  # noqa: S102 - the documentation's own code
    accelerator, opt1, opt2 = scope["accelerator"], scope["opt1"], scope["opt2"]
    assert accelerator.schedule_step == 6
    # Alternating(["layer1", "layer2"]): each Adam stepped on every other iteration, and only then.
    steps = [float(opt.optimizer.state[opt.param_groups[0]["params"][0]]["step"]) for opt in (opt1, opt2)]
    assert steps == [3.0, 3.0]
    accelerator.free_memory()
