"""One optimizer per parameter group, behind a single ``torch.optim.Optimizer``: :class:`GroupedOptimizer`.

:class:`GroupedOptimizer` is what Accelerate, the Trainer and LR schedulers see:
its ``param_groups`` are the inner optimizers' own dicts, ``step()`` steps only
the groups of the phase that trains, and ``state_dict()`` is keyed by group
and parameter *name* so it loads into a rebuilt model. Idle groups' optimizer
state follows a :class:`StatePolicy`: ``keep`` it, ``offload`` it to CPU
(pinned when the device is CUDA), or ``drop`` it (torch optimizers re-initialise
empty state at the next step). The policy is one typed value shared with the
planner and the memory report (:mod:`hf_altparams.engine.memory.model`); users
pass its strings. State moves through a
:class:`~hf_altparams.engine.memory.TensorMover`, the mover residency uses too.

Which groups train: inside a run, the phase its
:class:`~hf_altparams.engine.PhaseDriver` applied (the switcher makes the
optimizer :meth:`~GroupedOptimizer.follow` the driver and tells it each new
phase through :meth:`~GroupedOptimizer.enter_phase`); used on its own, the
groups given to :meth:`~GroupedOptimizer.set_active`. No copy of the phase is
kept: ``active`` reads whichever of the two it follows.

Also here: the checks of what a GroupedOptimizer is given (the ``optimizers``
argument), the checks by parameter *identity* the integrations share
(:func:`match_to_groups`: several built optimizers, one per group, matched by
the parameters they hold; :func:`uncovered`: the parameters a schedule trains
that no optimizer holds), and :func:`grouped_in` (the GroupedOptimizer inside
a prepared wrapper).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from ...errors import Cause, PlanError
from ...plan.groups import ParamGroups
from ..driver import PhaseSource
from ..memory import StatePolicy, StatePolicyLike, TensorMover, optimizer_of
from .idle import IdleState, optional_policies

__all__ = [
    "GroupedOptimizer",
    "OptimizerFactory",
    "StatePolicy",
    "as_factories",
    "check_groups_argument",
    "frozen_ungrouped",
    "grouped_in",
    "match_to_groups",
    "reapply_state_policy",
    "uncovered",
    "uncovered_message",
]

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
STATE_DICT_FORMAT = "hf_altparams.GroupedOptimizer/1"

_FORMS = (
    "accepted: a factory `params -> Optimizer` (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)), "
    "a dict group name -> factory, or a dict group name -> an optimizer already built on exactly that "
    "group's parameters"
)


def check_groups_argument(groups: Any) -> ParamGroups:
    """Refuse anything but a :class:`ParamGroups` (a model is the usual slip).

    Example:
        >>> check_groups_argument(nn.Linear(2, 2))
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `groups` must be a ParamGroups, got Linear; build one first: ParamGroups(model, {"name": "pattern.*", ...})
    """
    if not isinstance(groups, ParamGroups):
        raise PlanError(
            f"`groups` must be a ParamGroups, got {type(groups).__name__}; build one first: "
            'ParamGroups(model, {"name": "pattern.*", ...})'
        )
    return groups


def _held(opt: Optimizer) -> list[nn.Parameter]:
    return [p for g in opt.param_groups for p in g["params"]]


def _names_by_id(groups: ParamGroups) -> dict[int, str]:
    return {id(p): n for n, p in groups.all_named_params()}


def _mismatch(groups: ParamGroups, name: str, opt: Optimizer) -> tuple[list[str], list[str]]:
    """Group ``name``'s parameters that ``opt`` lacks, and the ones it holds besides (by name)."""
    wanted = groups.params(name)
    names = dict(zip(map(id, wanted), groups.param_names(name)))
    held_ids = {id(p) for p in _held(opt)}
    missing = [names[id(p)] for p in wanted if id(p) not in held_ids]
    where = _names_by_id(groups)
    extra = sorted(where.get(i, "<a parameter outside the model>") for i in held_ids - set(names))
    return missing, extra


