"""Argument checks shared by the plan's constructors (groups, schedules, recipes).

Each check returns the value it accepted (converted where said) or raises a
:class:`~hf_altparams.errors.PlanError` whose message names the argument, the
value received and what would be accepted, so that a bad group spec or
schedule fails at construction, before any training step.

Example:
    >>> check_int(3, "every", minimum=1)
    3
    >>> name_list("head", "always", one_str=True)
    ('head',)
    >>> check_int(0, "every", minimum=1)
    Traceback (most recent call last):
    ...
    hf_altparams.errors.PlanError: `every` must be an int >= 1, got 0
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional, Sequence, TypeVar

from ..errors import PlanError
from .phase import Phase

__all__ = ["as_phase", "check_bool", "check_choice", "check_disjoint", "check_int", "name_list", "ordered_groups"]

_Choice = TypeVar("_Choice")


def check_int(value: Any, argument: str, *, minimum: Optional[int] = None) -> int:
    """`value` if it is an int (not a bool) of at least `minimum` (any int when `minimum` is None).

    Example:
        >>> check_int(True, "seed")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `seed` must be an int, got True
    """
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise PlanError(f"`{argument}` must be an int{bound}, got {value!r}")
    return value


def check_bool(value: Any, argument: str) -> bool:
    """`value` if it is True or False.

    Example:
        >>> check_bool(1, "repeat")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `repeat` must be True or False, got 1
    """
    if not isinstance(value, bool):
        raise PlanError(f"`{argument}` must be True or False, got {value!r}")
    return value


def check_choice(value: Any, argument: str, choices: Sequence[_Choice]) -> _Choice:
    """`value` if it is one of `choices`.

    Example:
        >>> check_choice("steps", "unit", ("step", "epoch"))
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `unit` must be one of ['step', 'epoch'], got 'steps'
    """
    if value not in choices:
        raise PlanError(f"`{argument}` must be one of {list(choices)}, got {value!r}")
    return value  # one of `choices`, so of their type


def name_list(value: Any, argument: str, *, one_str: bool) -> tuple[str, ...]:
    """Group names from an iterable of non-empty str (or one str, if `one_str`); no duplicates.

    Example:
        >>> name_list(["a", "b"], "groups", one_str=False)
        ('a', 'b')
        >>> name_list(["a", "a"], "groups", one_str=False)
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `groups` lists group(s) ['a'] more than once: ['a', 'a']
    """
    if isinstance(value, str) and one_str:
        value = [value]
    if isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        accepted = "a group name or " if one_str else ""
        raise PlanError(f"`{argument}` must be {accepted}a list of group names, got {value!r}")
    names = tuple(value)
    bad = [n for n in names if not isinstance(n, str) or not n]
    if bad:
        raise PlanError(f"`{argument}` must hold non-empty str group names, got {bad[0]!r} in {value!r}")
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise PlanError(f"`{argument}` lists group(s) {dups} more than once: {value!r}")
    return names


def ordered_groups(value: Any, argument: str) -> tuple[str, ...]:
    """At least one group name, from a sequence (its order matters to the caller).

    Example:
        >>> ordered_groups("ab", "groups")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `groups` must be a list of group names (in order), got 'ab'
    """
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PlanError(f"`{argument}` must be a list of group names (in order), got {value!r}")
    names = name_list(value, argument, one_str=False)
    if not names:
        raise PlanError(f"`{argument}` must name at least one group, got {value!r}")
    return names


def check_disjoint(a: Iterable[str], b: Iterable[str], a_arg: str, b_arg: str) -> None:
    """Refuse groups named in both `a` (argument `a_arg`) and `b` (argument `b_arg`).

    Example:
        >>> check_disjoint(["head"], ["l0", "head"], "always", "groups")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: group(s) ['head'] appear in both `always` and `groups`; use each group once
    """
    both = sorted(set(a) & set(b))
    if both:
        raise PlanError(f"group(s) {both} appear in both `{a_arg}` and `{b_arg}`; use each group once")


def as_phase(value: Any, argument: str) -> Phase:
    """A :class:`Phase` as given, or one training a group name or a list of group names.

    Example:
        >>> as_phase(["a", "b"], "phases[0]") == Phase(["a", "b"])
        True
        >>> as_phase(3, "phases[0]")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `phases[0]` must be a Phase, a group name or a list of group names, got 3
    """
    if isinstance(value, Phase):
        name_list(sorted(value.trainable | (value.resident or frozenset()), key=str), argument, one_str=False)
        return value
    try:
        return Phase(trainable=name_list(value, argument, one_str=True))
    except PlanError:
        raise PlanError(f"`{argument}` must be a Phase, a group name or a list of group names, got {value!r}") from None
