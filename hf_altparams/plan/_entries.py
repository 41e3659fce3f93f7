"""The entries of :class:`~hf_altparams.plan.Alternating` and the tasks of
:class:`~hf_altparams.plan.PerTaskCycle`: parsing, the one-entry-per-group rule, and
refusals that spell out the call that works.

A group may appear in one entry only. A group meant to train in every phase
("the head always trains") is given once in ``always=``; a refusal of the form
``Alternating({("lo", "head"): 5, ("hi", "head"): 5})`` says exactly that, with
the rewritten call.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import PlanError
from ._checks import _name_list

__all__ = ["alternating_call", "alternating_hint", "check_always_apart", "check_unique_entries", "entry"]


def entry(value: Any, argument: str) -> tuple[str, ...]:
    """One alternating entry or task: a group name or a non-empty tuple/list of them."""
    if not isinstance(value, (str, tuple, list)):
        raise PlanError(f"`{argument}` must be a group name or a tuple of group names, got {value!r}")
    names = _name_list(value, argument, one_str=True)
    if not names:
        raise PlanError(f"`{argument}` must name at least one group, got {value!r}")
    return names


def alternating_call(entries: Sequence[tuple[str, ...]], durations: Sequence[int], *, as_mapping: bool,
                     every: int, always: Sequence[str]) -> str:
    """The source text of an ``Alternating(...)`` call with these entries (for error messages).

    Example:
        >>> alternating_call([("lo",), ("hi", "x")], [5, 5], as_mapping=True, every=1, always=["head"])
        "Alternating({'lo': 5, ('hi', 'x'): 5}, always=['head'])"
        >>> alternating_call([("lo",), ("hi",)], [2, 2], as_mapping=False, every=2, always=[])
        "Alternating(['lo', 'hi'], every=2)"
    """
    keys = [e[0] if len(e) == 1 else tuple(e) for e in entries]
    if as_mapping:
        ratios = "{" + ", ".join(f"{k!r}: {d}" for k, d in zip(keys, durations)) + "}"
    else:
        ratios = repr(keys) + ("" if every == 1 else f", every={every}")
    return f"Alternating({ratios}" + (f", always={sorted(always)!r}" if always else "") + ")"


def _sequence_call(entries: Sequence[tuple[str, ...]], durations: Sequence[int], always: Sequence[str]) -> str:
    phases = ", ".join(f"({[*e, *sorted(always)]!r}, {d})" for e, d in zip(entries, durations))
    return f"PhaseSequence([{phases}], repeat=True)"


def check_unique_entries(entries: Sequence[tuple[str, ...]], argument: str, *, hint: str = "") -> None:
    """Refuse a group named in two entries; the message names both and ends with `hint`."""
    seen: dict[str, int] = {}
    for i, names in enumerate(entries):
        for name in names:
            if name in seen:
                raise PlanError(
                    f"group {name!r} appears in `{argument}` entries {seen[name]} and {i} "
                    f"({list(entries[seen[name]])} and {list(names)}); each group may appear once"
                    + (f". {hint}" if hint else "")
                )
            seen[name] = i


def alternating_hint(entries: Sequence[tuple[str, ...]], durations: Sequence[int], *, as_mapping: bool,
                     every: int, always: frozenset[str]) -> str:
    """What to write instead of entries that share groups (``Alternating``'s refusal ends with it)."""
    shared = frozenset.intersection(*map(frozenset, entries)) if len(entries) > 1 else frozenset()
    rest = [tuple(n for n in e if n not in shared) for e in entries]
    flat = [n for e in rest for n in e]
    if shared and all(rest) and len(flat) == len(set(flat)):
        call = alternating_call(rest, durations, as_mapping=as_mapping, every=every, always=sorted(shared | always))
        one = len(shared) == 1
        return (f"{' and '.join(map(repr, sorted(shared)))} {'is' if one else 'are'} in every entry: to train "
                f"{'it' if one else 'them'} in every phase, name {'it' if one else 'them'} once in `always=`: {call}")
    return ("A group that trains in every phase goes in `always=` (named once); for phases that share "
            f"groups otherwise, list them as a PhaseSequence: {_sequence_call(entries, durations, sorted(always))}")


def check_always_apart(entries: Sequence[tuple[str, ...]], durations: Sequence[int], *, as_mapping: bool,
                       every: int, always: frozenset[str]) -> None:
    """Refuse `always` groups that also appear in an entry, with the call that works."""
    both = sorted({n for e in entries for n in e} & always)
    if not both:
        return
    where = [i for i, e in enumerate(entries) if set(e) & always]
    rest = [tuple(n for n in e if n not in always) for e in entries]
    if all(rest):
        fix = ("they train in every phase already, so leave them out of the entries: "
               + alternating_call(rest, durations, as_mapping=as_mapping, every=every, always=sorted(always)))
    else:
        fix = "an entry would be left with no group of its own: take them out of `always` or out of `ratios`"
    raise PlanError(f"group(s) {both} are in `always` and in `ratios` entries {where}; {fix}")
