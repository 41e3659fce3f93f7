"""What ``check`` trains: a model, its groups and schedule, an optimizer, synthetic batches, a loss.

A :class:`CheckSetup` holds all of it. Three ways to get one:

* :func:`builtin_setup`: the default, a small Llama built from a config (no
  download), one group per decoder layer plus ``emb`` and ``head``;
* :func:`model_setup`: the user's model from a config file or checkpoint folder
  (``--model``), built with or without its weights, grouped the same way (an
  encoder-decoder's encoder and decoder layers both), with the head of its
  task (:data:`TASKS`: causal LM, seq2seq LM, masked LM, sequence
  classification; from ``--task`` or the config's ``architectures``) and
  synthetic batches that fit it (:func:`synthetic_batch`);
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

__all__ = [
    "CHECK_DEFAULTS",
    "SCHEDULES",
    "TASKS",
    "Batch",
    "CheckSetup",
    "build_user_model",
    "builtin_model",
    "builtin_setup",
    "ddp_kwargs",
    "find_layer_stacks",
    "find_layers",
    "layer_groups",
    "load_setup",
    "model_setup",
    "model_task",
    "pick_task",
    "schedule_for",
    "synthetic_batch",
]

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
    "check",
    schedule="lisa",
    values={
        "every": {"alternating": 2, ANY_KIND: 3},
        "k": {ANY_KIND: 2},
        "always": {"lisa": _present("emb", "head"), "gradual": _present("head")},
        "blocks": {ANY_KIND: Derived("the layer groups (not emb, head) not in --always", _layers)},
    },
    refused={
        "unit": {
            "epoch": "it counts optimizer steps and runs no epochs, so a schedule in epochs would "
            "never switch; give --every in steps"
        },
        "schedule": {
            "per-task": "its groups are layers, and every forward runs through all of them, while "
            "a per-task schedule keeps the other tasks off the device; give a --setup "
            "whose model routes each batch through its own task's groups"
        },
    },
)

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
        before_step: ``before_step(model, optimizer, step)``, called between the last ``backward`` of an
            optimizer step and ``optimizer.step()``, with the prepared model (the DDP or FSDP2 wrapper,
            whose parameters hold the reduced gradients) and the prepared optimizer: gradient clipping
            (``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``), an LR scheduler's step, logging.
        ddp: DDP's options, as Accelerate takes them: a ``DistributedDataParallelKwargs`` or a mapping of
            its fields (``{"find_unused_parameters": True}`` for a forward that skips some trainable
            parameters on some steps: MoE, multi-task loops; ``static_graph``, ``bucket_cap_mb``, ...).
            ``comm_hook`` is refused: the check counts the bytes with its own.
        accumulation: micro-batches per optimizer step (gradient accumulation, through
            ``accelerator.accumulate``: DDP synchronises the last one only); default 1.
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
    before_step: Optional[Callable[[nn.Module, Optimizer, int], None]] = None
    ddp: Any = None
    accumulation: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.groups, ParamGroups):
            raise PlanError(f"CheckSetup `groups` must be a ParamGroups, got {type(self.groups).__name__}")
        if not isinstance(self.schedule, Schedule):
            raise PlanError(
                f"CheckSetup `schedule` must be an hf_altparams Schedule, got {type(self.schedule).__name__}"
            )
        for name in ("optimizer", "batch", "loss", "on_step", "before_step"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise PlanError(f"CheckSetup `{name}` must be callable or None, got {type(value).__name__}")
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise PlanError(
                f"CheckSetup `accumulation` must be a positive integer (micro-batches per optimizer "
                f"step), got {self.accumulation!r}"
            )
        self.ddp = ddp_kwargs(self.ddp)
        if self.batch is None and not hasattr(self.model, "config"):
            raise PlanError(
                f"CheckSetup has no `batch` and its model ({type(self.model).__name__}) is not a "
                "transformers model, whose inputs could be made up; give `batch=lambda step, rank: "
                "{...}` (the keyword arguments of its forward)"
            )

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
            raise PlanError(
                f"CheckSetup `batch` returned {type(raw).__name__}; return a mapping of the model's "
                "forward arguments, e.g. {'input_ids': ...}"
            )
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
            raise PlanError(
                f"the model returned {type(outputs).__name__} with no tensor to take a loss of; give CheckSetup `loss=`"
            )
        return first.float().pow(2).mean()


def ddp_kwargs(value: Any) -> Any:
    """``value`` (``CheckSetup.ddp``) as Accelerate's ``DistributedDataParallelKwargs`` (``None`` stays ``None``).

    Example:
        >>> ddp_kwargs({"find_unused_parameters": True}).find_unused_parameters
        True
        >>> ddp_kwargs({"find_unused": True})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: CheckSetup `ddp` names ['find_unused'], which DistributedDataParallelKwargs does not take; it takes [...]
    """
    if value is None:
        return None
    import dataclasses

    from accelerate.utils import DistributedDataParallelKwargs

    fields = sorted(f.name for f in dataclasses.fields(DistributedDataParallelKwargs))
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - set(fields))
        if unknown:
            raise PlanError(
                f"CheckSetup `ddp` names {unknown}, which DistributedDataParallelKwargs does not take; it "
                f"takes {fields}"
            )
        value = DistributedDataParallelKwargs(**value)
    if not isinstance(value, DistributedDataParallelKwargs):
        raise PlanError(
            f"CheckSetup `ddp` must be a DistributedDataParallelKwargs or a mapping of its fields "
            f"({fields}), got {type(value).__name__}"
        )
    if str(value.comm_hook) != "no":
        raise PlanError(
            f"CheckSetup `ddp` sets comm_hook={value.comm_hook!r}: the check counts the bytes all-reduced "
            "with a comm hook of its own, and DDP takes one; leave comm_hook out"
        )
    return value


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

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def find_layers(model: nn.Module) -> str:
    """The dotted path of the model's largest ``ModuleList`` (its decoder or encoder layers).

    Example:
        >>> net = nn.Module(); net.body = nn.Module(); net.body.blocks = nn.ModuleList([nn.Linear(2, 2)] * 2)
        >>> find_layers(net)
        'body.blocks'
    """
    return find_layer_stacks(model)[0]


def find_layer_stacks(model: nn.Module) -> list[str]:
    """The dotted paths of the model's stacks of layers: its largest ``ModuleList``, and the others of its kind.

    A stack is a ``ModuleList`` of several modules that is not inside another
    one; the others kept are those holding at least a quarter of the largest's
    parameters (an encoder-decoder's encoder and decoder), largest first.

    Example:
        >>> net = nn.Module(); net.encoder = nn.ModuleList([nn.Linear(4, 4)] * 2)
        >>> net.decoder = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
        >>> find_layer_stacks(net)
        ['decoder', 'encoder']
    """
    sizes: dict[str, int] = {}
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{other}.") for other in sizes)
        if isinstance(module, nn.ModuleList) and len(module) > 1 and not inside:
            sizes[name] = sum(p.numel() for p in module.parameters())
    if not sizes:
        raise PlanError(
            f"{type(model).__name__} holds no ModuleList of layers to group; name one with "
            "`--layers PATH` or give a `--setup module:function` that builds the groups"
        )
    largest = max(sizes.values())
    return sorted((n for n, size in sizes.items() if size * 4 >= largest), key=lambda n: -sizes[n])


def _stack_prefixes(paths: Sequence[str]) -> list[str]:
    """Group-name prefixes for the stacks: ``layer`` for one; else each stack's parent (``encoder``, ``decoder``)."""
    if len(paths) == 1:
        return ["layer"]
    parents = [p.rsplit(".", 1)[0].rsplit(".", 1)[-1] if "." in p else p for p in paths]
    if len(set(parents)) == len(parents):
        return parents
    return [p.replace(".", "_") for p in paths]


def _prefix_of(model: nn.Module, module: Optional[nn.Module]) -> Optional[str]:
    if module is None:
        return None
    for name, candidate in model.named_modules():
        if candidate is module:
            return name
    return None


def layer_groups(model: nn.Module, layers: Optional[str] = None, per: int = 1) -> ParamGroups:
    """One group per ``per`` layers (``layer0``, ...), plus ``emb`` and ``head`` where the model has them.

    The layers are those of ``layers`` (a dotted path), else of the model's
    stacks (:func:`find_layer_stacks`): an encoder-decoder gets ``encoder0``, ...
    and ``decoder0``, ... ``emb`` and ``head`` are the model's input and output
    embeddings (transformers' ``get_input_embeddings`` / ``get_output_embeddings``;
    a tied head is part of ``emb``). Other parameters (final norms) are ungrouped
    and stay frozen.

    Example:
        >>> groups = layer_groups(builtin_model(layers=2, hidden=64, vocab=128))
        >>> groups.names
        ('layer0', 'layer1', 'emb', 'head')
    """
    paths = [layers] if layers else find_layer_stacks(model)
    extra: dict[str, Union[str, list[str]]] = {}
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
    base = getattr(model, "base_model", None)
    output = getattr(model, "get_output_embeddings", None)
    if callable(output) and output() is None and isinstance(base, nn.Module) and base is not model:  # a classifier
        heads = [
            f"{name}.*"
            for name, child in model.named_children()
            if child is not base and any(id(p) not in emb_params for p in child.parameters())
        ]
        if heads:
            extra["head"] = heads
    specs: dict[str, Any] = {}
    for path, name in zip(paths, _stack_prefixes(paths)):
        try:
            stack = model.get_submodule(path)
        except AttributeError as err:
            raise PlanError(f"`--layers` {path!r} is not a ModuleList of {type(model).__name__} ({err})") from err
        if not isinstance(stack, nn.ModuleList) or not len(stack):
            raise PlanError(
                f"`--layers` {path!r} is a {type(stack).__name__} of {type(model).__name__}, not a ModuleList of layers"
            )
        for i, start in enumerate(range(0, len(stack), per)):
            specs[f"{name}{i}"] = list(stack[start : start + per])
    return ParamGroups(model, {**specs, **extra})


#: The model kinds ``--model`` trains (``--task``), each with the transformers auto class that builds it.
TASKS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "masked-lm": "AutoModelForMaskedLM",
    "seq-classification": "AutoModelForSequenceClassification",
}


