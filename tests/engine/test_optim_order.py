"""GroupedOptimizer.set_active frees idle groups' state before bringing the active ones' back."""

from __future__ import annotations

import functools

import pytest
import torch

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.optim.idle import IdleState
from hf_altparams.plan import ParamGroups


def test_idle_state_leaves_before_active_state_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    opt = GroupedOptimizer(
        ParamGroups(net, {"a": "0.*", "b": "1.*", "c": "2.*"}),
        functools.partial(torch.optim.Adam, lr=0.1),
        state_policy="offload",
    )
    calls: list[tuple[str, str]] = []
    leave, restore = IdleState.leave, IdleState.restore
    monkeypatch.setattr(IdleState, "leave", lambda self, name: calls.append(("out", name)) or leave(self, name))
    monkeypatch.setattr(IdleState, "restore", lambda self, name: calls.append(("in", name)) or restore(self, name))
    opt.set_active({"a"})  # "a" comes back while "b" and "c" (defined after it) go idle
    assert calls == [("out", "b"), ("out", "c"), ("in", "a")]
