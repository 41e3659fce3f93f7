"""One rank of a dead-or-stuck-rank check: a rank stops answering right before a phase switch.

Started by ``tests/engine/test_faults.py`` as two processes with torchrun's
environment variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
but no launcher: torchrun would stop the survivor itself when a rank dies (on
one node); on another node, or with a rank that hangs, nothing does, so the
switch's own bound is what is tested here.

Usage::

    python fault_switch.py MODE GROUP_TIMEOUT COLLECTIVE_TIMEOUT

A ``PhasedAccelerator`` run on gloo (``InitProcessGroupKwargs(timeout=GROUP_TIMEOUT)``,
``switcher_options={"collective_timeout": COLLECTIVE_TIMEOUT}``; ``none``: not set)
whose schedule switches at step :data:`SWITCH_AT`. After the backward of the step
before it (the gradients are all-reduced; the optimizer step that follows runs the
switch), rank 1 ``MODE``:

* ``dead``: exits at once (``os._exit``), like a rank killed by the OOM killer;
* ``stuck``: sleeps for a minute, like a rank blocked on I/O.

Rank 0 goes on into the switch; it prints ``FAULT-RESULT {json}`` (the error
type and message, the seconds it waited in the switch, the wall-clock time) and lets the error end
the process, as a user's script would (status 1); 0 if the switch (wrongly) completed.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
from accelerate.utils import InitProcessGroupKwargs
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups

SWITCH_AT = 2


def main() -> int:
    mode, group_timeout, collective_timeout = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    options = {} if collective_timeout == "none" else {"collective_timeout": float(collective_timeout)}
    acc = PhasedAccelerator(
        Alternating(["a", "b"], every=SWITCH_AT), switcher_options=options,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=group_timeout))])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = GroupedOptimizer(ParamGroups(model, {"a": "0.*", "b": "2.*"}),
                           lambda params: torch.optim.SGD(params, lr=0.1))
    ddp, opt = acc.prepare(model, opt)
    for step in range(SWITCH_AT + 1):
        acc.backward(ddp(torch.randn(2, 4)).square().mean())
        if step == SWITCH_AT - 1 and acc.process_index == 1:
            if mode == "dead":
                os._exit(9)
            time.sleep(60)
            os._exit(0)
        started = time.perf_counter()
        try:
            opt.step()  # at step SWITCH_AT - 1 this runs the switch to phase "b"
            opt.zero_grad()
        except Exception as exc:  # what the test checks; the process group is unusable now
            waited = time.perf_counter() - started
            print("FAULT-RESULT " + json.dumps({"type": type(exc).__name__, "message": str(exc),
                                                "waited": waited, "at": time.time()}), flush=True)
            raise  # as in a user's script: the error ends the process
    return 0


if __name__ == "__main__":
    sys.exit(main())
