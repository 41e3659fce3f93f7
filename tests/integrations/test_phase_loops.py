"""What a loop asks of a phased run: ``phase`` and ``task`` in both loop orders, and ``visiting(...)``.

One process, no DDP: when the switch happens is the same code with and without
a wrapper (the two-rank runs of the GAN and multi-task examples, in
``test_examples_accelerate.py``, cover DDP).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch
from torch import nn

from hf_altparams.engine import GroupedLRScheduler, GroupedOptimizer
from hf_altparams.errors import AltParamsError, PlanError, SwitchError
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle, Schedule

ORDERS = ["zero_grad_last", "zero_grad_first"]


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()  # an accumulation window left open would make every step a micro-step
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


GROUPS = {"a": "0.*", "b": "2.*"}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def _run(
    order: str, ga: int, steps: int, schedule: Schedule, strict: bool = True
) -> tuple[list[tuple[int, Any]], nn.Module]:
    """The user's loop in one of the two orders; the phase is read at the top of every iteration.

    ``strict``: fail on the warning about a ``zero_grad()`` that drops unapplied gradients.
    """
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(schedule, cpu=True, gradient_accumulation_steps=ga)
    model = _net()
    opt = GroupedOptimizer(ParamGroups(model, GROUPS), functools.partial(torch.optim.SGD, lr=0.1))
    prepared, opt = acc.prepare(model, opt)
    seen = []
    with warnings.catch_warnings():
        if strict:
            warnings.filterwarnings("error", message=".*zero_grad.*dropped")
        for x, y in _batches(steps * ga):
            seen.append((acc.schedule_step, acc.phase.trainable if acc.phase else None))
            with acc.accumulate(prepared):
                if order == "zero_grad_first":
                    opt.zero_grad()
                acc.backward(nn.functional.mse_loss(prepared(x), y))
                opt.step()
                if order == "zero_grad_last":
                    opt.zero_grad()
    assert acc.schedule_step == steps
    acc.free_memory()
    return seen, model


def _reference(ga: int, steps: int, schedule: Schedule) -> nn.Module:
    """The same training written by hand: one SGD per group, only the phase's groups step."""
    model = _net()
    groups = ParamGroups(model, GROUPS)
    opts = {g: torch.optim.SGD(groups.params(g), lr=0.1) for g in GROUPS}
    batches = _batches(steps * ga)
    for step in range(steps):
        active = schedule.phase_at(step).trainable
        for x, y in batches[step * ga : (step + 1) * ga]:
            (nn.functional.mse_loss(model(x), y) / ga).backward()
        for g in sorted(active):
            opts[g].step()
        for o in opts.values():
            o.zero_grad(set_to_none=True)
    return model


# Inside `accumulate()`, a zero_grad at the top of the boundary micro-step would wipe the window's
# gradients in plain Accelerate too (zero_grad is skipped only on the other micro-steps): with
# accumulation, Accelerate's order (zero_grad after step) is the one loop order there is.
@pytest.mark.parametrize("ga, orders", [(1, ORDERS), (2, ["zero_grad_last"])])
def test_phase_at_the_top_of_an_iteration_is_right_in_both_loop_orders(ga: int, orders: list[str]) -> None:
    schedule = Alternating({"a": 2, "b": 1})
    steps = 6
    runs = {order: _run(order, ga, steps, schedule) for order in orders}
    for order, (seen, _) in runs.items():
        # Every micro-step of optimizer step s reads the phase of step s, in either order.
        assert [s for s, _ in seen] == [i // ga for i in range(steps * ga)], order
        assert all(phase == schedule.phase_at(s).trainable for s, phase in seen), (order, seen)
    reference = _reference(ga, steps, schedule)
    for order, (_, model) in runs.items():
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=order)


def test_zero_grad_first_inside_accumulate_warns_that_it_drops_the_window() -> None:
    with pytest.warns(UserWarning, match=r"zero_grad\(\)` ran at a gradient-sync boundary.*after `optimizer.step\(\)`"):
        _run("zero_grad_first", 2, 2, Alternating(["a", "b"]), strict=False)


