"""The switch's side of a DeepSpeed ZeRO-1/2 engine: :class:`ZeroBackend`, and who holds idle groups' state.

:class:`ZeroBackend` is what the switch transaction drives for a
``DeepSpeedEngine``: at each switch the engine's active param groups follow
the ``requires_grad`` flags the switch just set (no collective, so the switch
settles in one all-gather). :class:`ZeroStateOwner` is the run's
:class:`~hf_altparams.engine.optim.StateOwner` for it: at each phase it keeps,
offloads or drops idle groups' fp32 partitions and optimizer state, per the
run's policies (``lisa`` and ``badam`` drop by default).

Everything reaches DeepSpeed through :class:`._partitions.ZeroPartitions` and
:mod:`._surface`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

import torch
from torch import nn

from ...errors import AltParamsError, Cause, PlanError
from ...plan.groups import ParamGroups
from ..backend import Backend
from ..driver import PhaseSource
from ..memory import StatePolicy
from ._partitions import GROUP_TAG, ZeroPartitions
from ._surface import check_deepspeed, refused_features, zero12_class

__all__ = ["ZeroBackend", "ZeroStateOwner"]

#: How a refusal names the way to an optimizer split per group, per integration.
SPLIT_HOWTO = (
    "pass the torch optimizer to `PhasedAccelerator.prepare` together with the model (it splits it per "
    "group before DeepSpeed partitions it), or add AlternatingFreeze to `Trainer(callbacks=...)` without "
    "`optimizers=` (it has the Trainer build it split)"
)


class ZeroBackend(Backend):
    """A ``DeepSpeedEngine`` at ZeRO-1 or ZeRO-2, its optimizer split per library group.

    Raises:
        AltParamsError: the engine's optimizer is not ZeRO-1/2's (another
            class: bf16 with fp32 gradient accumulation at ZeRO-1, fp16 without
            ZeRO, a client optimizer at stage 0), uses a feature the strategy
            refuses (optimizer offload, MoE), lacks a name the strategy reads,
            or was not split per group before ``deepspeed.initialize``.
    """

    kind = "deepspeed"
    collective_free_apply = True

    def __init__(self, engine: nn.Module) -> None:
        check_deepspeed()
        self.wrapper = engine
        zero = getattr(engine, "optimizer", None)
        zero_class = zero12_class()
        if zero_class is None or type(zero) is not zero_class:
            raise AltParamsError(
                f"the DeepSpeed engine's optimizer is a {type(zero).__name__}, not ZeRO-1/2's DeepSpeedZeroOptimizer "
                "that the phases drive (BF16_Optimizer comes with `data_types.grad_accum_dtype='fp32'` at ZeRO-1: "
                "leave it out or use ZeRO-2; without ZeRO, stage 0, train with DDP)",
                cause=Cause.STRATEGY_REFUSED,
            )
        refused = refused_features(zero)
        if refused:
            raise AltParamsError(
                f"the phases cannot drive DeepSpeed with {', '.join(refused)}: untested; turn it "
                "off (ZeRO-1/2 without offload)",
                cause=Cause.STRATEGY_REFUSED,
            )
        self.partitions = ZeroPartitions(zero)
        problems = self.partitions.problems()
        untagged = [i for i, tag in enumerate(self.partitions.tags) if tag is None]
        if problems or untagged:
            self.partitions.close()
        if problems:
            raise AltParamsError(
                f"deepspeed's ZeRO optimizer is not laid out as hf_altparams expects "
                f"({problems[:3]}); install a tested deepspeed (0.19)",
                cause=Cause.STRATEGY_REFUSED,
            )
        if untagged:
            raise AltParamsError(
                f"{len(untagged)} param group(s) of the DeepSpeed optimizer (e.g. {untagged[:3]}) are not one library "
                f"group's (no {GROUP_TAG!r} key): ZeRO flattens each param group into partitions that mix the "
                f"groups, so an idle group could not be skipped, left out of the all-gather or freed. {SPLIT_HOWTO}. "
                "A DeepSpeed `optimizer` config section builds one param group over everything: remove it",
                cause=Cause.STRATEGY_REFUSED,
            )
        self._owner: Optional[ZeroStateOwner] = None

    @property
    def optimizers(self) -> tuple[Any, ...]:
        """The ZeRO optimizer and the torch optimizer inside it (by either the run finds this backend)."""
        return self.partitions.zero, self.partitions.inner

    @property
    def device(self) -> Optional[torch.device]:
        return getattr(self.wrapper, "device", None)

    # ------------------------------------------------------------ the switch
    def follow_flags(self) -> None:
        """The active param groups are those whose parameters require gradients now.

        Raises:
            AltParamsError: a param group's parameters disagree (the flags were set behind the schedule).
        """
        flags = self.partitions.flags()
        mixed = [self.partitions.tags[i] for i, flag in enumerate(flags) if flag is None]
        if mixed:
            raise AltParamsError(
                f"the parameters of group(s) {mixed[:3]} disagree on `requires_grad`; one group is "
                "one ZeRO param group and trains or idles whole",
                cause=Cause.REQUIRES_GRAD_BEHIND_SCHEDULE,
            )
        self.partitions.set_active(frozenset(i for i, flag in enumerate(flags) if flag))

    def snapshot(self) -> frozenset[int]:
        return self.partitions.active

    def apply(self, ignore: set[str]) -> None:
        self.follow_flags()

    def restore(self, snapshot: frozenset[int]) -> None:
        self.partitions.set_active(snapshot)

    def reduced_bytes_per_step(self) -> int:
        """Bytes of the active groups' gradients the engine reduces per optimizer step (their weights' dtype)."""
        zero = self.partitions.zero
        return sum(p.numel() * p.element_size() for i in self.partitions.active for p in zero.bit16_groups[i])

    def close(self) -> None:
        self.partitions.close()

    # ------------------------------------------------------------ optimizer state
    def state_owner(self, groups: ParamGroups) -> ZeroStateOwner:
        """The run's owner of idle groups' fp32 partitions and optimizer state (one per engine)."""
        if self._owner is None:
            self._owner = ZeroStateOwner(self.partitions, groups)
        return self._owner


class ZeroStateOwner:
    """Where idle groups' fp32 partitions and optimizer state live, on one ZeRO-1/2 engine (a StateOwner).

    Each library group follows the run's policies (``idle_state`` for the
    optimizer state, ``idle_master`` for the fp32 partition): ``keep``,
    ``offload`` (to the host, brought back exactly) or ``drop`` (freed; the
    partition restarts from the group's weights when it returns).
    """

    def __init__(self, partitions: ZeroPartitions, groups: ParamGroups) -> None:
        self.partitions = partitions
        unknown = sorted({t for t in partitions.tags if t is not None} - set(groups.names))
        if unknown:
            raise PlanError(
                f"the DeepSpeed optimizer's param groups name group(s) {unknown} that the run's groups "
                f"{list(groups.names)} do not have; split the optimizer over these groups"
            )
        covered = {id(p) for i, tag in enumerate(partitions.tags) if tag is not None for p in partitions.params(i)}
        missing = [
            f"{name}: {param_name}"
            for name in sorted({t for t in partitions.tags if t is not None})
            for param_name, param in groups.named_params(name)
            if id(param) not in covered
        ]
        if missing:
            raise PlanError(
                f"DeepSpeed's optimizer leaves out {len(missing)} parameter(s) of the groups it trains "
                f"(e.g. {missing[:3]}): they were frozen at `deepspeed.initialize`, so ZeRO never "
                "partitions them. Every parameter the schedule trains must be trainable then"
            )
        self.names = tuple(groups.names)
        self._state = {name: StatePolicy.KEEP for name in self.names}
        self._master = dict(self._state)
        self._active: frozenset[str] = frozenset(self.names)

    @property
    def policies(self) -> Mapping[str, StatePolicy]:
        return dict(self._state)

    @property
    def active(self) -> frozenset[str]:
        return self._active

    def follow(
        self, source: PhaseSource, idle_state: Optional[StatePolicy] = None, idle_master: Optional[StatePolicy] = None
    ) -> None:
        for name in self.names:
            self._state[name] = idle_state or StatePolicy.KEEP
            self._master[name] = idle_master or idle_state or StatePolicy.KEEP

    def enter_phase(self, trainable: Iterable[str]) -> None:
        self._active = frozenset(trainable)
        self._place()

    def _place(self) -> int:
        partitions, moved, changed = self.partitions, 0, False
        for index, tag in enumerate(partitions.tags):
            if tag is None or tag in self._active:
                back = partitions.restore(index)
                freed = 0
            else:
                freed, back = partitions.place(index, self._state[tag], self._master[tag])
            moved += freed + back
            changed = changed or bool(freed or back)
        if changed:
            partitions.relink()
        return moved

    def idle_state_leaves(self, group: str) -> bool:
        return self._state.get(group, StatePolicy.KEEP) is not StatePolicy.KEEP

    def reapply_policy(self) -> int:
        return self._place()

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        return 0

    def summary(self, idle: Iterable[str], source: str) -> str:
        idle = sorted(idle)
        policies = sorted({f"state {self._state[g].value}, fp32 partition {self._master[g].value}" for g in idle})
        return (
            f"idle groups {idle[:4]}{'...' if len(idle) > 4 else ''} on DeepSpeed ZeRO: "
            f"{'; '.join(policies)} ({source})"
        )

    def master_partitions(self, group: str) -> list[torch.Tensor]:
        """This rank's fp32 partitions of ``group`` (while idle under ``drop`` / ``offload``: its bit16 partitions)."""
        return [self.partitions.fp32(i) for i in self.partitions.indices(group)]

    def census(self) -> dict[str, dict[str, int]]:
        """Per library group, this rank's bytes of optimizer state and of fp32 partition held on the device."""
        out: dict[str, dict[str, int]] = {}
        for index, tag in enumerate(self.partitions.tags):
            entry = out.setdefault(str(tag), {"state": 0, "master": 0})
            entry["state"] += self.partitions.state_bytes(index)
            entry["master"] += self.partitions.master_bytes(index)
        return out
