"""One rank of an exit check: train a few steps on 2 gloo ranks, then return without teardown.

Started by :func:`hf_altparams.testing.exits.repeat_exits` (``python exit_check.py MODE``
with torchrun's environment variables), the way many user scripts end: the
last backward runs just before the interpreter exits. ``MODE``:

* ``phased``: a ``PhasedAccelerator`` loop;
* ``plain``: plain DDP without hf_altparams (the baseline, which aborts now and then);
* ``shutdown``: plain DDP ended by :func:`hf_altparams.engine.shutdown`.
"""

from __future__ import annotations

import sys


def _rank(mode: str) -> None:
    """One rank of one run: a few training steps, then return (no teardown)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    batches = [torch.randn(8, 32) for _ in range(4)]
    if mode == "phased":
        from hf_altparams.engine import GroupedOptimizer
        from hf_altparams.integrations.accelerate import PhasedAccelerator
        from hf_altparams.plan import Alternating, ParamGroups

        accelerator = PhasedAccelerator(Alternating(["a", "b"]), log_switches=False)
        groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
        optimizer = GroupedOptimizer(groups, lambda params: torch.optim.SGD(params, lr=0.1))
        model, optimizer = accelerator.prepare(model, optimizer)
        for x in batches:
            accelerator.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        return
    dist.init_process_group("gloo")
    ddp = nn.parallel.DistributedDataParallel(model)
    sgd = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x in batches:
        ddp(x).square().mean().backward()
        sgd.step()
        sgd.zero_grad()
    if mode == "shutdown":
        from hf_altparams.engine import shutdown

        shutdown(ddp)



if __name__ == "__main__":
    _rank(sys.argv[1])
