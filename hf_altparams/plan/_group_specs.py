"""How :class:`~hf_altparams.plan.ParamGroups` turns group specs into parameter names, and its message helpers.

A spec is a glob or ``re:`` pattern over full dotted parameter names, a
submodule, or a list mixing both; :func:`resolve_spec` expands one into the
names it claims (aliases of tied parameters included) or raises a
:class:`~hf_altparams.errors.PlanError` naming what is wrong.
:func:`layer_specs` and :func:`check_module_specs` build and check the specs of
the ``from_layers`` / ``from_modules`` constructors. The :data:`Spec` type and
:func:`format_bytes` are re-exported by :mod:`hf_altparams.plan.groups` (users and
the planner import them there); this module imports nothing from it, so the two
depend one way only.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Mapping, Sequence, Union

import torch
from torch import nn

from ..errors import PlanError

__all__ = ["Spec", "check_module_specs", "format_bytes", "layer_specs", "overlap_message", "resolve_spec"]

#: One group's specification: a pattern, a submodule, or a list mixing both
#: (re-exported by :mod:`hf_altparams.plan.groups`, where users import it).
Spec = Union[str, nn.Module, Sequence[Union[str, nn.Module]]]

_SPEC_HELP = (
    "a glob pattern str (e.g. 'encoder.layer.0.*'), a regex str starting with 're:', "
    "a submodule of the model, or a list/tuple mixing these"
)
_SHOW = 5  # how many example names an error message lists


def _preview(names: Sequence[str], limit: int = _SHOW) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = len(names) - limit
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


def format_bytes(n: int) -> str:
    """``1536 -> '1.50 KiB'``: bytes in the largest binary unit below 1024."""
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.2f} {unit}"


def _show(value: object, limit: int = 100) -> str:
    """A short description of a user value for an error message."""
    if isinstance(value, torch.Tensor):
        return f"{type(value).__name__} of shape {tuple(value.shape)} (pass its name as a pattern)"
    if isinstance(value, nn.Module):
        return type(value).__name__
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _unwrap(module: nn.Module) -> nn.Module:
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return module.module
    if not isinstance(module, nn.Module):
        raise PlanError(f"`module` must be a torch.nn.Module, got {type(module).__name__}: {_show(module)}")
    return module


def resolve_spec(
    root: nn.Module, all_pairs: Sequence[tuple[str, nn.Parameter]], group: str, spec: Spec
) -> list[str]:
    """All parameter names (aliases included) that `spec` claims for `group`."""
    if isinstance(spec, (str, nn.Module)):
        items: Sequence[object] = [spec]
    elif isinstance(spec, (list, tuple)):
        items = spec
    else:
        raise PlanError(
            f"group {group!r}: invalid spec {_show(spec)} of type {type(spec).__name__}; "
            f"expected {_SPEC_HELP}"
        )
    if not items:
        raise PlanError(f"group {group!r} is empty: its spec {spec!r} lists nothing")
    names: list[str] = []
    for item in items:
        if isinstance(item, str):
            names.extend(match_pattern(all_pairs, group, item))
        elif isinstance(item, nn.Module):
            names.extend(match_module(root, group, item))
        else:
            raise PlanError(
                f"group {group!r}: invalid spec item {_show(item)} of type "
                f"{type(item).__name__}; expected {_SPEC_HELP}"
            )
    return names


def match_pattern(all_pairs: Sequence[tuple[str, nn.Parameter]], group: str, pattern: str) -> list[str]:
    """The names among `all_pairs` that a glob (or ``re:`` regex) `pattern` matches; at least one."""
    if pattern.startswith("re:"):
        try:
            regex = re.compile(pattern[3:])
        except re.error as err:
            raise PlanError(f"group {group!r}: invalid regex in pattern {pattern!r}: {err}") from err
        hits = [n for n, _ in all_pairs if regex.fullmatch(n)]
    else:
        hits = [n for n, _ in all_pairs if fnmatch.fnmatchcase(n, pattern)]
    if not hits:
        raise PlanError(
            f"group {group!r}: pattern {pattern!r} matches no parameter; patterns are "
            "globs (or 're:' regexes) over full dotted names such as "
            f"{_preview([n for n, _ in all_pairs])}"
        )
    return hits


def match_module(root: nn.Module, group: str, sub: nn.Module) -> list[str]:
    """The parameter names (aliases included) under submodule `sub` of `root`; at least one."""
    qualname = next((n for n, m in root.named_modules() if m is sub), None)
    if qualname is None:
        raise PlanError(
            f"group {group!r}: module {type(sub).__name__} (id {id(sub):#x}) is not a "
            "submodule of `module`; pass a submodule of the model (matched by identity), "
            "e.g. `model.encoder.layer[0]`, or a pattern"
        )
    hits = [n for n, _ in sub.named_parameters(prefix=qualname, remove_duplicate=False)]
    if not hits:
        raise PlanError(
            f"group {group!r}: submodule {qualname or '<root>'!r} "
            f"({type(sub).__name__}) has no parameters"
        )
    return hits


def overlap_message(
    alias_of: Mapping[str, str], canonical: str, first: tuple[str, str], second: tuple[str, str]
) -> str:
    """The error for a parameter claimed by two groups, ``(group, name it was matched by)`` each."""
    (g1, via1), (g2, via2) = first, second
    aliases = [n for n, c in alias_of.items() if c == canonical]
    if via1 == via2:
        return (
            f"parameter {via1!r} is claimed by two groups, {g1!r} and {g2!r}; each "
            "parameter belongs to at most one group: narrow one of the patterns"
        )
    return (
        f"tied/shared parameter {canonical!r} (names {aliases}) is claimed by group "
        f"{g1!r} as {via1!r} and by group {g2!r} as {via2!r}; a parameter object "
        "belongs to exactly one group: put all its names in one group"
    )


def layer_specs(
    root: nn.Module,
    layers: nn.ModuleList | str,
    per: int,
    prefix: str,
    extra: Mapping[str, Spec] | None,
) -> dict[str, Spec]:
    """The group specs of :meth:`ParamGroups.from_layers`: one per `per` layers, then `extra`."""
    if isinstance(layers, str):
        try:
            resolved = root.get_submodule(layers)
        except AttributeError as err:
            raise PlanError(f"`layers` path {layers!r} does not exist in `module`: {err}") from err
    else:
        resolved = layers
    if not isinstance(resolved, nn.ModuleList):
        raise PlanError(
            f"`layers` must be an nn.ModuleList (or the dotted path of one), got "
            f"{type(resolved).__name__} from {layers if isinstance(layers, str) else 'object'!r}"
        )
    if len(resolved) == 0:
        raise PlanError(f"`layers` {layers if isinstance(layers, str) else 'ModuleList'!r} is empty")
    if isinstance(per, bool) or not isinstance(per, int) or per < 1:
        raise PlanError(f"`per` must be an int >= 1, got {per!r}")
    if not isinstance(prefix, str):
        raise PlanError(f"`prefix` must be a str, got {prefix!r}")
    specs: dict[str, Spec] = {}
    for i, start in enumerate(range(0, len(resolved), per)):
        specs[f"{prefix}{i}"] = list(resolved[start : start + per])
    for name, spec in (extra or {}).items():
        if name in specs:
            raise PlanError(
                f"`extra` group {name!r} collides with a layer group; layer groups are "
                f"{list(specs)}: rename it or change `prefix`"
            )
        specs[name] = spec
    return specs


def check_module_specs(modules: object) -> None:
    """Check the ``modules`` argument of :meth:`ParamGroups.from_modules`: name -> submodule(s)."""
    if not isinstance(modules, Mapping):
        raise PlanError(f"`modules` must be a mapping of group name -> submodule(s), got {_show(modules)}")
    for name, value in modules.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in items if not isinstance(v, nn.Module)]
        if bad:
            raise PlanError(
                f"`modules` group {name!r}: expected an nn.Module or a list of them, got {_show(bad[0])}"
            )
