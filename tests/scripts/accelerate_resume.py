"""Resume half of the checkpoint check (run after ``accelerate_checks.py`` on the same OUT_DIR).

Usage::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 accelerate_resume.py OUT_DIR

New processes build the same model, optimizer and data as the ``resume``
scenario of ``accelerate_checks.py``, ``load_state`` its mid-phase checkpoint
(``OUT_DIR/ckpt``), skip the batches already seen and train to the end. Each
rank writes ``OUT_DIR/resume/rank{r}.json``: whether the final parameters are
bitwise equal to the uninterrupted run's, and the optimizer state found right
after loading (phase, devices and step counts per group).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.scripts.accelerate_checks import (  # noqa: E402
    LR,
    RESUME_POLICY,
    RESUME_SAVE_AT,
    RESUME_SCHEDULE,
    RESUME_STEPS,
    SPECS,
    fresh_model,
    loader,
)
from tests.support.digests import state_sha  # noqa: E402


def optimizer_state(opt: GroupedOptimizer) -> dict[str, Any]:
    """Per group: the devices its state tensors live on and the step count, if any."""
    out: dict[str, Any] = {}
    for name, inner in opt.inner.items():
        steps = [float(s["step"]) for p in opt.groups.params(name) if (s := inner.state.get(p)) and "step" in s]
        out[name] = {"devices": sorted(opt.state_bytes(name)), "step": max(steps) if steps else None}
    return out


def main() -> None:
    out = Path(sys.argv[1])
    acc = PhasedAccelerator(Alternating(RESUME_SCHEDULE), gradient_accumulation_steps=2)
    model = fresh_model()
    opt = GroupedOptimizer(
        ParamGroups(model, SPECS), functools.partial(torch.optim.AdamW, lr=LR), state_policy=RESUME_POLICY
    )
    ddp, prepared_opt, dl = acc.prepare(model, opt, loader(2 * 2 * RESUME_STEPS))
    phase_at_prepare = acc.phase.name if acc.phase else None

    acc.load_state(str(out / "ckpt"))
    inner_groups = [g for o in opt.inner.values() for g in o.param_groups]
    after_load = {
        "schedule_step": acc.schedule_step,
        "phase": acc.phase.name if acc.phase else None,
        "active": sorted(opt.active),
        "optimizer_state": optimizer_state(opt),
        # LR schedulers act on opt.param_groups: they must be the inner optimizers' live dicts
        "param_groups_live": all(a is b for a, b in zip(opt.param_groups, inner_groups)),
    }

    for x, y in acc.skip_first_batches(dl, 2 * RESUME_SAVE_AT):
        with acc.accumulate(ddp):
            acc.backward(nn.functional.mse_loss(ddp(x), y))
            prepared_opt.step()
            prepared_opt.zero_grad()
        if acc.schedule_step >= RESUME_STEPS:
            break

    uninterrupted = torch.load(out / f"uninterrupted_rank{acc.process_index}.pt")
    state = model.state_dict()
    write_rank_result(
        out / "resume",
        {
            "phase_at_prepare": phase_at_prepare,
            "after_load": after_load,
            "steps": acc.schedule_step,
            "bitwise_equal_to_uninterrupted": all(torch.equal(state[k], uninterrupted[k]) for k in uninterrupted),
            "max_abs_diff": max(float((state[k] - uninterrupted[k]).abs().max()) for k in uninterrupted),
            "param_sha256": state_sha(model),
            "models_registered": len(acc._models),
        },
        rank=int(os.environ.get("RANK", "0")),
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        # Let the gloo threads finish before interpreter exit, then destroy the group
        # (hf_altparams.engine.shutdown explains the "terminate called" abort it prevents).
        shutdown()
