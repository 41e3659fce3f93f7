"""One optimizer per parameter group, behind a single ``torch.optim.Optimizer``.

:class:`GroupedOptimizer` is what Accelerate, the Trainer and LR schedulers see:
its ``param_groups`` are the inner optimizers' own dicts, ``step()`` steps only
the active groups, and ``state_dict()`` is keyed by group and parameter *name*
so it loads into a rebuilt model. Idle groups' optimizer state follows a
:class:`StatePolicy`: ``keep`` it, ``offload`` it to CPU (pinned when the device
is CUDA), or ``drop`` it (torch optimizers re-initialise empty state at the next
step). The policy is one typed value shared with the planner and the memory
report (:mod:`hf_altparams.engine.memory.model`); users pass its strings.

:class:`GroupedLRScheduler` and :func:`reapply_state_policy`, which act on a
built :class:`GroupedOptimizer` from outside, live in :mod:`._scheduler`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from ...errors import PlanError
from ...plan.groups import ParamGroups
from ..memory.model import StatePolicy, StatePolicyLike
from ..memory._transfer import HostCopies, Prefetcher, param_group_map, state_target_device, to_device, to_host
from ..memory._transfer import nbytes as _nbytes
from ._factories import as_factories, check_groups_argument

__all__ = ["GroupedOptimizer", "OptimizerFactory", "StatePolicy"]

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
STATE_DICT_FORMAT = "hf_altparams.GroupedOptimizer/1"


def _per_group(value: Any, names: tuple[str, ...], argument: str) -> dict[str, Any]:
    """``value`` per group name: a mapping checked to name each group once, or one value for all."""
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
        return dict(value)
    return {name: value for name in names}


def policies_per_group(value: Any, names: tuple[str, ...], argument: str) -> dict[str, StatePolicy]:
    """A :class:`StatePolicy` per group from one value or a mapping (``argument`` names it in errors)."""
    return {name: StatePolicy.parse(policy, f"`{argument}` for group {name!r}")
            for name, policy in _per_group(value, names, argument).items()}


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
            ``"drop"``; one value or one per group.
        active: the groups that step at first (default: all). The phase switcher
            sets this at every switch.

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
        state_policy: Union[StatePolicyLike, Mapping[str, StatePolicyLike]] = "keep",
        active: Optional[Iterable[str]] = None,
    ) -> None:
        self.groups = check_groups_argument(groups)
        factories = as_factories(groups, optimizers)
        self.policies: dict[str, StatePolicy] = policies_per_group(state_policy, groups.names, "state_policy")
        self.inner: dict[str, Optimizer] = {}
        for name in groups.names:
            opt = factories[name](groups.params(name))
            if not isinstance(opt, Optimizer):
                raise PlanError(
                    f"`optimizers` factory for group {name!r} returned {type(opt).__name__}; "
                    "it must return a torch.optim.Optimizer built on the parameters it is given"
                )
            self.inner[name] = opt
        self._offloaded: dict[str, list[tuple[nn.Parameter, str, torch.device]]] = {}
        self._host_copies = HostCopies()  # device -> host copies not yet waited for
        self._prefetcher = Prefetcher()  # host -> device copies started before a switch
        all_params = [p for name in groups.names for p in groups.params(name)]
        super().__init__(all_params, defaults={})
        # The composite's param_groups ARE the inner optimizers' dicts.
        self.param_groups = [g for opt in self.inner.values() for g in opt.param_groups]
        self.active: frozenset[str] = frozenset(groups.names)
        #: The groups that just stepped, when a switch right after the step has already
        #: changed ``active`` (PhasedAccelerator sets it; the next ``step()`` clears it):
        #: what a GroupedLRScheduler then advances instead of ``active``.
        self.stepped: Optional[frozenset[str]] = None
        self.set_active(groups.names if active is None else active)

    # `Optimizer.__init__` assigns `self.state`; the composite's state is the inner ones'.
    @property  # type: ignore[override]
    def state(self) -> dict[nn.Parameter, dict[str, Any]]:
        merged: dict[nn.Parameter, dict[str, Any]] = {}
        for opt in self.inner.values():
            merged.update(opt.state)
        return merged

    @state.setter
    def state(self, value: Any) -> None:
        if value:
            raise AttributeError("GroupedOptimizer.state is the union of the inner optimizers' state")

    def __repr__(self) -> str:
        parts = [f"  {n} ({'active' if n in self.active else 'idle'}, {self.policies[n]}): "
                 f"{type(o).__name__}" for n, o in self.inner.items()]
        return "GroupedOptimizer(\n" + "\n".join(parts) + "\n)"

    # ----------------------------------------------------------------- phases
    def set_active(self, names: Iterable[str]) -> None:
        """Make ``names`` the groups that step; apply the state policy to the others.

        Groups becoming idle get their policy applied (offload/drop); groups
        becoming active get offloaded state back on their parameters' device.
        Names that are not groups of this optimizer are ignored (a phase may
        name groups that a single optimizer does not cover).
        """
        new_active = frozenset(n for n in names if n in self.inner)
        for name in self.groups.names:  # out first: the device never holds both groups' state
            if name not in new_active:
                self._apply_idle_policy(name)
        for name in self.groups.names:
            if name in new_active:
                self._restore(name)
        self.active = new_active

    def _state_tensors(self, name: str) -> Iterable[tuple[nn.Parameter, str, torch.Tensor]]:
        opt = self.inner[name]
        for param in self.groups.params(name):
            for key, value in opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor):
                    yield param, key, value

    def _apply_idle_policy(self, name: str) -> None:
        policy = self.policies[name]
        if policy is StatePolicy.DROP:
            opt = self.inner[name]
            for param in self.groups.params(name):
                opt.state.pop(param, None)
            self._offloaded.pop(name, None)
        elif policy is StatePolicy.OFFLOAD:
            self.offload(name)

    def offload(self, name: str, non_blocking: bool = True) -> int:
        """Move group ``name``'s optimizer state to CPU; return the bytes moved.

        From CUDA the copies go into pinned memory without blocking the host:
        the device memory is reusable at once in stream order, so the copy never
        raises the peak. The host copies are waited for only before the CPU
        reads them (:meth:`state_dict`, :meth:`synchronize`).
        """
        moved = self._offloaded.setdefault(name, [])
        recorded = {(id(p), k) for p, k, _ in moved}
        opt = self.inner[name]
        nbytes = 0
        for param, key, tensor in list(self._state_tensors(name)):
            if tensor.device.type == "cpu":
                continue
            opt.state[param][key] = to_host(tensor, torch.device("cpu")) if non_blocking \
                else tensor.to("cpu")
            self._host_copies.note(tensor.device)
            if (id(param), key) not in recorded:
                moved.append((param, key, tensor.device))
            nbytes += _nbytes(tensor)
        self._host_copies.record()
        return nbytes

    def _restore(self, name: str, non_blocking: bool = True) -> int:
        """Bring group ``name``'s state to where torch keeps it for the parameters' device.

        The rule is ``Optimizer.load_state_dict``'s (``step`` stays on the CPU
        unless the group is capturable or fused), so state that came back from
        a checkpoint, or whose parameters moved, lands right too. A copy started
        by :meth:`prefetch` is used when it is still current.
        """
        self._offloaded.pop(name, None)
        opt = self.inner[name]
        nbytes = 0
        for param, key, tensor, target in self._misplaced_state(name):
            ready = self._prefetcher.take((id(param), key), tensor)
            opt.state[param][key] = ready if ready is not None else (
                to_device(tensor, target) if non_blocking else tensor.to(target))
            nbytes += _nbytes(tensor)
        return nbytes

    def _misplaced_state(self, name: str) -> list[tuple[nn.Parameter, str, torch.Tensor, torch.device]]:
        """Group ``name``'s state tensors not where torch keeps them for their parameter."""
        groups_of: Optional[dict[int, Any]] = None
        out = []
        for param, key, tensor in list(self._state_tensors(name)):
            # The target is the parameter's device or "stays": state on that device is never
            # misplaced, so the (rarer) exact rule runs only for state elsewhere.
            if tensor.device == param.device:
                continue
            if groups_of is None:
                groups_of = param_group_map(self.inner[name].param_groups)
            target = state_target_device(param, key, groups_of.get(id(param)))
            if target is not None and tensor.device != target:
                out.append((param, key, tensor, target))
        return out

    def prefetch(self, name: str, max_bytes: Optional[int] = None) -> int:
        """Start copying idle group ``name``'s offloaded state back, on a CUDA side stream.

        The copy overlaps whatever runs until the group becomes active again,
        when :meth:`set_active` uses it; meanwhile it occupies device memory
        (that is the trade-off; ``PhaseSwitcher(prefetch=...)`` decides when).
        Returns the bytes started: 0 off CUDA or when nothing is offloaded.
        """
        started = 0
        for param, key, tensor, target in self._misplaced_state(name):
            if max_bytes is not None and started + _nbytes(tensor) > max_bytes:
                break
            started += self._prefetcher.start((id(param), key), tensor, target)
        return started

    @property
    def prefetched_bytes(self) -> int:
        """Device bytes of prefetched state not yet used."""
        return self._prefetcher.bytes

    def synchronize(self) -> None:
        """Wait for pending device -> host copies of offloaded state (before reading it on the CPU)."""
        self._host_copies.wait()

    def state_bytes(self, name: str) -> dict[str, int]:
        """Bytes of group ``name``'s optimizer state, by device type."""
        out: dict[str, int] = {}
        for _, _, tensor in self._state_tensors(name):
            key = tensor.device.type
            out[key] = out.get(key, 0) + _nbytes(tensor)
        return out

    # -------------------------------------------------------------- optimizer
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:  # type: ignore[override]
        """Step the active groups' optimizers (each skips parameters whose grad is None)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for name in self.groups.names:
            if name in self.active:
                self.inner[name].step()
        self.stepped = None
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
                    {**g, "params": [index_to_name[i] for i in g["params"]]}
                    for g in inner["param_groups"]
                ],
            }
        return {"format": STATE_DICT_FORMAT, "active": sorted(self.active),
                "policies": {n: p.value for n, p in self.policies.items()}, "groups": groups_out}

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
                    f"GroupedOptimizer.load_state_dict: group {name!r} has state for unknown "
                    f"parameters {unknown[:5]}"
                )
            opt.load_state_dict({
                "state": {name_to_index[n]: s for n, s in entry["state"].items()},
                "param_groups": [
                    {**g, "params": [name_to_index[n] for n in g["params"]]}
                    for g in entry["param_groups"]
                ],
            })
        # torch's load_state_dict replaces each inner param_group dict with a new one;
        # re-point the composite at the live dicts, or LR schedulers (and GradScaler)
        # acting on `self.param_groups` would edit stale copies the inner optimizers ignore.
        self.param_groups = [g for opt in self.inner.values() for g in opt.param_groups]
        self._offloaded.clear()
        self._prefetcher.cancel()
        self.set_active(self.active)