class TwoTasks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 8)
        self.heads = nn.ModuleDict({"t0": nn.Linear(8, 1), "t1": nn.Linear(8, 1), "t2": nn.Linear(8, 1)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](torch.tanh(self.trunk(x)))


TASK_GROUPS = {"trunk": "trunk.*", "t0": "heads.t0.*", "t1": "heads.t1.*", "t2": "heads.t2.*"}


def _multitask(schedule: Schedule) -> tuple[Any, TwoTasks, Any, GroupedOptimizer]:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(schedule, cpu=True)
    model = TwoTasks()
    grouped = GroupedOptimizer(ParamGroups(model, TASK_GROUPS), functools.partial(torch.optim.AdamW, lr=0.01))
    prepared, opt = acc.prepare(model, grouped)
    return acc, model, (prepared, opt), grouped


def _train_tasks(acc: Any, prepared: Any, opt: Any, steps: int, order: str) -> list[Optional[str]]:
    tasks = []
    for x, y in _batches(steps):
        x, y = x.to(acc.device), y.to(acc.device)
        tasks.append(acc.task)  # the loop picks its data and head by the task
        if order == "zero_grad_first":
            opt.zero_grad()
        acc.backward(nn.functional.mse_loss(prepared(x, acc.task), y))
        opt.step()
        if order == "zero_grad_last":
            opt.zero_grad()
    return tasks


@pytest.mark.parametrize("order", ORDERS)
def test_task_names_the_current_per_task_cycle_task(order: str) -> None:
    acc, _, (prepared, opt), _ = _multitask(PerTaskCycle(["trunk"], ["t0", "t1", "t2"], every=2))
    assert _train_tasks(acc, prepared, opt, 7, order) == ["t0", "t0", "t1", "t1", "t2", "t2", "t0"]
    assert acc.task == "t0" and acc.phase is not None and acc.phase.name == "t0"


def test_task_is_none_before_prepare_and_for_other_schedules() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    assert PhasedAccelerator(Alternating(["a", "b"]), cpu=True).task is None
    acc, _, _, _ = _multitask(Alternating([("trunk", "t0"), ("t1", "t2")]))
    assert acc.phase is not None and acc.task is None


def test_set_epoch_switches_at_once_in_the_zero_grad_first_order() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    schedule = Alternating(["a", "b"], unit="epoch")
    acc = PhasedAccelerator(schedule, cpu=True)
    model = _net()
    prepared, opt = acc.prepare(
        model, GroupedOptimizer(ParamGroups(model, GROUPS), functools.partial(torch.optim.SGD, lr=0.1))
    )
    for epoch in range(3):
        acc.set_epoch(epoch)  # the previous epoch's last gradients are still there (zero_grad comes first)
        for x, y in _batches(2):
            assert acc.phase == schedule.phase_at(acc.schedule_step, epoch)
            opt.zero_grad()
            acc.backward(nn.functional.mse_loss(prepared(x), y))
            opt.step()


def test_set_epoch_inside_an_accumulation_window_is_refused_when_it_would_switch() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"], unit="epoch"), cpu=True, gradient_accumulation_steps=2)
    model = _net()
    prepared, opt = acc.prepare(
        model, GroupedOptimizer(ParamGroups(model, GROUPS), functools.partial(torch.optim.SGD, lr=0.1))
    )
    x, y = _batches(1)[0]
    with acc.accumulate(prepared):
        acc.backward(nn.functional.mse_loss(prepared(x), y))  # first micro-step: no sync yet
        opt.step()
    assert acc.set_epoch(0) is None  # same phase: nothing to do
    with pytest.raises(AltParamsError, match=r"set_epoch.*top of the epoch"):
        acc.set_epoch(1)
    assert model[0].weight.grad is not None  # nothing was dropped


def test_lr_schedulers_advance_the_phase_just_trained() -> None:
    # The switch comes before the loop's scheduler.step(): the scheduler must still advance the
    # groups that stepped, whether prepared or not.
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating({"a": 2, "b": 1}), cpu=True)
    model = _net()
    grouped = GroupedOptimizer(ParamGroups(model, GROUPS), functools.partial(torch.optim.SGD, lr=0.1))
    prepared_sched = GroupedLRScheduler(grouped, lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5))
    prepared, opt, prepared_sched = acc.prepare(model, grouped, prepared_sched)
    for x, y in _batches(3):  # a, a, b
        acc.backward(nn.functional.mse_loss(prepared(x), y))
        opt.step()
        prepared_sched.step()
        opt.zero_grad()
    assert grouped.inner["a"].param_groups[0]["lr"] == 0.1 * 0.5**2
    assert grouped.inner["b"].param_groups[0]["lr"] == 0.1 * 0.5


