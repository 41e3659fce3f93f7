"""One rank of an exit check: train a few steps on 2 gloo ranks, then return without teardown.

Started by :func:`tests.support.exits.repeat_exits` (``python exit_check.py MODE``
with torchrun's environment variables), the way many user scripts end: the
last backward runs just before the interpreter exits. ``MODE``:

* ``phased``: a ``PhasedAccelerator`` loop;
* ``trainer``: ``Trainer.train()`` with an ``AlternatingFreeze`` callback;
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
    if mode == "trainer":
        _trainer()
        return
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


def _trainer() -> None:
    import tempfile

    import torch
    from torch import nn
    from transformers import Trainer, TrainingArguments

    from hf_altparams.integrations.trainer import AlternatingFreeze
    from hf_altparams.plan import Alternating

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.b(torch.tanh(self.a(x))).squeeze(-1) - labels).square().mean()}

    torch.manual_seed(0)
    rows = [{"x": torch.randn(16), "labels": torch.randn(())} for _ in range(32)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=4,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            ddp_find_unused_parameters=False,
            disable_tqdm=True,
        )
        freeze = AlternatingFreeze({"a": "a.*", "b": "b.*"}, Alternating(["a", "b"]))
        Trainer(model=Net(), args=args, train_dataset=rows, callbacks=[freeze]).train()


if __name__ == "__main__":
    _rank(sys.argv[1])
