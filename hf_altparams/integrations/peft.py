"""peft adapters as parameter groups, and peft's active adapters kept on the phase.

Two pieces, for a model wrapped by ``peft.get_peft_model`` (LoRA and the other
tuners, ``modules_to_save`` included):

* :func:`adapter_groups` builds :class:`~hf_altparams.plan.ParamGroups` with
  one group per adapter, named after it, holding all of that adapter's
  parameters (``lora_A`` / ``lora_B``, the embedding variants, DoRA magnitudes,
  its copies of ``modules_to_save``), plus optional groups of your own and one
  for the rest (the frozen base model), so a schedule trains one adapter at a
  time: ``PerTaskCycle(["base"], ["sst", "topic"], every=50, train_trunk=False)``.
* :class:`PeftAdapters` (made by :func:`follow_phases`) is a phase hook: at
  every switch, inside the switch transaction and right before the library sets
  ``requires_grad``, it makes peft's active adapters the adapters the new phase
  trains (``set_adapter``), so the forward runs the adapter being trained. A
  phase that trains parts of several adapters activates all of them.

Who owns what. peft's ``set_adapter`` does two things: it picks the adapters
the forward uses, and it turns ``requires_grad`` on for them (off for the
others). The first is the hook's job. The second belongs to the schedule: the
library sets ``requires_grad`` for the phase right after the hook (so it wins),
and DDP's reducer is built for exactly those parameters. A ``set_adapter``
made behind the schedule's back therefore leaves the forward on one adapter
and DDP on another; :class:`PeftAdapters` refuses the next training forward
(gradients enabled) whose active adapters differ from the phase's, naming both,
and without the hook the per-step check (:mod:`hf_altparams.engine.invariants`)
refuses the optimizer step that would apply gradients DDP never reduced.

Which parameters belong to which adapter is read from the model's structure
(:func:`adapter_parameters`): peft keeps each adapter's weights in containers
keyed by the adapter's name; every tuner layer (``BaseTunerLayer``: LoRA's
``lora_A`` / ``lora_B`` / ``lora_embedding_A`` / ``lora_embedding_B`` /
``lora_magnitude_vector``, and the like for the other tuners) and every
auxiliary wrapper (``AuxiliaryTrainingWrapper``: the per-adapter copies of
``modules_to_save``, trainable tokens) lists those containers in its
``adapter_layer_names``, so an adapter's parameters are found whatever its
tuner and whatever the names of the modules it wraps. peft is optional: this
module imports without it, and every entry point says how to install it when
it is missing.

Decisions:

* adapters that no phase trains stay inactive and frozen (they are saved
  unchanged); a phase that trains no adapter at all (a head-only phase)
  activates ``fallback`` (frozen), and is refused when no fallback was given;
* evaluating an adapter the phase does not train: ``with adapters.visiting("b"):``
  (no gradients, the adapter active and, under a schedule that keeps only some
  groups resident, its parameters back for the block; the phase's adapters and
  flags are put back on leaving), or ``set_adapter`` under ``torch.no_grad()``
  followed by :meth:`PeftAdapters.restore`;
* ``save_pretrained(folder, selected_adapters=[name])`` saves one adapter, as
  with peft alone.

Example:
    >>> # groups = adapter_groups(peft_model, base="base")
    >>> # accelerator = PhasedAccelerator(PerTaskCycle(["base"], ["sst", "topic"], every=20,
    >>> #                                              train_trunk=False), groups=groups)
    >>> # model, optimizer, loader = accelerator.prepare(peft_model, optimizer, loader)
    >>> # adapters = follow_phases(accelerator)    # right after prepare, before the first forward
    >>> # ... batch = next(data[accelerator.task]); loss = model(**batch).loss ...
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..engine.layouts import remember
from ..engine.strategies import strategy_for
from ..engine.switch import PhaseSwitcher
from ..errors import AltParamsError, Cause, PlanError
from ..plan.groups import ParamGroups, Spec, UngroupedPolicy
from ..plan.phase import Phase
from ..plan.schedules import Schedule

peft: Any
_IMPORT_ERROR: Optional[ImportError]
try:  # peft is an optional dependency (the `test` and `examples` extras install it)
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
except ImportError as _missing:  # pragma: no cover - exercised only without peft
    peft = None
    _IMPORT_ERROR = _missing
else:
    _IMPORT_ERROR = None

__all__ = [
    "PeftAdapters",
    "adapter_groups",
    "adapter_parameters",
    "as_peft_model",
    "check_adapter_names",
    "follow_phases",
]


def _require_peft() -> None:
    if _IMPORT_ERROR is not None:
        raise PlanError(
            "hf_altparams.integrations.peft needs the `peft` package (with `BaseTunerLayer` and "
            f"`AuxiliaryTrainingWrapper`; tested with peft 0.21): `pip install peft` ({_IMPORT_ERROR})"
        )


def as_peft_model(model: Any, *, argument: str = "model") -> Any:
    """``model`` itself (a wrapper such as DDP unwrapped) if it is a peft model with adapters; else a clear error.

    Example:
        >>> import torch
        >>> as_peft_model(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `model` must be a peft model ...
    """
    _require_peft()
    if isinstance(model, nn.Module):
        strategy = strategy_for(model)  # a wrapper a registered strategy drives (DDP): its module
        if strategy.capabilities.wraps_module:
            model = strategy.wrapped_module(model)
    if not isinstance(model, (peft.PeftModel, peft.PeftMixedModel)):
        raise PlanError(
            f"`{argument}` must be a peft model (a PeftModel from `peft.get_peft_model(model, config)` or "
            f"`PeftModel.from_pretrained(...)`, or a PeftMixedModel), got {type(model).__name__}; build the groups "
            "and the phase hook on the peft model itself, not on the model it wraps"
        )
    if not getattr(model, "peft_config", None):
        raise PlanError(f"`{argument}` ({type(model).__name__}) has no adapter: its `peft_config` is empty")
    return model


def _container(module: Any, attribute: str) -> Any:
    """``module.<attribute>``, following dots (``"token_adapter.trainable_tokens_delta"``); ``None`` if absent."""
    try:
        return functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        return None


def adapter_parameters(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each adapter of a peft model -> the canonical names of its parameters, in module order.

    Every adapter named in ``model.peft_config`` is a key, in that order; an
    adapter whose weights live in no tuner layer or auxiliary wrapper (prompt
    learning: prompt tuning, prefix tuning, ...) maps to an empty tuple.

    Example:
        >>> # adapter_parameters(peft_model)["a"][:2]
        >>> # ('base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.a.weight',
        >>> #  'base_model.model.bert.encoder.layer.0.attention.self.query.lora_B.a.weight')
    """
    peft_model = as_peft_model(model)
    owner: dict[int, str] = {}  # id(parameter) -> adapter
    adapters = list(peft_model.peft_config)
    for module in peft_model.modules():
        if not isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            continue
        for attribute in module.adapter_layer_names:
            container = _container(module, attribute)
            if isinstance(container, nn.ModuleDict):
                items = [(key, list(sub.parameters())) for key, sub in container.items()]
            elif isinstance(container, nn.ParameterDict):
                items = [(key, [param]) for key, param in container.items()]
            else:
                continue
            for key, params in items:
                if key in peft_model.peft_config:
                    for param in params:
                        owner.setdefault(id(param), key)
    found: dict[str, list[str]] = {name: [] for name in adapters}
    for name, param in peft_model.named_parameters():  # canonical names: each parameter object once
        adapter = owner.get(id(param))
        if adapter is not None:
            found[adapter].append(name)
    return {adapter: tuple(names) for adapter, names in found.items()}


def check_adapter_names(names: Any, known: Sequence[str], *, argument: str) -> tuple[str, ...]:
    """``names`` (one adapter name or a list of them) as a tuple, each a known adapter; else a clear error.

    Example:
        >>> check_adapter_names("a", ["a", "b"], argument="fallback")
        ('a',)
        >>> check_adapter_names(["c"], ["a", "b"], argument="adapters")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `adapters` names unknown adapter(s) ['c']; the model's adapters are ['a', 'b']
    """
    values = [names] if isinstance(names, str) else names
    if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, str) for v in values):
        raise PlanError(
            f"`{argument}` must be an adapter name or a non-empty list of them, got {names!r}; "
            f"the model's adapters are {list(known)}"
        )
    unknown = [v for v in values if v not in known]
    if unknown:
        raise PlanError(f"`{argument}` names unknown adapter(s) {unknown}; the model's adapters are {list(known)}")
    if len(set(values)) != len(values):
        raise PlanError(f"`{argument}` names an adapter twice: {list(values)}")
    return tuple(values)


