"""What a strategy is: the one object that knows how a kind of wrapper trains across ranks.

A *strategy* (one process, DDP, FSDP2; DeepSpeed ZeRO next) is one registered
object (:mod:`hf_altparams.engine.strategies` lists them) that

* **declares what it supports** (:class:`Capabilities`): whether a switch
  rebuilds its gradient sync, whether it shards parameters or owns the
  optimizer's state, whether per-task residency, the frozen-prefix cache, kept
  reducers and comm counting work with it, and where its step boundary is.
  The refusals (:mod:`hf_altparams.integrations.refusals`) and the
  integrations read these flags instead of asking what class a wrapper is;
* **recognises the wrapper it drives** (:meth:`Strategy.recognises`) and
  names the module inside it (:meth:`Strategy.wrapped_module`);
* **applies a phase** through its per-wrapper runtime object, a
  :class:`~hf_altparams.engine.backend.Backend` (:meth:`Strategy.backend`),
  after an optional hook on the optimizer *before* the wrapper is built
  (:meth:`Strategy.before_wrap`) and one after it is attached
  (:meth:`Strategy.attached`);
* **counts what it communicates** (:meth:`Strategy.count_comm`; the backend
  reads the trainable bytes it communicates per step);
* **decides who owns the optimizer state** (:meth:`Strategy.state_owner`):
  the library's own :class:`~hf_altparams.engine.optim.StateOwner` for the
  optimizers it can see, or the strategy's own where the wrapper keeps the
  state itself (DeepSpeed ZeRO);
* **prices itself for the planner** (:class:`Pricing`): what a rank holds per
  category (parameters, gradients, optimizer state, fp32 masters: replicated
  or sharded over the ranks), whether it holds gradient buckets, which
  collective carries the gradients, which parameters it all-gathers per step
  (:class:`Gather`), and whether it keeps fp32 masters of fp32 weights.

Example:
    >>> caps = Capabilities(synchronises_gradients=True, rebuckets_at_switch=True)
    >>> caps.step_boundary.value, Pricing().collective.value
    ('optimizer.step', 'all-reduce')
    >>> Collective.REDUCE_SCATTER.sent_per_rank(1000, world_size=4)
    750
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from torch import nn
from torch.optim import Optimizer

from ...errors import PlanError
from ...plan.groups import ParamGroups
from ..backend import Backend
from ..comm import CommCounter
from ..optim import StateOwner, library_state_owner

__all__ = ["Capabilities", "Collective", "Gather", "Placement", "Pricing", "StepBoundary", "Strategy"]


class StepBoundary(str, Enum):
    """Where a strategy's optimizer step happens, so where the phase switch that follows it runs.

    * ``optimizer.step``: the sync-boundary ``optimizer.step()`` applies the
      update; the switch runs right after it (one process, DDP, FSDP2).
    * ``backward``: the wrapper applies the update itself inside the
      sync-boundary backward (DeepSpeed's engine under Accelerate, whose
      prepared optimizer's ``step()`` does nothing); the switch runs at the
      end of that backward.
    """

    OPTIMIZER_STEP = "optimizer.step"
    BACKWARD = "backward"


class Placement(str, Enum):
    """How a category of bytes is spread over the ranks: every rank holds all of it, or 1/world of it."""

    REPLICATED = "replicated"
    SHARDED = "sharded"


class Collective(str, Enum):
    """The collective that carries a step's gradients between the ranks (``none``: one process)."""

    NONE = "none"
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"

    @property
    def verb(self) -> str:
        """How messages say it: ``"all-reduced"``, ``"reduce-scattered"`` (``"synchronised"`` for none)."""
        return {"all-reduce": "all-reduced", "reduce-scatter": "reduce-scattered"}.get(self.value, "synchronised")

    def sent_per_rank(self, fed_bytes: int, world_size: int) -> int:
        """Bytes one rank sends for ``fed_bytes`` fed to the collective: a ring all-reduce ``2 (N-1)/N``,
        a reduce-scatter ``(N-1)/N``, nothing without one."""
        if self is Collective.NONE:
            return 0
        share = world_size - 1 if self is Collective.REDUCE_SCATTER else 2 * (world_size - 1)
        return share * fed_bytes // world_size


class Gather(str, Enum):
    """Which parameters a strategy all-gathers every step, besides the collective that carries the gradients.

    * ``none``: none (one process, DDP; FSDP2's per-unit gathers are priced
      as a transient, ``Pricing.unit_transient``).
    * ``updated``: after the optimizer step, the trainable parameters: each
      rank stepped its partition of them, and every rank gathers the updated
      whole (DeepSpeed ZeRO-1/2).
    * ``every``: every parameter, trainable or not, for the forward: a rank
      holds a partition of each weight between uses (DeepSpeed ZeRO-3).

    Example:
        >>> Gather.UPDATED.gathered_bytes(trainable=40, every=100), Gather.EVERY.gathered_bytes(40, 100)
        (40, 100)
    """

    NONE = "none"
    UPDATED = "updated"
    EVERY = "every"

    def gathered_bytes(self, trainable: int, every: int) -> int:
        """The bytes gathered per step (the whole tensors), given the trainable and all resident parameters' bytes."""
        return {"none": 0, "updated": trainable, "every": every}[self.value]


@dataclass(frozen=True)
class Capabilities:
    """What a strategy supports: the flags refusals and integrations read instead of class checks.

    Attributes:
        wraps_module: the wrapper is another object around the grouped module
            (DDP, DeepSpeed's engine); ``False``: the module itself trains (one
            process, or FSDP2, which shards it in place).
        wrapper_per_model: several models trained by one schedule may each come
            with their own wrapper (``ParamGroups.of_models``).
        synchronises_gradients: the wrapper synchronises gradients across ranks.
        rebuckets_at_switch: a switch rebuilds the wrapper's gradient-sync set
            (DDP's reducer): a gradient outside the phase is never synchronised,
            and a trainable parameter without one stalls its bucket.
        rebinds_parameters: wrapping replaces the parameter objects (FSDP2's
            ``fully_shard``): the groups are rebound to the new ones after the
            wrapper is built, and the first phase is applied then.
        shards_parameters: each rank holds a shard of the parameters.
        owns_optimizer_state: the wrapper keeps the optimizer state itself
            (DeepSpeed ZeRO's partitions): :meth:`Strategy.state_owner` provides
            the object that moves it.
        per_task_residency: non-resident groups may live off the device.
        frozen_prefix: the frozen-prefix cache is verified with it.
        kept_reducers: idle phases' gradient-sync state can be kept (``keep_reducers``).
        counts_comm: :meth:`Strategy.count_comm` counts the bytes it communicates.
        step_boundary: where the optimizer step, and the switch after it, happen.
        builds_with_every_group: the wrapper must be built with every parameter
            the schedule trains trainable (DeepSpeed ZeRO leaves a parameter
            frozen at ``initialize`` out of its partitions for good); the
            integrations turn them on while it is built and the phase's flags
            back on after (the strategy's :meth:`Strategy.attached` follows them).
        trains: the library trains with it; ``False``: known to the planner
            only (priced), refused by :mod:`hf_altparams.integrations.refusals`
            with its measured reason, and left out of "drives ..." in messages.
    """

    wraps_module: bool = False
    wrapper_per_model: bool = False
    synchronises_gradients: bool = False
    rebuckets_at_switch: bool = False
    rebinds_parameters: bool = False
    shards_parameters: bool = False
    owns_optimizer_state: bool = False
    per_task_residency: bool = True
    frozen_prefix: bool = True
    kept_reducers: bool = False
    counts_comm: bool = False
    step_boundary: StepBoundary = StepBoundary.OPTIMIZER_STEP
    builds_with_every_group: bool = False
    trains: bool = True


@dataclass(frozen=True)
class Pricing:
    """What one rank holds and communicates in a phase, for the planner (:func:`~hf_altparams.planner.plan_cost`).

    Attributes:
        parameters, gradients, optimizer_state, masters: each category's
            :class:`Placement`; a sharded one is ``ceil(rows / world_size)`` rows
            of each parameter per rank (dim 0, padded, as ``fully_shard`` and
            ZeRO's flat partitions split it). ZeRO-1 shards the optimizer state
            and masters, ZeRO-2 the gradients too, ZeRO-3 the parameters too.
        buckets: the rank holds gradient buckets beside the gradients (DDP).
        collective: what carries the gradients; what a rank feeds it per step is
            the trainable gradients (padded, unsharded, where gradients are sharded).
        compare_with: the strategy whose device bytes the plan shows beside this
            one's (FSDP2: ``"ddp"``), or ``None``.
        unit_transient: one wrapping unit's parameters are unsharded during its
            forward and backward (FSDP2): the plan names the largest.
        gathers: which parameters are all-gathered every step besides the
            gradients' collective (:class:`Gather`; DeepSpeed ZeRO).
        fp32_masters: the wrapper keeps an fp32 copy (master) of every parameter
            its optimizer was given, made when the wrapper is built, even of a
            parameter stored in fp32 (DeepSpeed's fp32 partitions); placed as
            ``masters`` says, kept, offloaded or dropped with the optimizer state.
        reduces_per_micro_batch: under gradient accumulation the gradients go
            through the collective at every micro-batch, not only at the sync
            boundary (DeepSpeed ZeRO-2 reduces each micro-batch's gradients into
            their partitions; DDP and FSDP2 under Accelerate's ``accumulate``
            communicate at the boundary only).
    """

    parameters: Placement = Placement.REPLICATED
    gradients: Placement = Placement.REPLICATED
    optimizer_state: Placement = Placement.REPLICATED
    masters: Placement = Placement.REPLICATED
    buckets: bool = False
    collective: Collective = Collective.ALL_REDUCE
    compare_with: Optional[str] = None
    unit_transient: bool = False
    gathers: Gather = Gather.NONE
    fp32_masters: bool = False
    reduces_per_micro_batch: bool = False

    @property
    def sharded(self) -> bool:
        """Whether any category is sharded over the ranks."""
        return Placement.SHARDED in (self.parameters, self.gradients, self.optimizer_state, self.masters)


class Strategy(ABC):
    """One way of training the grouped model across ranks; one registered instance each.

    Subclasses set :attr:`name`, :attr:`label`, :attr:`capabilities` and
    :attr:`pricing`, and implement :meth:`recognises` and :meth:`backend`;
    the other methods have the defaults of a strategy with no wrapper-specific
    needs. Every method may be called on every rank; :meth:`backend` and the
    backend's methods run inside the switch transaction.

    Example:
        >>> class Plain(Strategy):
        ...     name, label = "plain", "a plain module"
        ...     def recognises(self, model): return False
        ...     def backend(self, model): raise NotImplementedError
        >>> Plain().capabilities.synchronises_gradients, Plain().pricing.collective.value
        (False, 'all-reduce')
    """

    #: The name the registry, ``plan_cost(backend=)`` and ``--strategy`` know it by.
    name: str = ""
    #: Other names accepted for it (the old spellings).
    aliases: tuple[str, ...] = ()
    #: How messages and tables name it ("DDP", "FSDP2", ...).
    label: str = ""
    capabilities: Capabilities = Capabilities()
    pricing: Pricing = Pricing()

    def __repr__(self) -> str:
        return f"<strategy {self.name!r} ({self.label})>"

    @abstractmethod
    def recognises(self, model: nn.Module) -> bool:
        """Whether ``model`` is a wrapper this strategy drives (checked in registry order)."""

    def wrapped_module(self, wrapper: nn.Module) -> nn.Module:
        """The module ``wrapper`` trains (the grouped module, or one model of several); itself by default."""
        return wrapper

    @abstractmethod
    def backend(self, wrapper: nn.Module) -> Backend:
        """The per-wrapper runtime object the switch transaction drives (checks the wrapper is supported)."""

    def before_wrap(self, groups: ParamGroups, optimizer: Optional[Optimizer]) -> None:
        """Called by the run assembly after the first phase is known and BEFORE the wrapper is built.

        What the wrapper's constructor fixes must be right by then: DDP reads
        ``requires_grad`` (the assembly has applied the first phase), a
        strategy that partitions the optimizer at construction may split its
        param groups per library group here. Nothing by default.
        """

    def attached(self, wrapper: nn.Module, optimizer: Optional[Optimizer]) -> None:
        """Called once the switcher has attached ``wrapper``, with the run's optimizer (``None`` if none yet)."""

    def count_comm(self, wrapper: nn.Module, counter: Optional[CommCounter] = None) -> CommCounter:
        """Count the gradient bytes ``wrapper`` communicates per step into ``counter`` (a new one by default).

        Raises:
            PlanError: the strategy cannot count (``capabilities.counts_comm`` is false).
        """
        raise PlanError(
            f"`count_comm=True`: {self.label} has no comm counter (it communicates no gradients, or "
            "counting is not implemented for it); leave `count_comm` out"
        )

    def state_owner(self, optimizer: Optional[Optimizer], groups: ParamGroups) -> Optional[StateOwner]:
        """Who decides where ``optimizer``'s state (and fp32 masters) of idle groups lives.

        By default the library (:func:`~hf_altparams.engine.optim.library_state_owner`):
        a :class:`~hf_altparams.engine.GroupedOptimizer` decides per group, a
        plain torch optimizer follows the run's policy, anything else nothing.
        A strategy whose wrapper owns the state (``capabilities.owns_optimizer_state``)
        returns its own implementation.
        """
        return library_state_owner(optimizer, groups)