def _check_built(groups: ParamGroups, name: str, opt: Optimizer) -> None:
    missing, extra = _mismatch(groups, name, opt)
    if missing or extra:
        raise PlanError(
            f"`optimizers[{name!r}]` ({type(opt).__name__}) must be built on exactly group {name!r}'s "
            f"parameters; missing: {missing}; extra (not in group {name!r}): {extra}"
        )


def _preview(names: Sequence[str], limit: int = 4) -> str:
    return repr(list(names[:limit]))[:-1] + (", ...]" if len(names) > limit else "]")


def match_to_groups(
    groups: ParamGroups, optimizers: Sequence[tuple[str, Optimizer]], *, forms: str
) -> dict[str, Optimizer]:
    """Match built optimizers to groups by the parameters they hold: one optimizer per group.

    Args:
        groups: the groups.
        optimizers: ``(label, optimizer)`` pairs; the label names the argument in messages.
        forms: the accepted forms, appended to every message.

    Returns:
        group name -> optimizer, for every group (in ``groups.names`` order).

    Raises:
        PlanError: an optimizer holds parameters of several groups (or of none), holds
            a group's parameters but not exactly them (missing and extra are named), two
            optimizers hold the same group, or a group has no optimizer.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt_b, opt_a = torch.optim.SGD(net[1].parameters()), torch.optim.SGD(net[0].parameters())
        >>> matched = match_to_groups(groups, [("opt_b", opt_b), ("opt_a", opt_a)], forms="")
        >>> matched == {"a": opt_a, "b": opt_b}
        True
        >>> match_to_groups(groups, [("opt", torch.optim.SGD(net.parameters()))], forms="Accepted: ...")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: opt (SGD) holds parameters of groups ['a', 'b']; with several optimizers each must hold exactly one group's parameters. Accepted: ...
    """
    by_id = _names_by_id(groups)
    matched: dict[str, tuple[str, Optimizer]] = {}
    for label, opt in optimizers:
        held = [by_id.get(id(p)) for p in _held(opt)]
        touched = sorted(
            {g for g in (groups.group_of(n) for n in held if n is not None) if g is not None}, key=groups.names.index
        )
        what = f"{label} ({type(opt).__name__})"
        if len(touched) > 1:
            raise PlanError(
                f"{what} holds parameters of groups {touched}; with several optimizers each must "
                f"hold exactly one group's parameters. {forms}"
            )
        if not touched:
            outside = [n if n is not None else "<a parameter outside the model>" for n in held]
            raise PlanError(
                f"{what} holds no parameter of any group ({_preview(outside)}); known groups: "
                f"{list(groups.names)}. {forms}"
            )
        name = touched[0]
        if name in matched:
            raise PlanError(
                f"{matched[name][0]} and {what} both hold group {name!r}'s parameters; give each "
                f"group one optimizer. {forms}"
            )
        missing, extra = _mismatch(groups, name, opt)
        if missing or extra:
            raise PlanError(
                f"{what} holds group {name!r}'s parameters but must hold exactly them; missing: "
                f"{_preview(missing)}; extra (not in group {name!r}): {_preview(extra)}. {forms}"
            )
        matched[name] = (label, opt)
    left = [g for g in groups.names if g not in matched]
    if left:
        raise PlanError(
            f"no optimizer holds group(s) {left} (the optimizers hold {list(matched)}); their "
            f"parameters would never be updated; add one optimizer per group left out, or leave "
            f"those groups out of the ParamGroups. {forms}",
            cause=Cause.OPTIMIZER_MISSES_PARAMETERS,
        )
    return {g: matched[g][1] for g in groups.names}


