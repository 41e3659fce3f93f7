"""Every private DeepSpeed name the ZeRO strategy uses, checked against the installed release, and nothing else.

deepspeed is optional: nothing here imports it at module import; each function
imports it when a DeepSpeed engine is already in the process (a user who built
one has it installed).

The names (deepspeed 0.19; :data:`USES`), on ``DeepSpeedZeroOptimizer`` (ZeRO-1
and ZeRO-2 are one class):

* ``.optimizer`` (an attribute without underscore, documented nowhere): the
  inner torch optimizer, whose param group ``i`` holds one tensor, this rank's
  fp32 partition of group ``i`` (``single_partition_of_fp32_groups[i]``);
* ``.bit16_groups[i]``: the model parameters of param group ``i``;
* ``.parallel_partitioned_bit16_groups[i][rank]``: this rank's bit16 partition
  of group ``i``, into which DeepSpeed copies the fp32 partition after the step;
* ``.real_dp_process_group[i]``: the process group group ``i`` is partitioned over;
* ``.bit16_groups_flat``: the list identifying the optimizer in the all-gather below;
* ``._link_all_hp_params()`` and ``._hp_optimizer_states_linked``: DeepSpeed's
  per-parameter views of the fp32 partitions and of their optimizer state
  (``safe_get_full_fp32_param`` & co.) re-linked to the current tensors, so a
  dropped partition is not kept alive (and no view reads freed memory);
* ``.cpu_offload``, ``.has_moe_layers``: what the strategy refuses;
* ``deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups``, the module
  function ``DeepSpeedZeroOptimizer.step`` calls by that name to gather the
  updated partitions of every group: replaced, once per process, by a filter
  that leaves out the idle groups of an optimizer registered here (any other
  call passes through unchanged);
* ``deepspeed.comm.comm.cdb``: the backend object every ``deepspeed.comm``
  collective goes through, whose collectives :func:`count_collectives` wraps;
* ``deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"]``: whether
  ``deepspeed.init_distributed`` builds (minutes, once per machine) the
  shared-memory all-reduce op on CPU (:func:`skip_shm_comm_build`).

:func:`surface_problems` checks them on a live optimizer before anything
changes; ``tests/engine/test_deepspeed_fence.py`` exercises each use.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from ..._compat import check_library_at_import
from ...errors import AltParamsError, Cause

__all__ = [
    "TESTED_DEEPSPEED",
    "USES",
    "AllGatherFilter",
    "bit16_partition",
    "check_deepspeed",
    "count_collectives",
    "missing_names",
    "engine_class",
    "fp32_partition",
    "group_params",
    "relink_views",
    "skip_shm_comm_build",
    "surface_problems",
    "zero12_class",
]

#: Inclusive range of (major, minor) deepspeed releases these uses were checked on.
TESTED_DEEPSPEED: tuple[tuple[int, int], tuple[int, int]] = ((0, 19), (0, 19))

#: Each use and the deepspeed names it relies on.
USES: dict[str, tuple[str, ...]] = {
    "partitions": (
        "DeepSpeedZeroOptimizer.optimizer",
        "DeepSpeedZeroOptimizer.bit16_groups",
        "DeepSpeedZeroOptimizer.parallel_partitioned_bit16_groups",
        "DeepSpeedZeroOptimizer.real_dp_process_group",
    ),
    "relink_views": (
        "DeepSpeedZeroOptimizer._link_all_hp_params",
        "DeepSpeedZeroOptimizer._hp_optimizer_states_linked",
    ),
    "all_gather_filter": (
        "deepspeed.runtime.zero.stage_1_and_2.all_gather_dp_groups",
        "DeepSpeedZeroOptimizer.bit16_groups_flat",
    ),
    "refusals": ("DeepSpeedZeroOptimizer.cpu_offload", "DeepSpeedZeroOptimizer.has_moe_layers"),
    "count_collectives": ("deepspeed.comm.comm.cdb",),
    "skip_shm_comm_build": ("deepspeed.ops.__compatible_ops__",),
}

_ALL_GATHER = "all_gather_dp_groups"
_ALL_GATHER_ARGS = (
    "groups_flat",
    "partitioned_param_groups",
    "dp_process_group",
    "start_alignment_factor",
    "allgather_bucket_size",
)
#: The collectives of deepspeed's comm backend that :func:`count_collectives` counts, and which tensor
#: argument is the full tensor the collective works on (all-gather: its output).
_COUNTED = {
    "all_reduce": 0,
    "inference_all_reduce": 0,
    "reduce": 0,
    "reduce_scatter_tensor": 1,
    "all_gather_into_tensor": 0,
    "all_reduce_coalesced": 0,
}


def engine_class() -> Optional[type]:
    """``deepspeed.DeepSpeedEngine`` when deepspeed is imported in this process, else ``None`` (no engine can exist)."""
    module = sys.modules.get("deepspeed.runtime.engine")
    return getattr(module, "DeepSpeedEngine", None)


def zero12_class() -> Optional[type]:
    """``DeepSpeedZeroOptimizer`` (ZeRO-1 and ZeRO-2) when deepspeed is imported, else ``None``."""
    module = sys.modules.get("deepspeed.runtime.zero.stage_1_and_2")
    return getattr(module, "DeepSpeedZeroOptimizer", None)


def missing_names() -> list[str]:
    import deepspeed.runtime.zero.stage_1_and_2 as zero12

    missing = []
    function = getattr(zero12, _ALL_GATHER, None)
    original = getattr(function, "altparams_original", function)
    if original is None or tuple(inspect.signature(original).parameters) != _ALL_GATHER_ARGS:
        missing.append(f"deepspeed.runtime.zero.stage_1_and_2.{_ALL_GATHER}{_ALL_GATHER_ARGS}")
    optimizer = getattr(zero12, "DeepSpeedZeroOptimizer", None)
    if optimizer is None:
        missing.append("DeepSpeedZeroOptimizer")
    else:
        if _ALL_GATHER not in inspect.getsource(optimizer.step):
            missing.append(f"DeepSpeedZeroOptimizer.step calling {_ALL_GATHER}")
        if not callable(getattr(optimizer, "_link_all_hp_params", None)):
            missing.append("DeepSpeedZeroOptimizer._link_all_hp_params")
    import deepspeed.comm.comm as comm

    if not hasattr(comm, "cdb"):
        missing.append("deepspeed.comm.comm.cdb")
    return missing


_CHECKED = False


def check_deepspeed() -> None:
    """Once per process: refuse a deepspeed lacking a name :data:`USES` relies on; warn outside the tested range."""
    global _CHECKED
    if _CHECKED:
        return
    import deepspeed

    check_library_at_import(
        "deepspeed", str(deepspeed.__version__), TESTED_DEEPSPEED, missing_names(), "DeepSpeed ZeRO internals"
    )
    _CHECKED = True


def surface_problems(zero: Any) -> list[str]:
    """What a live ZeRO-1/2 optimizer lacks of what the strategy reads (empty: all present and consistent)."""
    problems = []
    inner = getattr(zero, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return [f"`.optimizer` is {type(inner).__name__}, not a torch optimizer"]
    count = len(inner.param_groups)
    for name in ("bit16_groups", "parallel_partitioned_bit16_groups", "real_dp_process_group", "bit16_groups_flat"):
        value = getattr(zero, name, None)
        if not isinstance(value, list) or len(value) != count:
            problems.append(f"`.{name}` is not a list of {count} (one per param group)")
    if not isinstance(getattr(zero, "_hp_optimizer_states_linked", None), bool):
        problems.append("`._hp_optimizer_states_linked` is not a bool")
    if problems:
        return problems
    for i, group in enumerate(inner.param_groups):
        if len(group["params"]) != 1:
            problems.append(
                f"param group {i} of the inner optimizer holds {len(group['params'])} tensors, not one fp32 partition"
            )
        elif fp32_partition(zero, i).numel() != bit16_partition(zero, i).numel():
            problems.append(f"param group {i}: the fp32 and bit16 partitions differ in size")
    return problems


def refused_features(zero: Any) -> list[str]:
    """The DeepSpeed features of ``zero`` the strategy refuses (optimizer offload, MoE)."""
    found = []
    if getattr(zero, "cpu_offload", False):
        found.append("optimizer offload (`zero_optimization.offload_optimizer`)")
    if getattr(zero, "has_moe_layers", False):
        found.append("mixture-of-experts layers")
    return found


def group_params(zero: Any, index: int) -> list[torch.nn.Parameter]:
    """The model parameters of param group ``index``."""
    return list(zero.bit16_groups[index])


def fp32_partition(zero: Any, index: int) -> torch.Tensor:
    """This rank's fp32 partition of param group ``index`` (the one tensor its inner param group holds)."""
    tensor = zero.optimizer.param_groups[index]["params"][0]
    assert isinstance(tensor, torch.Tensor)
    return tensor


