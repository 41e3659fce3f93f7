"""The fence around the private DDP APIs: torch version range and required attributes."""

from __future__ import annotations

from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams._compat import TESTED_TORCH, torch_version
from hf_altparams.engine import PhaseSwitcher
from hf_altparams.engine.ddp import _surgery as _ddp
from hf_altparams.errors import SwitchError
from hf_altparams.plan import Alternating, ParamGroups


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


@pytest.fixture
def ddp(gloo_world_1: dist.ProcessGroup) -> Iterator[DDP]:
    yield DDP(_model())


def _switcher(ddp: DDP) -> PhaseSwitcher:
    switcher = PhaseSwitcher(ParamGroups(ddp.module, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))
    return switcher


def test_installed_torch_is_in_the_tested_range() -> None:
    low, high = TESTED_TORCH
    assert low <= torch_version() <= high


def test_every_private_attribute_exists_on_a_real_ddp(ddp: DDP) -> None:
    missing = [name for name in _ddp.PRIVATE_DDP_ATTRIBUTES if not hasattr(ddp, name)]
    assert missing == []
    static = DDP(_model(), static_graph=True)
    assert [n for n in _ddp.STATIC_GRAPH_ATTRIBUTES if not hasattr(static, n)] == []
    _ddp.check_ddp_supported(ddp)  # and the whole fence passes


@pytest.mark.parametrize("version", [(2, 99), (3, 0), (2, 10)])
def test_untested_torch_refused_naming_the_way_out(
    ddp: DDP, version: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_ddp, "torch_version", lambda: version)
    monkeypatch.delenv(_ddp.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(SwitchError) as info:
        _switcher(ddp).attach(ddp)
    message = str(info.value)
    assert f"found torch {version[0]}.{version[1]}" in message
    assert f"{TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]} to {TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1]}" in message
    assert f"{_ddp.ALLOW_UNTESTED_ENV}=1" in message


def test_untested_torch_allowed_with_a_warning_when_opted_in(ddp: DDP, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ddp, "torch_version", lambda: (2, 99))
    monkeypatch.setenv(_ddp.ALLOW_UNTESTED_ENV, "1")
    switcher = _switcher(ddp)
    with pytest.warns(UserWarning, match="outside the tested range"):
        switcher.attach(ddp)
    assert switcher.ddp is ddp
    with pytest.warns(UserWarning, match="outside the tested range"):
        record = switcher.step_to(1)  # the rebuild re-checks, and still works
    assert record is not None and record.rebuilt_ddp


@pytest.mark.parametrize("name", _ddp.PRIVATE_DDP_ATTRIBUTES)
def test_missing_private_attribute_refused_by_name(ddp: DDP, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if name in vars(ddp) or name in ddp._modules:
        monkeypatch.delattr(ddp, name)
    else:  # a method (or class attribute): remove it from the class for this test
        monkeypatch.delattr(DDP, name)
    assert not hasattr(ddp, name)
    with pytest.raises(SwitchError, match=name) as info:
        _switcher(ddp).attach(ddp)
    assert "tested range" in str(info.value)


def test_missing_static_graph_attribute_refused_only_for_static_graph(
    gloo_world_1: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    static = DDP(_model(), static_graph=True)
    (name,) = _ddp.STATIC_GRAPH_ATTRIBUTES
    monkeypatch.delattr(static, name)
    with pytest.raises(SwitchError, match=name):
        _switcher(static).attach(static)
    plain = DDP(_model())
    assert not hasattr(plain, name)
    _switcher(plain).attach(plain)  # not needed without static_graph


def test_fence_runs_before_any_state_is_touched(ddp: DDP, monkeypatch: pytest.MonkeyPatch) -> None:
    switcher = _switcher(ddp)
    switcher.step_to(0)
    flags = [p.requires_grad for p in ddp.module.parameters()]
    reducer = ddp.reducer
    monkeypatch.setattr(_ddp, "torch_version", lambda: (2, 99))
    monkeypatch.delenv(_ddp.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(SwitchError):
        _ddp.rebuild_reducer(ddp)
    assert ddp.reducer is reducer
    assert [p.requires_grad for p in ddp.module.parameters()] == flags