def uncovered(
    groups: ParamGroups, trained_groups: Iterable[str], optimizers: Iterable[Optimizer]
) -> list[tuple[str, Optional[str]]]:
    """The parameters some phase trains that none of ``optimizers`` holds: ``(name, group or None)``.

    ``trained_groups`` are the groups the schedule trains (``schedule.group_names()``,
    unknown names ignored); ungrouped parameters count when ``groups.ungrouped`` is
    ``"trainable"`` (they train in every phase). Checked by identity, in module order.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> uncovered(groups, ["a", "b"], [torch.optim.SGD(net[0].parameters())])
        [('1.weight', 'b'), ('1.bias', 'b')]
    """
    names = [g for g in groups.names if g in set(trained_groups)]
    wanted = groups.trainable_param_names(names)
    held = {id(p) for opt in optimizers for p in _held(opt)}
    return [(n, groups.group_of(n)) for n, p in groups.all_named_params() if n in wanted and id(p) not in held]


def frozen_ungrouped(groups: ParamGroups, optimizers: Iterable[Optimizer]) -> list[str]:
    """The parameters ``optimizers`` hold that no group names, when ``groups.ungrouped`` freezes them.

    They are never updated: a likely mistake (a layer left out of the groups).

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> frozen_ungrouped(ParamGroups(net, {"a": "0.*"}), [torch.optim.SGD(net.parameters(), lr=0.1)])
        ['1.weight', '1.bias']
    """
    if groups.ungrouped != "frozen":
        return []
    held = {id(p) for opt in optimizers for p in _held(opt)}
    by_name = dict(groups.all_named_params())
    return [n for n in groups.ungrouped_names() if id(by_name[n]) in held]


def uncovered_message(
    groups: ParamGroups, trained_groups: Iterable[str], optimizers: Iterable[Optimizer]
) -> Optional[str]:
    """``"leaves out N parameter(s) that the schedule trains (group(s) [...]: names)"``, or ``None``.

    The shared start of the coverage refusals (``PhasedAccelerator.prepare`` and
    ``AlternatingFreeze``), over :func:`uncovered`'s list.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> uncovered_message(groups, ["a", "b"], [torch.optim.SGD(net[0].parameters())])
        "leaves out 2 parameter(s) that the schedule trains (group(s) ['b']: '1.weight', '1.bias')"
    """
    missing = uncovered(groups, trained_groups, optimizers)
    if not missing:
        return None
    left = sorted({g or "<ungrouped>" for _, g in missing})
    names = ", ".join(repr(n) for n, _ in missing[:3]) + (", ..." if len(missing) > 3 else "")
    return f"leaves out {len(missing)} parameter(s) that the schedule trains (group(s) {left}: {names})"


def _returning(optimizer: Optimizer) -> Callable[[list[nn.Parameter]], Optimizer]:
    """A factory that returns ``optimizer`` (built by the user on exactly the group's parameters)."""

    def factory(params: list[nn.Parameter]) -> Optimizer:
        return optimizer

    return factory


def as_factories(groups: ParamGroups, optimizers: Any) -> dict[str, Callable[[list[nn.Parameter]], Optimizer]]:
    """One factory per group; a built optimizer is checked, then returned as is.

    Example:
        >>> import torch
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt_a = torch.optim.SGD(net[0].parameters(), lr=0.1)
        >>> opt_b = torch.optim.SGD(net[1].parameters(), lr=0.1)
        >>> f = as_factories(groups, {"a": opt_a, "b": opt_b})
        >>> f["a"](groups.params("a")) is opt_a
        True
        >>> as_factories(groups, {"a": opt_b, "b": opt_b})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `optimizers['a']` (SGD) must be built on exactly group 'a''s parameters; missing: ['0.weight', '0.bias']; extra (not in group 'a'): ['1.bias', '1.weight']
    """
    if isinstance(optimizers, Optimizer):
        raise PlanError(
            f"`optimizers` got one built {type(optimizers).__name__} for all groups {list(groups.names)}; "
            "a GroupedOptimizer needs one optimizer per group; " + _FORMS
        )
    if isinstance(optimizers, Mapping):
        unknown = sorted(set(optimizers) - set(groups.names))
        if unknown:
            raise PlanError(f"`optimizers` names unknown groups {unknown}; known groups: {list(groups.names)}")
        missing = [n for n in groups.names if n not in optimizers]
        if missing:
            raise PlanError(
                f"`optimizers` has no entry for groups {missing}; give one per group "
                f"(an optimizer each, or factories), or a single factory for all of {list(groups.names)}"
            )
        out: dict[str, Callable[[list[nn.Parameter]], Optimizer]] = {}
        for name in groups.names:
            value = optimizers[name]
            if isinstance(value, Optimizer):
                _check_built(groups, name, value)
                out[name] = _returning(value)
            elif callable(value):
                out[name] = value
            else:
                raise PlanError(f"`optimizers[{name!r}]` is a {type(value).__name__}; " + _FORMS)
        return out
    if not callable(optimizers):
        raise PlanError(f"`optimizers` is a {type(optimizers).__name__}; " + _FORMS)
    return {name: optimizers for name in groups.names}


