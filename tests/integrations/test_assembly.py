"""The run assembly both integrations share (``integrations/assembly.py``), driven with test-only strategies.

Each strategy here is registered by the test alone: the assembly, the
accelerator and the Trainer's wrapper catcher must reach it through the
registry, with nothing in the library changed.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import nn
from torch.optim import Optimizer

from hf_altparams.engine.backend import Backend
from hf_altparams.engine.comm import CommCounter
from hf_altparams.engine.config import SwitchConfig
from hf_altparams.engine.prefix import FrozenPrefix
from hf_altparams.engine.strategies import Capabilities, StepBoundary, strategy_named
from hf_altparams.errors import AltParamsError, Cause
from hf_altparams.integrations.assembly import PhaseRun, RunOptions
from hf_altparams.integrations.trainer import FirstCallCatcher
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle
from tests.support.fake_strategy import FakeBackend, FakeStrategy, FakeWrapper, registered


class Hooked(FakeStrategy):
    """Records the hook before wrapping, and counts its 'communication' into the counter it is given."""

    name, aliases, label = "hooked", (), "Hooked"
    capabilities = Capabilities(
        wraps_module=True, synchronises_gradients=True, counts_comm=True, frozen_prefix=False, per_task_residency=False
    )

    def __init__(self) -> None:
        super().__init__()
        self.before: list[tuple[dict[str, bool], Optional[Optimizer]]] = []

    def before_wrap(self, groups: ParamGroups, optimizer: Optional[Optimizer]) -> None:
        self.before.append(({n: p.requires_grad for n, p in groups.all_named_params()}, optimizer))

    def count_comm(self, wrapper: nn.Module, counter: Optional[CommCounter] = None) -> CommCounter:
        counter = counter if counter is not None else CommCounter()
        counter.bytes_pending += 1
        return counter

    def state_owner(self, optimizer: Optional[Optimizer], groups: ParamGroups) -> Any:
        return strategy_named("ddp").state_owner(optimizer, groups)  # the library's, as DDP has it


@pytest.fixture
def hooked() -> Iterator[Hooked]:
    with registered(Hooked()) as strategy:
        yield strategy


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _run(**options: Any) -> tuple[PhaseRun, list[str]]:
    seen: list[str] = []
    config = SwitchConfig.build(options.pop("switcher_options", None))
    run = PhaseRun(Alternating(["a", "b"]), RunOptions(config, **options), on_switch=lambda r: seen.append(r.phase))
    return run, seen


def test_the_first_phase_is_applied_before_the_strategys_hook_and_reported_at_attach(hooked: Hooked) -> None:
    net = _net()
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    run, seen = _run(count_comm=True)
    run.expect(hooked)
    run.start(groups, optimizer)
    ((flags, given),) = hooked.before
    assert given is optimizer and flags == {"0.weight": True, "0.bias": True, "1.weight": False, "1.bias": False}
    assert seen == []  # reported once the wrapper says what it communicates
    record = run.attach(FakeWrapper(net))
    assert record is not None and seen == ["a"] and run.strategy is hooked
    assert record.allreduce_bytes_per_step == sum(p.numel() * 4 for p in net[0].parameters())
    assert run.comm_counter is not None and run.comm_counter.bytes_pending == 1
    assert run.stepped() is not None and seen == ["a", "b"]
    assert run.comm_counter.history == [1]  # the step closed the counter


def test_a_feature_the_expected_strategy_lacks_is_refused_before_anything_is_built(hooked: Hooked) -> None:
    run, _ = _run(prefix=FrozenPrefix())
    with pytest.raises(AltParamsError, match=r"`frozen_prefix` is not supported with Hooked") as info:
        run.expect(hooked)
    assert info.value.cause is Cause.STRATEGY_REFUSED
    seen: list[str] = []
    schedule = PerTaskCycle(["a"], ["b"], every=1)  # the other task's head lives off the device
    run = PhaseRun(schedule, RunOptions(SwitchConfig()), on_switch=lambda r: seen.append(r.phase))
    with pytest.raises(AltParamsError, match=r"keep only some groups resident.*not supported with Hooked"):
        run.expect(hooked)
    run = PhaseRun(schedule, RunOptions(SwitchConfig.build({"offload_device": None})))
    run.expect(hooked)  # groups stay on the device: nothing to refuse


def test_a_wrapper_of_another_strategy_than_configured_is_refused(hooked: Hooked) -> None:
    net = _net()
    run, _ = _run()
    run.expect(strategy_named("fsdp2"))
    run.start(ParamGroups(net, {"a": "0.*", "b": "1.*"}), None)
    with pytest.raises(
        AltParamsError,
        match=r"configured for FSDP2, but the framework returned a FakeWrapper, "
        r"which FSDP2 does not drive \(Hooked does\)",
    ):
        run.attach(FakeWrapper(net))


def test_a_wrapper_built_before_the_phase_is_rebuilt_and_reported(hooked: Hooked) -> None:
    net = _net()
    run, seen = _run()
    run.start(ParamGroups(net, {"a": "0.*", "b": "1.*"}), None, first_phase=False)
    run.move_to(1)  # a resumed position: "b"
    record = run.attach(FakeWrapper(net), rebuild=True)
    assert record is not None and record.phase == "b" and seen == ["b", "b"]
    backend = hooked.backends[-1]
    assert isinstance(backend, FakeBackend) and backend.applied == [set()]


def test_restart_keeps_the_prefix_cache_and_close_removes_it() -> None:
    net = nn.ModuleDict({"emb": nn.Embedding(5, 3), "layers": nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])})
    run, _ = _run(prefix=FrozenPrefix(blocks="layers", embeddings="emb"))
    cache = run.attach_prefix(net)
    assert cache is not None and run.attach_prefix(net) is cache
    first = run.driver
    run.restart()
    assert run.driver is not first and run.switcher is None and run.frozen_prefix is cache
    run.close()
    assert run.frozen_prefix is None


# ---------------------------------------------------------------------------- the integrations
class Inplace(FakeStrategy):
    """A strategy that trains one given module in place and applies its update inside the backward."""

    name, aliases, label = "inplace", (), "In place"
    capabilities = Capabilities(step_boundary=StepBoundary.BACKWARD)

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def recognises(self, model: nn.Module) -> bool:
        return model is self.module

    def wrapped_module(self, wrapper: nn.Module) -> nn.Module:
        return wrapper

    def backend(self, wrapper: nn.Module) -> Backend:
        backend = FakeBackend(FakeWrapper(wrapper))
        self.backends.append(backend)
        return backend

    def state_owner(self, optimizer: Optional[Optimizer], groups: ParamGroups) -> Any:
        return strategy_named("ddp").state_owner(optimizer, groups)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_strategy_stepping_inside_backward_switches_at_the_end_of_the_sync_backward() -> None:
    from hf_altparams.engine import GroupedOptimizer
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    net = _net()
    with registered(Inplace(net)) as strategy:
        groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        acc = PhasedAccelerator(Alternating(["a", "b"]), gradient_accumulation_steps=2, cpu=True)
        opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
        model, opt = acc.prepare(net, opt)
        assert acc.switcher is not None and acc.switcher.strategy is strategy
        phases = []
        for step in range(4):
            with acc.accumulate(model):
                acc.backward(model(torch.ones(2, 3)).sum())
                phases.append(acc.phase.name)  # type: ignore[union-attr]
                opt.step()  # the strategy's update ran inside backward: this step drives nothing
                opt.zero_grad()
        assert phases == ["a", "b", "b", "a"]  # switched right after each sync-boundary backward
        assert acc.schedule_step == 2


def test_the_trainers_catcher_finds_a_registered_strategys_wrapper(hooked: Hooked) -> None:
    net = _net()
    found: list[nn.Module] = []
    catcher = FirstCallCatcher(net, found.append, lambda: found.append(net))
    wrapper = FakeWrapper(net)
    wrapper(torch.ones(1, 3))
    assert found == [wrapper]
    wrapper(torch.ones(1, 3))  # one shot
    assert found == [wrapper]
    catcher.remove()
