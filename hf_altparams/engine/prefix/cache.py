"""The frozen-prefix cache: the forward starts from the cached output of the frozen leading layers.

The model is seen as stages: the embeddings, then the blocks of a ``ModuleList``.
The *frozen prefix* is the longest run of leading stages with no trainable
parameter (a parameter shared with a trainable layer is trainable: tracked by
identity). It is found again at every training forward from ``requires_grad``,
which the phase switch sets from the schedule and the groups, so it follows
progressive freezing (the prefix grows) and gradual unfreezing (it shrinks).

While frozen, the prefix runs in eval mode (no dropout). With ``cache=True``
the root module's ``forward`` takes the sample indices (``index_key``); a batch
whose every index is held skips the prefix: the embeddings return the cached
output of the last frozen block and the frozen blocks pass their input through.
A batch with any index missing runs the prefix and stores the missing rows.
The cache is cleared when the prefix changes or one of its weights changes by
any route (a new tensor, ``load_state_dict``, a write through ``.data``): the
stages' parameters (and buffers, in eval mode) are compared by identity and by
content before every training forward (:mod:`._weights`).
"""

from __future__ import annotations

import inspect
import time
import types
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ...errors import AltParamsError, PlanError
from ..torch_internals import DROPOUT_BASE
from ._store import ActivationStore
from ._weights import PrefixWeights
from .config import FrozenPrefix

__all__ = ["FrozenPrefixCache", "PrefixRecord", "find_stages"]

_HIT, _MISS, _RUN = "hit", "miss", "run"


@dataclass
class PrefixRecord:
    """What the cache did while one prefix stayed frozen (one record per prefix).

    ``depth`` counts stages (the embeddings, then blocks); samples and batches
    that hit or missed; ``compute_seconds`` ran the prefix on missing batches,
    ``load_seconds`` gathered cached rows; bytes held in memory and on disk.

    Example:
        >>> r = PrefixRecord(2, ("emb", "layers.0"), hit_samples=30, miss_samples=10, compute_seconds=1.0)
        >>> r.hit_rate, r.seconds_saved, r.as_log()["altparams/prefix_hit_rate"]
        (0.75, 3.0, 0.75)
    """

    depth: int
    stages: tuple[str, ...]
    hit_samples: int = 0
    miss_samples: int = 0
    hit_batches: int = 0
    miss_batches: int = 0
    compute_seconds: float = 0.0  # spent running the prefix on computing batches
    load_seconds: float = 0.0  # spent gathering cached rows
    memory_bytes: int = 0
    disk_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        seen = self.hit_samples + self.miss_samples
        return self.hit_samples / seen if seen else 0.0

    @property
    def seconds_saved(self) -> float:
        """Estimated prefix time avoided on hits (per-sample cost of misses), less the load time."""
        if not self.miss_samples:
            return 0.0
        return self.hit_samples * self.compute_seconds / self.miss_samples - self.load_seconds

    def as_log(self, prefix: str = "altparams/") -> dict[str, Union[int, float]]:
        data = {k: v for k, v in asdict(self).items() if k != "stages"}
        data.update(hit_rate=self.hit_rate, seconds_saved=self.seconds_saved)
        return {f"{prefix}prefix_{k}": v for k, v in data.items()}