class GroupedOptimizer(Optimizer):
    """A composite optimizer: one inner optimizer per parameter group.

    Args:
        groups: the :class:`~hf_altparams.plan.ParamGroups` to optimize.
        optimizers: a factory ``params -> Optimizer`` (e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-3)``) used for every group,
            or a mapping from group name to factory (one per group), or a mapping
            from group name to an optimizer already built on exactly that group's
            parameters (checked: missing or extra parameters are named).
        state_policy: what happens to an idle group's optimizer state: a
            :class:`StatePolicy` or its string, ``"keep"``, ``"offload"`` or
            ``"drop"``; one value or one per group. ``None`` (default): the
            run's (a switcher's ``idle_state``, else its schedule's: ``"drop"``
            for :func:`~hf_altparams.plan.lisa` and :func:`~hf_altparams.plan.badam`,
            ``"keep"`` otherwise; ``"keep"`` for an optimizer used on its own).
        active: the groups that step at first when the optimizer is used on its
            own (default: all); inside a run the driver's phase decides
            (:meth:`follow`).

    ``param_groups`` are the inner optimizers' own dicts (an LR scheduler on this
    optimizer changes every group's learning rate, idle or not; use
    :class:`GroupedLRScheduler` for schedules that pause while a group is idle).

    Example:
        >>> import functools, torch
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
        >>> opt.set_active({"a"}); sorted(opt.active)
        ['a']
    """

    def __init__(
        self,
        groups: ParamGroups,
        optimizers: Union[OptimizerFactory, Mapping[str, Union[OptimizerFactory, Optimizer]]],
        *,
        state_policy: Union[None, StatePolicyLike, Mapping[str, StatePolicyLike]] = None,
        active: Optional[Iterable[str]] = None,
    ) -> None:
        self.groups = check_groups_argument(groups)
        factories = as_factories(groups, optimizers)
        self._given: dict[str, Optional[StatePolicy]] = optional_policies(state_policy, groups.names, "state_policy")
        self._run_policy = StatePolicy.KEEP  # for the groups whose policy was left open (follow() sets the run's)
        self.inner: dict[str, Optimizer] = {}
        for name in groups.names:
            opt = factories[name](groups.params(name))
            if not isinstance(opt, Optimizer):
                raise PlanError(
                    f"`optimizers` factory for group {name!r} returned {type(opt).__name__}; "
                    "it must return a torch.optim.Optimizer built on the parameters it is given"
                )
            self.inner[name] = opt
        self._mover = TensorMover()  # state to the host and back, and prefetched copies
        self._idle = IdleState(lambda: self.groups, lambda name: self.inner[name], self.policy_of, self._mover)
        all_params = [p for name in groups.names for p in groups.params(name)]
        super().__init__(all_params, defaults={})
        # The composite's param_groups ARE the inner optimizers' dicts.
        self.param_groups = [g for opt in self.inner.values() for g in opt.param_groups]
        #: the groups the last ``step()`` stepped (``None`` before the first, and after ``set_active``): what
        #: a GroupedLRScheduler advances, whatever phase a switch right after the step applied
        self.last_stepped: Optional[frozenset[str]] = None
        #: the groups that step when the optimizer is used on its own (``set_active``)
        self._own: frozenset[str] = frozenset(
            n for n in (groups.names if active is None else active) if n in self.inner
        )
        self._source: Optional[PhaseSource] = None  # a run's driver, once a switcher took the optimizer
        self.enter_phase(self.active)

    # `Optimizer.__init__` assigns `self.state`; the composite's state is the inner ones'.
    @property  # type: ignore[override]
    def state(self) -> dict[torch.Tensor, dict[str, Any]]:
        merged: dict[torch.Tensor, dict[str, Any]] = {}
        for opt in self.inner.values():
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError("GroupedOptimizer.state is the union of the inner optimizers' state")

    def __repr__(self) -> str:
        parts = [
            f"  {n} ({'active' if n in self.active else 'idle'}, {self.policies[n]}): {type(o).__name__}"
            for n, o in self.inner.items()
        ]
        return "GroupedOptimizer(\n" + "\n".join(parts) + "\n)"

    # ----------------------------------------------------------------- phases
    @property
    def active(self) -> frozenset[str]:
        """The groups that step now: the followed driver's phase, or those given to :meth:`set_active`."""
        if self._source is None:
            return self._own
        phase = self._source.current
        return frozenset(self.inner) if phase is None else frozenset(n for n in phase.trainable if n in self.inner)

    @property
    def policies(self) -> dict[str, StatePolicy]:
        """Each group's idle-state policy now (given, or the run's where it was left open)."""
        return {name: self.policy_of(name) for name in self.groups.names}

    def policy_of(self, name: str) -> StatePolicy:
        """Group ``name``'s idle-state policy now."""
        return self._given.get(name) or self._run_policy

    def follow(
        self, source: PhaseSource, idle_state: Optional[StatePolicy] = None, idle_master: Optional[StatePolicy] = None
    ) -> None:
        """Take the groups that step from ``source`` (a run's :class:`~hf_altparams.engine.PhaseDriver`).

        The :class:`~hf_altparams.engine.PhaseSwitcher` that takes this optimizer
        calls it; from then on :meth:`set_active` is refused (the phase is the
        driver's) and the switcher tells each new phase through :meth:`enter_phase`.
        ``idle_state``: the run's policy for the groups whose policy was left
        open (``None``: ``keep``); ``idle_master``: the same for fp32 masters
        (:class:`PrecisionOptimizer`).
        """
        self._source = source
        self._run_policy = idle_state or StatePolicy.KEEP

    def set_active(self, names: Iterable[str]) -> None:
        """Make ``names`` the groups that step (used on its own); the state policy applies to the others.

        Names that are not groups of this optimizer are ignored (a phase may
        name groups that a single optimizer does not cover).

        Raises:
            PlanError: the optimizer follows a run's driver (the phase decides).
        """
        if self._source is not None:
            raise PlanError(
                "this GroupedOptimizer follows a run's phases (a PhaseSwitcher took it): the groups "
                "that step are the driver's phase; switch phases through the run instead"
            )
        self._own = frozenset(n for n in names if n in self.inner)
        self.last_stepped = None  # no step in this phase yet: a GroupedLRScheduler advances the new groups
        self.enter_phase(self._own)

    def enter_phase(self, trainable: Iterable[str]) -> None:
        """A phase that trains ``trainable`` starts: idle groups' state follows its policy, active groups' comes back.

        Groups becoming idle get their policy applied (offload/drop) first, so
        the device never holds both groups' state; groups becoming active get
        offloaded state back on their parameters' device (a prefetched copy when
        one was started).
        """
        self._idle.enter_phase(self.groups.names, frozenset(n for n in trainable if n in self.inner))

    def rebind(self, groups: ParamGroups) -> None:
        """Take ``groups`` (the same groups, by name, on new parameter objects: FSDP2's ``fully_shard``
        replaced them, and Accelerate swapped them in the inner optimizers' ``param_groups``).

        Raises:
            PlanError: ``groups`` have other names than this optimizer's.
        """
        if tuple(groups.names) != tuple(self.groups.names):
            raise PlanError(f"`groups` {list(groups.names)} are not this optimizer's groups {list(self.groups.names)}")
        self.groups = groups

    def refresh_param_groups(self) -> None:
        """Point ``param_groups`` at the inner optimizers' live dicts again (after an inner ``load_state_dict``).

        torch's ``load_state_dict`` replaces each param_group dict with a new one;
        without this, LR schedulers (and GradScaler) acting on ``param_groups``
        would edit stale copies the inner optimizers ignore.
        """
        self.param_groups = [g for opt in self.inner.values() for g in opt.param_groups]

    def idle_state_leaves(self, group: str) -> bool:
        """Whether group ``group``'s state leaves the device while it is idle (its policy is not ``keep``)."""
        return group in self.inner and self.policy_of(group) is not StatePolicy.KEEP

    def reapply_policy(self) -> int:
        """Put every group's state back where its policy says; return the bytes re-offloaded (or dropped).

        Three places move optimizer state back onto the device by themselves:
        ``Optimizer.load_state_dict`` (torch casts state to the parameters'
        device), Accelerate's optimizer preparation (``AcceleratedOptimizer``
        with ``device_placement=True`` reloads the state dict moved to the
        device) and the Trainer's resume. :meth:`load_state_dict` re-applies the
        policy itself; the switcher calls this after the others.
        """
        return self._idle.reapply(self.groups.names, self.active)

    def attach_ddp(self, ddp: DistributedDataParallel) -> Any:
        """Called when the switcher attaches a DDP wrapper; nothing to do here (see PrecisionOptimizer)."""
        return None

    def summary(self, idle: Iterable[str], source: str) -> str:
        """What the ``idle`` groups' state is now, under which policy and where (``source``: who chose the policy)."""
        return self._idle.summary(idle, source)

    def offload(self, name: str) -> int:
        """Move group ``name``'s optimizer state to CPU; return the bytes moved.

        From CUDA the copies go into pinned memory without blocking the host:
        the device memory is reusable at once in stream order, so the copy never
        raises the peak. The host copies are waited for only before the CPU
        reads them (:meth:`state_dict`, :meth:`synchronize`).
        """
        return self._idle.offload(name)

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        """Start copying idle group ``name``'s offloaded state back, on a CUDA side stream.

        The copy overlaps whatever runs until the group becomes active again,
        when :meth:`enter_phase` uses it; meanwhile it occupies device memory
        (that is the trade-off; ``PhaseSwitcher(prefetch=...)`` decides when).
        Returns the bytes started: 0 off CUDA or when nothing is offloaded.
        """
        return self._idle.prefetch(name, max_bytes) if name in self.inner else 0

    @property
    def prefetched_bytes(self) -> int:
        """Device bytes of prefetched state not yet used."""
        return self._mover.prefetched_bytes

    def synchronize(self) -> None:
        """Wait for pending device -> host copies of offloaded state (before reading it on the CPU)."""
        self._mover.settle()

    def state_bytes(self, name: str) -> dict[str, int]:
        """Bytes of group ``name``'s optimizer state, by device type."""
        return self._idle.bytes(name)

    # -------------------------------------------------------------- optimizer
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Step the active groups' optimizers (each skips parameters whose grad is None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self.active
        for name in self.groups.names:
            if name in active:
                self.inner[name].step()
        self.last_stepped = active
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every group (``None`` by default: frees memory, keeps DDP buckets unpinned)."""
        for opt in self.inner.values():
            opt.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "inner", None) and getattr(self, "active", None) is not None:
            raise PlanError(
                "GroupedOptimizer.add_param_group: parameters belong to named groups; "
                "define a new group in ParamGroups instead"
            )
        super().add_param_group(param_group)

    def _indexed_names(self, name: str) -> list[str]:
        """Group ``name``'s parameter names in the order torch's ``state_dict`` numbers them.

        Torch numbers parameters in ``param_groups`` order, which a factory may
        change (e.g. weight-decay and no-decay sub-groups), so the group's own
        order would key the state under the wrong names.
        """
        names_by_id = {id(p): n for n, p in self.groups.named_params(name)}
        order: list[str] = []
        seen: set[int] = set()
        for group in self.inner[name].param_groups:
            for param in group["params"]:
                if id(param) in seen:
                    continue
                if id(param) not in names_by_id:
                    raise PlanError(
                        f"the optimizer of group {name!r} holds a parameter of shape "
                        f"{tuple(param.shape)} that is not in that group; a factory must build "
                        "its optimizer on the parameters it is given"
                    )
                seen.add(id(param))
                order.append(names_by_id[id(param)])
        return order

    def state_dict(self) -> dict[str, Any]:
        """State of every group, keyed by group and parameter name."""
        self.synchronize()  # offloaded state may still be in flight to the host
        groups_out: dict[str, Any] = {}
        for name, opt in self.inner.items():
            index_to_name = dict(enumerate(self._indexed_names(name)))
            inner = opt.state_dict()
            groups_out[name] = {
                "state": {index_to_name[i]: s for i, s in inner["state"].items()},
                "param_groups": [
                    {**g, "params": [index_to_name[i] for i in g["params"]]} for g in inner["param_groups"]
                ],
            }
        return {
            "format": STATE_DICT_FORMAT,
            "policies": {n: p.value for n, p in self.policies.items()},
            "groups": groups_out,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict`; then re-apply the idle-state policy.

        Torch's ``load_state_dict`` casts state onto the parameters' device, so
        offloaded or dropped state would silently come back; it is re-offloaded
        (or dropped) here for every idle group.
        """
        if state_dict.get("format") != STATE_DICT_FORMAT:
            raise PlanError(
                f"GroupedOptimizer.load_state_dict: `format` is {state_dict.get('format')!r}; "
                f"expected {STATE_DICT_FORMAT!r} (a dict from GroupedOptimizer.state_dict())"
            )
        saved = state_dict["groups"]
        if set(saved) != set(self.inner):
            raise PlanError(
                f"GroupedOptimizer.load_state_dict: saved groups {sorted(saved)} differ from "
                f"this optimizer's groups {sorted(self.inner)}"
            )
        for name, opt in self.inner.items():
            name_to_index = {n: i for i, n in enumerate(self._indexed_names(name))}
            entry = saved[name]
            unknown = sorted(set(entry["state"]) - set(name_to_index))
            if unknown:
                raise PlanError(
                    f"GroupedOptimizer.load_state_dict: group {name!r} has state for unknown parameters {unknown[:5]}"
                )
            opt.load_state_dict(
                {
                    "state": {name_to_index[n]: s for n, s in entry["state"].items()},
                    "param_groups": [
                        {**g, "params": [name_to_index[n] for n in g["params"]]} for g in entry["param_groups"]
                    ],
                }
            )
        self.refresh_param_groups()
        self._mover.cancel_prefetch()
        self.enter_phase(self.active)


def grouped_in(optimizer: Any) -> Optional[GroupedOptimizer]:
    """The :class:`GroupedOptimizer` inside ``optimizer`` (Accelerate's ``AcceleratedOptimizer``, a handle), if any.

    Example:
        >>> import torch
        >>> grouped_in(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)) is None
        True
    """
    inner = optimizer_of(optimizer)
    return inner if isinstance(inner, GroupedOptimizer) else None


def reapply_state_policy(optimizer: Any) -> int:
    """Re-apply a :class:`GroupedOptimizer`'s idle-state policy (:meth:`GroupedOptimizer.reapply_policy`).

    ``optimizer`` may be wrapped (``.optimizer`` chains such as
    ``AcceleratedOptimizer`` are unwrapped); any other optimizer is left alone
    (returns 0).

    Example:
        >>> # optimizer = accelerator.prepare(GroupedOptimizer(groups, factory, state_policy="offload"))
        >>> # reapply_state_policy(optimizer)  # idle groups' state back on the CPU
    """
    grouped = grouped_in(optimizer)
    return 0 if grouped is None else grouped.reapply_policy()
