"""What a new user hit first with PhasedAccelerator: each is a clear error, or the right behaviour.

(The multi-rank ones are elsewhere: a second ``step()`` on the same gradients,
``tests/engine/test_misuse.py``; a rank that skips its step,
``tests/engine/test_faults.py``.)
"""

from __future__ import annotations

import functools

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn

from hf_altparams import Alternating, AltParamsError, Cause, GroupedOptimizer, ParamGroups, PhasedAccelerator, PlanError
from hf_altparams.integrations import accelerate_internals
from hf_altparams.integrations.accelerate_prepare import find_grouped
from tests.support.digests import param_sha


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1 = nn.Linear(4, 8)
        self.layer2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")


def _train(acc: PhasedAccelerator, model: nn.Module, opt: torch.optim.Optimizer, steps: int = 4) -> list[str]:
    phases = []
    for step in range(steps):
        phases.append(acc.phase.name if acc.phase is not None else "")
        acc.backward(model(torch.full((2, 4), 0.1 * (step + 1))).square().mean())
        opt.step()
        opt.zero_grad()
    return phases


def test_set_phases_after_an_unphased_prepare_is_refused_naming_the_order() -> None:
    acc = PhasedAccelerator(cpu=True)
    net = Net()
    net, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(
        PlanError,
        match=r"`set_phases` came after `prepare` of \['Net'\].*would train whole.*"
        r"before `accelerator.prepare",
    ):
        acc.set_phases(Alternating(["a", "b"]), groups=ParamGroups(net, {"a": "layer1.*", "b": "layer2.*"}))
    assert acc.schedule is None  # nothing half-applied


def test_parameters_the_optimizer_holds_but_no_group_names_are_named_at_prepare() -> None:
    net = Net()
    groups = ParamGroups(net, {"a": "layer1.*"})  # layer2 in no group: frozen for the whole run
    acc = PhasedAccelerator(Alternating(["a"]), groups=groups, cpu=True)
    with pytest.warns(
        UserWarning,
        match=r"holds 2 parameter\(s\) that no group names \(e.g. \['layer2.weight', "
        r"'layer2.bias'\]\).*never updated.*ungrouped='trainable'",
    ):
        acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))


def test_groups_given_as_parts_of_the_model_passed_to_prepare_are_groups_of_that_model() -> None:
    net, reference = Net(), Net()
    acc = PhasedAccelerator(Alternating(["a", "b"]), groups={"a": net.layer1, "b": net.layer2}, cpu=True)
    model, opt = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    assert acc.groups is not None and acc.groups.module is net
    assert _train(acc, model, opt) == ["a", "b", "a", "b"]
    # the same run with the groups spelled on the model: the same weights
    acc2 = PhasedAccelerator(
        Alternating(["a", "b"]), groups=ParamGroups(reference, {"a": "layer1.*", "b": "layer2.*"}), cpu=True
    )
    model2, opt2 = acc2.prepare(reference, torch.optim.SGD(reference.parameters(), lr=0.1))
    _train(acc2, model2, opt2)
    assert param_sha(net) == param_sha(reference)


