"""2 gloo ranks: PhasedAccelerator refuses diverged weights, torn or damaged checkpoints, other groups.

Usage (``tests/integrations/test_integrity.py`` launches it)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 integrity_checks.py OUT_DIR

Scenarios, each on a fresh ``PhasedAccelerator``, in one launch; each rank writes
``OUT_DIR/rank{r}.json`` with what it caught:

* ``drift_at_save``: a complete ``save_state("latest")``, then rank 1 changes
  one element of group ``b``; the next ``save_state("latest")`` must raise a
  ``DriftError`` on both ranks naming group ``b`` and rank 1, write nothing, and
  leave the earlier ``latest`` loadable (both ranks equal again after loading).
* ``drift_every_n``: ``switcher_options={"drift_check": 2}``; rank 1 changes an
  element of group ``a`` after step 1; the optimizer step that ends step 2 raises.
* ``torn_in_place``: ``save_state("latest")`` twice, the second killed right
  after the model file is written (the kill stands in as an exception raised on
  both ranks at that point, as the process would die there); ``load_state("latest")``
  must be refused (the old marker may not vouch for the new model).
* ``damaged``: a complete checkpoint whose ``model.safetensors`` is then deleted,
  or whose ``optimizer.bin`` is truncated, is refused naming that file; a
  folder that does not exist is called missing.
* ``other_groups``: a checkpoint saved with groups ``a`` = layer 0, ``b`` =
  layer 2 under plain SGD, loaded with the two swapped: refused naming both.
* ``total_limit``: ``ProjectConfiguration(total_limit=2)``; one complete save,
  then three killed before their marker; the complete one must survive (plain
  Accelerate deletes it to make room for the torn ones), then complete saves
  prune the torn folders and keep the two newest complete ones.
* ``unreached``: the loop's forward skips the phase's group (a branch the batch
  does not take): ``accelerator.backward`` raises the library's error naming
  the phase and the causes, not torch's "element 0 of tensors does not require grad".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, NoReturn

import accelerate.checkpointing
import pytest
import torch
import torch.distributed as dist
from accelerate.utils import ProjectConfiguration
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.launch import write_rank_result

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support
from tests.support.digests import state_sha  # noqa: E402
from tests.support.faults import SaveFault  # noqa: E402

SPECS = {"a": "trunk.*", "b": "head.*"}


class Branchy(nn.Module):
    """A trunk (group ``a``) and a head (group ``b``) that a forward may skip."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.trunk, self.head = nn.Linear(4, 8), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_head: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) if use_head else h.sum(dim=1, keepdim=True)


class Killed(Exception):
    """Stands for the process dying at that point (raised on every rank alike)."""


