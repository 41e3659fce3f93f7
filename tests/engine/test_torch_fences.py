"""The engine's fence around the private torch names it uses outside ddp/ and fsdp2/ (engine/torch_internals.py).

One test per use: each fails if the installed torch changes what the library
relies on (the DDP and FSDP2 fences have their own tests).
"""

from __future__ import annotations

import torch
from torch import nn

from hf_altparams.engine import torch_internals
from hf_altparams.engine.torch_internals import DROPOUT_BASE, NORM_BASE, version_counter


def test_every_private_name_exists_in_this_torch() -> None:
    assert torch_internals.missing_private_names() == []


def test_the_version_counter_moves_with_every_in_place_write_and_only_then() -> None:
    tensor = torch.zeros(3)
    before = version_counter(tensor)
    _ = tensor + 1  # out of place: unchanged
    assert version_counter(tensor) == before
    tensor.add_(1)
    tensor[0] = 5.0
    assert version_counter(tensor) == before + 2
    assert version_counter(tensor.detach()) == version_counter(tensor)  # shared with its views


def test_the_norm_base_covers_every_norm_layer_with_running_statistics() -> None:
    for layer in (
        nn.BatchNorm1d(2),
        nn.BatchNorm2d(2),
        nn.InstanceNorm1d(2, track_running_stats=True),
        nn.SyncBatchNorm(2),
    ):
        assert isinstance(layer, NORM_BASE), type(layer).__name__
    assert not isinstance(nn.LayerNorm(2), NORM_BASE)  # no running statistics


def test_the_dropout_base_covers_every_dropout_layer() -> None:
    for layer in (nn.Dropout(0.1), nn.Dropout1d(0.1), nn.Dropout2d(0.1), nn.Dropout3d(0.1), nn.AlphaDropout(0.1)):
        assert isinstance(layer, DROPOUT_BASE) and layer.p == 0.1, type(layer).__name__
    assert not isinstance(nn.Identity(), DROPOUT_BASE)
