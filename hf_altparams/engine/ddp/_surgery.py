"""The DDP surgery: the one place in hf_altparams that touches private torch APIs.

``DistributedDataParallel`` decides in its constructor which parameters its C++
``Reducer`` all-reduces. To change that set on the *same* wrapper object (the
HuggingFace Trainer keeps the wrapper in a local variable, so a new object would
never reach its loop), :func:`rebuild_reducer` does what ``DDP.__setstate__``
does: drop the reducer and its logger, rebuild the parameter list from
``requires_grad`` and the ignore list, re-run DDP's reducer init helper,
re-register the comm hooks and reset the lazy-init / bucket-rebuild flags.
It never re-broadcasts parameters (the constructor's ``init_sync`` traffic):
phase training keeps the ranks bit-identical, so there is nothing to sync.
After a wrapper's first rebuild, the reducer's inputs (parameters, their
names, the broadcast buffers) come from one walk of the module tree
(:func:`._inputs.reducer_inputs`) instead of DDP's three walks.

Every private name used here is listed in :data:`PRIVATE_DDP_ATTRIBUTES` and
checked by :func:`check_ddp_supported` together with the torch version, so an
untested torch fails with a clear message before any state is touched.
The switch's DDP backend, ``DDPBackend``, is in :mod:`._backend`.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..._compat import ALLOW_UNTESTED_ENV, TESTED_TORCH, torch_version
from ...errors import Cause, Refusal, SwitchError
from . import _inputs
from ._inputs import InputsVerdict, reducer_inputs
from ._reducer_cache import PER_BUCKET_HOOK_STATE, ReducerCache

__all__ = [
    "PRIVATE_DDP_ATTRIBUTES",
    "STATIC_GRAPH_ATTRIBUTES",
    "check_comm_hooks",
    "check_ddp_supported",
    "comm_hook_states",
    "ddp_settings",
    "drop_reducer",
    "ignored_before_wrap",
    "is_ddp",
    "mark_ignored_before_wrap",
    "rebuild_reducer",
    "reduced_parameters",
    "InputsVerdict",
    "reducer_parameter_names",
    "unfinished_reduction_error",
    "unwrap",
]


#: Private DDP attributes and methods the rebuild relies on (present in torch 2.11-2.13).
PRIVATE_DDP_ATTRIBUTES = (
    "reducer",
    "logger",
    "parameters_to_ignore",
    "static_graph",
    "_module_parameters",
    "_comm_hooks",
    "_build_params_for_reducer",
    "_build_debug_param_to_name_mapping",
    "_ddp_init_helper",
    "_has_rebuilt_buckets",
    "_lazy_init_ran",
    "_delay_all_reduce_all_params",
    "_delay_all_reduce_params",
    "_use_python_reducer",
    "mixed_precision",
    "modules_buffers",
    "named_module_buffers",
)

#: Private attributes the rebuild also resets when the wrapper uses ``static_graph=True``.
STATIC_GRAPH_ATTRIBUTES = ("_static_graph_delay_allreduce_enqueued",)


def is_ddp(module: object) -> bool:
    """True when ``module`` is a ``DistributedDataParallel`` wrapper."""
    return isinstance(module, DistributedDataParallel)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or ``module`` itself)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def ignored_before_wrap(module: nn.Module) -> set[str]:
    """The names DDP's constructor will ignore for ``module`` (``_ddp_params_and_buffers_to_ignore``)."""
    return set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))


def mark_ignored_before_wrap(
    module: nn.Module,
    ignore: Iterable[str],
    tensors: Mapping[str, torch.Tensor],
    keep_tagged: Iterable[str] = (),
) -> None:
    """Write the names a *future* DDP constructor must ignore (neither bucket nor broadcast).

    DDP reads ``module._ddp_params_and_buffers_to_ignore`` when it is built and
    tags those tensors ``_ddp_ignored`` (read by dynamo's DDP optimizer); the
    tags are set here too. ``tensors`` maps names to the tensors whose tag may
    change; a tag on a name no longer ignored is removed unless in ``keep_tagged``
    (the user's own ignore list).
    """
    ignore = set(ignore)
    keep = set(keep_tagged)
    module._ddp_params_and_buffers_to_ignore = sorted(ignore)  # type: ignore[assignment]
    for name, tensor in tensors.items():
        if name in ignore:
            tensor._ddp_ignored = True  # type: ignore[attr-defined]
        elif getattr(tensor, "_ddp_ignored", False) and name not in keep:
            del tensor._ddp_ignored  # type: ignore[attr-defined]