def adapter_groups(
    model: nn.Module,
    adapters: Union[None, str, Sequence[str]] = None,
    *,
    extra: Optional[Mapping[str, Spec]] = None,
    base: Optional[str] = None,
    ungrouped: UngroupedPolicy = "frozen",
) -> ParamGroups:
    """One parameter group per peft adapter (named after it), plus ``extra`` groups and the ``base`` rest.

    Args:
        model: the peft model (``peft.get_peft_model(...)``; a DDP wrapper around it is unwrapped).
        adapters: the adapters that become groups (default: every adapter of the
            model, in the order of ``model.peft_config``). Others stay ungrouped.
        extra: more groups, name -> spec as in :class:`~hf_altparams.plan.ParamGroups`
            (e.g. a shared head outside peft). A name may not be an adapter's.
        base: name a group holding every parameter no other group claims (the
            frozen base model; a ``PerTaskCycle`` needs it as its trunk).
        ungrouped: what happens to the parameters in no group (when ``base`` is not given).

    Raises:
        PlanError: ``model`` is not a peft model; an unknown adapter name (the
            model's adapters are listed); an adapter without parameters in
            tuner layers (prompt learning); an ``extra`` group named like an
            adapter or claiming an adapter's parameter.

    Example:
        >>> import torch
        >>> from peft import LoraConfig, get_peft_model
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"]), adapter_name="sst")
        >>> model.add_adapter("topic", LoraConfig(r=2, target_modules=["0"]))
        >>> groups = adapter_groups(model, base="base")
        >>> groups.names, groups.param_names("topic")
        (('sst', 'topic', 'base'), ('base_model.model.0.lora_A.topic.weight', 'base_model.model.0.lora_B.topic.weight'))
    """
    peft_model = as_peft_model(model)
    owned = adapter_parameters(peft_model)
    chosen = tuple(owned) if adapters is None else check_adapter_names(adapters, list(owned), argument="adapters")
    empty = [a for a in chosen if not owned[a]]
    if empty:
        raise PlanError(
            f"adapter(s) {empty} have no parameters in peft tuner layers or `modules_to_save` wrappers "
            "(prompt-learning adapters such as prompt or prefix tuning are not supported); adapters with "
            f"parameters: {[a for a in owned if owned[a]]}"
        )
    specs: dict[str, Spec] = {a: ["re:" + re.escape(n) for n in owned[a]] for a in chosen}
    for name, spec in (extra or {}).items():
        if name in specs:
            raise PlanError(f"`extra` group {name!r} has the name of an adapter group; adapter groups: {list(specs)}")
        specs[name] = spec
    groups = ParamGroups(peft_model, specs, ungrouped=ungrouped)
    return groups if base is None else groups.with_rest(base)


