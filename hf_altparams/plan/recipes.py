"""Named recipes over the schedules: LISA and BAdam (block-coordinate fine-tuning).

Both train a few blocks (layers) of a large model at a time. Combined with
:class:`~hf_altparams.engine.PrecisionOptimizer` (model stored in bf16, fp32
masters and optimizer state only for the blocks that train, ``master_policy``
and ``state_policy`` ``"drop"``) they give the memory these methods are used
for, under DDP, with only the active blocks' gradients all-reduced.

* :func:`lisa`: embeddings and head always train; ``k`` of the layers, drawn
  at random, train for ``every`` steps, then a new draw (Pan et al., 2024,
  "LISA: Layerwise Importance Sampling").
* :func:`badam`: one block at a time for ``steps_per_block`` steps, in order
  (``"ascending"`` or ``"descending"``) or in a fresh random order each sweep
  (``"random"``) (Luo et al., 2024, "BAdam: a memory efficient full parameter
  optimization method"). BAdam drops a block's Adam state when it leaves:
  use ``state_policy="drop"``.

The draws are seeded by the step alone: every rank and a resumed run agree.
"""

from __future__ import annotations

import random
from typing import Iterable, Literal, Sequence

from ..errors import PlanError
from .checks import check_int, name_list
from .phase import Phase
from .schedules import Alternating, FnSchedule, RandomBlocks, Schedule, with_idle_state

__all__ = ["badam", "lisa"]

#: The order in which :func:`badam` visits the blocks.
Order = Literal["ascending", "descending", "random"]
_ORDERS: tuple[Order, ...] = ("ascending", "descending", "random")


def _names(value: Sequence[str], argument: str) -> list[str]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value) or not value:
        raise PlanError(f"`{argument}` must be a non-empty list of group names, got {value!r}")
    return list(value)


def lisa(
    layers: Sequence[str], *, k: int = 2, every: int = 50, always: Iterable[str] = ("emb", "head"), seed: int = 0
) -> Schedule:
    """LISA: ``always`` groups train every step; ``k`` random ``layers`` re-drawn every ``every`` steps.

    What it saves depends on the model: the ``always`` groups train in every
    phase, so each phase trains at least their share of the parameters. LISA's
    paper keeps the embeddings and head training; on a 7B decoder they are a few
    percent of the model, but on a small one they can be most of it (MiniLM's
    embeddings are 52 % of its parameters: LISA there trains 69 % of the model
    per phase and needs about the memory of a full fine-tune). Before the run,
    ``schedule.trained_share(groups)`` gives the share per phase and the largest;
    ``schedule.validate(groups)``, which every entry point runs, warns
    (:class:`~hf_altparams.plan.TrainShareWarning`) when what trains in every
    phase is over :data:`~hf_altparams.plan.ALWAYS_SHARE_LIMIT` (25 %) of the
    parameters. Then leave the embeddings out of ``always`` (``always=["head"]``),
    or count them among the ``layers`` drawn.

    Args:
        layers: the layer groups to sample from (e.g. ``groups.names`` minus
            the embeddings and head of ``ParamGroups.from_layers``).
        k: layers trained at a time (LISA's gamma; the paper uses 2 to 8).
        every: steps between draws (LISA's sampling period K).
        always: groups trained in every phase (embeddings and head in LISA).
        seed: draws are ``random.Random(f"{seed}:{block}")``: equal on every rank.

    Example:
        >>> s = lisa(["l0", "l1", "l2", "l3"], k=1, every=2, always=["emb", "head"])
        >>> phase = s.phase_at(0); sorted(phase.trainable - {"emb", "head"}) == sorted(s.phase_at(1).trainable - {"emb", "head"})
        True
        >>> len(phase.trainable)
        3
        >>> from torch import nn
        >>> from hf_altparams.plan import ParamGroups
        >>> net = nn.ModuleDict({"emb": nn.Embedding(1000, 16), "l0": nn.Linear(16, 16), "l1": nn.Linear(16, 16),
        ...                      "head": nn.Linear(16, 2)})
        >>> groups = ParamGroups(net, {n: f"{n}.*" for n in net})
        >>> print(lisa(["l0", "l1"], k=1, always=["head"]).trained_share(groups))
        RandomBlocks trains at most 1.8% of 16,578 params in a phase (head+l0); 0.2% in every phase (head 0.2%); per phase: head+l0 1.8%, head+l1 1.8%
    """
    return with_idle_state(RandomBlocks(_names(layers, "layers"), k=k, every=every, seed=seed, always=always), "drop")


