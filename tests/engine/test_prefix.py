"""Frozen-prefix cache on one process: equivalence with the uncached run, invalidation, disk spill, errors.

The two-rank runs (PhasedAccelerator, resume) are in ``tests/integrations/test_prefix_distributed.py``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Optional

import pytest
import torch
from torch import nn

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.engine.prefix import FrozenPrefix, FrozenPrefixCache, as_frozen_prefix
from hf_altparams.errors import AltParamsError, PlanError
from hf_altparams.plan import GradualUnfreeze, ParamGroups, ProgressiveFreeze, Schedule
from tests.support.models import TinyEncoder

N, SEQ, BATCH, LAYERS = 24, 6, 6, 4
GROUPS = {"emb": "embeddings.*", **{f"layer{i}": f"layers.{i}.*" for i in range(LAYERS)}, "head": "head.*"}
SCHEDULES = {
    "progressive": lambda: ProgressiveFreeze(
        ["emb", "layer0", "layer1", "layer2"], every=2, unit="epoch", always=["layer3", "head"]
    ),
    "gradual": lambda: GradualUnfreeze(
        ["emb", "layer0", "layer1", "layer2", "layer3"], every=2, unit="epoch", order="last_to_first", always=["head"]
    ),
}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(0, 50, (N, SEQ), generator=gen), torch.randint(0, 4, (N,), generator=gen)


def train(schedule: Schedule, option: FrozenPrefix, epochs: int = 8) -> tuple[nn.Module, FrozenPrefixCache, int]:
    """A shuffled epoch loop driving the switcher; returns the model, the cache and the embedding calls."""
    torch.manual_seed(0)
    model = TinyEncoder(layers=LAYERS, dropout=0.1)
    groups = ParamGroups(model, GROUPS)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    switcher = PhaseSwitcher(groups, schedule, optimizer=opt)
    cache = FrozenPrefixCache(model, option).attach()
    calls = [0]
    model.embeddings.tok.register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    x, y = data()
    step = 0
    torch.manual_seed(1)  # the suffix's dropout: the same draws with and without the cache
    for epoch in range(epochs):
        switcher.step_to(step, epoch)
        order = torch.randperm(N, generator=torch.Generator().manual_seed(epoch))
        for b in range(0, N, BATCH):
            idx = order[b : b + BATCH]
            model(x[idx], labels=y[idx], sample_index=idx).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
    return model, cache, calls[0]


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("kind", sorted(SCHEDULES))
def test_cache_equals_uncached_run_and_skips_the_prefix(kind: str) -> None:
    reference, ref_cache, ref_calls = train(SCHEDULES[kind](), FrozenPrefix(cache=False))
    cached, cache, calls = train(SCHEDULES[kind](), FrozenPrefix())
    assert max_diff(reference, cached) < 1e-6  # bitwise equal on the CPUs tried
    records = [*cache.records, cache.record]
    # progressive: the prefix grows (embeddings, then blocks); gradual: it shrinks from three blocks
    assert [r.depth for r in records] == ([1, 2, 3] if kind == "progressive" else [4, 3, 2, 1])
    # every phase lasts two epochs: the first computes the prefix, the second reads it
    for r in records:
        assert r.hit_samples == N and r.miss_samples == N, r
        assert r.memory_bytes == N * SEQ * 16 * 4 and r.disk_bytes == 0
    assert calls == ref_calls - N // BATCH * len(records)  # the embeddings did not run on hits
    assert not ref_cache.records and ref_cache.record.hit_samples == 0


def test_spill_to_disk_gives_the_same_run_and_removes_its_file(tmp_path: Any) -> None:
    reference, _, _ = train(SCHEDULES["progressive"](), FrozenPrefix(cache=False), epochs=4)
    option = FrozenPrefix(memory_budget_bytes=5 * SEQ * 16 * 4, disk_dir=str(tmp_path))
    cached, cache, _ = train(SCHEDULES["progressive"](), option, epochs=4)
    assert max_diff(reference, cached) < 1e-5
    assert cache.record.memory_bytes == 5 * SEQ * 16 * 4 and cache.record.disk_bytes == (N - 5) * SEQ * 16 * 4
    assert cache.record.hit_samples == N
    path = cache.store.path
    assert path is not None and os.path.exists(path)
    cache.detach()
    assert not os.path.exists(path) and os.listdir(tmp_path) == []


def frozen_model(option: Optional[FrozenPrefix] = None) -> tuple[TinyEncoder, FrozenPrefixCache]:
    torch.manual_seed(0)
    model = TinyEncoder(layers=3, dropout=0.0)
    model.embeddings.requires_grad_(False)
    model.layers[0].requires_grad_(False)
    return model, FrozenPrefixCache(model, option or FrozenPrefix()).attach()


def test_changed_prefix_weights_are_not_served_from_the_cache() -> None:
    model, cache = frozen_model()
    x, idx = torch.randint(0, 50, (4, SEQ)), torch.arange(4)
    model(x, sample_index=idx), model(x, sample_index=idx)
    assert cache.record.hit_samples == 4
    with torch.no_grad():
        model.layers[0].ff[0].weight.mul_(2.0)  # in place, as load_state_dict does
    out = model(x, sample_index=idx)
    assert cache.records[-1].hit_samples == 4 and cache.record.miss_samples == 4  # a new record, recomputed
    cache.detach()
    assert torch.equal(out, model(x))


def test_unfreezing_shrinks_the_prefix_and_restores_train_mode() -> None:
    model, cache = frozen_model()
    x, idx = torch.randint(0, 50, (4, SEQ)), torch.arange(4)
    model(x, sample_index=idx)
    assert cache.depth == 2 and not model.layers[0].training and not model.embeddings.training
    model.layers[0].requires_grad_(True)
    model(x, sample_index=idx)
    assert cache.depth == 1 and model.layers[0].training and not model.embeddings.training
    assert "forward" not in model.layers[0].__dict__ and len(cache.store) == 4


def test_eval_mode_opt_out_and_evaluation_batches() -> None:
    model, cache = frozen_model(FrozenPrefix(cache=False, eval_frozen=False))
    model(torch.randint(0, 50, (2, SEQ)))
    assert model.embeddings.training
    model, cache = frozen_model()
    model.eval()
    model(torch.randint(0, 50, (2, SEQ)), sample_index=torch.arange(2))  # evaluation: cache untouched
    assert cache.record.miss_samples == 0 and len(cache.store) == 0


def test_forward_signature_shows_the_index_key() -> None:
    model, _ = frozen_model(FrozenPrefix(index_key="row"))
    assert "row" in inspect.signature(model.forward).parameters  # the Trainer keeps that column


def test_batch_without_index_is_refused_or_recomputed() -> None:
    model, _ = frozen_model()
    with pytest.raises(AltParamsError, match="sample_index=.*with_indices=True"):
        model(torch.randint(0, 50, (2, SEQ)))
    model, cache = frozen_model(FrozenPrefix(missing_index="recompute"))
    with pytest.warns(UserWarning, match="without `sample_index`"):
        model(torch.randint(0, 50, (2, SEQ)))
    assert len(cache.store) == 0


class Scaled(TinyEncoder):
    """Transforms the embeddings' output before the first block: the forward cannot start from a row."""

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.embeddings(input_ids) * 2.0
        for block in self.layers:
            hidden = block(hidden)[0]
        return self.head(hidden.mean(dim=1))


