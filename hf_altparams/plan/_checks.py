"""The argument checks shared by every schedule kind: each names the argument, the value and what is accepted."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from ..errors import PlanError
from .phase import Phase

__all__ = ["_as_phase", "_check_bool", "_check_choice", "_check_disjoint", "_check_int", "_name_list",
           "_ordered_groups"]


def _check_int(value: Any, argument: str, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"`{argument}` must be an int >= {minimum}, got {value!r}")
    return value


def _check_bool(value: Any, argument: str) -> bool:
    if not isinstance(value, bool):
        raise PlanError(f"`{argument}` must be True or False, got {value!r}")
    return value


def _check_choice(value: Any, argument: str, choices: Sequence[str]) -> Any:
    if value not in choices:
        raise PlanError(f"`{argument}` must be one of {list(choices)}, got {value!r}")
    return value


def _name_list(value: Any, argument: str, *, one_str: bool) -> tuple[str, ...]:
    """Group names from a str (if `one_str`) or an iterable of non-empty str; no duplicates."""
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


def _ordered_groups(value: Any, argument: str) -> tuple[str, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise PlanError(f"`{argument}` must be a list of group names (in order), got {value!r}")
    names = _name_list(value, argument, one_str=False)
    if not names:
        raise PlanError(f"`{argument}` must name at least one group, got {value!r}")
    return names


def _check_disjoint(a: Iterable[str], b: Iterable[str], a_arg: str, b_arg: str) -> None:
    both = sorted(set(a) & set(b))
    if both:
        raise PlanError(f"group(s) {both} appear in both `{a_arg}` and `{b_arg}`; use each group once")


def _as_phase(value: Any, argument: str) -> Phase:
    if isinstance(value, Phase):
        _name_list(sorted(value.trainable | (value.resident or frozenset()), key=str), argument, one_str=False)
        return value
    try:
        return Phase(trainable=_name_list(value, argument, one_str=True))
    except PlanError:
        raise PlanError(
            f"`{argument}` must be a Phase, a group name or a list of group names, got {value!r}"
        ) from None