def check_ddp_supported(ddp: DistributedDataParallel) -> None:
    """Raise :class:`SwitchError` if ``ddp`` cannot be re-bucketed in place.

    Checked: the torch version is in the tested range (or
    ``HF_ALTPARAMS_ALLOW_UNTESTED_TORCH=1`` is set), every private attribute the
    rebuild uses exists, and the wrapper uses no mode the rebuild cannot keep
    (DDP-native mixed precision, the compiled python reducer, delayed all-reduce).
    """
    version = torch_version()
    low, high = TESTED_TORCH
    if not low <= version <= high:
        found = f"{version[0]}.{version[1]}"
        tested = f"{low[0]}.{low[1]} to {high[0]}.{high[1]}"
        if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
            raise SwitchError(
                f"in-place DDP re-bucketing uses private torch APIs tested on torch {tested}; "
                f"found torch {found}. Install a tested torch, or set {ALLOW_UNTESTED_ENV}=1 "
                "to try anyway (the test suite in tests/engine checks it)."
            )
        warnings.warn(
            f"hf_altparams: torch {found} is outside the tested range {tested}; "
            f"{ALLOW_UNTESTED_ENV}=1 is set, trying the in-place DDP rebuild anyway.",
            stacklevel=3,
        )
    needed = PRIVATE_DDP_ATTRIBUTES + (STATIC_GRAPH_ATTRIBUTES if getattr(ddp, "static_graph", False) else ())
    missing = [name for name in needed if not hasattr(ddp, name)]
    if missing:
        raise SwitchError(
            f"this torch ({torch.__version__}) DistributedDataParallel lacks {missing}, which the "
            "in-place rebuild needs; use a torch version from the tested range "
            f"{TESTED_TORCH[0]}..{TESTED_TORCH[1]}."
        )
    if ddp.mixed_precision is not None:
        raise SwitchError(
            "`mixed_precision` on DistributedDataParallel (DDP-native mixed precision) is not "
            "supported: its parameter copies and upcast hook cannot be rebuilt in place. Use "
            "autocast instead (Accelerate `mixed_precision='bf16'`, Trainer `bf16=True`)."
        )
    if ddp._use_python_reducer:
        raise SwitchError(
            "the compiled python reducer (torch._dynamo optimize_ddp='python_reducer') is not "
            "supported: it has no C++ reducer to rebuild. Use the default optimize_ddp mode."
        )
    if ddp._delay_all_reduce_params:
        raise SwitchError(
            "`delay_all_reduce_named_params` on DistributedDataParallel is not supported: its "
            "delayed gradient buffer is fixed at construction. Remove that argument."
        )


def reduced_parameters(ddp: DistributedDataParallel) -> list[nn.Parameter]:
    """The parameters the current reducer all-reduces (requires_grad and not ignored)."""
    if ddp._delay_all_reduce_all_params:
        return []
    ignore = ddp.parameters_to_ignore
    seen: set[int] = set()
    params = []
    for name, param in ddp.module.named_parameters():
        if param.requires_grad and name not in ignore and id(param) not in seen:
            seen.add(id(param))
            params.append(param)
    return params


def reducer_parameter_names(ddp: DistributedDataParallel) -> set[str] | None:
    """The names of the parameters the reducer *actually* buckets (``None``: cannot tell).

    :func:`reduced_parameters` says what a reducer built now would cover; this
    reads the live reducer's buckets (private ``Reducer._get_zeros_like_grad_buckets``,
    which allocates one zero-filled copy of the buckets while it runs), so it
    tells whether the wrapper was built for other ``requires_grad`` flags.
    """
    if ddp._delay_all_reduce_all_params or ddp.reducer is None:
        return set()
    read = getattr(ddp.reducer, "_get_zeros_like_grad_buckets", None)
    if read is None:
        return None
    try:
        buckets = read()
        ids = {id(p) for bucket in buckets for p in bucket.parameters()}
    except (RuntimeError, TypeError):
        return None
    return {name for name, p in ddp.module.named_parameters() if id(p) in ids}


def ddp_settings(ddp: DistributedDataParallel) -> dict[str, object]:
    """The user's DDP settings that a rebuild keeps (for logs and checks)."""
    return {
        "find_unused_parameters": ddp.find_unused_parameters,
        "gradient_as_bucket_view": ddp.gradient_as_bucket_view,
        "static_graph": ddp.static_graph,
        "bucket_bytes_cap": ddp.bucket_bytes_cap,
        "broadcast_buffers": ddp.broadcast_buffers,
        "comm_hooks": [hook.__qualname__ for hook, _ in ddp._comm_hooks],
    }


