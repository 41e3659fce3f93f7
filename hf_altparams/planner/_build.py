"""Building a model on ``meta`` (no memory) from a config, a checkpoint folder or a factory."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from ..errors import PlanError
from ._sizes import dtype_from_name

__all__ = ["build_model"]


def build_model(model: str, *, model_class: str = "AutoModel", dtype: Union[str, torch.dtype, None] = None,
                device: str = "meta") -> nn.Module:
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
        raise PlanError(f"`model` (--model) {model!r} is neither an existing config JSON or checkpoint "
                        "folder nor an import path 'pkg.module:factory' (hub names are not fetched: "
                        "save the config locally first)")
    return built.to(cast) if cast is not None else built


def _from_config(path: Path, model_class: str, device: str) -> nn.Module:
    import transformers

    if path.is_dir() and not (path / "config.json").is_file():
        raise PlanError(f"`model` (--model) folder {str(path)!r} holds no config.json")
    cls: Any = getattr(transformers, model_class, None)
    if not hasattr(cls, "from_config"):
        raise PlanError(f"`model_class` (--model-class) {model_class!r} is not a transformers class with "
                        "`from_config`; use e.g. AutoModel, AutoModelForSequenceClassification, AutoModelForCausalLM")
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise PlanError(f"cannot read a transformers config from `model` (--model) {str(path)!r}: {err}") from err
    with torch.device(device):
        return cls.from_config(config)


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
