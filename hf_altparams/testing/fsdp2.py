"""Run Accelerate's FSDP2 code on CPU ranks (gloo), to test an FSDP2 set-up without a GPU.

On CPU, Accelerate chooses ``MULTI_CPU`` (plain DDP) and leaves an FSDP plugin
unused, although torch's ``fully_shard`` itself runs on CPU with gloo.
:func:`use_accelerate_fsdp2` sets the distributed type of an ``Accelerator``
already built on CPU ranks to ``FSDP`` with the given plugin, so that
``prepare``, ``save_state`` and ``load_state`` then run Accelerate's own FSDP2
code (``fully_shard`` of the model, sharded ``torch.distributed.checkpoint``
files). What it does not give is what Accelerate's ``__init__`` does for FSDP
on a GPU only (the fp16 grad scaler, device choice): test those on a GPU.
``docs/testing.md`` shows the Accelerate and Trainer forms.
"""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

from ..integrations import accelerate_internals

__all__ = ["fresh_accelerator_state", "use_accelerate_fsdp2"]


def fresh_accelerator_state() -> None:
    """Forget Accelerate's shared ``AcceleratorState`` (not the process group).

    The next ``Accelerator`` then reads its own plugins: a script that runs a
    DDP run and then an FSDP2 run in one process needs it between the two.

    Example::

        fresh_accelerator_state()
        acc = PhasedAccelerator(schedule, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    """
    accelerate_internals.fresh_accelerator_state()


def use_accelerate_fsdp2(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make ``accelerator`` (built on gloo CPU ranks) run Accelerate's FSDP2 path with ``plugin``.

    Call it right after constructing the accelerator (or the Trainer), before
    ``prepare``.

    Example (every rank; ``launch(script, ..., launcher="torchrun")`` starts them)::

        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
        acc = PhasedAccelerator(schedule, fsdp_plugin=plugin)
        if acc.distributed_type != DistributedType.FSDP:  # CPU ranks: Accelerate chose MULTI_CPU
            use_accelerate_fsdp2(acc, plugin)
        model, optimizer = acc.prepare(model, optimizer)  # fully_shard, as on GPUs
    """
    accelerate_internals.run_fsdp_state(accelerator, plugin)
