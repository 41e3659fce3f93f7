"""Which parameters belong to which peft adapter, read from the model's structure.

peft keeps each adapter's weights in containers keyed by the adapter's name:
every tuner layer (``BaseTunerLayer``: LoRA's ``lora_A`` / ``lora_B`` /
``lora_embedding_A`` / ``lora_embedding_B`` / ``lora_magnitude_vector``, and the
like for the other tuners) and every auxiliary wrapper
(``AuxiliaryTrainingWrapper``: the per-adapter copies of ``modules_to_save``,
trainable tokens) lists those containers in its ``adapter_layer_names``. This
module walks them, so an adapter's parameters are found whatever its tuner and
whatever the names of the modules it wraps, and maps them to the canonical
parameter names of the peft model (the names :class:`~hf_altparams.plan.ParamGroups` uses).

peft is optional: this module imports without it, and every entry point says
how to install it when it is missing.
"""

from __future__ import annotations

import functools
from typing import Any, Optional, Sequence

from torch import nn

from ..errors import PlanError

try:  # peft is an optional dependency (the `test` and `examples` extras install it)
    import peft
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
except ImportError as _missing:  # pragma: no cover - exercised only without peft
    peft = None
    _IMPORT_ERROR: Optional[ImportError] = _missing
else:
    _IMPORT_ERROR = None

__all__ = ["adapter_parameters", "as_peft_model", "check_adapter_names"]


def _require_peft() -> None:
    if _IMPORT_ERROR is not None:
        raise PlanError(
            "hf_altparams.integrations.peft needs the `peft` package (with `BaseTunerLayer` and "
            f"`AuxiliaryTrainingWrapper`; tested with peft 0.21): `pip install peft` ({_IMPORT_ERROR})"
        )


def as_peft_model(model: Any, *, argument: str = "model") -> nn.Module:
    """``model`` itself (a DDP wrapper unwrapped) if it is a peft model with adapters; else a clear error.

    Example:
        >>> import torch
        >>> as_peft_model(torch.nn.Linear(2, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `model` must be a peft model ...
    """
    _require_peft()
    inner = getattr(model, "module", None)
    if isinstance(model, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        model = inner
    if not isinstance(model, (peft.PeftModel, peft.PeftMixedModel)):
        raise PlanError(
            f"`{argument}` must be a peft model (a PeftModel from `peft.get_peft_model(model, config)` or "
            f"`PeftModel.from_pretrained(...)`, or a PeftMixedModel), got {type(model).__name__}; build the groups "
            "and the phase hook on the peft model itself, not on the model it wraps"
        )
    if not getattr(model, "peft_config", None):
        raise PlanError(f"`{argument}` ({type(model).__name__}) has no adapter: its `peft_config` is empty")
    return model


def _container(module: nn.Module, attribute: str) -> Any:
    """``module.<attribute>``, following dots (``"token_adapter.trainable_tokens_delta"``); ``None`` if absent."""
    try:
        return functools.reduce(getattr, attribute.split("."), module)
    except AttributeError:
        return None


def adapter_parameters(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each adapter of a peft model -> the canonical names of its parameters, in module order.

    Every adapter named in ``model.peft_config`` is a key, in that order; an
    adapter whose weights live in no tuner layer or auxiliary wrapper (prompt
    learning: prompt tuning, prefix tuning, ...) maps to an empty tuple.

    Example:
        >>> # adapter_parameters(peft_model)["a"][:2]
        >>> # ('base_model.model.bert.encoder.layer.0.attention.self.query.lora_A.a.weight',
        >>> #  'base_model.model.bert.encoder.layer.0.attention.self.query.lora_B.a.weight')
    """
    model = as_peft_model(model)
    owner: dict[int, str] = {}  # id(parameter) -> adapter
    adapters = list(model.peft_config)
    for module in model.modules():
        if not isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)):
            continue
        for attribute in module.adapter_layer_names:
            container = _container(module, attribute)
            if isinstance(container, nn.ModuleDict):
                items = [(key, list(sub.parameters())) for key, sub in container.items()]
            elif isinstance(container, nn.ParameterDict):
                items = [(key, [param]) for key, param in container.items()]
            else:
                continue
            for key, params in items:
                if key in model.peft_config:
                    for param in params:
                        owner.setdefault(id(param), key)
    found: dict[str, list[str]] = {name: [] for name in adapters}
    for name, param in model.named_parameters():  # canonical names: each parameter object once
        adapter = owner.get(id(param))
        if adapter is not None:
            found[adapter].append(name)
    return {adapter: tuple(names) for adapter, names in found.items()}


def check_adapter_names(names: Any, known: Sequence[str], *, argument: str) -> tuple[str, ...]:
    """``names`` (one adapter name or a list of them) as a tuple, each a known adapter; else a clear error.

    Example:
        >>> check_adapter_names("a", ["a", "b"], argument="fallback")
        ('a',)
        >>> check_adapter_names(["c"], ["a", "b"], argument="adapters")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `adapters` names unknown adapter(s) ['c']; the model's adapters are ['a', 'b']
    """
    values = [names] if isinstance(names, str) else names
    if not isinstance(values, (list, tuple)) or not values or not all(isinstance(v, str) for v in values):
        raise PlanError(f"`{argument}` must be an adapter name or a non-empty list of them, got {names!r}; "
                        f"the model's adapters are {list(known)}")
    unknown = [v for v in values if v not in known]
    if unknown:
        raise PlanError(f"`{argument}` names unknown adapter(s) {unknown}; the model's adapters are {list(known)}")
    if len(set(values)) != len(values):
        raise PlanError(f"`{argument}` names an adapter twice: {list(values)}")
    return tuple(values)
