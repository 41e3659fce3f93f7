"""Named parameter groups resolved from a module by patterns or submodules.

A :class:`ParamGroups` splits the parameters of a module into named groups.
Parameters are tracked by identity (the tensor object) and by name, never by
value. A tied or shared parameter (``lm_head.weight = emb.weight``) is one
object seen under several names: its *canonical* name is the first one
``module.named_parameters()`` yields, the others are *aliases*, and it belongs
to at most one group whatever name a group used to claim it.

A :data:`Spec` (a glob or ``re:`` pattern over full dotted parameter names, a
submodule, or a list mixing both) becomes the names it claims in the second
half of this module, which also words the refusals (a pattern matching
nothing, a parameter claimed twice, a tied parameter split across groups).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Iterable, Literal, Mapping, Optional, Sequence, Union, cast

import torch
from torch import nn

from ..errors import PlanError
from .checks import check_choice, check_int

__all__ = ["ParamGroups", "Spec", "UngroupedPolicy", "format_bytes"]

#: One group's specification: a pattern, a submodule, or a list mixing both.
Spec = Union[str, nn.Module, Sequence[Union[str, nn.Module]]]

#: What happens to parameters that no group claims.
UngroupedPolicy = Literal["frozen", "trainable", "error"]

_POLICIES: tuple[UngroupedPolicy, ...] = ("frozen", "trainable", "error")
_SPEC_HELP = (
    "a glob pattern str (e.g. 'encoder.layer.0.*'), a regex str starting with 're:', "
    "a submodule of the model, or a list/tuple mixing these"
)
_SHOW = 5  # how many example names an error message lists


def format_bytes(n: int) -> str:
    """``1536 -> '1.50 KiB'``: bytes in the largest binary unit below 1024.

    Example:
        >>> format_bytes(1536), format_bytes(512), format_bytes(3 * 1024**3)
        ('1.50 KiB', '512 B', '3.00 GiB')
    """
    if n < 1024:
        return f"{n} B"
    size, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if size < 1024:
            break
        size, unit = size / 1024, bigger
    return f"{size:.2f} {unit}"


class ParamGroups:
    """Named, disjoint groups of the parameters of a module.

    Args:
        module: the model. A ``DistributedDataParallel`` wrapper is unwrapped,
            so names never carry its ``module.`` prefix.
        groups: group name -> spec. A spec is a glob pattern matched against
            full dotted parameter names (``fnmatch.fnmatchcase``), a pattern
            starting with ``"re:"`` (a regex matched with ``re.fullmatch``), a
            submodule of ``module`` (claims every parameter under it), or a
            list/tuple mixing these. Every pattern and submodule must claim at
            least one parameter, and no parameter may be claimed by two groups.
        ungrouped: what happens to parameters in no group: ``"frozen"`` (never
            train), ``"trainable"`` (train in every phase) or ``"error"``
            (refuse a module with ungrouped parameters).

    Raises:
        PlanError: on any invalid spec, overlap or policy (see the message).

    Example:
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        >>> groups = ParamGroups(model, {"first": "0.*", "second": model[1]})
        >>> groups.names
        ('first', 'second')
        >>> groups.param_names("second")
        ('1.weight', '1.bias')
        >>> groups.numel("first"), groups.group_of("1.bias")
        (6, 'second')
    """

    def __init__(
        self,
        module: nn.Module,
        groups: Mapping[str, Spec],
        *,
        ungrouped: UngroupedPolicy = "frozen",
    ) -> None:
        self.module: nn.Module = _unwrap(module)
        self.ungrouped: UngroupedPolicy = check_choice(ungrouped, "ungrouped", _POLICIES)
        if not isinstance(groups, Mapping) or len(groups) == 0:
            raise PlanError(f"`groups` must be a non-empty mapping of group name -> spec, got {_show(groups)}")

        # Every (name, parameter) pair, aliases included; canonical = first name.
        all_pairs = list(self.module.named_parameters(remove_duplicate=False))
        canonical_of_id: dict[int, str] = {}
        self._param_by_name: dict[str, nn.Parameter] = {}
        self._alias_of: dict[str, str] = {}  # any name -> canonical name
        for name, param in all_pairs:
            canonical = canonical_of_id.setdefault(id(param), name)
            self._alias_of[name] = canonical
            if canonical == name:
                self._param_by_name[name] = param
        order = {n: i for i, n in enumerate(self._param_by_name)}

        # Resolve each group; claims maps canonical name -> (group, name it was matched by).
        claims: dict[str, tuple[str, str]] = {}
        self._members: dict[str, tuple[str, ...]] = {}
        for group, spec in groups.items():
            if not isinstance(group, str) or not group:
                raise PlanError(f"group names must be non-empty str, got {group!r}")
            matched = _resolve_spec(self.module, all_pairs, group, spec)
            for via in matched:
                canonical = self._alias_of[via]
                owner = claims.setdefault(canonical, (group, via))
                if owner[0] != group:
                    raise PlanError(_overlap_message(self._alias_of, canonical, owner, (group, via)))
            members = {self._alias_of[n] for n in matched}
            self._members[group] = tuple(sorted(members, key=order.__getitem__))

        self._group_of: dict[str, str] = {c: g for c, (g, _) in claims.items()}
        self._ungrouped: tuple[str, ...] = tuple(n for n in self._param_by_name if n not in self._group_of)
        if ungrouped == "error" and self._ungrouped:
            raise PlanError(
                f"`ungrouped='error'` but {len(self._ungrouped)} parameter(s) are in no group: "
                f"{_preview(self._ungrouped)}; add them to a group, or pass "
                "`ungrouped='frozen'` or `ungrouped='trainable'`"
            )

    # -- queries ------------------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        """Group names, in definition order."""
        return tuple(self._members)

    def _check_group(self, group: str) -> None:
        if group not in self._members:
            raise PlanError(f"unknown group {group!r}; known groups: {list(self._members)}")

    def param_names(self, group: str) -> tuple[str, ...]:
        """Canonical names of the parameters of `group`, in module order."""
        self._check_group(group)
        return self._members[group]

    def params(self, group: str) -> list[nn.Parameter]:
        """The parameters of `group` (each object once), in module order."""
        return [self._param_by_name[n] for n in self.param_names(group)]

    def named_params(self, group: str) -> list[tuple[str, nn.Parameter]]:
        """``(canonical name, parameter)`` pairs of `group`, in module order."""
        return [(n, self._param_by_name[n]) for n in self.param_names(group)]

    def ungrouped_names(self) -> tuple[str, ...]:
        """Canonical names of the parameters in no group, in module order."""
        return self._ungrouped

    def group_of(self, param_name: str) -> str | None:
        """The group of a parameter given by canonical or alias name; ``None`` if ungrouped.

        Raises:
            PlanError: if `param_name` names no parameter of the module.
        """
        canonical = self._alias_of.get(param_name)
        if canonical is None:
            raise PlanError(
                f"`param_name` {param_name!r} is not a parameter of the module; names look "
                f"like {_preview(list(self._param_by_name))}"
            )
        return self._group_of.get(canonical)

    def numel(self, group: str) -> int:
        """Number of elements in `group` (a tied parameter counts once)."""
        return sum(p.numel() for p in self.params(group))

    def nbytes(self, group: str) -> int:
        """Bytes of the parameters of `group` (``numel * element_size`` each)."""
        return sum(p.numel() * p.element_size() for p in self.params(group))

    def all_named_params(self) -> list[tuple[str, nn.Parameter]]:
        """Every unique parameter with its canonical name, in module order."""
        return list(self._param_by_name.items())

    def check_names(self, names: Iterable[str], *, argument: str) -> None:
        """Raise :class:`PlanError` if any of `names` is not a group.

        Args:
            names: the names to check.
            argument: the caller's argument name, quoted in the message.
        """
        values = [names] if isinstance(names, str) else list(names)
        unknown = [n for n in values if n not in self._members]
        if unknown:
            raise PlanError(f"`{argument}` names unknown group(s) {unknown}; known groups: {list(self._members)}")

    def trainable_param_names(self, trainable_groups: Iterable[str]) -> frozenset[str]:
        """Canonical names that need ``requires_grad=True`` while `trainable_groups` train.

        That is the groups' parameters, plus the ungrouped ones when the policy
        is ``"trainable"``.
        """
        groups = [trainable_groups] if isinstance(trainable_groups, str) else list(trainable_groups)
        self.check_names(groups, argument="trainable_groups")
        names = {n for g in groups for n in self._members[g]}
        if self.ungrouped == "trainable":
            names.update(self._ungrouped)
        return frozenset(names)

    # -- reporting ----------------------------------------------------------------------------

    def summary(self, trainable: Iterable[str] | None = None) -> str:
        """A table of groups: parameter count and size, and whether each trains.

        Args:
            trainable: the groups that train (e.g. ``phase.trainable``); when
                given, a ``trainable`` column and a
                ``trainable: X of Y params (Z%)`` line are added.
        """
        chosen: frozenset[str] | None = None
        if trainable is not None:
            chosen = frozenset([trainable] if isinstance(trainable, str) else trainable)
            self.check_names(chosen, argument="trainable")
        rows: list[tuple[str, int, int, bool]] = [
            (g, self.numel(g), self.nbytes(g), chosen is not None and g in chosen) for g in self._members
        ]
        loose = [self._param_by_name[n] for n in self._ungrouped]
        rows.append(
            (
                f"<ungrouped: {self.ungrouped}>",
                sum(p.numel() for p in loose),
                sum(p.numel() * p.element_size() for p in loose),
                chosen is not None and self.ungrouped == "trainable",
            )
        )
        width = max(len("group"), *(len(r[0]) for r in rows), len("total"))
        header = f"{'group':<{width}}  {'params':>14}  {'size':>11}"
        if chosen is not None:
            header += "  trainable"
        lines = [header, "-" * len(header)]
        for name, count, size, trains in rows:
            line = f"{name:<{width}}  {count:>14,}  {format_bytes(size):>11}"
            if chosen is not None:
                line += f"  {'yes' if trains else 'no':>9}"
            lines.append(line)
        total = sum(r[1] for r in rows)
        lines.append("-" * len(header))
        lines.append(f"{'total':<{width}}  {total:>14,}  {format_bytes(sum(r[2] for r in rows)):>11}")
        if chosen is not None:
            on = sum(r[1] for r in rows if r[3])
            pct = 100.0 * on / total if total else 0.0
            lines.append(f"trainable: {on:,} of {total:,} params ({pct:.2f}%)")
        return "\n".join(lines)

    def print_summary(self, trainable: Iterable[str] | None = None) -> None:
        """Print :meth:`summary`."""
        print(self.summary(trainable))

    def __contains__(self, group: object) -> bool:
        return group in self._members

    def __repr__(self) -> str:
        parts = ", ".join(f"{g}: {len(m)}" for g, m in self._members.items())
        return f"ParamGroups({parts}; ungrouped={len(self._ungrouped)} {self.ungrouped})"

    # -- other constructors -------------------------------------------------------------------

    def rebind(self, module: nn.Module) -> ParamGroups:
        """The same groups, by canonical parameter name, on another module object.

        Use it after rebuilding or reloading a model. Parameters of `module`
        that were not grouped here stay ungrouped (under the same policy).

        Raises:
            PlanError: if `module` lacks some grouped names (they are listed).
        """
        target = _unwrap(module)
        present = {n for n, _ in target.named_parameters(remove_duplicate=False)}
        missing = [n for g in self._members for n in self._members[g] if n not in present]
        if missing:
            raise PlanError(
                f"cannot rebind: `module` lacks {len(missing)} grouped parameter(s) "
                f"{_preview(missing)}; it must have every name of the original groups"
            )
        return ParamGroups(target, self._exact_specs(), ungrouped=self.ungrouped)

    def with_rest(self, name: str) -> ParamGroups:
        """The same groups plus one more, `name`, holding every parameter no group claims.

        Use it when the parameters left over must be a group of their own: a
        frozen trunk that a :class:`~hf_altparams.plan.PerTaskCycle` keeps
        resident, or a base model next to its adapters.

        Raises:
            PlanError: if `name` is already a group, is not a non-empty str, or
                would be empty (every parameter is in a group).

        Example:
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
            >>> groups = ParamGroups(model, {"head": "1.*"}).with_rest("base")
            >>> groups.names, groups.param_names("base")
            (('head', 'base'), ('0.weight', '0.bias'))
        """
        if not isinstance(name, str) or not name:
            raise PlanError(f"the rest group's name must be a non-empty str, got {name!r}")
        if name in self._members:
            raise PlanError(f"the rest group {name!r} is already a group; known groups: {list(self._members)}")
        if not self._ungrouped:
            raise PlanError(
                f"the rest group {name!r} would be empty: every parameter is in one of the groups {list(self._members)}"
            )
        specs = self._exact_specs()
        specs[name] = ["re:" + re.escape(n) for n in self._ungrouped]
        return ParamGroups(self.module, specs, ungrouped=self.ungrouped)

    def _exact_specs(self) -> dict[str, Spec]:
        """Each group as the exact names of its parameters (``re:`` patterns of the escaped names)."""
        return {g: ["re:" + re.escape(n) for n in m] for g, m in self._members.items()}

    @classmethod
    def of_models(
        cls,
        models: Mapping[str, nn.Module],
        groups: Optional[Mapping[str, Spec]] = None,
        *,
        ungrouped: UngroupedPolicy = "frozen",
    ) -> ParamGroups:
        """Groups over several models trained by one schedule, each with its own wrapper and optimizer.

        The models go under one root (an ``nn.ModuleDict`` holding them, not
        copies), so a parameter is named ``"<model>.<its name>"``. By default one
        group per model, named like it; ``groups`` gives finer ones over the
        root's names (e.g. ``{"d_head": "discriminator.head.*", ...}``). A GAN:
        ``ParamGroups.of_models({"generator": gen, "discriminator": disc})``.

        Example:
            >>> from torch import nn
            >>> groups = ParamGroups.of_models({"generator": nn.Linear(2, 4), "discriminator": nn.Linear(4, 1)})
            >>> groups.names, groups.param_names("discriminator")
            (('generator', 'discriminator'), ('discriminator.weight', 'discriminator.bias'))
        """
        if not isinstance(models, Mapping) or not models:
            raise PlanError(f"`models` must be a non-empty mapping of name -> nn.Module, got {models!r}")
        bad = {
            k: type(v).__name__
            for k, v in models.items()
            if not isinstance(k, str) or not k or "." in k or not isinstance(v, nn.Module)
        }
        if bad:
            raise PlanError(f"`models` needs names without '.' mapped to nn.Module objects; refused: {bad}")
        root = nn.ModuleDict(dict(models))
        return cls(root, dict(groups) if groups is not None else dict(root.items()), ungrouped=ungrouped)

    @classmethod
    def from_layers(
        cls,
        module: nn.Module,
        layers: nn.ModuleList | str,
        *,
        per: int = 1,
        prefix: str = "layer",
        extra: Mapping[str, Spec] | None = None,
        ungrouped: UngroupedPolicy = "frozen",
    ) -> ParamGroups:
        """One group per `per` consecutive layers of a ``ModuleList``.

        Args:
            module: the model.
            layers: the ``ModuleList`` or its dotted path in `module`
                (e.g. ``"encoder.layer"``).
            per: layers per group; the last group may be shorter.
            prefix: groups are named ``f"{prefix}{i}"``, ``i`` counting chunks from 0.
            extra: more groups (name -> spec), placed after the layer groups.
            ungrouped: policy for the parameters in no group.

        Example:
            >>> from torch import nn
            >>> model = nn.Module()
            >>> model.blocks = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))
            >>> model.head = nn.Linear(2, 1)
            >>> groups = ParamGroups.from_layers(model, "blocks", per=2, extra={"head": "head.*"})
            >>> groups.names
            ('layer0', 'layer1', 'head')
            >>> groups.param_names("layer1")
            ('blocks.2.weight', 'blocks.2.bias')
        """
        root = _unwrap(module)
        return cls(root, _layer_specs(root, layers, per, prefix, extra), ungrouped=ungrouped)

    @classmethod
    def from_modules(
        cls,
        module: nn.Module,
        modules: Mapping[str, nn.Module | Sequence[nn.Module]],
        *,
        ungrouped: UngroupedPolicy = "frozen",
    ) -> ParamGroups:
        """Groups given as submodules: name -> submodule or list of submodules.

        Example:
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
            >>> ParamGroups.from_modules(model, {"a": model[0], "b": [model[2]]}).names
            ('a', 'b')
        """
        _check_module_specs(modules)
        return cls(module, dict(modules), ungrouped=ungrouped)


# -- how a spec becomes parameter names, and the messages that refuse one --------------------------


def _preview(names: Sequence[str], limit: int = _SHOW) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = len(names) - limit
    return f"[{shown}{f', ... ({more} more)' if more > 0 else ''}]"


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
        return cast(nn.Module, module.module)
    if not isinstance(module, nn.Module):
        raise PlanError(f"`module` must be a torch.nn.Module, got {type(module).__name__}: {_show(module)}")
    return module


def _resolve_spec(root: nn.Module, all_pairs: Sequence[tuple[str, nn.Parameter]], group: str, spec: Spec) -> list[str]:
    """All parameter names (aliases included) that `spec` claims for `group`."""
    if isinstance(spec, (str, nn.Module)):
        items: Sequence[object] = [spec]
    elif isinstance(spec, (list, tuple)):
        items = spec
    else:
        raise PlanError(
            f"group {group!r}: invalid spec {_show(spec)} of type {type(spec).__name__}; expected {_SPEC_HELP}"
        )
    if not items:
        raise PlanError(f"group {group!r} is empty: its spec {spec!r} lists nothing")
    names: list[str] = []
    for item in items:
        if isinstance(item, str):
            names.extend(_match_pattern(all_pairs, group, item))
        elif isinstance(item, nn.Module):
            names.extend(_match_module(root, group, item))
        else:
            raise PlanError(
                f"group {group!r}: invalid spec item {_show(item)} of type {type(item).__name__}; expected {_SPEC_HELP}"
            )
    return names


def _match_pattern(all_pairs: Sequence[tuple[str, nn.Parameter]], group: str, pattern: str) -> list[str]:
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


def _match_module(root: nn.Module, group: str, sub: nn.Module) -> list[str]:
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
        raise PlanError(f"group {group!r}: submodule {qualname or '<root>'!r} ({type(sub).__name__}) has no parameters")
    return hits


def _overlap_message(
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


def _layer_specs(
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
    check_int(per, "per", minimum=1)
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


def _check_module_specs(modules: object) -> None:
    """Check the ``modules`` argument of :meth:`ParamGroups.from_modules`: name -> submodule(s)."""
    if not isinstance(modules, Mapping):
        raise PlanError(f"`modules` must be a mapping of group name -> submodule(s), got {_show(modules)}")
    for name, value in modules.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in items if not isinstance(v, nn.Module)]
        if bad:
            raise PlanError(f"`modules` group {name!r}: expected an nn.Module or a list of them, got {_show(bad[0])}")
