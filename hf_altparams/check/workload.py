"""What ``check`` trains: a model, its groups and schedule, an optimizer, synthetic batches, a loss.

A :class:`CheckSetup` holds all of it. Three ways to get one:

* :func:`builtin_setup`: the default, a small Llama built from a config (no
  download), one group per decoder layer plus ``emb`` and ``head``;
* :func:`model_setup`: the user's model from a config file or checkpoint folder
  (``--model``), built with or without its weights, grouped the same way;
* :func:`load_setup`: the user's own ``module:function`` (``--setup``), which
  returns a :class:`CheckSetup` (or a ``(groups, schedule)`` pair). That is where
  a set-up's own code goes: its optimizer, its batches and loss, and what it
  runs every step (``on_step``, as a Trainer callback would), so that the check
  trains what the user's run will.

Schedules come from :func:`schedule_for`: any kind of the one schedule registry
(:data:`hf_altparams.plan.SCHEDULES`, whose flags the planner has too), with the
defaults ``check`` declares over its layer groups (:data:`CHECK_DEFAULTS`).
Every function here runs on each rank alike and builds the same thing on each.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.optim import Optimizer

from ..errors import PlanError
from ..plan import ANY_KIND, SCHEDULES, CommandDefaults, Derived, ParamGroups, Schedule

__all__ = ["CHECK_DEFAULTS", "SCHEDULES", "Batch", "CheckSetup", "builtin_model", "builtin_setup", "find_layers",
           "layer_groups", "load_setup", "model_setup", "schedule_for", "synthetic_batch"]

#: The groups :func:`layer_groups` adds beside the layers: the input embeddings and the output head.
_EMBEDDINGS = ("emb", "head")


def _present(*names: str) -> Derived:
    def derive(groups: ParamGroups, values: Mapping[str, Any]) -> tuple[str, ...]:
        return tuple(n for n in names if n in groups.names)
    has = "those the model has" if len(names) > 1 else "if the model has one"
    return Derived(f"{','.join(names)} ({has})", derive)


def _layers(groups: ParamGroups, values: Mapping[str, Any]) -> tuple[str, ...]:
    always = set(values.get("always") or ())
    return tuple(n for n in groups.names if n not in _EMBEDDINGS and n not in always)


#: ``check``'s own defaults over the registry's (the planner has none): short phases, so that a
#: one-minute run switches often; LISA's embeddings and head in every phase and gradual's head
#: from the start, as those recipes train them; the scheduled blocks are the layer groups of
#: :func:`layer_groups` (not ``emb`` and ``head``). ``--unit epoch`` is refused: the check counts
#: optimizer steps and runs no epochs, so such a schedule would never switch. ``per-task`` is refused
#: over layer groups (every forward runs through every layer; its other tasks are off the device):
#: a ``--setup`` with a model that routes by task checks it.
CHECK_DEFAULTS = CommandDefaults(
    "check", schedule="lisa",
    values={"every": {"alternating": 2, ANY_KIND: 3}, "k": {ANY_KIND: 2},
            "always": {"lisa": _present("emb", "head"), "gradual": _present("head")},
            "blocks": {ANY_KIND: Derived("the layer groups (not emb, head) not in --always", _layers)}},
    refused={"unit": {"epoch": "it counts optimizer steps and runs no epochs, so a schedule in epochs would "
                               "never switch; give --every in steps"},
             "schedule": {"per-task": "its groups are layers, and every forward runs through all of them, while "
                                      "a per-task schedule keeps the other tasks off the device; give a --setup "
                                      "whose model routes each batch through its own task's groups"}})

#: Model inputs of one micro-batch (keyword arguments of the model's forward).
Batch = Mapping[str, torch.Tensor]


@dataclass
class CheckSetup:
    """What one check trains, the same on every rank.

    Attributes:
        groups: the parameter groups; their module is the model that is trained.
        schedule: which groups train at each optimizer step.
        optimizer: ``optimizer(model) -> Optimizer`` (default ``AdamW(model.parameters(), lr=1e-4)``,
            the Trainer's own optimizer, over every parameter).
        batch: ``batch(step, rank) -> inputs`` for ``model(**inputs)`` (default: random token ids,
            with ``labels`` for a model that computes its own loss; only for transformers models).
        loss: ``loss(outputs) -> scalar`` (default ``outputs.loss`` when the model returns one, else the
            mean square of its first output).
        on_step: ``on_step(model, step)``, called on the unwrapped model before each step's forward:
            the user's own per-step code (what a Trainer callback does), checked with the rest.
        description: one line for the report (what model, what schedule).

    Example:
        >>> from hf_altparams.plan import Alternating, ParamGroups
        >>> net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        >>> setup = CheckSetup(ParamGroups(net, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]),
        ...                    batch=lambda step, rank: {"input": torch.randn(8, 4)})
        >>> setup.model is net
        True
    """

    groups: ParamGroups
    schedule: Schedule
    optimizer: Optional[Callable[[nn.Module], Optimizer]] = None
    batch: Optional[Callable[[int, int], Batch]] = None
    loss: Optional[Callable[[Any], torch.Tensor]] = None
    on_step: Optional[Callable[[nn.Module, int], None]] = None
    description: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.groups, ParamGroups):
            raise PlanError(f"CheckSetup `groups` must be a ParamGroups, got {type(self.groups).__name__}")
        if not isinstance(self.schedule, Schedule):
            raise PlanError(f"CheckSetup `schedule` must be an hf_altparams Schedule, got "
                            f"{type(self.schedule).__name__}")
        for name in ("optimizer", "batch", "loss", "on_step"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise PlanError(f"CheckSetup `{name}` must be callable or None, got {type(value).__name__}")
        if self.batch is None and not hasattr(self.model, "config"):
            raise PlanError(f"CheckSetup has no `batch` and its model ({type(self.model).__name__}) is not a "
                            "transformers model, whose inputs could be made up; give `batch=lambda step, rank: "
                            "{...}` (the keyword arguments of its forward)")

    @property
    def model(self) -> nn.Module:
        """The model the groups were built on."""
        return self.groups.module

    def make_optimizer(self, model: nn.Module) -> Optimizer:
        """The set-up's optimizer over ``model`` (default ``AdamW(model.parameters(), lr=1e-4)``)."""
        if self.optimizer is None:
            return torch.optim.AdamW(model.parameters(), lr=1e-4)
        built = self.optimizer(model)
        if not isinstance(built, Optimizer):
            raise PlanError(f"CheckSetup `optimizer` returned {type(built).__name__}, not a torch Optimizer")
        return built

    def make_batch(self, step: int, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The inputs of ``step`` on ``rank`` (different on each rank, as a sharded loader gives), on ``device``."""
        raw = self.batch(step, rank) if self.batch is not None else synthetic_batch(self.model, step, rank)
        if not isinstance(raw, Mapping):
            raise PlanError(f"CheckSetup `batch` returned {type(raw).__name__}; return a mapping of the model's "
                            "forward arguments, e.g. {'input_ids': ...}")
        return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in raw.items()}

    def compute_loss(self, outputs: Any) -> torch.Tensor:
        """The set-up's loss of ``outputs`` (see the ``loss`` attribute)."""
        if self.loss is not None:
            return self.loss(outputs)
        loss = getattr(outputs, "loss", None)
        if isinstance(loss, torch.Tensor):
            return loss
        first = outputs
        if isinstance(outputs, Mapping):
            first = next(iter(outputs.values()))
        elif isinstance(outputs, (tuple, list)):
            first = outputs[0]
        if not isinstance(first, torch.Tensor):
            raise PlanError(f"the model returned {type(outputs).__name__} with no tensor to take a loss of; give "
                            "CheckSetup `loss=`")
        return first.float().pow(2).mean()


# ------------------------------------------------------------------------------ models
def builtin_model(layers: int = 8, hidden: int = 256, vocab: int = 2048) -> nn.Module:
    """The default model: a small Llama (``LlamaForCausalLM``) from a config, seeded, no download.

    About 7.5 M parameters with the defaults (7,475,456): 8 decoder layers of 0.80 M, embeddings
    and head of 0.52 M each (untied, so that LISA's always-on groups are 14 % of it).

    Example:
        >>> sum(p.numel() for p in builtin_model(layers=2, hidden=64, vocab=128).parameters())
        117056
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def find_layers(model: nn.Module) -> str:
    """The dotted path of the model's largest ``ModuleList`` (its decoder or encoder layers).

    Example:
        >>> net = nn.Module(); net.body = nn.Module(); net.body.blocks = nn.ModuleList([nn.Linear(2, 2)] * 2)
        >>> find_layers(net)
        'body.blocks'
    """
    best, size = "", -1
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            count = sum(p.numel() for p in module.parameters())
            if count > size:
                best, size = name, count
    if not best:
        raise PlanError(f"{type(model).__name__} holds no ModuleList of layers to group; name one with "
                        "`--layers PATH` or give a `--setup module:function` that builds the groups")
    return best


def _prefix_of(model: nn.Module, module: Optional[nn.Module]) -> Optional[str]:
    if module is None:
        return None
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return None


def layer_groups(model: nn.Module, layers: Optional[str] = None, per: int = 1) -> ParamGroups:
    """One group per ``per`` layers (``layer0``, ...), plus ``emb`` and ``head`` where the model has them.

    ``emb`` and ``head`` are the model's input and output embeddings (transformers'
    ``get_input_embeddings`` / ``get_output_embeddings``; a tied head is part of
    ``emb``). Other parameters (final norms) are ungrouped and stay frozen.

    Example:
        >>> groups = layer_groups(builtin_model(layers=2, hidden=64, vocab=128))
        >>> groups.names
        ('layer0', 'layer1', 'emb', 'head')
    """
    path = layers or find_layers(model)
    extra: dict[str, str] = {}
    getters = {"emb": "get_input_embeddings", "head": "get_output_embeddings"}
    emb_params = set()
    for group, getter in getters.items():
        module = getattr(model, getter)() if callable(getattr(model, getter, None)) else None
        prefix = _prefix_of(model, module)
        if prefix is None or module is None:
            continue
        if group == "head" and any(id(p) in emb_params for p in module.parameters()):
            continue  # tied to the embeddings: trained with them
        emb_params |= {id(p) for p in module.parameters()}
        extra[group] = f"{prefix}.*"
    try:
        return ParamGroups.from_layers(model, path, per=per, extra=extra)
    except (AttributeError, KeyError, TypeError) as err:
        raise PlanError(f"`--layers` {path!r} is not a ModuleList of {type(model).__name__} ({err})") from err


def model_setup(model: Union[str, Path], *, weights: bool = False, model_class: str = "AutoModelForCausalLM",
                dtype: Optional[str] = None, layers: Optional[str] = None, per: int = 1) -> tuple[nn.Module, ParamGroups]:
    """The user's model (``--model``: a config JSON or a checkpoint folder) and its layer groups.

    Args:
        model: a transformers config file, or a folder holding ``config.json`` (and the
            weights, for ``weights=True``). Read locally; hub names are not fetched.
        weights: load the checkpoint's weights (``from_pretrained``); default: built from the
            config with fresh weights, which trains and measures the same.
        model_class: the transformers class (``AutoModelForCausalLM`` computes its own loss).
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (default: as built).
        layers, per: the ``ModuleList`` to group (default: the largest) and layers per group.
    """
    from ..planner.model import build_model, dtype_from_name

    path = Path(model)
    if weights:
        import transformers

        if not path.is_dir():
            raise PlanError(f"`--weights` needs `--model` to be a checkpoint folder, got {str(path)!r}")
        cls: Any = getattr(transformers, model_class, None)
        if not hasattr(cls, "from_pretrained"):
            raise PlanError(f"`--model-class` {model_class!r} is not a transformers class with `from_pretrained`")
        torch.manual_seed(0)
        built: nn.Module = cls.from_pretrained(str(path), local_files_only=True)
        if dtype is not None:
            built = built.to(dtype_from_name(dtype, "`--dtype`"))
    else:
        torch.manual_seed(0)  # the same fresh weights on every rank
        built = build_model(str(path), model_class=model_class, dtype=dtype, device="cpu")
    return built, layer_groups(built, layers, per)


def builtin_setup(schedule: str = "lisa", **options: Any) -> CheckSetup:
    """The default set-up: :func:`builtin_model` under ``schedule`` (see :func:`schedule_for`).

    Example:
        >>> setup = builtin_setup("alternating", every=2)
        >>> setup.schedule.phase_at(2).name
        'layer1'
    """
    model = builtin_model()
    groups = layer_groups(model)
    return CheckSetup(groups, schedule_for(schedule, groups, **options),
                      description=f"built-in Llama, 8 layers, 7.5 M parameters; {schedule}")


def schedule_for(name: Optional[str], groups: ParamGroups, **options: Any) -> Schedule:
    """The schedule ``--schedule`` names over ``groups``, with ``check``'s defaults (:data:`CHECK_DEFAULTS`).

    ``name`` is any kind of :data:`~hf_altparams.plan.SCHEDULES` (``None``: ``lisa``); ``options`` are
    its options (``every=3``, ``always=["head"]``, or the command line's text), the same as the
    planner's flags. Over :func:`layer_groups`, by default:

    * ``lisa``: ``k`` 2 layers re-drawn every 3 steps, ``emb`` and ``head`` in every
      phase; idle state dropped (its recipe);
    * ``badam``: one layer at a time for 3 steps, ascending; idle state dropped;
    * ``alternating``: every group in turn, 2 steps each; state kept;
    * ``gradual``: layers unfrozen from the last, one more every 3 steps; ``head``
      trains from the start;
    * the other kinds as the planner builds them, over the layer groups, 3 steps a phase;
      ``per-task`` is refused (see :data:`CHECK_DEFAULTS`).

    Raises:
        PlanError: an unknown kind or option, an option that does not apply, a bad value; the
            message names the flag.

    Example:
        >>> groups = layer_groups(builtin_model(layers=4, hidden=64, vocab=128))
        >>> schedule_for("badam", groups, every=1).phase_at(1).name
        'layer1'
        >>> schedule_for("sequence", groups, phase=["layer0+head:2", "layer1:2"]).phase_at(3).name
        'layer1'
    """
    return SCHEDULES.build(name, groups, options, CHECK_DEFAULTS)


def load_setup(spec: str, **context: Any) -> CheckSetup:
    """The user's ``module:function`` (``--setup``) called with no arguments, as a :class:`CheckSetup`.

    The function returns a :class:`CheckSetup`, or a ``(groups, schedule)`` pair for a
    transformers model. It runs on every rank and must build the same set-up on each
    (seed it); ``context`` is passed on when the function accepts it (``rank``, ``world``).

    Example:
        >>> setup = load_setup("hf_altparams.check.workload:builtin_setup")
        >>> setup.groups.names[:2]
        ('layer0', 'layer1')
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(f"`--setup` must be 'module:function' (e.g. 'my_project.check:setup'), got {spec!r}")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as err:
        raise PlanError(f"`--setup` {spec!r} cannot be imported: {type(err).__name__}: {err} (the module must "
                        "be importable from the working directory or PYTHONPATH)") from err
    if not callable(target):
        raise PlanError(f"`--setup` {spec!r} is a {type(target).__name__}, not a function")
    import inspect

    try:
        accepted = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin without a signature: call it plainly
        accepted = {}  # type: ignore[assignment]
    wants = {k: v for k, v in context.items() if k in accepted}
    built = target(**wants)
    if isinstance(built, tuple) and len(built) == 2:
        built = CheckSetup(built[0], built[1], description=spec)
    if not isinstance(built, CheckSetup):
        raise PlanError(f"`--setup` {spec!r} returned {type(built).__name__}; return a CheckSetup or a "
                        "(groups, schedule) pair")
    if not built.description:
        built.description = spec
    return built


def synthetic_batch(model: nn.Module, step: int, rank: int, batch_size: int = 4, length: int = 64
                    ) -> dict[str, torch.Tensor]:
    """Random token ids for a transformers model, seeded by ``(step, rank)``; ``labels`` for a causal LM.

    Example:
        >>> batch = synthetic_batch(builtin_model(layers=2, hidden=64, vocab=128), step=0, rank=1)
        >>> sorted(batch), tuple(batch["input_ids"].shape)
        (['input_ids', 'labels'], (4, 64))
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise PlanError(f"cannot make up inputs for {type(model).__name__} (no `config.vocab_size`); give a "
                        "`--setup` whose CheckSetup has `batch=`")
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int):
        length = min(length, positions)
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    ids = torch.randint(0, vocab, (batch_size, length), generator=generator)
    batch = {"input_ids": ids}
    if type(model).__name__.endswith(("ForCausalLM", "LMHeadModel")):
        batch["labels"] = ids
    return batch
