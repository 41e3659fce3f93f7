"""``grouped_optimizer``: one optimizer per group, split like the Trainer's default.

For ``Trainer(optimizers=(grouped_optimizer(groups, ...), None))`` next to
:class:`~hf_altparams.integrations.trainer.AlternatingFreeze`; re-exported there.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import nn
from torch.optim import Optimizer

from ..engine.optim import GroupedOptimizer, PrecisionOptimizer, StatePolicyLike
from ..errors import PlanError
from ..plan.groups import ParamGroups

__all__ = ["grouped_optimizer"]

_NO_DECAY_PATTERNS = tuple(
    re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def _no_decay_names(model: nn.Module) -> set[str]:
    """Parameter names the Trainer's default optimizer exempts from weight decay."""
    names: set[str] = set()
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("LayerNorm", "RMSNorm"))
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if is_norm or any(p.search(full.lower()) for p in _NO_DECAY_PATTERNS):
                names.add(full)
    return names


def grouped_optimizer(
    groups: ParamGroups,
    optimizer_cls: type[Optimizer] = torch.optim.AdamW,
    *,
    weight_decay: float = 0.0,
    state_policy: Union[None, StatePolicyLike, Mapping[str, StatePolicyLike]] = None,
    master_policy: Optional[Union[StatePolicyLike, Mapping[str, StatePolicyLike]]] = None,
    allreduce_dtype: Optional[torch.dtype] = None,
    **optimizer_kwargs: Any,
) -> GroupedOptimizer:
    """One optimizer per group, for ``Trainer(optimizers=(grouped_optimizer(...), None))``.

    Each group's optimizer splits its parameters like the Trainer's default
    (no weight decay for biases and normalisation weights). Give the same
    ``groups`` to :class:`AlternatingFreeze`: at every switch it makes the
    phase's groups the active ones, and idle groups' optimizer state follows
    ``state_policy`` (``"offload"`` moves it to the CPU while they are frozen).

    Args:
        groups: ParamGroups built on the model passed to the Trainer.
        optimizer_cls: a ``torch.optim.Optimizer`` class.
        weight_decay: weight decay of the decayed parameters.
        state_policy: ``"keep"``, ``"offload"`` or ``"drop"``, or one per group;
            ``None`` (default): the run's (``"drop"`` under ``lisa`` and
            ``badam``, ``"keep"`` otherwise; :class:`AlternatingFreeze`'s
            ``switcher_options={"idle_state": ...}`` sets it for the run).
        master_policy: for a model stored in bf16/fp16 (e.g. loaded with
            ``dtype=torch.bfloat16``) the result is a
            :class:`~hf_altparams.engine.PrecisionOptimizer`: fp32 masters and
            optimizer state for the training groups only; this is what an idle
            group's master does (``"offload"``, ``"drop"`` or ``"keep"``;
            ``None``: the run's, ``"drop"`` under ``lisa`` and ``badam``,
            ``"offload"`` otherwise). Giving it for an fp32 model also returns a
            PrecisionOptimizer (with no masters: nothing to do).
        allreduce_dtype: with a PrecisionOptimizer, the dtype DDP all-reduces the
            gradients in: ``None`` (the storage dtype) or ``torch.float32``
            (see :class:`~hf_altparams.engine.PrecisionOptimizer`); giving it
            returns a PrecisionOptimizer, as ``master_policy`` does.
        **optimizer_kwargs: passed to ``optimizer_cls`` (``lr=...``, ``betas=...``).

    Example:
        >>> import torch
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> opt = grouped_optimizer(groups, lr=1e-3, weight_decay=0.01, state_policy="offload")
        >>> [g["weight_decay"] for g in opt.inner["a"].param_groups]
        [0.01, 0.0]
    """
    if not isinstance(groups, ParamGroups):
        raise PlanError(f"`groups` must be ParamGroups built on the model, got {type(groups).__name__}")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
        raise PlanError(f"`optimizer_cls` must be a torch.optim.Optimizer class, got {optimizer_cls!r}")
    no_decay = _no_decay_names(groups.module)

    def factory_for(group: str) -> Callable[[list[nn.Parameter]], Optimizer]:
        named = groups.named_params(group)

        def build(_params: list[nn.Parameter]) -> Optimizer:
            decay = [p for n, p in named if n not in no_decay]
            plain = [p for n, p in named if n in no_decay]
            param_groups: list[dict[str, Any]] = [
                {"params": ps, "weight_decay": wd} for ps, wd in ((decay, weight_decay), (plain, 0.0)) if ps
            ]
            return optimizer_cls(param_groups, **optimizer_kwargs)

        return build

    factories = {g: factory_for(g) for g in groups.names}
    low = {p.dtype for n in groups.names for p in groups.params(n)} & {torch.bfloat16, torch.float16}
    if master_policy is not None or allreduce_dtype is not None or low:
        return PrecisionOptimizer(
            groups,
            factories,
            storage_dtype=None,
            state_policy=state_policy,
            master_policy=master_policy,
            allreduce_dtype=allreduce_dtype,
        )
    return GroupedOptimizer(groups, factories, state_policy=state_policy)
