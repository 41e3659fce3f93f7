"""The fence around FSDP2's private state: torch version range, required names, the fallbacks."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.tensor import DTensor

from hf_altparams._compat import TESTED_TORCH
from hf_altparams.engine import PhaseSwitcher
from hf_altparams.engine.fsdp2 import _backend as _fsdp2
from hf_altparams.errors import SwitchError
from hf_altparams.plan import Alternating, ParamGroups

CLASSES = {"FSDPParamGroup": FSDPParamGroup, "FSDPParam": FSDPParam, "DTensor": DTensor}


def _sharded(mp: MixedPrecisionPolicy | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    for unit in (model[0], model[1], model):
        fully_shard(unit, mp_policy=mp or MixedPrecisionPolicy())
    return model


def _switcher(model: nn.Sequential) -> PhaseSwitcher:
    return PhaseSwitcher(ParamGroups(model, {"a": "0.*", "b": "1.*"}), Alternating(["a", "b"]))


def test_every_private_name_exists_on_a_real_fsdp2_model(gloo_world_1: dist.ProcessGroup) -> None:
    model = _sharded()
    state = model[0]._get_fsdp_state()
    (group,) = _fsdp2._param_groups(model[0])
    fp = group.fsdp_params[0]
    objects = {"FSDPModule": model[0], "FSDPParamGroup": group, "FSDPParam": fp, "DTensor": fp.sharded_param}
    missing = [
        f"{o}.{n}" for o, names in _fsdp2.PRIVATE_FSDP2_ATTRIBUTES.items() for n in names if not hasattr(objects[o], n)
    ]
    assert missing == []
    assert hasattr(state, "_fsdp_param_groups") or hasattr(state, "_fsdp_param_group")
    _fsdp2.check_fsdp2_supported(model)  # the whole fence passes


@pytest.mark.parametrize("version", [(2, 99), (2, 10)])
def test_untested_torch_refused_naming_the_way_out(
    gloo_world_1: dist.ProcessGroup, version: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _sharded()
    monkeypatch.setattr(_fsdp2, "torch_version", lambda: version)
    monkeypatch.delenv(_fsdp2.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(SwitchError) as info:
        _switcher(model).attach(model)
    message = str(info.value)
    assert f"found torch {version[0]}.{version[1]}" in message
    assert f"{TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]} to {TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1]}" in message
    assert f"{_fsdp2.ALLOW_UNTESTED_ENV}=1" in message
    monkeypatch.setenv(_fsdp2.ALLOW_UNTESTED_ENV, "1")
    switcher = _switcher(model)
    with pytest.warns(UserWarning, match="outside the tested range"):
        switcher.attach(model)
    assert switcher.backend.kind == "fsdp2"


@pytest.mark.parametrize(
    "owner,name", [(o, n) for o, names in _fsdp2.PRIVATE_FSDP2_ATTRIBUTES.items() for n in names if o != "FSDPModule"]
)
def test_missing_private_name_refused_by_name_before_any_change(
    gloo_world_1: dist.ProcessGroup, owner: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _sharded()
    switcher = _switcher(model)
    switcher.step_to(0)  # local: flags set, no backend yet
    flags = [p.requires_grad for p in model.parameters()]
    cls = CLASSES[owner]
    if hasattr(cls, name):
        monkeypatch.delattr(cls, name)
    else:  # an instance attribute: hide it behind a property that raises AttributeError
        monkeypatch.setattr(
            cls, name, property(lambda self: (_ for _ in ()).throw(AttributeError(name))), raising=False
        )
    with pytest.raises(SwitchError, match=f"{owner}.{name}"):
        switcher.attach(model)
    assert switcher.backend.kind == "local"
    assert [p.requires_grad for p in model.parameters()] == flags


def test_missing_init_mp_dtypes_falls_back_without_casting_and_refuses_with_it(
    gloo_world_1: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a torch without the method (torch's own lazy init still has it here: the name is what changes)
    monkeypatch.setattr(_fsdp2, "MP_REINIT_METHOD", "_init_mp_dtypes_absent")
    plain = _sharded()
    switcher = _switcher(plain)
    switcher.attach(plain)  # no MixedPrecisionPolicy cast: nothing to re-initialise
    switcher.step_to(1)
    plain(torch.ones(2, 3)).sum().backward()
    assert plain[1].weight.grad is not None and plain[0].weight.grad is None
    bf16 = _sharded(MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    with pytest.raises(SwitchError, match=r"unit '0'.*_init_mp_dtypes_absent"):
        _switcher(bf16).attach(bf16)


def test_older_single_group_state_layout_is_read(
    gloo_world_1: dist.ProcessGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _sharded()
    for unit in _fsdp2.fsdp2_units(model):
        groups = _fsdp2._param_groups(unit)
        old_style = types.SimpleNamespace(_fsdp_param_group=groups[0] if groups else None)
        monkeypatch.setattr(unit, "_get_fsdp_state", lambda state=old_style: state)
    switcher = _switcher(model)
    switcher.attach(model)
    record = switcher.step_to(0)
    assert record is not None
    # bytes fed to reduce-scatter per step: group "a" (Linear(3, 4)) only, one rank
    assert record.allreduce_bytes_per_step == sum(p.numel() * 4 for p in model[0].parameters())