def test_a_model_compiled_before_prepare_trains_in_one_process_with_groups_named_either_way() -> None:
    results = []
    for on_compiled in (False, True):
        accelerate_internals.fresh_accelerator_state(partial=True)
        net = Net()
        compiled = torch.compile(net, backend="eager")
        target = compiled if on_compiled else net
        prefix = "_orig_mod." if on_compiled else ""
        groups = ParamGroups(target, {"a": f"{prefix}layer1.*", "b": f"{prefix}layer2.*"})
        acc = PhasedAccelerator(Alternating(["a", "b"]), groups=groups, cpu=True)
        model, opt = acc.prepare(compiled, torch.optim.SGD(net.parameters(), lr=0.1))
        assert _train(acc, model, opt) == ["a", "b", "a", "b"]
        results.append(param_sha(net))
    plain = Net()
    acc = PhasedAccelerator(
        Alternating(["a", "b"]), groups=ParamGroups(plain, {"a": "layer1.*", "b": "layer2.*"}), cpu=True
    )
    model, opt = acc.prepare(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    _train(acc, model, opt)
    assert results == [param_sha(plain)] * 2  # the same weights as the uncompiled run


@pytest.mark.parametrize("on_compiled", [False, True])
def test_a_compiled_model_is_refused_with_several_processes_naming_compile(on_compiled: bool) -> None:
    net = Net()
    compiled = torch.compile(net, backend="eager")
    target = compiled if on_compiled else net
    prefix = "_orig_mod." if on_compiled else ""
    groups = ParamGroups(target, {"a": f"{prefix}layer1.*", "b": f"{prefix}layer2.*"})
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(
        AltParamsError,
        match=r"compiled with `torch.compile` before `prepare`.*several processes.*"
        r"Pass the uncompiled model",
    ) as info:
        find_grouped(
            (compiled, opt),
            groups,
            Alternating(["a", "b"]),
            prepared_models=set(),
            driving_bound=False,
            multi_process=True,
        )
    assert info.value.cause is Cause.STRATEGY_REFUSED


def test_an_optimizer_whose_model_is_not_the_grouped_one_gets_the_right_error() -> None:
    net, other = Net(), Net()
    acc = PhasedAccelerator(
        Alternating(["a", "b"]), groups=ParamGroups(net, {"a": "layer1.*", "b": "layer2.*"}), cpu=True
    )
    wrapper = nn.Sequential(other)
    with pytest.raises(
        AltParamsError,
        match=r"no argument of this `prepare` is that model: the groups were built "
        r"on a Net, and \['`prepare` argument #1 \(Sequential\)'\] is not it",
    ):
        acc.prepare(wrapper, torch.optim.SGD(net.parameters(), lr=0.1))


def test_single_process_refusals_name_the_setting_not_distributed_type_no() -> None:
    with pytest.raises(AltParamsError, match=r"cannot drive FSDP version 1") as fsdp1:
        PhasedAccelerator(Alternating(["a", "b"]), cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1))
    assert "'NO'" not in str(fsdp1.value)
    accelerate_internals.fresh_accelerator_state(partial=True)
    with pytest.raises(AltParamsError, match=r"cannot drive dynamo_backend='EAGER' \(torch.compile\)") as dynamo:
        PhasedAccelerator(Alternating(["a", "b"]), cpu=True, dynamo_backend="eager")
    assert "'NO'" not in str(dynamo.value)


def test_the_grouped_optimizer_follows_lisa_and_frees_idle_state_by_default() -> None:
    from hf_altparams import lisa

    net = nn.ModuleDict({f"l{i}": nn.Linear(4, 4) for i in range(4)} | {"head": nn.Linear(4, 1)})
    groups = ParamGroups(net, {name: f"{name}.*" for name in net})
    acc = PhasedAccelerator(lisa(["l0", "l1", "l2", "l3"], k=1, every=1, always=["head"]), cpu=True)
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.Adam, lr=1e-2))
    model, opt = acc.prepare(net, opt)
    for step in range(6):
        x = torch.full((2, 4), 0.1 * (step + 1))
        acc.backward(net["head"](sum(net[f"l{i}"](x) for i in range(4))).square().mean())
        opt.step()
        opt.zero_grad()
        trainable = acc.phase.trainable  # type: ignore[union-attr]
        held = {g for g in groups.names if any(opt.optimizer.inner[g].state.get(p) for p in groups.params(g))}
        assert held <= trainable, (step, held, trainable)  # no Adam state outside the phase


def test_the_first_switch_that_idles_a_trained_group_logs_what_its_state_does(caplog: pytest.LogCaptureFixture) -> None:
    """With the Trainer-style plain optimizer: lisa drops idle state, and the log says so, once, with the why."""
    from hf_altparams import lisa

    net = nn.ModuleDict({f"l{i}": nn.Linear(4, 4) for i in range(4)} | {"head": nn.Linear(4, 1)})
    groups = ParamGroups(net, {name: f"{name}.*" for name in net})
    acc = PhasedAccelerator(lisa(["l0", "l1", "l2", "l3"], k=1, every=1, always=["head"]), groups=groups, cpu=True)
    plain = torch.optim.AdamW(net.parameters(), lr=1e-2)
    with caplog.at_level("INFO", logger="hf_altparams"):
        model, opt = acc.prepare(net, plain)
        assert not [r for r in caplog.records if "idle optimizer state" in r.getMessage()]  # nothing trained yet
        for step in range(6):
            x = torch.full((2, 4), 0.1 * (step + 1))
            acc.backward(net["head"](sum(net[f"l{i}"](x) for i in range(4))).square().mean())
            opt.step()
            opt.zero_grad()
            held = {g for g in groups.names if any(plain.state.get(p) for p in groups.params(g))}
            assert held <= acc.phase.trainable, (step, held)  # type: ignore[union-attr]
    lines = [r.getMessage() for r in caplog.records if "idle optimizer state" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0] == (
        "hf_altparams: idle optimizer state: drop (the RandomBlocks recipe's assumption); 3 idle group(s) hold none"
    )