def build(specs: dict[str, str] = SPECS, plain: bool = False, **kwargs: Any) -> tuple[Any, nn.Module, Any]:
    model = Branchy()
    groups = ParamGroups(model, specs)
    if plain:  # one torch optimizer over every parameter, the groups given to the accelerator
        acc = PhasedAccelerator(Alternating({"a": 2, "b": 1}), groups=groups, **kwargs)
        opt: Any = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        acc = PhasedAccelerator(Alternating({"a": 2, "b": 1}), **kwargs)
        opt = GroupedOptimizer(groups, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    ddp, opt = acc.prepare(model, opt)
    return acc, ddp, opt


def train(acc: Any, ddp: nn.Module, opt: Any, steps: int, after: Callable[[int], None] = lambda step: None) -> None:
    gen = torch.Generator().manual_seed(100 + acc.schedule_step * 2 + acc.process_index)
    for _ in range(steps):
        x, y = torch.randn(4, 4, generator=gen), torch.randn(4, 1, generator=gen)
        acc.backward(nn.functional.mse_loss(ddp(x), y))
        opt.step()
        opt.zero_grad()
        after(acc.schedule_step)


def caught(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        call()
    except Exception as exc:  # what the test checks
        return {"type": type(exc).__name__, "message": str(exc), "is_library_error": isinstance(exc, AltParamsError)}
    return {"type": None, "message": ""}


def nudge(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.view(-1)[0] += 1e-3


def drift_at_save(out: Path) -> dict[str, Any]:
    acc, ddp, opt = build()
    model = ddp.module
    train(acc, ddp, opt, 2)
    latest = str(out / "drift" / "latest")
    acc.save_state(latest)
    saved_sha = state_sha(model)
    train(acc, ddp, opt, 1)
    if acc.process_index == 1:
        nudge(model.head.weight)
    error = caught(lambda: acc.save_state(latest))
    acc.load_state(latest)  # the earlier checkpoint, untouched: both ranks equal again
    shas: list[Any] = [None, None]
    dist.all_gather_object(shas, state_sha(model))
    return {
        "error": error,
        "loaded_step": acc.schedule_step,
        "loaded_is_saved": state_sha(model) == saved_sha,
        "ranks_equal_after_load": shas[0] == shas[1],
    }


def drift_every_n() -> dict[str, Any]:
    steps: list[int] = []

    def run() -> None:
        acc, ddp, opt = build(switcher_options={"drift_check": 2})

        def diverge(step: int) -> None:
            steps.append(step)
            if step == 1 and acc.process_index == 1:
                nudge(ddp.module.trunk.bias)

        train(acc, ddp, opt, 3, after=diverge)

    return {"error": caught(run), "steps_done": steps}


def torn_in_place(out: Path) -> dict[str, Any]:
    acc, ddp, opt = build()
    latest = str(out / "torn" / "latest")
    train(acc, ddp, opt, 2)
    acc.save_state(latest)
    train(acc, ddp, opt, 1)
    original = accelerate.checkpointing.save

    def save_then_die(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(obj, f, *args, **kwargs)
        if str(f).endswith("model.safetensors"):
            raise Killed("killed right after the model was written")
        return result

    accelerate.checkpointing.save = save_then_die
    try:
        killed = caught(lambda: acc.save_state(latest))
    finally:
        accelerate.checkpointing.save = original
    dist.barrier()
    return {"killed": killed, "load": caught(lambda: acc.load_state(latest))}


def damaged(out: Path) -> dict[str, Any]:
    acc, ddp, opt = build()
    train(acc, ddp, opt, 2)
    folders = {name: str(out / "damaged" / name) for name in ("model", "optimizer")}
    for folder in folders.values():
        acc.save_state(folder)
    if acc.is_main_process:
        os.remove(os.path.join(folders["model"], "model.safetensors"))
        path = os.path.join(folders["optimizer"], "optimizer.bin")
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
    dist.barrier()
    return {
        "no_model": caught(lambda: acc.load_state(folders["model"])),
        "half_optimizer": caught(lambda: acc.load_state(folders["optimizer"])),
        "missing_folder": caught(lambda: acc.load_state(str(out / "damaged" / "never_saved"))),
    }


def other_groups(out: Path) -> dict[str, Any]:
    folder = str(out / "groups")
    acc, ddp, opt = build(plain=True)
    train(acc, ddp, opt, 2)
    acc.save_state(folder)
    acc, ddp, opt = build({"a": "head.*", "b": "trunk.*"}, plain=True)
    return {"load": caught(lambda: acc.load_state(folder))}


def total_limit(out: Path) -> dict[str, Any]:
    config = ProjectConfiguration(project_dir=str(out / "limited"), automatic_checkpoint_naming=True, total_limit=2)
    acc, ddp, opt = build(project_config=config)
    checkpoints = out / "limited" / "checkpoints"

    def listing() -> list[str]:
        return sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else []

    def die(stage: str) -> NoReturn:
        raise Killed(f"killed at {stage}")

    fault = SaveFault(pytest.MonkeyPatch(), die)  # the save "dies" after Accelerate wrote, before the marker

    def killed_save() -> Any:
        fault.arm("before_marker")
        try:
            return caught(acc.save_state)
        finally:
            fault.disarm()

    train(acc, ddp, opt, 1)
    acc.save_state()  # checkpoint_0, complete
    torn = [killed_save() for _ in range(3)]  # checkpoint_1..3, torn before their marker
    dist.barrier()
    after_torn = {"folders": listing(), "latest": acc.latest_checkpoint()}
    train(acc, ddp, opt, 1)
    acc.save_state()  # checkpoint_4, complete: the torn ones go, 0 stays (2 complete kept)
    dist.barrier()
    after_one = listing()
    acc.save_state()  # checkpoint_5: 0 goes
    dist.barrier()
    return {
        "torn": torn,
        "after_torn": after_torn,
        "after_one_complete": after_one,
        "after_two_complete": listing(),
        "latest": acc.latest_checkpoint(),
    }


def unreached() -> dict[str, Any]:
    acc, ddp, opt = build()
    train(acc, ddp, opt, 2)  # phase "b" (the head) trains now
    x = torch.randn(4, 4)
    phase = acc.phase.name if acc.phase else None
    return {"phase": phase, "error": caught(lambda: acc.backward(ddp(x, use_head=False).square().mean()))}


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "drift_at_save": drift_at_save(out),
        "drift_every_n": drift_every_n(),
        "torn_in_place": torn_in_place(out),
        "damaged": damaged(out),
        "other_groups": other_groups(out),
        "total_limit": total_limit(out),
        "unreached": unreached(),  # last: the skipped backward leaves the DDP wrapper mid-iteration
    }
    write_rank_result(out, results, rank=dist.get_rank())


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
