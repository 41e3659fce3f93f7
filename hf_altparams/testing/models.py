"""Small models shared by the check scripts and the benchmarks."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

__all__ = ["TwoHalves"]


class TwoHalves(nn.Module):
    """``second(tanh(first(x)))``: two square ``Linear`` layers of about ``size_mib`` MiB each.

    With ``layers > 1`` each half is a stack of that many square ``Linear``
    layers (``tanh`` between them) of about ``size_mib`` MiB together, so that
    DDP's gradient buckets can overlap the backward pass.

    Example:
        >>> net = TwoHalves(0.01, names=("a", "b"))
        >>> net.a.in_features == net.b.out_features, net(torch.zeros(1, net.a.in_features)).shape[0]
        (True, 1)
    """

    def __init__(self, size_mib: float, names: Sequence[str] = ("layer1", "layer2"), layers: int = 1) -> None:
        super().__init__()
        width = int((size_mib / layers * 2**20 / 4) ** 0.5)
        self.names = tuple(names)
        for name in self.names:
            if layers == 1:
                self.add_module(name, nn.Linear(width, width))
            else:
                stack: list[nn.Module] = []
                for i in range(layers):
                    stack += [nn.Linear(width, width)] + ([nn.Tanh()] if i < layers - 1 else [])
                self.add_module(name, nn.Sequential(*stack))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (getattr(self, name) for name in self.names)
        return second(torch.tanh(first(x)))
