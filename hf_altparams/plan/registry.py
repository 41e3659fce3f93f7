"""One registry of schedule kinds, read by every command line (``plan`` and ``check``).

A schedule kind (:class:`ScheduleKind`) is registered once: its name and
aliases, the options that apply to it, its own defaults and its builder from a
:class:`~hf_altparams.plan.ParamGroups` and the option values. Each option
(:class:`Option`) is declared once too: its flag, what it means, how its text
is read and checked. A command line adds the registry's flags to its parser
(:meth:`ScheduleRegistry.add_flags`) and builds the schedule through it
(:meth:`ScheduleRegistry.build`), so a flag means the same thing in every
command and a kind registered here appears in all of them.

Where a command has defaults of its own, it declares them in one
:class:`CommandDefaults` (``check``, over its built-in layer groups, trains the
embeddings and head in every LISA phase; the planner has no such default).

Input is checked before anything is built, and every refusal is a
:class:`~hf_altparams.errors.PlanError` naming the flag, the value and what is
accepted: a value its option cannot read, a flag that does not apply to the
kind, a value the kind (or the command) does not take, a required flag left
out, a group name that is not a group.

The built-in kinds are registered in :data:`hf_altparams.plan.SCHEDULES`
(:mod:`~hf_altparams.plan.kinds`).

Example:
    >>> from torch import nn
    >>> from hf_altparams.plan import PhaseSequence
    >>> registry = ScheduleRegistry([Option("every", "positions per phase", lambda v, flag: int(v))])
    >>> registry.register(ScheduleKind(
    ...     "twice", "each group for `--every` positions, twice", options=("every",), defaults={"every": 1},
    ...     build=lambda groups, args: PhaseSequence([(g, args["every"]) for g in groups.names * 2])))
    ScheduleKind(name='twice', ...)
    >>> groups = ParamGroups(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)), {"a": "0.*", "b": "1.*"})
    >>> schedule = registry.build("twice", groups, {"every": "2"})
    >>> [schedule.phase_at(i).name for i in range(0, 8, 2)]
    ['a', 'b', 'a', 'b']
    >>> registry.build("twice", groups, {"seed": 1})
    Traceback (most recent call last):
    ...
    hf_altparams.errors.PlanError: unknown schedule option 'seed' (`--seed`); the options are ['every']
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol

from ..errors import PlanError
from .groups import ParamGroups
from .schedules import Schedule

__all__ = [
    "ANY_KIND",
    "CommandDefaults",
    "Derived",
    "FlagSink",
    "Option",
    "ScheduleArgs",
    "ScheduleKind",
    "ScheduleRegistry",
    "describe_value",
]

#: The key of :attr:`CommandDefaults.values` that sets a default for every kind the option applies to.
ANY_KIND = "*"

#: An option's reader: ``(value, flag) -> the value it stands for``; the value is the command line's text
#: (a list of texts for a repeatable option) or a Python value; raises :class:`PlanError` naming ``flag``.
Reader = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Option:
    """One schedule option: its flag, what it means, how a value is read and checked.

    Attributes:
        name: the option's name, a keyword of :meth:`ScheduleRegistry.build` (``"every"``); its flag is
            ``--`` plus the name with ``_`` as ``-`` (``--every``).
        help: what it means, the same in every command.
        read: ``read(value, flag)``: the value from the command line's text or a Python value, checked.
        metavar: how its value is written (``GROUP[,GROUP...]``).
        what: a few words said when a kind requires it and it is missing (``"groups drawn per block"``).
        repeatable: given once per item (``--phase a:2 --phase b:3``): the text is a list.
        switch: takes no value (``--repeat``): ``True`` when given.
        names_in: ``names_in(value)``: the group names a value names, checked against the groups.
    """

    name: str
    help: str
    read: Reader
    metavar: Optional[str] = None
    what: str = ""
    repeatable: bool = False
    switch: bool = False
    names_in: Optional[Callable[[Any], Iterable[str]]] = None

    @property
    def flag(self) -> str:
        """The command-line flag, e.g. ``--every``."""
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Derived:
    """A default computed from the groups and the other options' values (``"every group not in --always"``).

    Attributes:
        text: what it is, in words, for the help and the docs.
        derive: ``derive(groups, values) -> value``; ``values`` holds the options resolved before it
            (in the registry's option order).
    """

    text: str
    derive: Callable[[ParamGroups, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class ScheduleArgs:
    """What a kind's builder gets: every option of the kind, read and checked, defaults filled in.

    ``args["every"]`` is the value (``None`` for an option with no default that was not given);
    ``"every" in args.given`` says whether the caller gave it.
    """

    kind: str
    values: Mapping[str, Any]
    given: frozenset[str]

    def __getitem__(self, name: str) -> Any:
        return self.values.get(name)


@dataclass(frozen=True)
class ScheduleKind:
    """One kind of schedule, as the command lines know it.

    Attributes:
        name: what ``--schedule`` calls it (``"random-blocks"``).
        help: one line: what it trains.
        build: ``build(groups, args) -> Schedule`` (``args`` a :class:`ScheduleArgs`).
        options: the names of the options that apply to it; any other option is refused.
        defaults: its default per option: a value, or a :class:`Derived`. An option of the kind with no
            default and not in ``required`` reaches the builder as ``None``.
        required: options that must be given (or defaulted by the command).
        choices: for an option, the values this kind accepts (``order``: ``("ascending", ...)``).
        aliases: other names ``--schedule`` accepts for it.
        instead: for an option that does not apply, what to use instead (said in the refusal).
    """

    name: str
    help: str
    build: Callable[[ParamGroups, ScheduleArgs], Schedule]
    options: tuple[str, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()
    instead: Mapping[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ScheduleKind(name={self.name!r}, ...)"


@dataclass(frozen=True)
class CommandDefaults:
    """A command's own defaults over the registry's, declared in one place.

    Attributes:
        command: the command's name, for messages (``"check"``).
        schedule: the kind ``--schedule`` defaults to (``None``: ``--schedule`` is required).
        values: option name -> {kind name, or :data:`ANY_KIND` for every kind it applies to -> default}
            (a value or a :class:`Derived`); these win over the kind's own defaults.
        refused: option name (or ``"schedule"`` for a kind) -> {value -> why this command cannot take it}.

    Example:
        >>> mine = CommandDefaults("mine", values={"every": {"alternating": 2, ANY_KIND: 3}})
        >>> mine.default("every", "alternating"), mine.default("every", "lisa"), mine.default("k", "lisa")
        ((True, 2), (True, 3), (False, None))
    """

    command: str
    schedule: Optional[str] = None
    values: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    refused: Mapping[str, Mapping[Any, str]] = field(default_factory=dict)

    def default(self, option: str, kind: str) -> tuple[bool, Any]:
        """``(True, default)`` if this command sets one for ``option`` under ``kind``, else ``(False, None)``."""
        per_kind = self.values.get(option, {})
        for key in (kind, ANY_KIND):
            if key in per_kind:
                return True, per_kind[key]
        return False, None


_NO_DEFAULTS = CommandDefaults("plan")


class FlagSink(Protocol):
    """What :meth:`ScheduleRegistry.add_flags` adds flags to: an ``argparse`` parser or argument group."""

    def add_argument(self, *name_or_flags: str, **kwargs: Any) -> Any: ...


def describe_value(value: Any) -> str:
    """A default as the help and the docs write it.

    Example:
        >>> describe_value(("emb", "head")), describe_value(()), describe_value(3), describe_value(False)
        ('emb,head', 'none', '3', 'off')
    """
    if isinstance(value, Derived):
        return value.text
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


class ScheduleRegistry:
    """The schedule kinds and their options; every command line reads its flags and builds through it.

    Iterating gives the kinds' names in registration order; ``name in registry`` accepts aliases.
    """

    def __init__(self, options: Iterable[Option] = ()) -> None:
        self._options: dict[str, Option] = {}
        self._kinds: dict[str, ScheduleKind] = {}
        for option in options:
            self.add_option(option)

    # -- what is registered ------------------------------------------------------------------
    def add_option(self, option: Option) -> Option:
        """Declare an option kinds may take; returns it. Refused when its name or flag is taken."""
        if not isinstance(option, Option):
            raise PlanError(f"`option` must be an hf_altparams.plan.registry.Option, got {type(option).__name__}")
        if option.name in self._options or option.name == "schedule":
            raise PlanError(
                f"schedule option {option.name!r} ({option.flag}) is declared already; the options "
                f"are {list(self._options)}"
            )
        self._options[option.name] = option
        return option

    def register(self, kind: ScheduleKind) -> ScheduleKind:
        """Add ``kind``; returns it. Every command line built after this offers it.

        Raises:
            PlanError: ``kind`` is not a :class:`ScheduleKind`, takes a registered name or alias, or names
                an option that is not declared (or a default, choice or requirement outside its options).
        """
        if not isinstance(kind, ScheduleKind):
            raise PlanError(f"`kind` must be an hf_altparams.plan.registry.ScheduleKind, got {type(kind).__name__}")
        spellings = (kind.name, *kind.aliases)
        odd = [s for s in spellings if not isinstance(s, str) or not s or s != _spelling(s)]
        if odd:
            raise PlanError(
                f"schedule kind {kind.name!r}: names and aliases must be non-empty, lower case, with "
                f"- between words (they are looked up so), got {odd}"
            )
        taken = sorted(set(spellings) & set(self.spellings))
        if taken:
            raise PlanError(
                f"schedule kind {kind.name!r} takes the name(s) {taken}, registered already; "
                f"registered: {self.spellings}"
            )
        unknown = sorted(set(kind.options) - set(self._options))
        if unknown:
            raise PlanError(
                f"schedule kind {kind.name!r} names undeclared option(s) {unknown}; declared: "
                f"{list(self._options)} (add_option first)"
            )
        for what, names in (("defaults", kind.defaults), ("required", kind.required), ("choices", kind.choices)):
            stray = sorted(set(names) - set(kind.options))
            if stray:
                raise PlanError(
                    f"schedule kind {kind.name!r}: `{what}` names option(s) {stray} that are not among its `options`"
                )
        applying = sorted(set(kind.instead) & set(kind.options))
        if applying:
            raise PlanError(
                f"schedule kind {kind.name!r}: `instead` names option(s) {applying} that apply to it "
                "(`instead` says what to use for an option that does not)"
            )
        self._kinds[kind.name] = kind
        return kind

    def unregister(self, name: str) -> ScheduleKind:
        """Remove the kind called ``name`` (or one of its aliases); returns it."""
        kind = self.kind(name)
        del self._kinds[kind.name]
        return kind

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._kinds))

    def __len__(self) -> int:
        return len(self._kinds)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._lookup(name) is not None

    @property
    def names(self) -> tuple[str, ...]:
        """The kinds' names, in registration order."""
        return tuple(self._kinds)

    @property
    def spellings(self) -> list[str]:
        """Every name ``--schedule`` accepts: the kinds' names, then their aliases."""
        return [*self._kinds, *(a for k in self._kinds.values() for a in k.aliases)]

    @property
    def options(self) -> tuple[Option, ...]:
        """Every declared option, in declaration order."""
        return tuple(self._options.values())

    def option(self, name: str) -> Option:
        """The option called ``name`` (``"every"``)."""
        if name not in self._options:
            flag = "--" + str(name).replace("_", "-")
            raise PlanError(f"unknown schedule option {name!r} (`{flag}`); the options are {list(self._options)}")
        return self._options[name]

    def kinds_of(self, option: str) -> tuple[str, ...]:
        """The kinds ``option`` applies to."""
        return tuple(k.name for k in self._kinds.values() if option in k.options)

    def _lookup(self, name: str) -> Optional[ScheduleKind]:
        wanted = _spelling(name)
        for kind in self._kinds.values():
            if wanted in (kind.name, *kind.aliases):
                return kind
        return None

    def kind(self, name: str) -> ScheduleKind:
        """The kind called ``name`` or one of its aliases (any case; ``_`` for ``-``).

        Raises:
            PlanError: no kind has that name; the message lists them.
        """
        found = self._lookup(name) if isinstance(name, str) else None
        if found is None:
            raise PlanError(f"`--schedule` is {name!r}; accepted: {list(self._kinds)}" + self._aliases_note())
        return found

    def _aliases_note(self) -> str:
        aliases = ", ".join(f"{a!r} for {k.name!r}" for k in self._kinds.values() for a in k.aliases)
        return f" (aliases: {aliases})" if aliases else ""

    # -- reading and building ------------------------------------------------------------------
    def resolve(
        self, name: Optional[str], given: Mapping[str, Any], defaults: Optional[CommandDefaults] = None
    ) -> tuple[ScheduleKind, ScheduleArgs]:
        """Check what can be checked without the groups: the kind, each given option, what is missing.

        ``given`` maps option names to values (the command line's text or Python values; ``None``:
        not given). Returns the kind and its :class:`ScheduleArgs`, in which a :class:`Derived`
        default is still unresolved (:meth:`build` resolves it over the groups). A command calls
        this before it starts anything, so that a bad flag costs nothing.

        Example:
            >>> from hf_altparams.plan import SCHEDULES
            >>> kind, args = SCHEDULES.resolve("badam", {"every": "5", "order": "random"})
            >>> kind.name, args["every"], args["order"], args["seed"]
            ('badam', 5, 'random', 0)
            >>> SCHEDULES.resolve("gradual", {"every": "5", "k": "2"})
            Traceback (most recent call last):
            ...
            hf_altparams.errors.PlanError: `--k` '2' does not apply to `--schedule gradual`; it applies to random-blocks, lisa
        """
        defaults = defaults or _NO_DEFAULTS
        if name is None:
            if defaults.schedule is None:
                raise PlanError(f"`--schedule` is required; accepted: {list(self._kinds)}")
            name = defaults.schedule
        kind = self.kind(name)
        why_not = defaults.refused.get("schedule", {}).get(kind.name)
        if why_not:
            raise PlanError(f"`--schedule {kind.name}` is refused by `{defaults.command}`: {why_not}")
        values: dict[str, Any] = {}
        for key, raw in given.items():
            if raw is None:
                continue
            option = self.option(key)
            if key not in kind.options:
                shown = "" if option.switch else f" {raw!r}"
                why = kind.instead.get(key) or f"it applies to {', '.join(self.kinds_of(key)) or 'no kind'}"
                raise PlanError(f"`{option.flag}`{shown} does not apply to `--schedule {kind.name}`; {why}")
            value = option.read(raw, option.flag)
            accepted = kind.choices.get(key)
            if accepted is not None and value not in accepted:
                raise PlanError(
                    f"`{option.flag}` {value!r} does not apply to `--schedule {kind.name}`; accepted: "
                    + ", ".join(accepted)
                )
            values[key] = value
        for key in kind.options:
            option = self.option(key)
            if key not in values:
                found, default = defaults.default(key, kind.name)
                if not found:
                    found, default = key in kind.defaults, kind.defaults.get(key)
                if not found and key in kind.required:
                    if option.repeatable:
                        raise PlanError(
                            f"`--schedule {kind.name}` needs at least one "
                            f"`{option.flag} {option.metavar or option.name.upper()}`"
                        )
                    what = f" ({option.what})" if option.what else ""
                    raise PlanError(f"`{option.flag}`{what} is required for `--schedule {kind.name}`")
                values[key] = default
            for refused, why in defaults.refused.get(key, {}).items():
                if values[key] == refused:
                    raise PlanError(f"`{option.flag}` {refused!r} is refused by `{defaults.command}`: {why}")
        return kind, ScheduleArgs(kind.name, values, frozenset(k for k, v in given.items() if v is not None))

    def build(
        self,
        name: Optional[str],
        groups: ParamGroups,
        given: Mapping[str, Any],
        defaults: Optional[CommandDefaults] = None,
    ) -> Schedule:
        """The schedule of kind ``name`` over ``groups``, from the options ``given`` (see :meth:`resolve`).

        Derived defaults are computed over ``groups``, and every group an option names must be one of
        them. ``defaults``: the command's own (:class:`CommandDefaults`); none for the planner.

        Example:
            >>> from torch import nn
            >>> from hf_altparams.plan import SCHEDULES, ParamGroups
            >>> net = nn.ModuleDict({n: nn.Linear(2, 2) for n in ("l0", "l1", "head")})
            >>> groups = ParamGroups(net, {n: f"{n}.*" for n in net})
            >>> schedule = SCHEDULES.build("badam", groups, {"every": "2", "always": "head"})
            >>> [schedule.phase_at(i).name for i in range(0, 6, 2)]
            ['l0+head', 'l1+head', 'l0+head']
            >>> SCHEDULES.build("badam", groups, {"every": "2", "always": "emb"})
            Traceback (most recent call last):
            ...
            hf_altparams.errors.PlanError: `--always` names ['emb'], which are not groups; the groups are ['l0', 'l1', 'head']
        """
        if not isinstance(groups, ParamGroups):
            raise PlanError(f"`groups` must be a ParamGroups, got {type(groups).__name__}")
        kind, args = self.resolve(name, given, defaults)
        values = dict(args.values)
        for key in args.given:
            self._check_names(key, values[key], groups)
        for option in self.options:  # declaration order: an option derived from another comes after it
            default = values.get(option.name)
            if not isinstance(default, Derived):
                continue
            derived = default.derive(groups, values)
            try:
                values[option.name] = option.read(derived, option.flag)
            except PlanError as err:
                raise PlanError(
                    f"`{option.flag}` was not given, and its default ({default.text}) is {derived!r} here: {err}"
                ) from None
            self._check_names(option.name, values[option.name], groups)
        return kind.build(groups, ScheduleArgs(kind.name, values, args.given))

    def _check_names(self, key: str, value: Any, groups: ParamGroups) -> None:
        option = self.option(key)
        if option.names_in is None or value is None:
            return
        unknown = sorted(set(option.names_in(value)) - set(groups.names))
        if unknown:
            raise PlanError(
                f"`{option.flag}` names {unknown}, which are not groups; the groups are {list(groups.names)}"
            )

    # -- command lines ---------------------------------------------------------------------------
    def add_flags(self, parser: FlagSink, defaults: Optional[CommandDefaults] = None) -> None:
        """Add ``--schedule`` and every option's flag to ``parser`` (a parser or an argument group).

        Each flag's value is checked as it is parsed (argparse exits 2 with the option's message);
        its ``dest`` is the option's name, ``None`` when not given (:meth:`given` reads them back).
        The help of each flag says which kinds it applies to and its default under each, with
        ``defaults`` (the command's own) applied.
        """
        defaults = defaults or _NO_DEFAULTS

        def kind_name(text: str) -> str:
            try:
                return self.kind(text).name
            except PlanError:
                raise argparse.ArgumentTypeError(
                    f"invalid choice: {text!r}; accepted: {', '.join(self._kinds)}" + self._aliases_note()
                ) from None

        refused = defaults.refused.get("schedule", {})
        lines = "; ".join(
            f"{k.name}: {k.help}"
            + (f" (`{defaults.command}` refuses it: {refused[k.name]})" if k.name in refused else "")
            for k in self._kinds.values()
        )
        parser.add_argument(
            "--schedule",
            type=kind_name,
            default=None,
            required=defaults.schedule is None,
            metavar="{" + ",".join(self._kinds) + "}",
            help=(
                f"the kind of schedule (default {defaults.schedule}). "
                if defaults.schedule
                else "the kind of schedule. "
            )
            + lines
            + self._aliases_note(),
        )
        for option in self.options:
            helptext = f"{option.help} [{self._defaults_text(option, defaults)}]"
            if option.switch:
                parser.add_argument(option.flag, dest=option.name, action="store_true", default=None, help=helptext)
                continue
            parser.add_argument(
                option.flag,
                dest=option.name,
                type=_flag_reader(option),
                default=None,
                metavar=option.metavar,
                action="append" if option.repeatable else "store",
                help=helptext,
            )

    def given(self, namespace: argparse.Namespace) -> tuple[Optional[str], dict[str, Any]]:
        """``(kind name or None, {option: text})``: what the flags of :meth:`add_flags` were given."""
        values = {o.name: getattr(namespace, o.name, None) for o in self.options}
        return getattr(namespace, "schedule", None), {k: v for k, v in values.items() if v is not None}

    def _defaults_text(self, option: Option, defaults: CommandDefaults) -> str:
        """``kinds: default; ...`` for one option's help, with the command's defaults applied."""
        parts: dict[str, list[str]] = {}
        for kind in self._kinds.values():
            if option.name not in kind.options:
                continue
            found, value = defaults.default(option.name, kind.name)
            if not found:
                found, value = option.name in kind.defaults, kind.defaults.get(option.name)
            text = (
                "default " + describe_value(value)
                if found
                else "required"
                if option.name in kind.required
                else "default none"
            )
            parts.setdefault(text, []).append(kind.name)
        refused = [
            f"`{defaults.command}` refuses {describe_value(value)}: {why}"
            for value, why in defaults.refused.get(option.name, {}).items()
        ]
        return "; ".join([*(f"{', '.join(kinds)}: {text}" for text, kinds in parts.items()), *refused])

    def table(self) -> str:
        """The kinds and their flags as a Markdown table (docs/planner.md and docs/check.md hold it)."""
        rows = ["| kind | trains | flags (default) |", "|---|---|---|"]
        for kind in self._kinds.values():
            flags = []
            for name in kind.options:
                option = self.option(name)
                if name in kind.defaults:
                    note = f" ({_cell(describe_value(kind.defaults[name]))})"
                else:
                    note = " (required)" if name in kind.required else ""
                choices = kind.choices.get(name)
                values = " " + "\\|".join(choices) if choices else ""
                flags.append(f"`{option.flag}{values}`{note}")
            aliases = f" (also {', '.join(f'`{a}`' for a in kind.aliases)})" if kind.aliases else ""
            rows.append(f"| `{kind.name}`{aliases} | {_cell(kind.help)} | {', '.join(flags)} |")
        return "\n".join(rows)

    def flag_table(self) -> str:
        """The options as a Markdown table: flag, value, meaning, kinds it applies to."""
        rows = ["| flag | value | meaning | applies to |", "|---|---|---|---|"]
        for option in self.options:
            value = "(none: a switch)" if option.switch else f"`{_cell(option.metavar or option.name.upper())}`"
            if option.repeatable:
                value += ", repeatable"
            rows.append(
                f"| `{option.flag}` | {value} | {_cell(option.help)} | "
                f"{', '.join(f'`{k}`' for k in self.kinds_of(option.name))} |"
            )
        return "\n".join(rows)

    def defaults_table(self, defaults: CommandDefaults) -> str:
        """A command's own defaults (and refusals) over the registry's, as a Markdown table."""
        rows = [f"| flag | kinds | `{defaults.command}`'s default |", "|---|---|---|"]
        if defaults.schedule is not None:
            rows.append(f"| `--schedule` | - | `{defaults.schedule}` |")
        for kind, why in defaults.refused.get("schedule", {}).items():
            rows.append(f"| `--schedule` | `{kind}` | refused: {_cell(why)} |")
        for option in self.options:
            per_kind = defaults.values.get(option.name, {})
            for key, value in per_kind.items():
                kinds = [k for k in self.kinds_of(option.name) if k not in per_kind] if key == ANY_KIND else [key]
                rows.append(
                    f"| `{option.flag}` | {', '.join(f'`{k}`' for k in kinds)} | {_cell(describe_value(value))} |"
                )
            for value, why in defaults.refused.get(option.name, {}).items():
                rows.append(
                    f"| `{option.flag}` | every kind it applies to | refuses `{describe_value(value)}`: {_cell(why)} |"
                )
        return "\n".join(rows)


def _spelling(name: str) -> str:
    """How a kind's name is looked up: any case, ``_`` or ``-`` between words."""
    return name.strip().lower().replace("_", "-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flag_reader(option: Option) -> Callable[[str], str]:
    """An argparse ``type=`` that checks one value of ``option`` and keeps its text (read again at build)."""

    def check(text: str) -> str:
        try:
            option.read([text] if option.repeatable else text, option.flag)
        except PlanError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    check.__name__ = option.flag  # argparse names the type in some messages
    return check
