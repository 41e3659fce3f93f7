"""The frozen-prefix cache sees every change to the prefix's weights, by any route, before serving a row.

A warm cache (every batch hits) over a frozen embeddings stage and block 0; then
the prefix's weights change by one route; the next training forward must give
exactly what the same model computes without the cache (the stale rows dropped,
the prefix run again). Torch's version counter misses ``.data`` writes and writes
through a NumPy view, and the parameter list taken at attach time misses a
swapped ``nn.Parameter``: each route is one case.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn

from hf_altparams.engine.prefix import FrozenPrefix, FrozenPrefixCache
from tests.support.models import TinyEncoder

ROUTES: dict[str, Callable[[TinyEncoder], None]] = {
    "data_copy": lambda m: m.layers[0].ff[0].weight.data.copy_(torch.full_like(m.layers[0].ff[0].weight, 0.01)),
    "data_ema": lambda m: m.embeddings.tok.weight.data.mul_(0.9).add_(0.1),  # an EMA update through .data
    "numpy_view": lambda m: m.layers[0].norm.bias.detach().numpy().__setitem__(0, 0.5),
    "load_state_dict": lambda m: m.load_state_dict(
        {k: (v + 0.25 if k.startswith("layers.0.") else v) for k, v in m.state_dict().items()}
    ),
    "no_grad_in_place": lambda m: _no_grad(lambda: m.embeddings.norm.weight.mul_(2.0)),
    "swapped_parameter": lambda m: setattr(
        m.layers[0].ff[2], "weight", nn.Parameter(m.layers[0].ff[2].weight.detach() * -1.0, requires_grad=False)
    ),
    "data_row": lambda m: m.embeddings.tok.weight.data[3].zero_(),  # one row, through .data
}


def _no_grad(write: Callable[[], object]) -> None:
    with torch.no_grad():
        write()


def _frozen_prefix_model() -> tuple[TinyEncoder, FrozenPrefixCache]:
    torch.manual_seed(0)
    model = TinyEncoder(layers=3, dropout=0.0)
    model.embeddings.requires_grad_(False)
    model.layers[0].requires_grad_(False)
    return model, FrozenPrefixCache(model, FrozenPrefix()).attach()


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_changed_prefix_weight_is_never_served_from_the_cache(route: str) -> None:
    model, cache = _frozen_prefix_model()
    x, idx = torch.randint(0, 50, (8, 6), generator=torch.Generator().manual_seed(1)), torch.arange(8)
    model(x, sample_index=idx)  # computes and stores the rows
    model(x, sample_index=idx)  # warm: served from the cache
    assert cache.depth == 2 and cache.record.hit_batches == 1

    ROUTES[route](model)
    served = model(x, sample_index=idx)  # must not come from the rows of the old weights

    model.eval()  # evaluation never uses the cache: the prefix runs on the current weights (no dropout here)
    cache_free = model(x)
    model.train()
    assert torch.equal(served, cache_free), (route, float((served - cache_free).abs().max()))
    assert cache.record.hit_batches == 0 and cache.record.miss_batches == 1  # the rows were dropped
    assert model(x, sample_index=idx).equal(served) and cache.record.hit_batches == 1  # and refilled
    cache.detach()


def test_an_unchanged_prefix_keeps_hitting() -> None:
    model, cache = _frozen_prefix_model()
    x, idx = torch.randint(0, 50, (8, 6), generator=torch.Generator().manual_seed(1)), torch.arange(8)
    first = model(x, sample_index=idx)
    with torch.no_grad():
        model.head[1].weight.mul_(1.5)  # the trainable part changes, as in training: the rows stay valid
    for _ in range(3):
        model(x, sample_index=idx)
    assert cache.record.hit_batches == 3 and cache.record.miss_batches == 1, cache.record
    assert not torch.equal(first, model(x, sample_index=idx))
    cache.detach()
