"""What ``check`` reads of the weights: do the ranks start equal, and does a group stay put while it is idle?

Both readings are the engine's weight digests (:func:`hf_altparams.engine.drift.local_digests`:
per group, exact integer sums of the parameters' bytes), taken at other moments
than the switch's own drift check, which compares the ranks after every switch:

* **at the start** (:func:`start_digests`, before ``prepare``): every rank's
  digests of the model as the set-up built it, compared across the ranks. A set-up
  that does not seed the model's construction builds different weights on each
  rank. Under DDP that is harmless for the run (DDP's constructor copies rank 0's
  parameters and buffers to every rank: :func:`copy_rank0`, which the check does
  itself before its first comparison), but the check says so; under FSDP2 each
  rank keeps its own shard of its own weights and nothing makes them equal.
* **while idle** (:class:`IdleWatch`): each group's digest on this rank when it
  goes idle against the next reading (every switch, and the end of the run).
  A group that does not train in a phase must not change in it: nothing the
  ranks disagree on, so the drift check cannot see it, but the run trains
  something else than its schedule says (an optimizer that decays every
  parameter it holds, gradient or not; per-step code that writes every weight;
  an EMA written back into the model).

Buffers are not read (a norm layer's running statistics change in every forward,
idle or not).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..engine.collective import gather_rows
from ..engine.drift import UNGROUPED, find_drift, local_digests
from ..plan import ParamGroups, Phase

__all__ = ["IdleChange", "IdleWatch", "copy_rank0", "differing_at_start", "frozen_groups"]


def _entries(groups: ParamGroups) -> list[str]:
    return [*groups.names, UNGROUPED]


def differing_at_start(groups: ParamGroups, group: Optional[dist.ProcessGroup]) -> list[str]:
    """The groups (and ``(ungrouped)``) whose weights differ between the ranks now: one all-gather.

    Called by every rank before ``prepare``, on a process group that carries
    CPU tensors (gloo). One process: nothing to compare.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return []
    rows = gather_rows(local_digests(groups), group, None)
    return sorted(find_drift(_entries(groups), rows))


def copy_rank0(module: torch.nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Copy rank 0's parameters and buffers to every rank, as DDP's constructor does (``init_sync``)."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            local = tensor.detach().cpu()
            dist.broadcast(local, src=0, group=group)
            if local.data_ptr() != tensor.data_ptr():
                tensor.copy_(local)


@dataclass
class IdleChange:
    """A group whose weights changed on this rank while it did not train.

    ``phase`` is the phase in which the change was seen: the group was idle
    from step ``since`` (the phase's first step, or the step its flags froze it)
    and had changed by step ``until`` (the next switch, the next change of the
    flags, or the end of the run). ``frozen``: the phase trains the group, but
    every parameter of it had ``requires_grad`` off (code outside the schedule
    froze it, as a LISA callback of one's own does).
    """

    group: str
    phase: str
    since: int
    until: int
    frozen: bool = False


class IdleWatch:
    """Each group's digest on this rank at every phase boundary; the idle ones must not have changed.

    Idle: a group the phase does not train, or one the phase trains whose
    parameters all had ``requires_grad`` off (:meth:`flags`: frozen behind the
    schedule, so it must not change either). A boundary is a switch, a change
    of the groups so frozen, and the end of the run.

    Args:
        groups: the groups of the prepared model (after ``fully_shard``: the rebound ones).
        phase: the phase that trains first.

    Example::

        watch = IdleWatch(switcher.groups, accelerator.phase)
        ... # at each switch, before the next step:
        changes += watch.boundary(step, accelerator.phase)
        changes += watch.boundary(steps, None)  # the end of the run
        # and before each step's forward, the groups frozen behind the schedule:
        changes += watch.flags(step, frozen_groups(switcher.groups, accelerator.phase))
    """

    def __init__(self, groups: ParamGroups, phase: Phase) -> None:
        self.groups = groups
        self.entries = _entries(groups)
        self.trains_ungrouped = groups.ungrouped == "trainable"
        self.digests = self._read()
        self.phase, self.since = phase, 0
        self.frozen: frozenset[str] = frozenset()

    def _read(self) -> list[tuple[int, int]]:
        row = local_digests(self.groups)
        return [(row[3 * i], row[3 * i + 1]) for i in range(len(self.entries))]

    def _idle(self, entry: str, phase: Phase) -> bool:
        if entry == UNGROUPED:
            return not self.trains_ungrouped
        return entry not in phase.trainable or entry in self.frozen

    def boundary(self, step: int, coming: Optional[Phase]) -> list[IdleChange]:
        """The changes of the groups idle since the last boundary; then ``coming`` (``None``: the end) trains."""
        now = self._read()
        changed = [
            IdleChange(entry, self.phase.name, self.since, step, frozen=entry in self.frozen)
            for entry, before, after in zip(self.entries, self.digests, now)
            if before != after and self._idle(entry, self.phase)
        ]
        self.digests = now
        if coming is not None:
            self.phase, self.since = coming, step
        return changed

    def flags(self, step: int, frozen: frozenset[str]) -> list[IdleChange]:
        """Before step ``step``'s forward: ``frozen``, the phase's groups whose flags are all off now.

        When they differ from the last reading, the segment since the last
        boundary ends here (its changes returned) and the next one judges them
        idle. A run whose flags follow the schedule never reads here.
        """
        if frozen == self.frozen:
            return []
        changed = self.boundary(step, self.phase)
        self.frozen = frozen
        return changed


def frozen_groups(groups: ParamGroups, phase: Phase) -> frozenset[str]:
    """The groups ``phase`` trains whose every parameter has ``requires_grad`` off now (frozen behind it).

    Example:
        >>> from hf_altparams.plan import Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> _ = net[1].requires_grad_(False)
        >>> sorted(frozen_groups(groups, Alternating([("a", "b")]).phase_at(0)))
        ['b']
    """
    return frozenset(
        g for g in phase.trainable if groups.params(g) and all(not p.requires_grad for p in groups.params(g))
    )