def _task_mappings() -> dict[str, dict[str, str]]:
    """Per task, transformers' ``{model_type: class name}`` of the auto class (its public name tables)."""
    from transformers.models.auto import modeling_auto as auto

    return {
        "causal-lm": dict(auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
        "seq2seq-lm": dict(auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES),
        "masked-lm": dict(auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES),
        "seq-classification": dict(auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES),
    }


def _classes(names: object) -> set[str]:
    return {names} if isinstance(names, str) else set(names) if isinstance(names, (tuple, list)) else set()


def model_task(model: nn.Module) -> Optional[str]:
    """The task (:data:`TASKS`) a transformers model's class is the head of; ``None`` for any other model.

    Example:
        >>> model_task(builtin_model(layers=2, hidden=64, vocab=128)), model_task(nn.Linear(2, 2))
        ('causal-lm', None)
    """
    name = type(model).__name__
    for task, mapping in _task_mappings().items():
        if any(name in _classes(v) for v in mapping.values()):
            return task
    return None


def pick_task(config: Any, task: Optional[str] = None) -> str:
    """The task to train a model of ``config`` for: ``task`` if given, else its ``architectures``, else the first it has.

    Raises:
        PlanError: ``task`` is not one of :data:`TASKS`, or the config has no head
            for it (or for any of them), naming what this config accepts.

    Example:
        >>> from transformers import T5Config
        >>> pick_task(T5Config(architectures=["T5ForConditionalGeneration"])), pick_task(T5Config())
        ('seq2seq-lm', 'seq2seq-lm')
    """
    if task is not None and task not in TASKS:
        raise PlanError(f"`--task` is {task!r}; accepted: {list(TASKS)}")
    mappings = _task_mappings()
    model_type = getattr(config, "model_type", None)
    supported = [t for t, mapping in mappings.items() if model_type in mapping]
    if task is not None:
        if task not in supported:
            raise PlanError(
                f"`--task` {task!r}: transformers has no {TASKS[task]} head for a {type(config).__name__} "
                f"(model_type {model_type!r}); this config accepts {supported or 'none of them'}"
            )
        return task
    for arch in getattr(config, "architectures", None) or []:
        for name, mapping in mappings.items():
            if any(arch in _classes(v) for v in mapping.values()):
                return name
    if supported:
        return supported[0]
    raise PlanError(
        f"a {type(config).__name__} (model_type {model_type!r}, architectures "
        f"{getattr(config, 'architectures', None)}) has none of the heads `check` trains: "
        f"{', '.join(f'{t} ({c})' for t, c in TASKS.items())}; give a `--setup module:function` "
        "that builds the model, its batches and its loss"
    )


def model_setup(
    model: Union[str, Path],
    *,
    weights: bool = False,
    model_class: Optional[str] = None,
    task: Optional[str] = None,
    dtype: Optional[str] = None,
    layers: Optional[str] = None,
    per: int = 1,
) -> tuple[nn.Module, ParamGroups]:
    """The user's model (``--model``: a config JSON or a checkpoint folder) and its layer groups.

    Args:
        model: a transformers config file, or a folder holding ``config.json`` (and the
            weights, for ``weights=True``). Read locally; hub names are not fetched.
        weights: load the checkpoint's weights (``from_pretrained``); default: built from the
            config with fresh weights, which trains and measures the same.
        model_class: the transformers class (default: the auto class of the task).
        task: ``causal-lm``, ``seq2seq-lm``, ``masked-lm`` or ``seq-classification``
            (:data:`TASKS`; default: :func:`pick_task` from the config's ``architectures``).
            A sequence classifier whose config names no padding token gets its
            end-of-sequence token (or 0) as one: transformers' decoder-style
            classifiers refuse batches of several sequences without one.
        dtype: ``"bf16"``, ``"fp16"``, ``"fp32"`` (default: as built).
        layers, per: the ``ModuleList`` to group (default: the model's stacks) and layers per group.

    Example:
        >>> # model, groups = model_setup("t5-small/config.json")  # T5ForConditionalGeneration: seq2seq-lm
    """
    from ..planner.model import dtype_from_name

    built = build_user_model(model, weights=weights, model_class=model_class, task=task)
    if dtype is not None:
        built = built.to(dtype_from_name(dtype, "`--dtype`"))
    return built, layer_groups(built, layers, per)


def build_user_model(
    model: Union[str, Path],
    *,
    weights: bool = False,
    model_class: Optional[str] = None,
    task: Optional[str] = None,
    device: str = "cpu",
) -> nn.Module:
    """``--model`` built with the head of its task (see :func:`model_setup`), on ``device``, in its own dtype.

    ``device="meta"`` builds it without memory (the pre-flight prices it so);
    ``weights=True`` loads the checkpoint's weights instead (on the host).

    Raises:
        PlanError: the path holds no config, the config has no head ``check``
            trains (naming those it does), or ``model_class`` cannot build it.
    """
    import transformers

    path = Path(model)
    if weights and not path.is_dir():
        raise PlanError(f"`--weights` needs `--model` to be a checkpoint folder, got {str(path)!r}")
    if not path.exists():
        raise PlanError(
            f"`--model` {str(path)!r} is neither a config JSON nor a checkpoint folder (read locally; "
            "hub names are not fetched: save the config first)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise PlanError(f"`--model` folder {str(path)!r} holds no config.json")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise PlanError(f"cannot read a transformers config from `--model` {str(path)!r}: {err}") from err
    name = model_class or TASKS[pick_task(config, task)]
    cls: Any = getattr(transformers, name, None)
    if not hasattr(cls, "from_config"):
        raise PlanError(
            f"`--model-class` {name!r} is not a transformers model class; use one of "
            f"{list(TASKS.values())} or leave it out"
        )
    if name == TASKS["seq-classification"] and getattr(config, "pad_token_id", None) is None:
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = (eos[0] if isinstance(eos, (list, tuple)) and eos else eos) or 0
    torch.manual_seed(0)  # the same fresh weights on every rank
    try:
        if weights:
            built: nn.Module = cls.from_pretrained(str(path), config=config, local_files_only=True)
        else:
            with torch.device(device):
                built = cls.from_config(config)
    except ValueError as err:  # transformers: "Unrecognized configuration class ... for this kind of AutoModel"
        raise PlanError(
            f"transformers' {name} cannot build a {type(config).__name__}: "
            f"{str(err).splitlines()[0][:300]}; leave `--model-class` out, or give `--task`"
        ) from err
    return built


def builtin_setup(schedule: str = "lisa", **options: Any) -> CheckSetup:
    """The default set-up: :func:`builtin_model` under ``schedule`` (see :func:`schedule_for`).

    Example:
        >>> setup = builtin_setup("alternating", every=2)
        >>> setup.schedule.phase_at(2).name
        'layer1'
    """
    model = builtin_model()
    groups = layer_groups(model)
    return CheckSetup(
        groups,
        schedule_for(schedule, groups, **options),
        description=f"built-in Llama, 8 layers, 7.5 M parameters; {schedule}",
    )


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
        raise PlanError(
            f"`--setup` {spec!r} cannot be imported: {type(err).__name__}: {err} (the module must "
            "be importable from the working directory or PYTHONPATH)"
        ) from err
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
        raise PlanError(
            f"`--setup` {spec!r} returned {type(built).__name__}; return a CheckSetup or a (groups, schedule) pair"
        )
    if not built.description:
        built.description = spec
    return built


def synthetic_batch(
    model: nn.Module, step: int, rank: int, batch_size: int = 4, length: int = 64
) -> dict[str, torch.Tensor]:
    """Random token ids for a transformers model, seeded by ``(step, rank)``, with what its head's loss needs.

    By :func:`model_task`: ``labels`` (the ids) for a causal or masked LM;
    ``labels`` and ``decoder_input_ids`` (the labels shifted right behind the
    decoder's start token) for a seq2seq LM; class ``labels`` for a sequence
    classifier (floats for regression and multi-label); ids alone for another
    model (the loss is then the mean square of its first output).

    Example:
        >>> batch = synthetic_batch(builtin_model(layers=2, hidden=64, vocab=128), step=0, rank=1)
        >>> sorted(batch), tuple(batch["input_ids"].shape)
        (['input_ids', 'labels'], (4, 64))
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise PlanError(
            f"cannot make up inputs for {type(model).__name__} (no `config.vocab_size`); give a "
            "`--setup` whose CheckSetup has `batch=`"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int):
        length = min(length, positions)
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    ids = torch.randint(0, vocab, (batch_size, length), generator=generator)
    batch = {"input_ids": ids}
    task = model_task(model)
    if task in ("causal-lm", "masked-lm"):
        batch["labels"] = ids
    elif task == "seq2seq-lm":
        start = getattr(config, "decoder_start_token_id", None)
        start = start if isinstance(start, int) else getattr(config, "pad_token_id", None) or 0
        batch["labels"] = ids
        batch["decoder_input_ids"] = torch.cat([torch.full((batch_size, 1), start), ids[:, :-1]], dim=1)
    elif task == "seq-classification":
        labels = max(1, int(getattr(config, "num_labels", 2)))
        problem = getattr(config, "problem_type", None)
        if labels == 1 or problem == "regression":
            batch["labels"] = torch.randn(batch_size, labels, generator=generator).squeeze(-1)
        elif problem == "multi_label_classification":
            batch["labels"] = torch.randint(0, 2, (batch_size, labels), generator=generator).float()
        else:
            batch["labels"] = torch.randint(0, labels, (batch_size,), generator=generator)
    return batch
