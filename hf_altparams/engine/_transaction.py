"""The switch transaction itself: apply locally, settle in one collective, roll back or finish.

:func:`run_transaction` is what :meth:`~hf_altparams.engine.PhaseSwitcher._transaction`
runs, on the switcher's own parts (its residency, backend, layouts, optimizer,
buffer sync, release policy, prefetch and history); the module docstring of
:mod:`.switch` lists the steps, ``docs/switch.md`` explains them.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from ..errors import SwitchError
from ..plan.phase import Phase
from ._collective import agree, any_rank_failed, collective_errors, settle
from ._layout import remember
from ._undo import resync_refusing
from .memory._host import release_memory
from .memory._transfer import optimizer_of
from .optim._grouped import GroupedOptimizer
from .records import SwitchRecord

__all__ = ["run_transaction"]


def run_transaction(sw: Any, phase: Phase, step: Optional[int], epoch: Optional[int],
                    local_error: Optional[str]) -> SwitchRecord:
    """One switch into ``phase`` on every rank: apply, settle, roll back or commit the rest, record."""
    started = time.perf_counter()
    timeout = sw._timeout()
    group = sw.process_group if sw._distributed() else None
    one_collective = sw.backend.collective_free_apply
    if not one_collective:
        agree(group, phase, step, local_error, timeout)
    layout = sw._layouts.get(phase.trainable)
    before = [param.requires_grad for param in sw._params]
    offloaded_before = sw.residency.offloaded
    snapshot = sw.backend.snapshot()
    failure: Optional[BaseException] = None
    applied, moved = False, 0
    if local_error is None:
        try:
            applied = True
            moved = sw.residency.apply(sw.residency.non_resident(phase),
                                         keep_state_off=sw._state_stays_off(phase))
            for hook in sw.phase_hooks:  # e.g. peft's active adapters; the flags below win
                hook(phase)
            sw._apply_flags(layout.trainable)
            sw.backend.apply(sw.residency.ignore_names())
        except Exception as exc:  # rolled back below, once every rank has heard of it
            failure = exc
    if one_collective:
        reason = f"{type(failure).__name__}: {failure}" if failure else None
        message, all_refused = settle(group, phase, step, local_error, reason, timeout)
    elif any_rank_failed(group, failure is not None, phase, step, timeout):
        reason = f"{type(failure).__name__}: {failure}" if failure else "it failed on another rank"
        message, all_refused = (f"phase switch to {phase.name!r} at step {step} failed ({reason}); the "
                                "previous trainable set and DDP reducer were restored on every rank"), False
    else:
        message, all_refused = None, False
    if message is not None:
        if applied:
            sw._rollback(before, offloaded_before, snapshot)
        elif group is not None and not all_refused:
            resync_refusing(sw.backend, sw._params, snapshot)
        raise SwitchError(message) from failure

    with collective_errors(phase, step, group, None, "broadcast of returning groups"):
        synced = sw.residency.sync_returning(sw.process_group) if sw._distributed() else 0
    sw.residency.install_guards(phase.name)
    grouped = optimizer_of(sw.optimizer) if sw.optimizer is not None else None
    if isinstance(grouped, GroupedOptimizer):  # also inside an AcceleratedOptimizer
        grouped.set_active(phase.trainable)
    plan = sw.buffer_sync.apply(sw.module, layout.trainable, ddp=sw.ddp, ignore=sw.residency.ignore_names())
    released, release_reason = sw.release_policy.decide(sw, sw.current, phase, step, epoch)
    if released:
        # No barrier: the settling all-gather above is one every rank just passed.
        release_memory(barrier=False, full_gc=sw.config.full_gc, trim=sw.config.trim)
    sw.prefetcher.switched(sw, phase)
    reduced = sw._reduced_bytes.get(phase)
    if reduced is None:
        reduced = remember(sw._reduced_bytes, phase, sw.allreduce_bytes_per_step())
    record = SwitchRecord(
        step=step,
        epoch=epoch,
        phase=phase.name,
        trainable_groups=layout.groups,
        trainable_params=layout.params,
        trainable_bytes=layout.nbytes,
        allreduce_bytes_per_step=reduced,
        rebuilt_ddp=bool(sw.wrappers),
        seconds=time.perf_counter() - started,
        moved_bytes=moved,
        offloaded_bytes=sw.residency.offloaded_bytes(),
        synced_bytes=synced,
        buffer_broadcast_bytes=plan.bytes_per_forward,
        buffer_broadcast_saved_bytes=plan.saved_bytes_per_forward,
        released=released,
        release_reason=release_reason,
    )
    sw.history.append(record)
    sw._ranks_met = True
    if sw.drift.after_switch:
        sw.check_weights(f"after the switch to {phase.name!r} at step {step}", timeout=timeout)
    return record
