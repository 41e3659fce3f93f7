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

* ``skip_step``: rank 1 skips that ``optimizer.step()`` (a loop whose ranks
  disagree on when to step) and goes on to the next backward. Both ranks must
  end with the library's error: rank 0 in the switch, rank 1 in
  ``accelerator.backward``, whose gradient all-reduce meets no partner. Both
  print ``FAULT-RESULT`` (rank 1 too).
* ``late``: nothing fails; rank 1 reaches ``prepare`` (the first switch)
  :data:`LATE_BY` seconds after rank 0, as a rank still loading its model
  would. The first switch waits under the process group's timeout, not
  ``collective_timeout``, so the run completes; rank 0 prints ``FAULT-RESULT``
  with ``type`` null and how long ``prepare`` waited, and both exit 0.

The ranks first meet in a file barrier (in ``$FAULT_SYNC_DIR``, no timeout
shorter than the test's) before the process group exists, and in a
``monitored_barrier`` with a long timeout before ``prepare``: on a loaded
machine their start-up (importing torch) can differ by more than the short
process-group timeouts these scenarios use, which would otherwise fail the
rendezvous or the first switch instead of the switch under test.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import Alternating, ParamGroups

SWITCH_AT = 2
LATE_BY = 4.0  # s: rank 1's delay before `prepare` in mode "late" (4x the tested collective_timeout)
MEET_WITHIN = 300.0  # s: the longest start-up gap the barriers below tolerate


def _file_barrier(folder: str, rank: int, world: int) -> None:
    """Wait (polling) until every rank has touched its file in ``folder``: no process group needed."""
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"rank{rank}"), "w").close()
    deadline = time.monotonic() + MEET_WITHIN
    while not all(os.path.exists(os.path.join(folder, f"rank{r}")) for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the other ranks did not start within {MEET_WITHIN:g} s")
        time.sleep(0.05)


def main() -> int:
    mode, group_timeout, collective_timeout = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    options = {} if collective_timeout == "none" else {"collective_timeout": float(collective_timeout)}
    _file_barrier(os.environ["FAULT_SYNC_DIR"], int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    acc = PhasedAccelerator(
        Alternating(["a", "b"], every=SWITCH_AT),
        switcher_options=options,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=group_timeout))],
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = GroupedOptimizer(ParamGroups(model, {"a": "0.*", "b": "2.*"}), lambda params: torch.optim.SGD(params, lr=0.1))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=MEET_WITHIN))  # gloo: its own timeout
    if mode == "late" and acc.process_index == 1:
        time.sleep(LATE_BY)
    started = time.perf_counter()
    ddp, opt = acc.prepare(model, opt)  # the first switch: rank 0 waits here for a late rank 1
    prepared_in = time.perf_counter() - started
    for step in range(SWITCH_AT + 2):
        started = time.perf_counter()
        try:
            acc.backward(ddp(torch.randn(2, 4)).square().mean())
            if step == SWITCH_AT - 1 and acc.process_index == 1 and mode in ("dead", "stuck"):
                if mode == "dead":
                    os._exit(9)
                time.sleep(60)
                os._exit(0)
            started = time.perf_counter()
            if not (mode == "skip_step" and step == SWITCH_AT - 1 and acc.process_index == 1):
                opt.step()  # at step SWITCH_AT - 1 this runs the switch to phase "b"
            opt.zero_grad()
        except Exception as exc:  # what the test checks; the process group is unusable now
            waited = time.perf_counter() - started
            print(
                "FAULT-RESULT "
                + json.dumps({"type": type(exc).__name__, "message": str(exc), "waited": waited, "at": time.time()}),
                flush=True,
            )
            raise  # as in a user's script: the error ends the process
    if acc.process_index == 0:
        print(
            "FAULT-RESULT "
            + json.dumps(
                {
                    "type": None,
                    "message": "",
                    "waited": prepared_in,
                    "at": time.time(),
                    "switches": len(acc.switch_records),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
