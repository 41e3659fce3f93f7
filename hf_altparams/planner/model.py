"""The model the planner costs: built on ``meta`` (no memory) from a config, a checkpoint folder or a factory.

:func:`build_model` builds it; :func:`dtype_from_name` reads the dtype names the
planner accepts (:data:`DTYPE_NAMES`: ``build_model(dtype=)`` and every ``--*dtype``
flag of ``python -m hf_altparams plan``).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from ..errors import PlanError

__all__ = ["DTYPE_NAMES", "build_model", "dtype_from_name"]

#: The dtype names the planner accepts (its ``--*dtype`` flags, ``build_model(dtype=)``): torch's, and the
#: short ones of Accelerate's ``mixed_precision`` and the Trainer's ``bf16``/``fp16`` flags; any case, and
#: ``torch.`` in front allowed.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def dtype_from_name(value: Union[str, torch.dtype], argument: str) -> torch.dtype:
    """The torch dtype a planner flag names: ``"bf16"``, ``"bfloat16"``, ``"torch.bfloat16"``, ... (:data:`DTYPE_NAMES`).

    `argument` is how the error names the flag or argument (e.g. ``"`--storage-dtype`"``).

    Example:
        >>> dtype_from_name("bf16", "`--storage-dtype`"), dtype_from_name("torch.Float16", "`dtype`")
        (torch.bfloat16, torch.float16)
        >>> dtype_from_name("int8", "`--storage-dtype`")
        Traceback (most recent call last):
        ...
        hf_altparams.errors.PlanError: `--storage-dtype` must name a float dtype: bf16/bfloat16, fp16/float16/half, fp32/float32/float (any case, 'torch.' in front allowed), got 'int8'
    """
    if isinstance(value, torch.dtype) and value in DTYPE_NAMES.values():
        return value
    key = value.strip().lower() if isinstance(value, str) else None
    if key is not None and key.startswith("torch."):
        key = key[len("torch.") :]
    if key in DTYPE_NAMES:
        return DTYPE_NAMES[key]
    spellings: dict[torch.dtype, list[str]] = {}
    for name, dtype in DTYPE_NAMES.items():
        spellings.setdefault(dtype, []).append(name)
    accepted = ", ".join("/".join(names) for names in spellings.values())
    raise PlanError(
        f"{argument} must name a float dtype: {accepted} (any case, 'torch.' in front allowed), got {value!r}"
    )


def build_model(
    model: str, *, model_class: str = "AutoModel", dtype: Union[str, torch.dtype, None] = None, device: str = "meta"
) -> nn.Module:
    """Build a model on ``device`` (``meta``: no memory) from a config, checkpoint folder or factory.

    Args:
        model: a transformers config JSON file, a checkpoint folder holding
            ``config.json`` (read locally, never from a hub; weights are not
            loaded), or an import path ``"pkg.module:factory"`` whose factory
            takes no arguments and returns an ``nn.Module``.
        model_class: the transformers class for a config, e.g. ``"AutoModel"``
            or ``"AutoModelForSequenceClassification"``.
        dtype: the dtype to cast to (``"bf16"``/``"bfloat16"``, ``"fp16"``/``"float16"``,
            ``"fp32"``/``"float32"``, or a torch dtype); ``None`` keeps it.
        device: where to build (``"meta"``; ``"cpu"`` for a real model).

    Example:
        >>> net = build_model("torch.nn:Identity")
        >>> type(net).__name__
        'Identity'
    """
    cast = None if dtype is None else dtype_from_name(dtype, "`dtype` (--dtype)")
    path = Path(model)
    if path.exists():
        built = _from_config(path, model_class, device)
    elif ":" in model:
        built = _from_factory(model, device)
    else:
        raise PlanError(
            f"`model` (--model) {model!r} is neither an existing config JSON or checkpoint "
            "folder nor an import path 'pkg.module:factory' (hub names are not fetched: "
            "save the config locally first)"
        )
    return built.to(cast) if cast is not None else built


def _from_config(path: Path, model_class: str, device: str) -> nn.Module:
    import transformers

    if path.is_dir() and not (path / "config.json").is_file():
        raise PlanError(f"`model` (--model) folder {str(path)!r} holds no config.json")
    cls: Any = getattr(transformers, model_class, None)
    if not hasattr(cls, "from_config"):
        raise PlanError(
            f"`model_class` (--model-class) {model_class!r} is not a transformers class with "
            "`from_config`; use e.g. AutoModel, AutoModelForSequenceClassification, AutoModelForCausalLM"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise PlanError(f"cannot read a transformers config from `model` (--model) {str(path)!r}: {err}") from err
    with torch.device(device):
        built = cls.from_config(config)
    if not isinstance(built, nn.Module):
        raise PlanError(
            f"`model_class` (--model-class) {model_class!r} built a {type(built).__name__}, not an nn.Module"
        )
    return built


def _from_factory(spec: str, device: str) -> nn.Module:
    module_name, _, attr = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as err:
        raise PlanError(f"`model` (--model) import path {spec!r} cannot be resolved: {err}") from err
    if not callable(target):
        raise PlanError(f"`model` (--model) {spec!r} is a {type(target).__name__}, not a callable factory")
    with torch.device(device):
        built = target()
    if not isinstance(built, nn.Module):
        raise PlanError(f"`model` (--model) factory {spec!r} returned {type(built).__name__}, not an nn.Module")
    return built