def _get(model: nn.Module, path: str, argument: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError as err:
        raise PlanError(f"`{argument}`={path!r} is not a submodule of {type(model).__name__}: {err}") from err


def find_stages(model: nn.Module, config: FrozenPrefix) -> tuple[list[str], list[nn.Module]]:
    """The stages (names and modules): the embeddings, then every block.

    Example:
        >>> from transformers import BertConfig, BertModel
        >>> config = BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        ...                     intermediate_size=16)
        >>> names, _ = find_stages(BertModel(config), FrozenPrefix())
        >>> names
        ['embeddings', 'encoder.layer.0', 'encoder.layer.1']
    """
    if config.blocks is not None:
        blocks = _get(model, config.blocks, "blocks")
        blocks_name = config.blocks
    else:
        lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
        if not lists:
            raise PlanError(f"{type(model).__name__} has no ModuleList of blocks; pass `FrozenPrefix(blocks=...)`")
        blocks_name, blocks = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    if not isinstance(blocks, nn.ModuleList) or not len(blocks):
        raise PlanError(f"`blocks`={blocks_name!r} must name a non-empty nn.ModuleList, got {type(blocks).__name__}")
    if config.embeddings is not None:
        emb_name, emb = config.embeddings, _get(model, config.embeddings, "embeddings")
    else:
        getter = getattr(model, "get_input_embeddings", None)
        table = getter() if callable(getter) else None
        names = {id(m): n for n, m in model.named_modules()}
        if table is None or id(table) not in names:
            raise PlanError(
                f"cannot find the embeddings of {type(model).__name__}; pass `FrozenPrefix(embeddings=...)`"
            )
        emb_name = names[id(table)]
        parent = emb_name.rpartition(".")[0]
        if parent.endswith("embeddings"):
            emb_name = parent
        emb = model.get_submodule(emb_name)
    return [emb_name] + [f"{blocks_name}.{i}" for i in range(len(blocks))], [emb, *blocks]


def _hidden_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _hidden_out(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _like(length: Optional[int], hidden: torch.Tensor) -> Any:
    """``hidden`` in the structure of a block's real output: a tensor (``None``) or a tuple of ``length``."""
    if length is None:
        return hidden
    return (hidden,) + tuple(None for _ in range(length - 1))


class FrozenPrefixCache:
    """Runs the frozen prefix in eval mode and, with ``cache=True``, from cached outputs.

    Args:
        model: the raw model (not a DDP wrapper); its ``forward`` is replaced by
            one that takes ``config.index_key`` (see :meth:`attach`).
        config: the :class:`FrozenPrefix` options.

    Example:
        >>> import torch
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(vocab_size=50, hidden_size=8, num_hidden_layers=3, num_attention_heads=2,
        ...                              intermediate_size=16, hidden_dropout_prob=0.0,
        ...                              attention_probs_dropout_prob=0.0))
        >>> cache = FrozenPrefixCache(model, FrozenPrefix()).attach()
        >>> _ = model.embeddings.requires_grad_(False), model.encoder.layer[0].requires_grad_(False)
        >>> x, idx = torch.randint(0, 50, (4, 6)), torch.arange(4)
        >>> a = model(x, sample_index=idx).last_hidden_state; b = model(x, sample_index=idx).last_hidden_state
        >>> torch.allclose(a, b), cache.depth, cache.record.hit_samples, cache.record.miss_samples
        (True, 2, 4, 4)
        >>> cache.detach()
    """

    def __init__(self, model: nn.Module, config: FrozenPrefix) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.model, self.config = model, config
        self.stage_names, self.stages = find_stages(model, config)
        self._stage_params = [list(m.parameters()) for m in self.stages]
        if config.cache and not config.eval_frozen:
            drops = [
                n
                for n, m in model.named_modules()
                if isinstance(m, DROPOUT_BASE)
                and float(m.p) > 0
                and any(m is s or any(m is x for x in s.modules()) for s in self.stages)
            ]
            if drops:
                raise PlanError(
                    f"`FrozenPrefix(eval_frozen=False)` with `cache=True`: the stages hold dropout {drops[:3]}, so the "
                    "prefix output is random and a cached one would replay a single draw; keep `eval_frozen=True` "
                    "or pass `cache=False`"
                )
        self.store = ActivationStore(config.memory_budget_bytes, config.disk_dir)
        self.depth = 0
        self.records: list[PrefixRecord] = []
        self.record = PrefixRecord(0, ())
        self._weights = PrefixWeights(with_buffers=config.eval_frozen)  # what the rows were computed from
        self._installed: list[tuple[nn.Module, Any]] = []
        self._mode: Optional[str] = None
        self._rows: Optional[torch.Tensor] = None
        self._indices: list[int] = []
        self._formats: dict[int, Optional[int]] = {}
        self._checking = False
        self._expected: Optional[torch.Tensor] = None
        self._check_hook: Any = None
        self._started = 0.0
        self._warned = False
        self._attached = False

    # ------------------------------------------------------------------ life cycle
    def attach(self) -> FrozenPrefixCache:
        """Replace ``model.forward`` by one that takes ``index_key`` (its signature shows it, so the
        Trainer keeps that dataset column). Returns ``self``."""
        model, key, inner = self.model, self.config.index_key, self.model.forward

        def forward(this: nn.Module, *args: Any, **kwargs: Any) -> Any:
            indices = kwargs.pop(key, None)
            if not self._attached:
                return inner(*args, **kwargs)
            return self._forward(inner, indices, args, kwargs)

        sig = inspect.signature(inner)
        params = [p for p in sig.parameters.values() if p.kind is not p.VAR_KEYWORD]
        extra = [p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD]
        self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
        index_param = inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=None)
        forward.__signature__ = sig.replace(parameters=[self_param, *params, index_param, *extra])  # type: ignore[attr-defined]
        model.forward = types.MethodType(forward, model)
        self._attached = True
        return self

    def detach(self) -> None:
        """Restore every module, clear the cache; ``model.forward`` then passes indices through unused."""
        self._set_depth(0)
        self._attached = False
        self.store.clear()

    def reset(self) -> None:
        """Forget the cached rows and start a new record (e.g. at the start of ``train()``)."""
        self._set_depth(0)

    def metrics(self, prefix: str = "altparams/") -> dict[str, Union[int, float]]:
        """The current record as flat log values, plus totals over every record."""
        out = self.record.as_log(prefix)
        done = [*self.records, self.record]
        out[f"{prefix}prefix_seconds_saved_total"] = sum(r.seconds_saved for r in done)
        out[f"{prefix}prefix_hit_samples_total"] = sum(r.hit_samples for r in done)
        return out

    # ------------------------------------------------------------------ the prefix
    def _frozen_depth(self) -> int:
        self._stage_params = [list(m.parameters()) for m in self.stages]  # a swapped Parameter counts as it is now
        depth = 0
        for params in self._stage_params:
            if any(p.requires_grad for p in params):
                break
            depth += 1
        return depth

    def _set_depth(self, depth: int) -> None:
        for module, previous in self._installed:  # back to the forward each stage had before
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._installed = []
        if self.config.eval_frozen:  # stages leaving the prefix train again with the model
            for stage in self.stages[depth : self.depth]:
                stage.train(self.model.training)
        if self.record.hit_samples or self.record.miss_samples:
            self.records.append(self.record)
        self.store.clear()
        self._formats.clear()
        self.depth = depth
        self.record = PrefixRecord(depth, tuple(self.stage_names[:depth]))
        self._checking = self.config.check_layout
        if self.config.cache:
            self._weights.capture(self.stages[:depth])
        if depth and self.config.cache:
            for i, stage in enumerate(self.stages[:depth]):
                self._installed.append((stage, stage.__dict__.get("forward")))
                stage.forward = self._stage_forward(i, stage.forward)

    def _refresh(self) -> None:
        depth = self._frozen_depth()
        if depth != self.depth:
            self._set_depth(depth)
        elif depth and self.config.cache and self._weights.changed(self.stages[:depth]):
            self._set_depth(depth)  # a frozen weight changed (load_state_dict, .data, a move): the rows are stale

    # ------------------------------------------------------------------ forward
    def _forward(self, inner: Callable[..., Any], indices: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.model.training:
            return inner(*args, **kwargs)  # evaluation: other samples, other indices
        self._refresh()
        if not self.depth:
            return inner(*args, **kwargs)
        if self.config.eval_frozen:
            for stage in self.stages[: self.depth]:
                stage.train(False)
        if not self.config.cache:
            return inner(*args, **kwargs)
        if indices is None:
            self._missing_index()
            return inner(*args, **kwargs)
        self._indices = [int(i) for i in (indices.tolist() if isinstance(indices, torch.Tensor) else indices)]
        rows = None if self._checking else self.store.get(self._indices)
        start = time.perf_counter()
        if rows is not None:
            self._mode, self._rows = _HIT, rows
            self.record.load_seconds += time.perf_counter() - start
        else:
            self._mode = _MISS
        try:
            return inner(*args, **kwargs)
        finally:
            self._mode, self._rows, self._expected = None, None, None
            if self._check_hook is not None:
                self._check_hook.remove()
                self._check_hook = None

    def _missing_index(self) -> None:
        key = self.config.index_key
        if self.config.missing_index == "error":
            raise AltParamsError(
                f"the frozen-prefix cache needs each training batch's dataset indices as `{key}=` (an int tensor "
                f"[batch]) in the model call; this batch has none. Add an index column to the dataset (e.g. "
                f"`ds.map(lambda e, i: {{'{key}': i}}, with_indices=True)`) and pass it with the inputs, or "
                "pass `FrozenPrefix(missing_index='recompute')` to run the prefix for such batches"
            )
        if not self._warned:
            warnings.warn(
                f"frozen-prefix cache: a training batch came without `{key}`; its prefix is recomputed "
                "and nothing is cached for it",
                stacklevel=4,
            )
            self._warned = True

    def _stage_forward(self, i: int, original: Callable[..., Any]) -> Callable[..., Any]:
        last = i == self.depth - 1

        def run(*args: Any, **kwargs: Any) -> Any:
            if self._mode == _HIT:
                if i == 0:
                    rows = self._rows
                    assert rows is not None
                    start = time.perf_counter()
                    device = next(iter(self._stage_params[0]), rows).device
                    self._rows = rows.to(device, non_blocking=True)
                    self.record.load_seconds += time.perf_counter() - start
                    self.record.hit_batches += 1
                    self.record.hit_samples += len(self._indices)
                    return self._rows
                return _like(self._formats[i], _hidden_in(args, kwargs))
            if self._mode != _MISS:
                return original(*args, **kwargs)
            self._refuse_trainable(
                [k for k, v in (*enumerate(args), *kwargs.items()) if isinstance(v, torch.Tensor) and v.requires_grad],
                "input {} of",
                i,
            )
            if i == 0:
                self._started = time.perf_counter()
            elif self._checking:
                self._check_input(i, _hidden_in(args, kwargs))
            out = original(*args, **kwargs)
            self._formats[i] = None if isinstance(out, torch.Tensor) else len(out)
            self._expected = _hidden_out(out)
            if last:
                self._refuse_trainable(["output"] if _hidden_out(out).requires_grad else [], "the {} of", i)
                self._store(_hidden_out(out))
            return out

        return run

    def _refuse_trainable(self, found: list[Any], what: str, i: int) -> None:
        if found:
            raise AltParamsError(
                f"frozen-prefix cache: {what.format(repr(found[0]))} the frozen stage {self.stage_names[i]!r} "
                "requires grad: it comes from trainable parameters outside the stages (a soft prompt, a trainable "
                "input projection), so a cached output would go stale. Pass `cache=False`"
            )

    def _store(self, hidden: torch.Tensor) -> None:
        missing = [j for j, idx in enumerate(self._indices) if idx not in self.store]
        if missing:
            rows = hidden.detach()[missing].to("cpu")  # one device-to-host copy per batch
            self.store.put([self._indices[j] for j in missing], rows)
        self.record.compute_seconds += time.perf_counter() - self._started
        self.record.miss_batches += 1
        self.record.miss_samples += len(self._indices)
        self.record.memory_bytes, self.record.disk_bytes = self.store.memory_bytes, self.store.disk_bytes
        if self._checking and self.depth < len(self.stages):
            self._check_hook = self.stages[self.depth].register_forward_pre_hook(
                lambda m, a, k: self._check_input(self.depth, _hidden_in(a, k)), with_kwargs=True
            )
        elif self._checking:
            self._checking = False

    def _check_input(self, i: int, hidden: torch.Tensor) -> None:
        expected = self._expected
        if expected is not None and hidden is not expected and not torch.equal(hidden, expected):
            raise AltParamsError(
                f"frozen-prefix cache: the input of stage {self.stage_names[i]!r} is not the output of "
                f"{self.stage_names[i - 1]!r} (the forward transforms it in between), so the forward cannot start "
                "from a cached output. Name the stages with `FrozenPrefix(embeddings=..., blocks=...)` so that "
                "each feeds the next, or pass `cache=False`"
            )
        if i == self.depth:
            self._checking = False
        if self._check_hook is not None and i == self.depth:
            self._check_hook.remove()
            self._check_hook = None