class PeftAdapters:
    """A phase hook keeping peft's active adapters equal to the adapters the current phase trains.

    Args:
        model: the peft model the groups were built on.
        groups: the run's groups (by adapter from :func:`adapter_groups`, or by
            any pattern: an adapter counts as trained by a phase when the phase
            trains any of its parameters).
        fallback: the adapter(s) active, frozen, in a phase that trains no
            adapter (``None``: such a phase is refused, at :meth:`bind` when the
            schedule's pattern is known, else at its switch).

    Use :func:`follow_phases` to make one for a started run. Called with a
    :class:`~hf_altparams.plan.Phase` (the switcher does it, inside each switch
    and before it sets ``requires_grad``), it activates that phase's adapters.
    Until :meth:`close`, a forward pre-hook on ``model`` refuses a forward with
    gradients enabled while other adapters are active.

    Example:
        >>> # adapters = PeftAdapters(peft_model, groups)
        >>> # adapters.bind(switcher)       # before or after the first phase
        >>> # adapters.adapters_of(switcher.current)
        >>> # ('sst',)
    """

    def __init__(
        self, model: nn.Module, groups: ParamGroups, *, fallback: Union[None, str, Sequence[str]] = None
    ) -> None:
        self.model: Any = as_peft_model(model)
        self._order = list(self.model.peft_config)
        if not isinstance(groups, ParamGroups):
            raise PlanError(f"`groups` must be a ParamGroups, got {type(groups).__name__}")
        if groups.module is not self.model:
            raise PlanError(
                f"`groups` were built on a {type(groups.module).__name__}, not on this peft model; build them on "
                "the peft model itself (`adapter_groups(peft_model, ...)`)"
            )
        self.groups = groups
        self.fallback = None if fallback is None else check_adapter_names(fallback, self._order, argument="fallback")
        self._adapter_of = {n: a for a, names in adapter_parameters(self.model).items() for n in names}
        self._applied: Optional[Phase] = None  # the phase this hook last activated adapters for (rolled back too)
        self._adapters: dict[Phase, tuple[str, ...]] = {}  # per phase, derived once (bounded)
        self.switcher: Optional[PhaseSwitcher] = None
        self._guard: Optional[Any] = self.model.register_forward_pre_hook(self._check_forward)

    # ------------------------------------------------------------ the hook
    def adapters_of(self, phase: Phase) -> tuple[str, ...]:
        """The adapters ``phase`` trains (in the model's order), or ``fallback`` when it trains none."""
        cached = self._adapters.get(phase)
        if cached is None:
            cached = remember(self._adapters, phase, self._find_adapters(phase))
        return cached

    def _find_adapters(self, phase: Phase) -> tuple[str, ...]:
        names = self.groups.trainable_param_names(phase.trainable)
        trained = {self._adapter_of[n] for n in names if n in self._adapter_of}
        if trained:
            return tuple(a for a in self._order if a in trained)
        if self.fallback is not None:
            return self.fallback
        raise AltParamsError(
            f"phase {phase.name!r} trains no adapter (its groups {sorted(phase.trainable)} hold no parameter of "
            f"the adapters {self._order}), so there is no adapter for its forward to use; pass "
            "`fallback=` (the adapter(s) to keep active, frozen, in such a phase) to follow_phases/PeftAdapters"
        )

    def check_schedule(self, schedule: Schedule) -> None:
        """Refuse now a phase of ``schedule`` that trains no adapter (without ``fallback``), when its pattern is known.

        A schedule with a known pattern (``pattern_length()``: every built-in
        kind but the random and user-function ones) is checked over one pattern;
        the others are checked at each switch (the switch is then refused and
        rolled back on every rank).
        """
        length = schedule.pattern_length()
        if length is not None:
            for _, _, phase in schedule.segments(length):
                self.adapters_of(phase)

    @property
    def phase(self) -> Optional[Phase]:
        """The phase whose adapters are active (the followed switcher's, once a switch completed)."""
        if self.switcher is not None and self.switcher.current is not None:
            return self.switcher.current
        return self._applied

    @property
    def active(self) -> Optional[tuple[str, ...]]:
        """The adapters the current phase trains (``None`` before the first phase)."""
        phase = self.phase
        return None if phase is None else self.adapters_of(phase)

    def __call__(self, phase: Phase) -> None:
        """Activate the adapters ``phase`` trains (the switcher then sets ``requires_grad`` for the phase)."""
        self._activate(self.adapters_of(phase), phase)
        self._applied = phase

    def _activate(self, adapters: tuple[str, ...], phase: Optional[Phase]) -> None:
        try:
            if len(adapters) == 1:
                self.model.set_adapter(adapters[0])
            else:  # several active adapters: the tuner's own set_adapter takes a list
                self.model.base_model.set_adapter(list(adapters))
        except (ValueError, TypeError, KeyError) as exc:
            where = f" for phase {phase.name!r}" if phase is not None else ""
            raise AltParamsError(f"peft refused to activate adapter(s) {list(adapters)}{where}: {exc}") from exc

    # ------------------------------------------------------------ wiring
    def bind(self, switcher: PhaseSwitcher) -> PeftAdapters:
        """Follow ``switcher``'s phases from now on; if a phase is applied already, activate its adapters now.

        The schedule is checked first (:meth:`check_schedule`). The flags are then put back to the phase's (``set_adapter`` changed
        them); gradients are not touched. Call it on every rank (it is not a
        collective), before the first forward.
        """
        if not isinstance(switcher, PhaseSwitcher):
            raise AltParamsError(f"`switcher` must be a PhaseSwitcher, got {type(switcher).__name__}")
        if switcher.groups is not self.groups:
            raise AltParamsError("`switcher` switches other groups than these adapters'; pass the run's own groups")
        if self.switcher is not None:
            raise AltParamsError("these adapters already follow a switcher; make one PeftAdapters per run")
        self.check_schedule(switcher.schedule)
        if switcher.current is not None:
            self(switcher.current)
            self._apply_flags(switcher.current)
        switcher.add_phase_hook(self)
        self.switcher = switcher
        return self

    def close(self) -> None:
        """Stop following the phases: the forward check and the phase hook go (peft's state stays)."""
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        if self.switcher is not None:
            self.switcher.remove_phase_hook(self)
        self.switcher = None

    # ------------------------------------------------------------ evaluation
    def restore(self) -> None:
        """Put the current phase's adapters back active and its ``requires_grad`` back (after a ``set_adapter``).

        Gradients are left as they are. Nothing to do before the first phase.
        """
        phase = self.phase
        if phase is None:
            return
        self._activate(self.adapters_of(phase), phase)
        self._apply_flags(phase)

    @contextlib.contextmanager
    def visiting(self, adapters: Union[str, Sequence[str]]) -> Iterator[None]:
        """Run the ``with`` block on ``adapters`` (e.g. to evaluate one the phase does not train), without gradients.

        Inside: ``torch.no_grad()``, ``adapters`` active and, under a schedule
        that keeps only some groups resident, the groups holding them back on the
        device. On leaving, the phase's adapters, flags and residency come back.
        Not a collective: a rank may visit alone. Evaluate the unwrapped model
        (``accelerator.unwrap_model(model)``): a DDP forward may sync buffers.

        Example:
            >>> # with adapters.visiting("topic"):
            >>> #     logits = accelerator.unwrap_model(model)(**batch).logits
        """
        names = check_adapter_names(adapters, self._order, argument="adapters")
        holding = [
            g for g in self.groups.names if any(self._adapter_of.get(n) in names for n in self.groups.param_names(g))
        ]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.no_grad())
            if self.switcher is not None and self.switcher.current is not None and holding:
                stack.enter_context(self.switcher.visiting(holding))
            stack.callback(self.restore)
            self._activate(names, None)
            yield

    # ------------------------------------------------------------ checks
    def _apply_flags(self, phase: Phase) -> None:
        """``requires_grad`` as the phase has it (the switcher's rule: the phase's parameters, nothing else)."""
        wanted = self.groups.trainable_param_names(phase.trainable)
        for name, param in self.groups.all_named_params():
            flag = name in wanted
            if param.requires_grad != flag:
                param.requires_grad_(flag)

    def _check_forward(self, module: nn.Module, args: Any) -> None:
        phase = self.phase
        if phase is None or not torch.is_grad_enabled():
            return
        wanted = self.adapters_of(phase)
        current = list(self.model.active_adapters)
        if sorted(current) == sorted(wanted):
            return
        raise AltParamsError(
            f"peft's active adapter(s) {current} are not the adapter(s) phase {phase.name!r} trains "
            f"({list(wanted)}): `set_adapter(...)` was called behind the schedule's back (by the loop, an "
            "evaluation helper or a callback). This training forward was refused before it ran: it would have "
            "computed gradients DDP does not reduce for one adapter and none for the phase's. Let the schedule "
            "pick the adapter (remove the call); to evaluate another adapter use "
            f"`with adapters.visiting({(current or ['name'])[0]!r}): ...` (from hf_altparams.integrations.peft.follow_phases), or "
            "call `set_adapter` under `torch.no_grad()` and then `adapters.restore()`.",
            cause=Cause.REQUIRES_GRAD_BEHIND_SCHEDULE,
        )


