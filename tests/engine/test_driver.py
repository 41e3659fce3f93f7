"""The phase driver: the one owner and the one writer of the schedule position and the current phase.

Every entry point reads the position and the phase from the driver and nothing
keeps a copy: the switcher's ``current``, the accelerator's ``schedule_step`` /
``phase``, the Trainer callback's log values, the GroupedOptimizer's active
groups. The driver decides when to switch and commits a phase only once the
switch transaction returned; its fields change only through its methods.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher
from hf_altparams.engine.driver import DriverState, PhaseDriver
from hf_altparams.errors import AltParamsError, PlanError, SwitchError
from hf_altparams.plan import Alternating, ParamGroups, Phase, PhaseSequence


class Applier:
    """A PhaseApplier that records the phases applied (and fails at the steps in ``fail_at``)."""

    def __init__(self, fail_at: tuple[int, ...] = ()) -> None:
        self.applied: list[tuple[str, object]] = []
        self.calls: list[object] = []
        self.fail_at = fail_at

    def apply_phase(self, phase: Phase, step: object, epoch: object) -> object:
        self.calls.append(step)
        if step in self.fail_at:
            raise SwitchError("refused")
        self.applied.append((phase.name, step))
        return f"record {phase.name}"

    def position_moved(self) -> None:
        pass

    def drop_applied_gradients(self) -> None:
        pass


def _recording(schedule: object) -> tuple[PhaseDriver, list[tuple[str, object]]]:
    driver = PhaseDriver(schedule)  # type: ignore[arg-type]
    applier = Applier()
    driver.bind(applier)  # type: ignore[arg-type]
    return driver, applier.applied


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
    applier = Applier(fail_at=(1,))
    calls = applier.calls
    driver.bind(applier)  # type: ignore[arg-type]
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
    driver.bind(Applier())  # type: ignore[arg-type]
    driver.move_to(0, 0)
    driver.note_backward()
    with pytest.raises(AltParamsError, match=r"`accelerator.set_epoch\(epoch\)` at the top of the epoch"):
        driver.set_epoch(1)
    assert driver.current.name == "a"  # type: ignore[union-attr]


def test_restore_takes_a_saved_state_without_switching() -> None:
    driver, applied = _recording(PhaseSequence([("a", 3), ("b", 3)]))
    driver.move_to(0)
    driver.restore(DriverState.from_dict(DriverState(4, 0, ("a",)).as_dict()))
    assert applied == [("a", 0)] and driver.step == 4 and driver.trained_groups == {"a"}
    assert driver.epoch_set_at == 4 and driver.state() == DriverState(4, 0, ("a",))
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


def test_the_driver_is_written_through_its_methods_only() -> None:
    driver, _ = _recording(Alternating(["a", "b"]))
    for field in ("step", "epoch", "current", "trained", "trained_groups", "backward_pending", "syncing_forwards"):
        with pytest.raises(AttributeError):
            setattr(driver, field, None)
    driver.move_to(0)
    driver.note_syncing_forward()
    driver.note_backward()
    assert driver.syncing_forwards == 1 and driver.backward_pending
    driver.stepped()
    assert driver.syncing_forwards == 0 and not driver.backward_pending


def test_a_grouped_optimizer_taken_by_a_switcher_follows_the_driver_and_refuses_set_active() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    opt.set_active(["b"])  # on its own: the groups given
    assert opt.active == {"b"}
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    switcher.step_to(0)
    assert opt.active == {"a"}  # the driver's phase, no copy
    with pytest.raises(PlanError, match="follows a run's phases"):
        opt.set_active(["b"])