def bit16_partition(zero: Any, index: int) -> torch.Tensor:
    """This rank's bit16 partition of param group ``index`` (a view into the model's flat weights)."""
    rank = dist.get_rank(group=zero.real_dp_process_group[index])
    tensor = zero.parallel_partitioned_bit16_groups[index][rank]
    assert isinstance(tensor, torch.Tensor)
    return tensor


def relink_views(zero: Any) -> None:
    """Point DeepSpeed's per-parameter views at the current fp32 partitions; its state views are re-made at the
    next step (so a dropped partition or state is referenced by nothing of DeepSpeed's)."""
    zero._link_all_hp_params()
    zero._hp_optimizer_states_linked = False


class AllGatherFilter:
    """The post-step all-gather of a ZeRO-1/2 optimizer, leaving out the idle groups of registered optimizers.

    Installed once per process (:meth:`install`) in place of deepspeed's
    ``all_gather_dp_groups``. An optimizer is registered by its
    ``bit16_groups_flat`` list (the first argument of every call for it) with
    the indices to leave out; the filter applies to the one call after each
    armed step (:meth:`arm`, from the step's own pre-hook), so DeepSpeed's
    other calls (``update_lp_params`` after loading a checkpoint) gather every
    group as before.
    """

    _installed: Optional[Callable[..., Any]] = None
    _idle: dict[int, frozenset[int]] = {}
    _armed: set[int] = set()

    @classmethod
    def install(cls) -> None:
        if cls._installed is not None:
            return
        import deepspeed.runtime.zero.stage_1_and_2 as zero12

        original = getattr(zero12, _ALL_GATHER)

        def all_gather_active_groups(
            groups_flat: list,
            partitioned_param_groups: list,
            dp_process_group: list,
            start_alignment_factor: int,
            allgather_bucket_size: int,
        ) -> Any:
            key = id(groups_flat)
            idle = cls._idle.get(key, frozenset()) if key in cls._armed else frozenset()
            cls._armed.discard(key)
            if idle:
                keep = [i for i in range(len(groups_flat)) if i not in idle]
                groups_flat = [groups_flat[i] for i in keep]
                partitioned_param_groups = [partitioned_param_groups[i] for i in keep]
                dp_process_group = [dp_process_group[i] for i in keep]
            return original(
                groups_flat, partitioned_param_groups, dp_process_group, start_alignment_factor, allgather_bucket_size
            )

        setattr(all_gather_active_groups, "altparams_original", original)
        setattr(zero12, _ALL_GATHER, all_gather_active_groups)
        cls._installed = all_gather_active_groups

    @classmethod
    def set_idle(cls, zero: Any, indices: frozenset[int]) -> None:
        """Leave ``indices`` out of ``zero``'s post-step all-gathers from now on."""
        cls._idle[id(zero.bit16_groups_flat)] = indices

    @classmethod
    def arm(cls, zero: Any) -> None:
        """``zero`` is stepping: its next all-gather is the post-step one."""
        cls._armed.add(id(zero.bit16_groups_flat))

    @classmethod
    def forget(cls, zero: Any) -> None:
        key = id(zero.bit16_groups_flat)
        cls._idle.pop(key, None)
        cls._armed.discard(key)


