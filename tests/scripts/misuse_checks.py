"""Loop and wiring mistakes on 2 gloo ranks: each must fail (or be repaired) before a wrong step.

Launched by ``tests/engine/test_misuse.py`` under ``accelerate launch`` (CPU,
2 ranks); writes ``{out}/rank{r}.json`` with one entry per scenario:

* ``ddp_before_phase`` (engine): DDP built over every parameter before
  ``switcher.step_to(0)``, then attached: warned and re-bucketed, ranks equal.
* ``forgot_attach`` (engine): ``switcher.attach(ddp)`` never called: the second
  phase's switch is refused on every rank, naming ``attach``, flags untouched.
* ``unwrapped_forward`` (PhasedAccelerator): a training forward through
  ``accelerator.unwrap_model(model)``: refused at ``step()``, nothing applied.
* ``epoch_never_set`` / ``epoch_set`` (PhasedAccelerator): an epoch-unit
  schedule without / with ``accelerator.set_epoch`` (``epoch_set_once``: called
  for the first epoch only: a warning).
* ``end_training``: ``PhasedAccelerator.end_training`` frees the reducer and
  destroys the process group.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from accelerate import PartialState
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
from hf_altparams.engine.ddp import _surgery as _ddp
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError, SwitchError
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.digests import param_sha  # noqa: E402

SPECS = {"a": "0.*", "b": "2.*"}


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def batch(step: int) -> torch.Tensor:
    # Different data on each rank: without an all-reduce the ranks drift apart.
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def sgd(groups: ParamGroups) -> GroupedOptimizer:
    return GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))


def ddp_before_phase() -> dict[str, Any]:
    model = net()
    groups = ParamGroups(model, SPECS)
    ddp = DDP(model)  # every parameter still trainable: the reducer buckets both groups
    opt = sgd(groups)
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    switcher.step_to(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        switcher.attach(ddp)
    reducer_after_attach = sorted(_ddp.reducer_parameter_names(ddp) or ())
    for step in range(4):
        ddp(batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        switcher.step_to(step + 1)
    return {
        "warnings": [str(w.message) for w in caught],
        "reducer_after_attach": reducer_after_attach,
        "phase_a_params": sorted(groups.trainable_param_names(frozenset({"a"}))),
        "sha": param_sha(model),
    }


def forgot_attach() -> dict[str, Any]:
    model = net()
    groups = ParamGroups(model, SPECS)
    opt = sgd(groups)
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    switcher.step_to(0)
    ddp = DDP(model)  # built after the first phase, as it should be, but never attached
    ddp(batch(0)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    error = ""
    try:
        switcher.step_to(1)
    except SwitchError as exc:
        error = str(exc)
    return {
        "error": error,
        "phase": switcher.current.name if switcher.current else None,
        "b_trainable": [p.requires_grad for p in model[2].parameters()],
    }


def _accelerate_run(
    schedule: Any, loop: Callable[[PhasedAccelerator, nn.Module, Any, Any], dict[str, Any]], batches: int = 3
) -> dict[str, Any]:
    acc = PhasedAccelerator(schedule, log_switches=False)
    model = net()
    groups = ParamGroups(model, SPECS)
    data = torch.utils.data.TensorDataset(torch.randn(4 * batches * acc.num_processes, 8))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    ddp, opt, loader = acc.prepare(model, sgd(groups), loader)
    try:
        return loop(acc, ddp, opt, loader)
    finally:
        acc.free_memory()


def unwrapped_forward() -> dict[str, Any]:
    def loop(acc: PhasedAccelerator, model: nn.Module, opt: Any, loader: Any) -> dict[str, Any]:
        acc.backward(model(batch(0)).square().mean())  # the first step goes through DDP: fine
        opt.step()
        opt.zero_grad()
        before = param_sha(acc.unwrap_model(model))
        acc.backward(acc.unwrap_model(model)(batch(1)).square().mean())
        error = ""
        try:
            opt.step()
        except AltParamsError as exc:
            error = str(exc)
        return {
            "error": error,
            "unchanged": param_sha(acc.unwrap_model(model)) == before,
            "sha": before,
            "steps": acc.schedule_step,
        }

    return _accelerate_run(Alternating(["a", "b"]), loop)


def doubled_step() -> dict[str, Any]:
    """``optimizer.step()`` twice after one backward (no switch in between): refused as a second step."""

    def loop(acc: PhasedAccelerator, model: nn.Module, opt: Any, loader: Any) -> dict[str, Any]:
        acc.backward(model(batch(0)).square().mean())
        opt.step()
        after_first = param_sha(acc.unwrap_model(model))
        error = ""
        try:
            opt.step()  # the same gradients again
        except AltParamsError as exc:
            error = str(exc)
        return {
            "error": error,
            "unchanged": param_sha(acc.unwrap_model(model)) == after_first,
            "steps": acc.schedule_step,
            "sha": after_first,
        }

    return _accelerate_run(Alternating(["a", "b"], every=4), loop)


def epochs(set_epoch: bool, only_first: bool = False) -> dict[str, Any]:
    def loop(acc: PhasedAccelerator, model: nn.Module, opt: Any, loader: Any) -> dict[str, Any]:
        phases, error = [], ""
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                for epoch in range(2):
                    if set_epoch and (epoch == 0 or not only_first):
                        acc.set_epoch(epoch)
                    for (x,) in loader:
                        phases.append(acc.phase.name if acc.phase else None)
                        acc.backward(model(x).square().mean())
                        opt.step()
                        opt.zero_grad()
            except AltParamsError as exc:
                error = str(exc)
        return {
            "error": error,
            "phases": phases,
            "steps": acc.schedule_step,
            "per_epoch": len(loader),
            "warnings": [str(w.message) for w in seen if "set_epoch" in str(w.message)],
            "sha": param_sha(acc.unwrap_model(model)),
        }

    return _accelerate_run(Alternating(["a", "b"], unit="epoch"), loop)


def end_training() -> dict[str, Any]:
    """Last: ``PhasedAccelerator.end_training`` frees the reducer, then destroys the group."""
    acc = PhasedAccelerator(Alternating(["a", "b"]), log_switches=False)
    model = net()
    ddp, opt = acc.prepare(model, sgd(ParamGroups(model, SPECS)))
    acc.backward(ddp(batch(0)).square().mean())
    opt.step()
    opt.zero_grad()
    acc.end_training()
    return {"reducer_freed": ddp.reducer is None, "group_destroyed": not dist.is_initialized()}


def main() -> None:
    out = sys.argv[1]
    PartialState(cpu=True)  # two gloo ranks (ACCELERATE_USE_CPU=1 under accelerate launch)
    results = {
        "ddp_before_phase": ddp_before_phase(),
        "forgot_attach": forgot_attach(),
        "unwrapped_forward": unwrapped_forward(),
        "doubled_step": doubled_step(),
        "epoch_never_set": epochs(set_epoch=False),
        "epoch_set": epochs(set_epoch=True),
        "epoch_set_once": epochs(set_epoch=True, only_first=True),
    }
    results["end_training"] = end_training()
    write_rank_result(out, results, rank=int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
