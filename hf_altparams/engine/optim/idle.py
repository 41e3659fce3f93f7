"""Where an idle group's optimizer state lives: kept on the device, offloaded to the host, or dropped.

:class:`IdleState` applies a :class:`~hf_altparams.engine.memory.StatePolicy`
per group to the optimizer state of the group's parameters, for either kind of
optimizer a run may have: a :class:`~hf_altparams.engine.GroupedOptimizer` (one
inner optimizer per group) or a plain torch optimizer over every parameter
(the Trainer's default AdamW; :class:`PlainOptimizerState`). State moves
through a :class:`~hf_altparams.engine.memory.TensorMover`:

* ``keep``: nothing moves; an idle group's state stays where it is;
* ``offload``: to the host (pinned, non-blocking from CUDA) when the group goes
  idle, back to where torch keeps it (``Optimizer.load_state_dict``'s rule)
  when it trains again, from a prefetched copy when one was started;
* ``drop``: freed when the group goes idle; torch optimizers create fresh state
  at the group's next step (BAdam's reset; LISA's memory figures).

**Who decides.** A policy given to the optimizer (``GroupedOptimizer(...,
state_policy=...)``) is used as given. Where the optimizer leaves it open (no
``state_policy``; a plain torch optimizer), the run decides: the switcher's
``idle_state`` setting, else the schedule's assumption
(:attr:`~hf_altparams.plan.Schedule.idle_state`: ``"drop"`` for
:func:`~hf_altparams.plan.lisa` and :func:`~hf_altparams.plan.badam`, whose
published memory figures hold state for the training blocks only; ``"keep"``
otherwise, as a GAN's Adam moments must persist). :meth:`IdleState.summary`
says what is held and where; the switcher logs it at the first switch that
leaves a group idle.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional

import torch
from torch.optim import Optimizer

from ...errors import PlanError
from ...plan.groups import ParamGroups
from ..driver import PhaseSource
from ..memory import StatePolicy, TensorMover, nbytes

__all__ = ["IdleState", "PlainOptimizerState", "optional_policies"]

_HOST = torch.device("cpu")


def optional_policies(value: Any, names: tuple[str, ...], argument: str) -> dict[str, Optional[StatePolicy]]:
    """A :class:`StatePolicy` per group from one value or a mapping; ``None`` (for all) leaves it to the run.

    Example:
        >>> optional_policies(None, ("a", "b"), "state_policy")
        {'a': None, 'b': None}
        >>> optional_policies({"a": "drop", "b": "keep"}, ("a", "b"), "state_policy")["a"]
        <StatePolicy.DROP: 'drop'>
    """
    if value is None:
        return {name: None for name in names}
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise PlanError(f"`{argument}` names unknown groups {unknown}; known groups: {list(names)}")
        missing = [n for n in names if n not in value]
        if missing:
            raise PlanError(
                f"`{argument}` has no entry for groups {missing}; give one per group, "
                f"or a single value for all of {list(names)}"
            )
        return {name: StatePolicy.parse(value[name], f"`{argument}` for group {name!r}") for name in names}
    return {name: StatePolicy.parse(value, f"`{argument}` for group {name!r}") for name in names}


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class IdleState:
    """Each group's idle-state policy, applied to the optimizer state of its parameters.

    Args:
        groups_of: the owner's groups now (read at every use: FSDP2's ``fully_shard``
            replaces the parameters, and the owner takes the rebound groups).
        optimizer_of: the torch optimizer holding group ``name``'s state.
        policy_of: group ``name``'s policy now.
        mover: moves the state (its copies in flight and prefetched copies).

    Example:
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt = torch.optim.Adam(net.parameters())
        >>> net(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> idle = IdleState(lambda: groups, lambda name: opt, lambda name: StatePolicy.DROP, TensorMover())
        >>> idle.enter_phase(groups.names, {"a"})  # "b" goes idle: its Adam state is freed
        >>> sorted(idle.bytes("b").items()), sorted(idle.bytes("a").items())
        ([], [('cpu', 56)])
    """

    def __init__(
        self,
        groups_of: Callable[[], ParamGroups],
        optimizer_of: Callable[[str], Optimizer],
        policy_of: Callable[[str], StatePolicy],
        mover: TensorMover,
    ) -> None:
        self._groups_of = groups_of
        self._optimizer_of = optimizer_of
        self._policy_of = policy_of
        self._mover = mover

    def enter_phase(self, names: Iterable[str], trainable: Iterable[str]) -> None:
        """Groups of ``names`` outside ``trainable`` go idle (their policy first, so the device never holds both
        phases' state); groups in it get their state back where torch keeps it."""
        coming = frozenset(trainable)
        chosen = list(names)
        for name in chosen:
            if name not in coming:
                self.leave(name)
        for name in chosen:
            if name in coming:
                self.restore(name)

    def leave(self, name: str) -> int:
        """Group ``name`` goes idle: offload or drop its state per its policy; the bytes moved or freed."""
        policy = self._policy_of(name)
        if policy is StatePolicy.DROP:
            freed = sum(self.bytes(name).values())
            optimizer = self._optimizer_of(name)
            for param in self._groups_of().params(name):
                optimizer.state.pop(param, None)
            return freed
        if policy is StatePolicy.OFFLOAD:
            return self.offload(name)
        return 0

    def offload(self, name: str) -> int:
        """Move group ``name``'s state to the host; the bytes moved."""
        return self._mover.state_to_host(self._optimizer_of(name), self._groups_of().params(name), _HOST)

    def restore(self, name: str) -> int:
        """Bring group ``name``'s state back where torch keeps it (a prefetched copy when still current)."""
        return self._mover.state_to_device(self._optimizer_of(name), self._groups_of().params(name))

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        """Start copying idle group ``name``'s offloaded state back on a CUDA side stream; the bytes started."""
        return self._mover.prefetch_state(self._optimizer_of(name), self._groups_of().params(name), max_bytes)

    def reapply(self, names: Iterable[str], active: frozenset[str]) -> int:
        """Put each group's state where its policy says now (after something moved it); bytes re-offloaded or freed."""
        moved = 0
        for name in names:
            if name in active:
                self.restore(name)
            else:
                moved += self.leave(name)
        return moved

    def bytes(self, name: str) -> dict[str, int]:
        """Bytes of group ``name``'s optimizer state, by device type."""
        out: dict[str, int] = {}
        optimizer = self._optimizer_of(name)
        for param in self._groups_of().params(name):
            for value in optimizer.state.get(param, {}).values():
                if isinstance(value, torch.Tensor):
                    out[value.device.type] = out.get(value.device.type, 0) + nbytes(value)
        return out

    def summary(self, idle: Iterable[str], source: str) -> str:
        """One line: what the idle groups' state is, under which policy and where (``source``: who chose it)."""
        idle = sorted(idle)
        policies = sorted({StatePolicy(self._policy_of(n)).value for n in idle})
        held: dict[str, int] = {}
        for name in idle:
            for device, n in self.bytes(name).items():
                held[device] = held.get(device, 0) + n
        where = ", ".join(f"{_mib(n)} on {device}" for device, n in sorted(held.items())) or "none"
        return f"idle optimizer state: {'/'.join(policies)} ({source}); {len(idle)} idle group(s) hold {where}"


class PlainOptimizerState:
    """A plain torch optimizer over every parameter, following a run's phases: its idle groups' state per policy.

    The run's switcher makes one for the optimizer it is given when that is not
    a :class:`~hf_altparams.engine.GroupedOptimizer` (the Trainer's default
    AdamW, ``torch.optim.AdamW(model.parameters())``). The optimizer steps
    every parameter that has a gradient, as always (torch skips the others); this
    object only decides where the state of idle groups lives, with one policy
    for every group (the run's: ``keep`` unless the schedule's recipe or the
    switcher's ``idle_state`` says otherwise).

    Example:
        >>> from hf_altparams.plan import ParamGroups, Phase
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt = torch.optim.Adam(net.parameters())
        >>> net(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> state = PlainOptimizerState(opt, groups)
        >>> state.follow(None, idle_state=StatePolicy.DROP)
        >>> state.enter_phase({"a"}); len(opt.state)  # group b's two tensors' state is gone
        2
    """

    def __init__(self, optimizer: Optimizer, groups: ParamGroups) -> None:
        self.optimizer = optimizer
        self.groups = groups
        self.policy = StatePolicy.KEEP
        self._source: Optional[PhaseSource] = None
        self._mover = TensorMover()
        self._idle = IdleState(lambda: self.groups, lambda name: optimizer, lambda name: self.policy, self._mover)

    @property
    def active(self) -> frozenset[str]:
        """The groups the followed phase trains (every group before the first phase)."""
        phase = None if self._source is None else self._source.current
        return frozenset(self.groups.names) if phase is None else frozenset(phase.trainable)

    @property
    def policies(self) -> dict[str, StatePolicy]:
        return {name: self.policy for name in self.groups.names}

    def follow(
        self,
        source: Optional[PhaseSource],
        idle_state: Optional[StatePolicy] = None,
        idle_master: Optional[StatePolicy] = None,
    ) -> None:
        """Follow ``source``'s phases; idle groups' state follows ``idle_state`` (default ``keep``)."""
        self._source = source
        self.policy = idle_state or StatePolicy.KEEP

    def enter_phase(self, trainable: Iterable[str]) -> None:
        """A phase that trains ``trainable`` starts: idle groups' state follows the policy."""
        if self.policy is not StatePolicy.KEEP:
            self._idle.enter_phase(self.groups.names, trainable)

    def idle_state_leaves(self, group: str) -> bool:
        return self.policy is not StatePolicy.KEEP

    def reapply_policy(self) -> int:
        """Put idle groups' state back where the policy says (after a load moved it to the device)."""
        if self.policy is StatePolicy.KEEP:
            return 0
        return self._idle.reapply(self.groups.names, self.active)

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        return self._idle.prefetch(name, max_bytes) if self.policy is StatePolicy.OFFLOAD else 0

    @property
    def prefetched_bytes(self) -> int:
        return self._mover.prefetched_bytes

    def summary(self, idle: Iterable[str], source: str) -> str:
        """What the ``idle`` groups' state is now, under which policy and where."""
        return self._idle.summary(idle, source)

    def state_bytes(self, name: str) -> dict[str, int]:
        """Bytes of group ``name``'s optimizer state, by device type."""
        return self._idle.bytes(name)