class _Counting:
    """The counters fed by the wrapped collectives of deepspeed's comm backend."""

    counters: list[Any] = []
    wrapped: Optional[int] = None


def count_collectives(counter: Any) -> None:
    """Add the bytes of every collective deepspeed runs from now on to ``counter.bytes_pending``.

    The full tensor each works on: all-reduce and reduce their tensor,
    reduce-scatter its input, all-gather its output. Wraps the collectives of
    ``deepspeed.comm.comm.cdb`` once per backend object.
    """
    import deepspeed.comm.comm as comm

    backend = comm.cdb
    if backend is None:
        raise AltParamsError(
            "deepspeed's comm backend is not initialised (no `deepspeed.init_distributed` yet); "
            "count after `deepspeed.initialize`",
            cause=Cause.STRATEGY_REFUSED,
        )
    if _Counting.wrapped != id(backend):
        for name, index in _COUNTED.items():
            method = getattr(backend, name, None)
            if callable(method):
                setattr(backend, name, _counted(method, index))
        _Counting.wrapped = id(backend)
    if counter not in _Counting.counters:
        _Counting.counters.append(counter)


def _counted(method: Callable[..., Any], index: int) -> Callable[..., Any]:
    def collective(*args: Any, **kwargs: Any) -> Any:
        tensors = [a for a in args if isinstance(a, torch.Tensor)] + [
            v for v in kwargs.values() if isinstance(v, torch.Tensor)
        ]
        if not tensors and args and isinstance(args[0], (list, tuple)):  # all_reduce_coalesced
            tensors = [t for t in args[0] if isinstance(t, torch.Tensor)]
            size = sum(t.numel() * t.element_size() for t in tensors)
        else:
            tensor = tensors[min(index, len(tensors) - 1)] if tensors else None
            size = 0 if tensor is None else tensor.numel() * tensor.element_size()
        for counter in _Counting.counters:
            counter.bytes_pending += size
            counter.buckets_pending += 1
        return method(*args, **kwargs)

    return collective


def skip_shm_comm_build() -> None:
    """Make ``deepspeed.init_distributed`` skip its shared-memory all-reduce op (gloo does the work).

    On a CPU machine DeepSpeed builds that op with a C++ compiler at its
    first ``init_distributed`` (minutes; cached in ``TORCH_EXTENSIONS_DIR``).
    It only speeds up all-reduce for inference kernels and falls back to
    torch.distributed when absent. Call before ``deepspeed.initialize`` (or
    Accelerate's / the Trainer's set-up); a no-op once DeepSpeed's comm is up.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
