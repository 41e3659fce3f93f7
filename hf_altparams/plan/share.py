"""What share of a model's parameters a schedule trains, and the warning when `always` groups dominate.

A block-wise schedule (:func:`~hf_altparams.plan.lisa`, :func:`~hf_altparams.plan.badam`,
:class:`~hf_altparams.plan.Alternating`) saves memory only if each phase trains a
small part of the model: gradients, optimizer state (and fp32 masters under
low-precision storage) exist for the trainable parameters only. Groups given in
a schedule's ``always=`` train in every phase, as do the ungrouped parameters of
``ParamGroups(..., ungrouped="trainable")``; they set a floor under every phase.
On a small model that floor can be most of it: ``lisa()`` keeps the embeddings
training, and on MiniLM (a 30k-token vocabulary, 6 layers) they are half of the
parameters.

:meth:`Schedule.trained_share(groups) <hf_altparams.plan.Schedule.trained_share>`
reports the share per phase, the largest, and the floor;
:meth:`Schedule.validate(groups) <hf_altparams.plan.Schedule.validate>`, which
every entry point runs before the first step, warns with
:class:`TrainShareWarning` when the floor is above :data:`ALWAYS_SHARE_LIMIT`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

from .groups import ParamGroups
from .phase import Phase

__all__ = [
    "ALWAYS_SHARE_LIMIT",
    "PhaseShare",
    "TrainShare",
    "TrainShareWarning",
    "train_share",
    "warn_if_always_dominates",
]

#: :meth:`Schedule.validate` warns when the parameters trained in every phase (the
#: schedule's ``always`` groups, and the ungrouped parameters under
#: ``ungrouped="trainable"``) are more than this share of the model: then no phase
#: can train less than a quarter of it, and a block-wise schedule keeps at most
#: three quarters of a full fine-tune's gradient and optimizer memory off the device.
ALWAYS_SHARE_LIMIT = 0.25
_UNGROUPED = "<ungrouped>"
_LISTED = 8  # phases listed by str(TrainShare)


class TrainShareWarning(UserWarning):
    """The groups a schedule trains in every phase hold most of the model (see :data:`ALWAYS_SHARE_LIMIT`).

    Silence it, once the figures are as intended, with
    ``warnings.filterwarnings("ignore", category=TrainShareWarning)``.
    """


@dataclass(frozen=True)
class PhaseShare:
    """One phase: its name, the groups it trains, and how many parameters that is."""

    phase: str
    trainable_groups: tuple[str, ...]
    params: int


@dataclass(frozen=True)
class TrainShare:
    """What share of the model's parameters a schedule trains; from :meth:`Schedule.trained_share`.

    Attributes:
        kind: the schedule's kind.
        total_params: parameters of the model (a tied parameter counts once).
        always: parameters per group trained in every phase: the schedule's
            ``always`` groups, and ``"<ungrouped>"`` for ungrouped parameters
            under ``ungrouped="trainable"``.
        phases: the distinct phases met over `positions` positions, in order.
        largest: the phase that trains the most (for random draws, the largest
            possible draw, met or not).
        positions: how many positions were scanned.
        exact: whether `largest` is certain: a known pattern scanned whole, or
            a random schedule's largest possible draw (False for a user
            function, whose phases are known only as far as scanned).

    Example:
        >>> from torch import nn
        >>> from hf_altparams.plan import Alternating, ParamGroups
        >>> net = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 1))
        >>> groups = ParamGroups(net, {"lo": "0.*", "hi": "1.*", "head": "2.*"})
        >>> share = Alternating(["lo", "hi"], always=["head"]).trained_share(groups)
        >>> share.largest_fraction, share.always_fraction
        (0.5238095238095238, 0.047619047619047616)
        >>> print(share)
        Alternating trains at most 52.4% of 231 params in a phase (lo+head); 4.8% in every phase (head 4.8%); per phase: lo+head 52.4%, hi+head 52.4%
    """

    kind: str
    total_params: int
    always: dict[str, int]
    phases: tuple[PhaseShare, ...]
    largest: PhaseShare
    positions: int
    exact: bool

    @property
    def always_params(self) -> int:
        """Parameters trained in every phase."""
        return sum(self.always.values())

    @property
    def always_fraction(self) -> float:
        """:attr:`always_params` over :attr:`total_params` (0 to 1)."""
        return self.always_params / self.total_params if self.total_params else 0.0

    @property
    def largest_fraction(self) -> float:
        """The largest phase's parameters over :attr:`total_params` (0 to 1)."""
        return self.largest.params / self.total_params if self.total_params else 0.0

    def fraction(self, params: int) -> float:
        """`params` over :attr:`total_params`."""
        return params / self.total_params if self.total_params else 0.0

    @property
    def warning(self) -> Optional[str]:
        """The :class:`TrainShareWarning` text if :attr:`always_fraction` is over :data:`ALWAYS_SHARE_LIMIT`, else None."""
        return _warning_text(self.kind, self.always, self.total_params)

    def headline(self) -> str:
        """One line: the largest phase's share and what trains in every phase.

        Example:
            >>> TrainShare("Alternating", 100, {"head": 5}, (), PhaseShare("a+head", ("a", "head"), 40), 2,
            ...            True).headline()
            'at most 40.0% of 100 params in a phase (a+head); 5.0% in every phase (head 5.0%)'
        """
        floor = ", ".join(f"{g} {self._pct(n)}" for g, n in self.always.items())
        return (
            f"at most {self._pct(self.largest.params)} of {self.total_params:,} params in a phase "
            f"({self.largest.phase}); {self._pct(self.always_params)} in every phase" + (f" ({floor})" if floor else "")
        )

    def _pct(self, params: int) -> str:
        return f"{100.0 * self.fraction(params):.1f}%"

    def __str__(self) -> str:
        listed = ", ".join(f"{p.phase} {self._pct(p.params)}" for p in self.phases[:_LISTED])
        more = len(self.phases) - _LISTED
        text = f"{self.kind} trains {self.headline()}; per phase: {listed}"
        text += f", ... ({more} more)" if more > 0 else ""
        if not self.exact:
            text += f" (the largest met in the first {self.positions:,} positions)"
        return text