def test_an_fp16_step_skipped_for_overflow_still_counts_and_switches() -> None:
    # As the Trainer's global_step: a skipped step counts; Accelerate's prepared scheduler skips it.
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)  # Accelerate makes none on CPU
    model = _net()
    grouped = GroupedOptimizer(ParamGroups(model, GROUPS), functools.partial(torch.optim.SGD, lr=0.1))
    sched = torch.optim.lr_scheduler.StepLR(grouped, 1, gamma=0.5)
    prepared, opt, sched = acc.prepare(model, grouped, sched)
    acc.native_amp = True  # so backward scales and step goes through the scaler (forward stays fp32)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = _batches(1)[0]
    acc.backward(nn.functional.mse_loss(prepared(x), y) * float("inf"))
    opt.step()
    sched.step()
    assert opt.step_was_skipped
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert acc.schedule_step == 1 and acc.phase is not None and acc.phase.trainable == {"b"}
    assert all(p.grad is None for p in model.parameters())  # the overflowed gradients are gone
    assert grouped.inner["a"].param_groups[0]["lr"] == 0.1
    acc.native_amp = False


# ------------------------------------------------------------------------- visiting


def _state_snapshot(grouped: GroupedOptimizer, group: str) -> dict[str, tuple[torch.device, torch.Tensor]]:
    out = {}
    for i, p in enumerate(grouped.groups.params(group)):
        for key, value in grouped.inner[group].state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{i}.{key}"] = (value.device, value.clone())
    return out


def test_visiting_brings_a_non_resident_group_back_and_puts_it_back() -> None:
    acc, model, (prepared, opt), grouped = _multitask(PerTaskCycle(["trunk"], ["t0", "t1", "t2"], every=1))
    _train_tasks(acc, prepared, opt, 3, "zero_grad_last")  # every head trained once: state exists
    assert acc.task == "t0"
    residency = acc.switcher.residency
    x = torch.ones(2, 4)
    with pytest.raises(SwitchError, match=r"heads\.t1\.weight.*visiting"):
        model(x, "t1")
    params_before = {n: (p, p.detach().clone(), p.device) for n, p in model.heads["t1"].named_parameters()}
    state_before = _state_snapshot(grouped, "t1")
    assert state_before  # AdamW state of the absent head
    offloaded_bytes = residency.offloaded_bytes()
    ignored = set(model._ddp_params_and_buffers_to_ignore)
    assert {"heads.t1.weight", "heads.t1.bias"} <= ignored

    with torch.no_grad(), acc.visiting(["t1"]):
        assert model(x, "t1").shape == (2, 1)
        assert residency.offloaded == {"t2"}
        assert offloaded_bytes - residency.offloaded_bytes() == sum(
            p.numel() * p.element_size() for p in model.heads["t1"].parameters()
        )
        with pytest.raises(SwitchError, match=r"heads\.t2\.weight"):  # only the visited group came back
            model(x, "t2")

    assert residency.offloaded == {"t1", "t2"} and residency.offloaded_bytes() == offloaded_bytes
    with pytest.raises(SwitchError, match=r"heads\.t1\.weight"):
        model(x, "t1")
    for name, p in model.heads["t1"].named_parameters():
        same, value, device = params_before[name]
        assert p is same and p.device == device and torch.equal(p, value)
    state_after = _state_snapshot(grouped, "t1")
    assert state_after.keys() == state_before.keys()
    assert all(state_after[k][0] == d and torch.equal(state_after[k][1], v) for k, (d, v) in state_before.items())
    assert set(model._ddp_params_and_buffers_to_ignore) == ignored
    with acc.visiting("t0"):  # resident already: nothing moves
        assert residency.offloaded == {"t1", "t2"}
    # Training goes on as before: the next step trains t1, which comes back by the schedule.
    _train_tasks(acc, prepared, opt, 1, "zero_grad_last")
    assert acc.task == "t1"