def test_layout_the_cache_cannot_replay_is_refused() -> None:
    model = Scaled(layers=2, dropout=0.0)
    model.embeddings.requires_grad_(False)
    FrozenPrefixCache(model, FrozenPrefix()).attach()
    with pytest.raises(AltParamsError, match="input of stage 'layers.0' is not the output of 'embeddings'"):
        model(torch.randint(0, 50, (2, SEQ)), sample_index=torch.arange(2))


def test_prefix_fed_by_a_trainable_tensor_is_refused() -> None:
    model = TinyEncoder(layers=2, dropout=0.0)
    model.embeddings.requires_grad_(False)
    model.layers[0].requires_grad_(False)
    prompt = nn.Parameter(torch.zeros(16))
    table = model.embeddings.tok
    model.embeddings.forward = lambda ids: table(ids) + prompt  # type: ignore[method-assign]
    cache = FrozenPrefixCache(model, FrozenPrefix()).attach()
    with pytest.raises(AltParamsError, match="input 0 of the frozen stage 'layers.0' requires grad"):
        model(torch.randint(0, 50, (2, SEQ)), sample_index=torch.arange(2))
    model.layers[0].requires_grad_(True)  # the prefix is the embeddings alone: its output is checked
    with pytest.raises(AltParamsError, match="the 'output' of the frozen stage 'embeddings' requires grad"):
        model(torch.randint(0, 50, (2, SEQ)), sample_index=torch.arange(2))
    assert len(cache.store) == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"augmentation": True}, "augmentation=True"),
        ({"missing_index": "skip"}, "`missing_index` must be"),
        ({"memory_budget_bytes": -1}, "`memory_budget_bytes`"),
        ({"index_key": ""}, "`index_key`"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        FrozenPrefix(**kwargs)


def test_bad_model_options_are_refused() -> None:
    with pytest.raises(PlanError, match="stages hold dropout"):
        FrozenPrefixCache(TinyEncoder(dropout=0.1), FrozenPrefix(eval_frozen=False))
    with pytest.raises(PlanError, match="`blocks`='encoder.layer' is not a submodule"):
        FrozenPrefixCache(TinyEncoder(), FrozenPrefix(blocks="encoder.layer"))
    with pytest.raises(PlanError, match="must name a non-empty nn.ModuleList"):
        FrozenPrefixCache(TinyEncoder(), FrozenPrefix(blocks="head"))
    with pytest.raises(PlanError, match="`frozen_prefix` must be"):
        as_frozen_prefix("yes")
