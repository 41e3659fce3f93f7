"""The phase driver: the one owner of the schedule position and the current phase.

Every entry point reads the position and the phase from the driver and nothing
keeps a copy: the switcher's ``current``, the accelerator's ``schedule_step`` /
``phase``, the Trainer callback's log values. The driver decides when to switch
and commits a phase only once the switch transaction returned.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
from hf_altparams.engine.driver import PhaseDriver
from hf_altparams.errors import AltParamsError, PlanError, SwitchError
from hf_altparams.plan import Alternating, ParamGroups, PhaseSequence


def _recording(schedule: object) -> tuple[PhaseDriver, list[tuple[str, object]]]:
    applied: list[tuple[str, object]] = []
    driver = PhaseDriver(schedule)  # type: ignore[arg-type]
    driver.bind(lambda phase, step, epoch: applied.append((phase.name, step)) or f"record {phase.name}")
    return driver, applied


def test_stepped_counts_switches_when_due_and_remembers_what_trained() -> None:
    driver, applied = _recording(Alternating(["a", "b"], every=2))
    assert driver.move_to(0) == "record a" and driver.current.name == "a"  # type: ignore[union-attr]
    records = [driver.stepped() for _ in range(5)]
    assert records == [None, "record b", None, "record a", None]
    assert applied == [("a", 0), ("b", 2), ("a", 4)]
    assert driver.step == 5 and driver.trained.name == "a"  # type: ignore[union-attr]
    assert driver.trained_groups == {"a", "b"}


def test_a_failed_transaction_does_not_commit_the_phase() -> None:
    driver = PhaseDriver(Alternating(["a", "b"]))
    calls = []

    def apply(phase: object, step: object, epoch: object) -> None:
        calls.append(step)
        if step == 1:
            raise SwitchError("refused")

    driver.bind(apply)
    driver.move_to(0)
    with pytest.raises(SwitchError, match="refused"):
        driver.stepped()
    assert driver.current.name == "a" and driver.step == 1  # type: ignore[union-attr]
    assert driver.due().name == "b"  # type: ignore[union-attr]  # still due: the next move tries again
    driver.stepped()  # step 2 trains "a" again: nothing to do
    driver.stepped()
    assert driver.current.name == "b" and calls == [0, 1, 3]  # type: ignore[union-attr]


def test_switch_false_moves_without_switching_and_upcoming_looks_one_step_ahead() -> None:
    driver, applied = _recording(Alternating(["a", "b"]))
    driver.move_to(0)
    assert driver.upcoming().name == "b"  # type: ignore[union-attr]
    assert driver.stepped(switch=False) is None and driver.step == 1 and applied == [("a", 0)]
    assert driver.due().name == "b"  # type: ignore[union-attr]


def test_a_switch_inside_an_accumulation_window_is_refused_naming_the_call() -> None:
    driver = PhaseDriver(Alternating(["a", "b"], unit="epoch"), set_epoch_call="accelerator.set_epoch(epoch)")
    driver.bind(lambda phase, step, epoch: None)
    driver.move_to(0, 0)
    driver.loop.backward_pending = True
    with pytest.raises(AltParamsError, match=r"`accelerator.set_epoch\(epoch\)` at the top of the epoch"):
        driver.set_epoch(1)
    assert driver.current.name == "a"  # type: ignore[union-attr]


def test_load_position_restores_without_switching() -> None:
    driver, applied = _recording(PhaseSequence([("a", 3), ("b", 3)]))
    driver.move_to(0)
    driver.load_position(4, 0, {"a"})
    assert applied == [("a", 0)] and driver.step == 4 and driver.trained_groups == {"a"}
    assert driver.loop.epoch_set_at == 4
    driver.move_to(driver.step)
    assert applied[-1] == ("b", 4)


def test_a_driver_needs_a_schedule() -> None:
    with pytest.raises(PlanError, match="`schedule` must be an hf_altparams Schedule"):
        PhaseDriver(["a", "b"])  # type: ignore[arg-type]


def test_the_switcher_and_the_optimizer_read_the_phase_from_the_driver() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    driver = switcher.driver
    assert switcher.current is None and switcher.phase is None
    for step in range(4):
        switcher.step_to(step)
        assert switcher.current is driver.current and switcher.phase is driver.current
        assert driver.step == step and opt.active == driver.current.trainable  # type: ignore[union-attr]
        net(torch.ones(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_a_driver_of_another_schedule_is_refused() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    with pytest.raises(AltParamsError, match="`driver` drives another schedule"):
        PhaseSwitcher(groups, Alternating(["a", "b"]), driver=PhaseDriver(Alternating(["b", "a"])))
