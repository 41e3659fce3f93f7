"""Driving Accelerate's FSDP2 code on CPU, for tests (no GPU needed).

Accelerate picks ``MULTI_CPU`` on CPU and ignores an FSDP plugin (DESIGN fact
13), although ``fully_shard`` itself runs on CPU with gloo. :func:`use_accelerate_fsdp2`
sets the distributed type of an ``Accelerator`` built on gloo CPU ranks to
``FSDP`` with the given plugin *after* its construction, so that ``prepare``,
``save_state`` and ``load_state`` run Accelerate's real FSDP2 code
(``_prepare_fsdp2`` -> ``fsdp2_prepare_model`` -> ``fully_shard``; DCP sharded
checkpoints). What it skips is what Accelerate does in ``__init__`` for FSDP2
on a GPU (mixed-precision grad scaler, device placement choices): GPU runs of
the same scripts are in ``benchmarks/gpu.sh``.
"""

from __future__ import annotations

from typing import Any


def fresh_accelerator_state() -> None:
    """Forget Accelerate's shared ``AcceleratorState`` (not the process group), so that the next
    ``Accelerator`` reads its own plugins: a script running a DDP run, then an FSDP2 run, needs it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()


def use_accelerate_fsdp2(accelerator: Any, plugin: Any) -> None:
    """Make ``accelerator`` (built on gloo CPU ranks) run Accelerate's FSDP2 path with ``plugin``.

    Example:
        >>> # acc = PhasedAccelerator(schedule, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        >>> # use_accelerate_fsdp2(acc, acc._fsdp_plugin_given)   # before prepare()
    """
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    state = AcceleratorState()
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":  # what AcceleratorState.__init__ does for an FSDP run
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    assert accelerator.is_fsdp2