def follow_phases(run: Any, *, fallback: Union[None, str, Sequence[str]] = None) -> PeftAdapters:
    """Make peft's active adapters follow a started run's phases; returns the :class:`PeftAdapters`.

    Args:
        run: a :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator`
            after ``prepare`` (or anything holding the run's ``switcher``), or a
            :class:`~hf_altparams.engine.PhaseSwitcher`. Its groups must be built
            on the peft model (:func:`adapter_groups`).
        fallback: the adapter(s) active, frozen, in a phase that trains none.

    Call it on every rank right after ``prepare`` and before the first forward:
    the first phase's adapters are activated at once, and every later switch
    activates its own.

    Example:
        >>> import torch
        >>> from peft import LoraConfig, get_peft_model
        >>> from hf_altparams.plan import Alternating
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        >>> model = get_peft_model(net, LoraConfig(r=2, target_modules=["0"]), adapter_name="sst")
        >>> model.add_adapter("topic", LoraConfig(r=2, target_modules=["0"]))
        >>> switcher = PhaseSwitcher(adapter_groups(model), Alternating(["sst", "topic"]))
        >>> adapters = follow_phases(switcher)   # with Accelerate: follow_phases(accelerator), after prepare
        >>> switcher.step_to(1).phase, model.active_adapters
        ('topic', ['topic'])
    """
    switcher = run if isinstance(run, PhaseSwitcher) else getattr(run, "switcher", None)
    if not isinstance(switcher, PhaseSwitcher):
        raise AltParamsError(
            f"follow_phases needs a started run: {type(run).__name__} has no switcher yet; call it after "
            "`accelerator.prepare(model, optimizer, ...)` (the switcher is built there), on every rank"
        )
    adapters = PeftAdapters(switcher.module, switcher.groups, fallback=fallback)
    try:
        return adapters.bind(switcher)
    except BaseException:
        adapters.close()  # its forward check goes with it
        raise