def test_visiting_before_prepare_or_with_unknown_groups_is_refused() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(PerTaskCycle(["trunk"], ["t0", "t1"], every=1), cpu=True)
    with pytest.raises(AltParamsError, match=r"before `accelerator\.prepare"):
        with acc.visiting(["t1"]):
            pass
    acc, _, _, _ = _multitask(PerTaskCycle(["trunk"], ["t0", "t1", "t2"], every=1))
    with pytest.raises(PlanError, match=r"unknown group\(s\) \['head9'\].*'trunk', 't0'"):
        with acc.visiting(["t1", "head9"]):
            pass
    assert acc.switcher.residency.offloaded == {"t1", "t2"}  # nothing half-applied


@pytest.mark.cuda
def test_cuda_visiting_moves_the_group_to_the_device_and_back() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(PerTaskCycle(["trunk"], ["t0", "t1", "t2"], every=1))
    model = TwoTasks()
    grouped = GroupedOptimizer(ParamGroups(model, TASK_GROUPS), functools.partial(torch.optim.AdamW, lr=0.01))
    prepared, opt = acc.prepare(model, grouped)
    _train_tasks(acc, prepared, opt, 3, "zero_grad_last")
    head = model.heads["t1"]
    assert head.weight.device.type == "cpu"
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    with torch.no_grad(), acc.visiting(["t1"]):
        assert head.weight.is_cuda
        assert grouped.inner["t1"].state[head.weight]["exp_avg"].device.type == "cpu"  # state stays off
        assert torch.cuda.memory_allocated() > allocated
        model(torch.ones(2, 4, device="cuda"), "t1")
    torch.cuda.synchronize()
    assert head.weight.device.type == "cpu" and torch.cuda.memory_allocated() == allocated


# ------------------------------------------------------------------------- the Trainer callback


class TrainerTasks(TwoTasks):
    """A multi-task model for the Trainer: the head comes from ``self.task`` (set by a callback)."""

    task = "t0"

    def forward(
        self,
        x: torch.Tensor,
        labels: Optional[torch.Tensor] = None,  # type: ignore[override]
        task: Optional[str] = None,
    ) -> dict[str, torch.Tensor]:
        out = super().forward(x, task or self.task).squeeze(-1)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out} if labels is not None else {"logits": out}


def test_trainer_callback_gives_the_task_and_visits(tmp_path: Path) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_altparams.integrations.trainer import AlternatingFreeze

    model = TrainerTasks()
    freeze = AlternatingFreeze(TASK_GROUPS, PerTaskCycle(["trunk"], ["t0", "t1", "t2"], every=1))
    seen: list[Optional[str]] = []

    class PickTask(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model.task = freeze.task  # type: ignore[assignment]
            seen.append(freeze.task)

    gen = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=gen), "labels": torch.randn((), generator=gen)} for _ in range(32)]
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=100,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[freeze, PickTask()])
    assert freeze.task is None and freeze.phase is None
    with pytest.raises(AltParamsError, match=r"before `trainer\.train\(\)`"):
        with freeze.visiting(["t1"]):
            pass
    trainer.train()
    assert seen == ["t0", "t1", "t2", "t0"]
    assert freeze.task == "t0" and freeze.phase is not None and freeze.phase.task == "t0"
    before = model.heads["t2"].weight.detach().clone()
    with pytest.raises(SwitchError, match=r"heads\.t2\.weight"):
        model(torch.ones(2, 4), task="t2")
    with torch.no_grad(), freeze.visiting(["t2"]):
        assert model(torch.ones(2, 4), task="t2")["logits"].shape == (2,)
    with pytest.raises(SwitchError, match=r"heads\.t2\.weight"):
        model(torch.ones(2, 4), task="t2")
    assert torch.equal(model.heads["t2"].weight, before)
    with pytest.raises(PlanError, match="unknown group"):
        with freeze.visiting(["nope"]):
            pass