def comm_hook_states(ddp: DistributedDataParallel) -> list[object]:
    """The states of the comm hooks registered on ``ddp`` (empty with DDP's default all-reduce)."""
    return [state for _, state in getattr(ddp, "_comm_hooks", [])]


def _reset_hook_state(state: object) -> None:
    # PowerSGD keeps per-bucket error feedback and low-rank factors keyed by bucket
    # index; bucket indices mean other parameters after a rebuild, so start fresh.
    for attr in PER_BUCKET_HOOK_STATE:
        value = getattr(state, attr, None)
        if isinstance(value, dict):
            value.clear()


def _check_hook_state(ddp: DistributedDataParallel, state: object) -> None:
    if state is ddp or any(v is ddp for v in getattr(state, "__dict__", {}).values()):
        raise SwitchError(
            f"a DDP comm hook state ({type(state).__name__}) holds a strong reference to the "
            "DDP wrapper; that cycle runs through C++ and keeps the old gradient buckets alive "
            "after a rebuild. Hold a weakref.ref(ddp) in the state instead."
        )


def check_comm_hooks(ddp: DistributedDataParallel) -> None:
    """Raise :class:`SwitchError` if a registered comm hook's state would pin old buckets.

    Checked before a switch touches anything (a refusal, not a failed rebuild).
    """
    for _, state in ddp._comm_hooks:
        _check_hook_state(ddp, state)


def unfinished_reduction_error(ddp: DistributedDataParallel, inputs: Optional[InputsVerdict] = None) -> Optional[str]:
    """Why the last backward left gradients un-all-reduced, or ``None`` (the switch's precondition).

    With ``find_unused_parameters=False`` a bucket is all-reduced once every
    parameter in it has its gradient: a trainable parameter the forward did not
    use leaves its bucket local on each rank. Plain DDP raises at its next
    forward ("Expected to have finished reduction"); a switch replaces that
    reducer before any next forward, so it must refuse instead. Reads the
    reducer's own verdict (private ``Reducer._check_reducer_finalized``, in
    torch 2.11-2.13; skipped where absent).
    """
    check = getattr(ddp.reducer, "_check_reducer_finalized", None) if ddp.reducer is not None else None
    if check is None:
        return None
    try:
        check()
    except RuntimeError as exc:
        found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", str(exc))
        indices = [int(i) for i in found.group(1).split()] if found else []
        known = inputs.inputs if inputs is not None and _inputs.fast_inputs else None
        if known is not None:
            names = known.parameters(ddp.parameters_to_ignore)[2]
        else:  # the live reducer was built for the current flags and ignore list
            names = ddp._build_debug_param_to_name_mapping(ddp._build_params_for_reducer()[0])
        unused = [names.get(i, f"#{i}") for i in indices]
        which = (
            f"{len(unused)} trainable parameter(s) of the current phase got no gradient in the last "
            f"backward (e.g. {unused[:6]})"
            if unused
            else "a trainable parameter of the current phase got no gradient in the last backward"
        )
        return Refusal(
            f"{which}, so with find_unused_parameters=False DDP never all-reduced their gradient bucket "
            "and the ranks would diverge. Which fix depends on why: if the loop ran the wrong branch, task "
            "or adapter for this phase, fix the loop (read the phase at the top of the iteration); if the "
            "forward skips them on purpose, build DDP with find_unused_parameters=True "
            "(PhasedAccelerator(find_unused_parameters=True); "
            "TrainingArguments(ddp_find_unused_parameters=True)); "
            "if they should not train in this phase, leave them out of its groups",
            Cause.TRAINABLE_PARAM_UNUSED,
        )
    return None