def badam(
    blocks: Sequence[str],
    *,
    steps_per_block: int = 50,
    order: Order = "ascending",
    always: Iterable[str] = (),
    seed: int = 0,
) -> Schedule:
    """BAdam: one block trains at a time for ``steps_per_block`` steps; blocks in ``order``.

    Args:
        blocks: the block groups, in model order (e.g. one group per layer).
        steps_per_block: optimizer steps per block (BAdam's K).
        order: ``"ascending"``, ``"descending"``, or ``"random"`` (a new
            permutation of all blocks every sweep, so each sweep trains each
            block once).
        always: groups trained with every block (none in BAdam itself), e.g.
            ``["head"]``; not among `blocks`. Phases are named ``block+always``.
            They bound what a phase can save, as for :func:`lisa`.
        seed: seeds the ``"random"`` permutations.

    Returns:
        ``"ascending"`` / ``"descending"``: an :class:`~hf_altparams.plan.Alternating`
        over the blocks with ``always=``; ``"random"``: a
        :class:`~hf_altparams.plan.FnSchedule` named
        ``badam-random-{seed}-{steps_per_block}-{len(blocks)}`` with ``always=``.
        Both record `always` in their ``state_dict()``, so a resume with other
        `always` groups is refused.

    Example:
        >>> s = badam(["l0", "l1", "l2"], steps_per_block=2, order="descending")
        >>> [s.phase_at(i).name for i in range(6)]
        ['l2', 'l2', 'l1', 'l1', 'l0', 'l0']
        >>> r = badam(["l0", "l1", "l2"], steps_per_block=1, order="random")
        >>> sorted(r.phase_at(i).name for i in range(3))
        ['l0', 'l1', 'l2']
        >>> [badam(["l0", "l1"], steps_per_block=1, always=["head"]).phase_at(i).name for i in range(3)]
        ['l0+head', 'l1+head', 'l0+head']
    """
    names = _names(blocks, "blocks")
    if order not in _ORDERS:
        raise PlanError(f"`order` is {order!r}; accepted: {list(_ORDERS)}")
    check_int(steps_per_block, "steps_per_block", minimum=1)
    extra = tuple(sorted(name_list(always, "always", one_str=True)))
    overlap = sorted(set(extra) & set(names))
    if overlap:
        rest = [n for n in names if n not in overlap]
        fix = (
            f"badam({rest!r}, always={list(extra)!r})"
            if rest
            else "badam(<the blocks>, always=...) with at least one block that is not in `always`"
        )
        raise PlanError(
            f"`always` groups {overlap} are also in `blocks` {names!r}; a group is one or the "
            f"other (an `always` group trains with every block): {fix}"
        )
    if order != "random":
        ordered = names if order == "ascending" else names[::-1]
        return with_idle_state(Alternating(ordered, every=steps_per_block, always=extra), "drop")
    check_int(seed, "seed")

    def sweep(step: int, epoch: int) -> Phase:
        block = step // steps_per_block
        permutation = random.Random(f"{seed}:{block // len(names)}").sample(names, len(names))
        chosen = permutation[block % len(names)]
        return Phase([chosen, *extra], label="+".join([chosen, *extra]))

    return with_idle_state(
        FnSchedule(sweep, groups=names, always=extra, name=f"badam-random-{seed}-{steps_per_block}-{len(names)}"),
        "drop",
    )
