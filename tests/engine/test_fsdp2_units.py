"""FSDP2 units vs groups (one rank, gloo): the set-up checks, shard_by_groups, moving shards."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from hf_altparams.engine import PhaseSwitcher, shard_by_groups
from hf_altparams.engine import fsdp2 as _fsdp2
from hf_altparams.engine.fsdp2 import set_data
from hf_altparams.engine.fsdp2._units import mixed_units
from hf_altparams.engine.memory.transfer import nbytes, to_device, to_host
from hf_altparams.errors import SwitchError
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))


SPEC = {"trunk": "0.*", "mid": ["2.*"], "t0": "3.*", "t1": "4.*"}


def test_groups_built_before_fully_shard_refused_naming_the_way_out(gloo_world_1: dist.ProcessGroup) -> None:
    model = _model()
    groups = ParamGroups(model, SPEC)
    fully_shard(model)
    with pytest.raises(SwitchError, match=r"built before sharding.*rebind"):
        PhaseSwitcher(groups, Alternating(["trunk", "mid"]), model=model)
    with pytest.warns(UserWarning, match="holds parameters of groups"):  # one unit for all
        switcher = PhaseSwitcher(groups.rebind(model), Alternating(["trunk", "mid"]), model=model)
    switcher.step_to(0)
    assert model[0].weight.requires_grad and not model[2].weight.requires_grad


def test_unit_mixing_groups_warned_by_name_and_shard_by_groups_splits_it(gloo_world_1: dist.ProcessGroup) -> None:
    mixed = _model()
    fully_shard(mixed[3])
    fully_shard(mixed)  # the root unit holds trunk, mid and t1
    with pytest.warns(UserWarning, match=r"unit '<root>' holds parameters of groups \['mid', 't1', 'trunk'\]"):
        PhaseSwitcher(ParamGroups(mixed, SPEC), Alternating(["trunk", "mid"]), model=mixed)

    model = _model()
    groups = shard_by_groups(model, ParamGroups(model, SPEC))
    assert mixed_units(model, groups) == {}
    units = {n for n, m in model.named_modules() if _fsdp2.is_fsdp2(m)}
    assert units == {"", "0", "2", "3", "4"}
    held = {n: {groups.group_of(p) for p in _names(model, m)} for n, m in model.named_modules() if n in units}
    assert held == {"": set(), "0": {"trunk"}, "2": {"mid"}, "3": {"t0"}, "4": {"t1"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PhaseSwitcher(groups, Alternating(["trunk", "mid"]), model=model).step_to(0)


def _names(model: nn.Module, unit: nn.Module) -> list[str]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for p in _fsdp2.unit_params(unit)]


def test_shard_by_groups_one_unit_per_group_or_per_module(gloo_world_1: dist.ProcessGroup) -> None:
    spec = {"low": ["0.*", "2.*"], "high": ["3.*", "4.*"]}
    model = _model()
    groups = shard_by_groups(model, ParamGroups(model, spec))
    states = {id(m._get_fsdp_state()) for m in model.modules() if _fsdp2.is_fsdp2(m)}
    assert len(states) == 3  # one unit (a list of modules: one FSDP state) per group, and the root
    assert mixed_units(model, groups) == {}
    switcher = PhaseSwitcher(groups, Alternating(["low", "high"]), model=model)
    for step, group in enumerate(["low", "high"]):  # a list unit (two modules, one state) counts once
        record = switcher.step_to(step)
        assert record is not None and record.allreduce_bytes_per_step == groups.nbytes(group) > 0
    per_module = _model()
    shard_by_groups(per_module, ParamGroups(per_module, spec), per_module=True)
    assert {n for n, m in per_module.named_modules() if _fsdp2.is_fsdp2(m)} == {"", "0", "2", "3", "4"}
    with pytest.raises(SwitchError, match="already sharded"):
        shard_by_groups(per_module, ParamGroups(per_module, spec))


def test_residency_splitting_a_unit_refused_at_the_switch(gloo_world_1: dist.ProcessGroup) -> None:
    model = _model()
    fully_shard(model)  # t0 and t1 share the root unit
    groups = ParamGroups(model, SPEC)
    schedule = PerTaskCycle(["trunk", "mid"], ["t0", "t1"], every=1)
    with pytest.warns(UserWarning, match="holds parameters of groups"):
        switcher = PhaseSwitcher(groups, schedule, model=model)
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(SwitchError, match=r"unit '<root>' would be partly off the device"):
        switcher.step_to(0)
    assert [p.requires_grad for p in model.parameters()] == flags  # rolled back
    with pytest.warns(UserWarning):
        PhaseSwitcher(groups, schedule, model=model, offload_device=None).step_to(0)  # nothing moves: fine


def test_dtensor_moves_keep_the_spec_and_copy_the_shard(gloo_world_1: dist.ProcessGroup) -> None:
    model = _model()
    fully_shard(model)
    weight = model[0].weight
    host = to_host(weight.data, torch.device("cpu"))
    assert _fsdp2.is_dtensor(host) and host._spec == weight._spec
    assert host.to_local().data_ptr() != weight.to_local().data_ptr()
    assert torch.equal(host.to_local(), weight.to_local())
    assert nbytes(host) == weight.to_local().nbytes
    assert to_device(host, torch.device("cpu")) is host


def test_place_data_swaps_fsdp2_storage_so_the_all_gather_reads_the_new_values(
    gloo_world_1: dist.ProcessGroup,
) -> None:
    model = _model()
    reference = _model()
    groups = shard_by_groups(model, ParamGroups(model, SPEC))
    switcher = PhaseSwitcher(groups, Alternating(["trunk", "mid"]), model=model)
    backend = switcher.backend
    assert switcher.residency.data_placer == backend.place_data
    x = torch.randn(5, 3)
    model(x)  # FSDP2's lazy init (which would re-read swapped shards once) is behind us
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        moved = to_host(param.data, torch.device("cpu"))  # a copy in new storage
        moved.to_local().add_(1.0)
        old = param.to_local().data_ptr()
        backend.place_data(param, moved)
        assert param.to_local().data_ptr() != old, name
        with torch.no_grad():
            ref.add_(1.0)
    assert torch.allclose(model(x), reference(x))  # FSDP2 all-gathered the moved shards


def test_a_shard_moved_before_attach_is_put_back_into_fsdp2_storage(gloo_world_1: dist.ProcessGroup) -> None:
    model, reference = _model(), _model()
    groups = shard_by_groups(model, ParamGroups(model, SPEC))
    x = torch.randn(5, 3)
    model(x)  # lazy init done: FSDP2 will not re-read the parameters by itself
    switcher = PhaseSwitcher(groups, Alternating(["trunk", "mid"]))
    for param, ref in zip(model.parameters(), reference.parameters()):
        moved = to_host(param.data, torch.device("cpu"))
        moved.to_local().add_(1.0)
        set_data(param, moved)  # the plain move, before any FSDP2 backend
        with torch.no_grad():
            ref.add_(1.0)
    switcher.attach(model)
    fsdp_params = switcher.backend._fsdp_param_of
    for param in model.parameters():
        storage = fsdp_params[id(param)]._sharded_param_data.untyped_storage()
        assert param.to_local().untyped_storage().data_ptr() == storage.data_ptr()
    assert torch.allclose(model(x), reference(x))


def test_forward_through_a_non_resident_unit_refused_before_fsdp2_gathers_it(
    gloo_world_1: dist.ProcessGroup,
) -> None:
    model = _model()
    groups = shard_by_groups(model, ParamGroups(model, SPEC))
    switcher = PhaseSwitcher(groups, PerTaskCycle(["trunk", "mid"], ["t0", "t1"], every=1), model=model)
    switcher.step_to(0)  # t1 (layer 4, a unit of its own) is not resident
    x = torch.randn(5, 3)
    with pytest.raises(SwitchError, match=r"fully_shard unit '4' ran its forward in phase .*\['t1'\]"):
        model(x)  # the unit guard runs before FSDP2's pre-forward (and before the module guard)
    with torch.no_grad(), switcher.residency.visiting(["t1"]):
        assert model(x).shape == (5, 2)  # a visit passes
    switcher.step_to(1)  # t1's phase: t0 is off, t1 back
    with pytest.raises(SwitchError, match="fully_shard unit '3'"):
        model(x)