def _always_params(always: Iterable[str], groups: ParamGroups) -> dict[str, int]:
    counts = {g: groups.numel(g) for g in sorted(always) if g in groups}
    if groups.ungrouped == "trainable":
        by_name = dict(groups.all_named_params())
        loose = sum(by_name[n].numel() for n in groups.ungrouped_names())
        if loose:
            counts[_UNGROUPED] = loose
    return counts


def _total(groups: ParamGroups) -> int:
    return sum(p.numel() for _, p in groups.all_named_params())


def train_share(
    kind: str,
    phases: Sequence[Phase],
    largest: Optional[Phase],
    always: Iterable[str],
    groups: ParamGroups,
    *,
    positions: int,
    exact: bool,
) -> TrainShare:
    """Count the parameters each phase trains (ungrouped ones under ``"trainable"`` in every phase)."""
    loose = _always_params((), groups).get(_UNGROUPED, 0)

    def share(phase: Phase) -> PhaseShare:
        names = tuple(sorted(g for g in phase.trainable if g in groups))
        return PhaseShare(phase.name, names, sum(groups.numel(g) for g in names) + loose)

    distinct = tuple(share(p) for p in dict.fromkeys(phases))
    candidates = [*distinct, *([share(largest)] if largest is not None else [])]
    return TrainShare(
        kind=kind,
        total_params=_total(groups),
        always=_always_params(always, groups),
        phases=distinct,
        largest=max(candidates, key=lambda p: p.params),
        positions=positions,
        exact=exact,
    )


def _warning_text(kind: str, counts: Mapping[str, int], total: int) -> Optional[str]:
    held = sum(counts.values())
    if not total or held / total <= ALWAYS_SHARE_LIMIT:
        return None
    named = [g for g in counts if g != _UNGROUPED]
    parts = ", ".join(f"{g!r} {100.0 * counts[g] / total:.1f}%" for g in named)
    what, fixes = [], []
    if named:
        what.append(f"the `always` groups of this {kind} ({parts})")
        fixes.append(
            "move the large ones (e.g. the embeddings) out of `always=`, into the groups that take "
            "turns, or leave them frozen"
        )
    if _UNGROUPED in counts:
        what.append(
            f"the {counts[_UNGROUPED]:,} ungrouped parameters (ungrouped='trainable', "
            f"{100.0 * counts[_UNGROUPED] / total:.1f}%)"
        )
        fixes.append("put the ungrouped parameters in groups or build the groups with ungrouped='frozen'")
    return (
        f"hf_altparams: {' and '.join(what)} train in every phase: {100.0 * held / total:.1f}% of the "
        f"model's {total:,} parameters (this warns above {100 * ALWAYS_SHARE_LIMIT:.0f}%, "
        "hf_altparams.plan.ALWAYS_SHARE_LIMIT). Every phase trains at least that share, so its gradients "
        "and optimizer state (and fp32 masters) stay near a full fine-tune's. To save memory, "
        f"{'; '.join(fixes)}. `schedule.trained_share(groups)` (or `python -m hf_altparams plan`) shows "
        "what each phase trains."
    )


def warn_if_always_dominates(kind: str, always: Iterable[str], groups: ParamGroups) -> None:
    """Warn (:class:`TrainShareWarning`) when what trains in every phase is over :data:`ALWAYS_SHARE_LIMIT`."""
    text = _warning_text(kind, _always_params(always, groups), _total(groups))
    if text is not None:
        warnings.warn(text, TrainShareWarning, stacklevel=3)