def rebuild_reducer(
    ddp: DistributedDataParallel,
    ignore: Iterable[str] | None = None,
    *,
    inputs: Optional[InputsVerdict] = None,
    cache: Optional[ReducerCache] = None,
) -> None:
    """Rebuild ``ddp``'s reducer in place for the current ``requires_grad`` flags.

    Args:
        ddp: the wrapper to re-bucket; the same object keeps working afterwards.
        ignore: if given, the full set of parameter/buffer names DDP must ignore
            (neither all-reduced nor broadcast), replacing the current ignore list.
        inputs: the wrapper's :class:`InputsVerdict` (the backend keeps one per
            wrapper): with it, what the reducer is built over is read without
            walking the module tree (:mod:`._inputs`); without it, DDP's own methods.
        cache: the wrapper's kept idle reducers (``keep_reducers``), if any.

    Call it only at an optimizer-step boundary, on every rank, with the same
    ``requires_grad`` flags everywhere. It clears every ``.grad`` first (a grad
    that is a view into an old bucket would keep that bucket alive). Settings
    kept: ``find_unused_parameters``, ``gradient_as_bucket_view``,
    ``static_graph``, bucket caps, buffer broadcast, comm hooks (re-registered
    with their state; PowerSGD's per-bucket memory is reset). When no parameter
    requires a gradient, DDP becomes a pass-through (no reducer, no gradient sync
    and no buffer broadcast) until the next rebuild. With a ``cache``, the old
    reducer is put aside instead of freed, and a kept one built over the same
    parameters, ignore list and comm hooks is re-installed instead of building
    a new one.

    Example:
        >>> # on every rank, after optimizer.step(); optimizer.zero_grad(set_to_none=True)
        >>> # for p in ddp.module.head.parameters(): p.requires_grad_(False)
        >>> # rebuild_reducer(ddp)
    """
    check_ddp_supported(ddp)
    hooks = list(ddp._comm_hooks)
    for _, state in hooks:
        _check_hook_state(ddp, state)
    known = inputs.inputs if inputs is not None and _inputs.fast_inputs else None
    if known is not None:
        known.clear_grads()
    else:
        for param in ddp.module.parameters():
            param.grad = None
    ignore = set(ignore) if ignore is not None else None
    if ignore is not None and (known is None or ignore != ddp.parameters_to_ignore):
        ddp.parameters_to_ignore = ignore
        ddp._module_parameters = (
            known.module_parameters(ddp.parameters_to_ignore)
            if known is not None
            else [p for n, p in ddp.module.named_parameters() if n not in ddp.parameters_to_ignore]
        )
    if cache is not None:
        cache.keep(ddp)  # put aside (keep_reducers), not freed
    # The logger holds the reducer; dropping both frees the old reducer and its
    # buckets by reference count (no gc pass needed: they form no Python cycle).
    ddp.reducer = None
    ddp.logger = None

    parameters, expect_sparse_gradient, name_mapping = reducer_inputs(ddp, inputs)
    # A kept reducer built over the same parameters, ignore list and hooks (its
    # hooks registered); the oldest kept ones past the limit are freed either way.
    reused = cache is not None and cache.take(ddp, parameters)
    if not parameters:
        # A reducer over zero parameters is an internal assert in torch; DDP's own
        # "delay all-reduce of all params" path skips the reducer in forward.
        ddp._delay_all_reduce_all_params = True
        return
    ddp._delay_all_reduce_all_params = False
    if reused:
        return
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, name_mapping, ddp.static_graph)
    reducer: Any = ddp.reducer  # built by the helper (the type checker still sees the None set above)
    logger: Any = ddp.logger
    if ddp.static_graph:
        reducer._set_static_graph()
        logger._set_static_graph()
        # The new reducer starts a static-graph first iteration, whose all-reduce
        # runs from a callback that DDP's forward queues only while this flag is
        # False; left True, nothing is ever all-reduced and the ranks drift apart.
        ddp._static_graph_delay_allreduce_enqueued = False
    for hook, state in hooks:
        _reset_hook_state(state)
        dist._register_comm_hook(reducer, state, hook)
        logger._set_comm_hook_name(hook.__qualname__)
    ddp._comm_hooks = hooks
    ddp._has_rebuilt_buckets = False
    ddp._lazy_init_ran = False
    if cache is not None:
        cache.built(ddp, parameters, expect_sparse_gradient)


def drop_reducer(ddp: DistributedDataParallel, cache: Optional[ReducerCache] = None) -> None:
    """Drop ``ddp``'s reducer and logger (the logger holds the reducer): the end of its training life.

    The wrapper's forward no longer works afterwards (a later
    :func:`rebuild_reducer` makes it usable again). Used at the end of a run so
    the reducer, its buckets and its reference to the process group go before
    the group does; ``cache``'s kept reducers (which hold the group too) go with it.
    """
    if cache is not None:
        cache.clear()
    ddp.reducer = None
    ddp.logger = None
