"""Frozen-prefix cache through the Trainer (one process): the index column survives, hits, equality, resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hf_altparams.engine.prefix import FrozenPrefix
from hf_altparams.integrations.trainer import AlternatingFreeze
from hf_altparams.plan import GradualUnfreeze
from tests.scripts import trainer_phases as S

N, BATCH = 16, 4  # 4 optimizer steps per epoch


class Indexed(S.TokenDataset):
    """The tiny token dataset with each sample's index in `sample_index`."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(i), "sample_index": torch.tensor(i)}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Any:
    yield
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def train(
    out: Path, option: FrozenPrefix, resume: str | None = None, save: bool = False
) -> tuple[Any, AlternatingFreeze]:
    from transformers import Trainer

    model = S.tiny_bert()
    schedule = GradualUnfreeze(["emb", "layer0", "layer1"], every=2, unit="epoch", always=["head"])
    freeze = AlternatingFreeze(
        layers="bert.encoder.layer", extra=S.EXTRA_GROUPS, schedule=schedule, frozen_prefix=option
    )
    args = S.arguments(
        out,
        max_steps=-1,
        num_train_epochs=4,
        gradient_accumulation_steps=1,
        per_device_train_batch_size=BATCH,
        save_strategy="steps" if save else "no",
        save_steps=6,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Indexed(N), callbacks=[freeze])
    trainer.train(resume_from_checkpoint=resume)
    return model, freeze


def test_trainer_keeps_the_index_column_and_the_cached_run_equals_the_uncached_one(tmp_path: Path) -> None:
    reference, _ = train(tmp_path / "plain", FrozenPrefix(cache=False))
    model, freeze = train(tmp_path / "cached", FrozenPrefix(), save=True)
    assert freeze.frozen_prefix is not None
    records = [*freeze.frozen_prefix.records, freeze.frozen_prefix.record]
    # epochs 0-1: embeddings + layer 0 frozen; epochs 2-3: the embeddings; the second epoch of each hits
    assert [(r.depth, r.hit_samples, r.miss_samples) for r in records] == [(2, N, N), (1, N, N)]
    ref = reference.state_dict()
    assert all(torch.allclose(ref[k], v, atol=1e-6) for k, v in model.state_dict().items())
    assert freeze.metrics()["altparams/prefix_hit_rate"] == 0.5

    resumed, again = train(tmp_path / "cached", FrozenPrefix(), resume=str(tmp_path / "cached" / "checkpoint-6"))
    assert all(torch.equal(v, resumed.state_dict()[k]) for k, v in model.state_dict().items())
    assert again.frozen_prefix is not None and again.frozen_prefix.record.hit_samples == N
