"""PhasedAccelerator: two real gloo ranks under `accelerate launch`, plus in-process argument checks.

The two-rank scenarios run in two launches shared by every test here
(imports and start-up cost more than the training):
``accelerate_checks.py`` (equivalence, bytes, comm hooks, the seed user's own two
optimizers, bf16, fp16 scaler, the uninterrupted run with its mid-phase checkpoint) and then
``accelerate_resume.py`` (new processes resuming from that checkpoint).
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Any, NoReturn

import pytest
import torch
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.errors import AltParamsError, PlanError
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path

NPROC = 2


# --------------------------------------------------------------------------- two ranks
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("accelerate_checks")
    launch(
        script_path("accelerate_checks.py"),
        str(out),
        nproc=NPROC,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return out, rank_results(out, nproc=NPROC)


@pytest.fixture(scope="module")
def resumed(ranks: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out, _ = ranks
    launch(
        script_path("accelerate_resume.py"),
        str(out),
        nproc=NPROC,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return rank_results(out / "resume", nproc=NPROC)


def scenario(ranks: tuple[Path, list[dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    return [r[name] for r in ranks[1]]


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ga1", "ga2"])
def test_parameters_equal_one_process_reference(ranks: Any, name: str) -> None:
    per_rank = scenario(ranks, name)
    for r in per_rank:
        assert r["steps"] == r["windows"] == 6
        assert r["max_abs_diff_vs_reference"] < 1e-6, r["max_abs_diff_vs_reference"]
    assert per_rank[0]["param_sha256"] == per_rank[1]["param_sha256"], "ranks must stay bit-identical"


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ga1", "ga2"])
def test_bytes_allreduced_per_step_equal_trainable_bytes(ranks: Any, name: str) -> None:
    for r in scenario(ranks, name):
        assert r["allreduce_bytes_measured"] == r["allreduce_bytes_expected"]
        assert r["record_bytes"] == r["record_trainable_bytes"]
        assert len(set(r["allreduce_bytes_expected"])) > 1, "the phases must differ in size"


@pytest.mark.distributed
def test_bf16_model_accumulates_and_all_reduces_in_fp32_like_the_one_process_reference(ranks: Any) -> None:
    """PrecisionOptimizer(allreduce_dtype=torch.float32), gradient accumulation 3, through prepare/accumulate."""
    per_rank = scenario(ranks, "bf16_masters")
    for r in per_rank:
        assert r["dtypes"] == ["torch.bfloat16"] and r["steps"] == 6
        assert r["max_abs_diff_vs_reference"] == 0.0  # two ranks: every sum rounds once, bit-exact
        assert r["allreduce_bytes_measured"] == [4 * n for n in r["trainable_numel"]]
    assert per_rank[0]["param_sha256"] == per_rank[1]["param_sha256"]


@pytest.mark.distributed
def test_switches_only_at_gradient_sync_boundaries(ranks: Any) -> None:
    ga1, ga2 = scenario(ranks, "ga1")[0], scenario(ranks, "ga2")[0]
    # Alternating({"l0": 2, "l1": 1, "head": 1}) over 6 optimizer steps (+ the switch after the last one).
    assert ga1["switch_phases"] == ["l0", "l1", "head", "l0", "l1"]
    assert ga1["switch_steps"] == [0, 2, 3, 4, 6]
    # With 2 micro-batches per step the schedule still counts optimizer steps, not micro-batches.
    assert ga2["switch_phases"] == ["head+l1", "head+l0+l1"]
    assert ga2["switch_steps"] == [0, 2]


@pytest.mark.distributed
def test_model_prepared_once_and_saved_once(ranks: Any) -> None:
    for name in ("ga1", "ga2"):
        for r in scenario(ranks, name):
            assert r["models_registered"] == 1
            # One DDP constructor (one full-model broadcast) for the run; every switch rebuilt it in place.
            assert r["ddp_constructions"] == 1 and len(r["switch_phases"]) > 1
            assert r["ddp_is_wrapper_of_model"]
            model_files = [f for f in r["checkpoint_files"] if f.startswith(("model", "pytorch_model"))]
            assert model_files == ["model.safetensors"], r["checkpoint_files"]
            assert ranks[1][0]["state_file"] in r["checkpoint_files"]
            assert "prepare" in r["reprepare_error"] and "_models" in r["reprepare_error"]
    assert scenario(ranks, "bf16")[0]["models_registered"] == 1


@pytest.mark.distributed
def test_switch_records_reach_the_tracker_on_the_main_process(ranks: Any) -> None:
    main, other = scenario(ranks, "ga1")
    logs = main["tracker_logs"]
    assert [log["altparams/phase"] for log in logs] == main["switch_phases"]
    assert [log["step"] for log in logs] == main["switch_steps"]
    for log, nbytes in zip(logs, main["record_bytes"]):
        assert log["altparams/allreduce_bytes_per_step"] == nbytes == log["altparams/trainable_bytes"]
        assert log["altparams/trainable_params"] * 4 == nbytes
        assert log["altparams/rss_bytes"] > 0 and log["altparams/seconds"] >= 0
    assert other["tracker_logs"] == [], "trackers live on the main process only"


@pytest.mark.distributed
def test_find_unused_parameters_false_by_default_and_explained(ranks: Any) -> None:
    assert all(not r["find_unused_parameters"] for r in scenario(ranks, "ga1"))
    for r in scenario(ranks, "unused"):
        assert r["default_find_unused_parameters"] is False
        assert "spare.weight" in r["default_error"] and "find_unused_parameters=True" in r["default_error"]
        assert r["true_find_unused_parameters"] is True
        assert r["true_error"] == "" and r["true_steps"] == 2


@pytest.mark.distributed
def test_comm_hook_from_ddp_kwargs_survives_switches(ranks: Any) -> None:
    per_rank = scenario(ranks, "comm_hook")
    for r in per_rank:
        assert len(set(r["phases"])) == 3
        assert r["hooks_per_step"] == [["fp16_compress_hook"]] * 6
        # Gradients came back through the fp16 all-reduce in every phase.
        assert r["fp16_exact_per_step"] == [True] * 6
    assert per_rank[0]["param_sha256"] == per_rank[1]["param_sha256"]


@pytest.mark.distributed
def test_per_task_residency_trains_trunk_and_current_task_only(ranks: Any) -> None:
    per_rank = scenario(ranks, "per_task")
    for r in per_rank:
        assert r["tasks"] == ["t0", "t0", "t1", "t1", "t0", "t0"]
        assert r["allreduce_bytes_measured"] == r["allreduce_bytes_expected"]
        assert r["max_abs_diff_vs_reference"] < 1e-6
        assert "t1" in r["refused"] or "t0" in r["refused"], "a forward through a non-resident head is refused"
    assert per_rank[0]["param_sha256"] == per_rank[1]["param_sha256"]


@pytest.mark.distributed
def test_bf16_on_cpu_switches_and_keeps_ranks_equal(ranks: Any) -> None:
    per_rank = scenario(ranks, "bf16")
    for r in per_rank:
        assert r["mixed_precision"] == "bf16" and r["autocast_dtype"] == "torch.bfloat16"
        assert r["steps"] == 4 and r["phases"] == ["l0", "l1+head", "l0", "l1+head", "l0"]
        assert r["changed"]
    assert per_rank[0]["param_sha256"] == per_rank[1]["param_sha256"]


@pytest.mark.distributed
def test_fp16_one_unscale_and_one_scaler_update_per_step(ranks: Any) -> None:
    r = scenario(ranks, "fp16_scaler")[0]
    init = r["init_scale"]
    # One GroupedOptimizer: one unscale, one update (growth_interval=1 doubles the scale once),
    # and the update equals an unscaled fp32 step.
    assert r["grouped"]["scale_after"] == 2 * init
    assert max(r["grouped"]["max_abs_diff_by_param"].values()) == 0.0
    # The user's own optimizers, one per group, each stepped: the same single unscale and update.
    assert r["own_optimizers"]["scale_after"] == 2 * init
    assert max(r["own_optimizers"]["max_abs_diff_by_param"].values()) == 0.0
    # The trap it avoids: two prepared optimizers step the scaler twice and unscale the second twice.
    assert r["two_optimizers"]["scale_after"] == 4 * init
    assert r["two_optimizers"]["max_abs_diff_by_param"]["l0.weight"] == 0.0
    assert r["two_optimizers"]["max_abs_diff_by_param"]["l1.weight"] > 1e-3


@pytest.mark.distributed
@pytest.mark.parametrize("style", ["step_both", "active_only"])
def test_seed_users_two_adams_train_like_their_own_loop_and_ranks_match(ranks: Any, style: str) -> None:
    per_rank = [r[style] for r in scenario(ranks, "own_optimizers")]
    for r in per_rank:
        assert r["steps"] == r["windows"] == 6, "one schedule step per iteration, not one per handle"
        assert r["optimizers_prepared"] == 1  # one GroupedOptimizer built from the two Adams
        assert r["adam_steps"] == r["reference_adam_steps"] and sum(r["adam_steps"]) == 6
        assert r["max_abs_diff_vs_reference"] < 1e-6, r["max_abs_diff_vs_reference"]
    assert per_rank[0]["param_sha256"] == per_rank[1]["param_sha256"], "ranks must stay bit-identical"


@pytest.mark.distributed
def test_an_optimizer_set_leaving_a_group_out_is_refused_at_prepare_on_every_rank(ranks: Any) -> None:
    for r in scenario(ranks, "own_optimizers"):
        assert "leaves out 2 parameter(s) that the schedule trains (group(s) ['layer2']" in r["leaves_out"]["error"]
        assert "holds parameters of groups ['layer1', 'layer2']" in r["spans"]["error"]
        for refused in (r["leaves_out"], r["spans"]):  # nothing half-applied
            assert refused["phase"] is None and refused["models"] == refused["optimizers"] == 0
            assert all(refused["requires_grad"])


@pytest.mark.distributed
def test_resume_mid_phase_equals_uninterrupted_run_bitwise(ranks: Any, resumed: list[dict[str, Any]]) -> None:
    uninterrupted = scenario(ranks, "resume")
    assert uninterrupted[0]["saved_phase"] == "l1"  # Alternating({"l0": 3, "l1": 2, "head": 1}) at step 4
    for r, u in zip(resumed, uninterrupted):
        assert r["phase_at_prepare"] == "l0"
        assert r["after_load"]["schedule_step"] == 4 and r["after_load"]["phase"] == "l1"
        assert r["steps"] == u["steps"] == 9
        assert r["bitwise_equal_to_uninterrupted"], r["max_abs_diff"]
        assert r["param_sha256"] == u["param_sha256"]
        assert r["models_registered"] == 1
    assert resumed[0]["param_sha256"] == resumed[1]["param_sha256"]


@pytest.mark.distributed
def test_resume_restores_every_group_state_under_its_policy(resumed: list[dict[str, Any]]) -> None:
    for r in resumed:
        state = r["after_load"]["optimizer_state"]
        assert r["after_load"]["active"] == ["l1"]
        # l1 ("drop" when idle) is active at the resumed step: its state is loaded, not dropped.
        assert state["l1"]["step"] == 1.0
        # l0 trained 3 steps and is idle with "offload": its state is loaded and stays off the device
        # (on a CPU-only run the device is the CPU, so this only shows that it is there).
        assert state["l0"]["step"] == 3.0 and state["l0"]["devices"] == ["cpu"]
        assert state["head"]["step"] is None  # never trained yet
        assert r["after_load"]["param_groups_live"]


# --------------------------------------------------------------------------- one process
def _grouped_sgd(model: nn.Module) -> GroupedOptimizer:
    groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
    return GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_bad_arguments_are_refused_before_anything_is_built() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    with pytest.raises(PlanError, match="`schedule`"):
        PhasedAccelerator(["a", "b"])  # type: ignore[arg-type]
    groups = ParamGroups(_net(), {"a": "0.*", "b": "2.*"})
    with pytest.raises(PlanError, match="unknown group"):
        PhasedAccelerator(Alternating(["a", "c"]), groups=groups)
    with pytest.raises(PlanError, match="`find_unused_parameters`"):
        PhasedAccelerator(Alternating(["a", "b"]), find_unused_parameters="auto")  # type: ignore[arg-type]


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_count_comm_and_a_ddp_comm_hook_are_refused_together() -> None:
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(PlanError, match="`count_comm=True`"):
        PhasedAccelerator(Alternating(["a", "b"]), count_comm=True, kwargs_handlers=[handler], cpu=True)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_one_process_switches_without_ddp_and_matches_a_plain_loop() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    schedule = Alternating({"a": 2, "b": 1})
    acc = PhasedAccelerator(schedule, cpu=True)
    model = _net()
    groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    prepared, prepared_opt = acc.prepare(model, opt)
    assert prepared is model  # one process: no DDP wrapper

    reference = _net()
    ref_groups = ParamGroups(reference, {"a": "0.*", "b": "2.*"})
    ref_opts = {g: torch.optim.SGD(ref_groups.params(g), lr=0.1) for g in ("a", "b")}
    gen = torch.Generator().manual_seed(1)
    flags = []
    for step in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        flags.append((model[0].weight.requires_grad, model[2].weight.requires_grad))
        acc.backward(nn.functional.mse_loss(prepared(x), y))
        prepared_opt.step()
        prepared_opt.zero_grad()

        active = schedule.phase_at(step).trainable
        for g, params in (("a", ref_groups.params("a")), ("b", ref_groups.params("b"))):
            for p in params:
                p.requires_grad_(g in active)
        nn.functional.mse_loss(reference(x), y).backward()
        for g in sorted(active):
            ref_opts[g].step()
            ref_opts[g].zero_grad(set_to_none=True)

    assert flags == [(True, False), (True, False), (False, True), (True, False), (True, False)]
    assert acc.schedule_step == 5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_backward_without_zero_grad_after_a_switching_step_applies_no_stale_gradient() -> None:
    # The switch runs at the end of step(): the previous phase's gradients are gone before any
    # later backward, so even a loop that forgets zero_grad never applies them to the next phase.
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    model = _net()
    opt = _grouped_sgd(model)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(2, 4)
    acc.backward(model(x).sum())
    opt.step()  # phase "a" done: "b" trains next
    assert acc.phase is not None and acc.phase.trainable == {"b"}
    assert all(p.grad is None for p in model.parameters())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    acc.backward(model(x).sum())  # no zero_grad in between
    expected_grad = model[2].weight.grad.clone()
    opt.step()
    assert torch.equal(model[0].weight, before["0.weight"])  # "a" is idle: untouched
    assert torch.equal(model[2].weight, before["2.weight"].add(expected_grad, alpha=-0.1))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_grouped_optimizer_without_its_model_is_refused() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    model = _net()
    opt = _grouped_sgd(model)
    with pytest.raises(AltParamsError, match="same `prepare` call"):
        acc.prepare(opt)


def _train_steps(acc: Any, model: nn.Module, opt: Any, steps: int, scheduler: Any = None) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad()


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_lr_scheduler_on_the_grouped_optimizer_still_acts_after_prepare() -> None:
    # prepare() reloads the optimizer state onto the device (AcceleratedOptimizer(device_placement=True));
    # the scheduler must keep changing the rates the inner optimizers use.
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    model = _net()
    opt = _grouped_sgd(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    model, prepared_opt, scheduler = acc.prepare(model, opt, scheduler)
    _train_steps(acc, model, prepared_opt, 2, scheduler)
    assert [inner.param_groups[0]["lr"] for inner in opt.inner.values()] == [0.1 * 0.25] * 2


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_grouped_lr_scheduler_is_prepared_and_pauses_idle_groups() -> None:
    from hf_altparams.engine import GroupedLRScheduler
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    model = _net()
    opt = _grouped_sgd(model)
    scheduler = GroupedLRScheduler(opt, lambda inner: torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5))
    model, prepared_opt, prepared_scheduler = acc.prepare(model, opt, scheduler)
    assert prepared_scheduler is not scheduler and prepared_scheduler in acc._schedulers  # saved by save_state
    _train_steps(acc, model, prepared_opt, 3, prepared_scheduler)  # a, b, a
    assert opt.inner["a"].param_groups[0]["lr"] == 0.1 * 0.5**2
    assert opt.inner["b"].param_groups[0]["lr"] == 0.1 * 0.5


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_load_state_refuses_a_checkpoint_of_another_schedule(tmp_path: Path) -> None:
    from hf_altparams.integrations.accelerate import STATE_FILE, PhasedAccelerator

    acc = PhasedAccelerator(Alternating({"a": 2, "b": 1}), cpu=True)
    model = _net()
    model, opt = acc.prepare(model, _grouped_sgd(model))
    _train_steps(acc, model, opt, 2)
    acc.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / STATE_FILE).is_file()
    acc.free_memory()

    other = _net()
    acc = PhasedAccelerator(Alternating({"a": 3, "b": 1}), cpu=True)
    other, other_opt = acc.prepare(other, _grouped_sgd(other))
    with pytest.raises(PlanError, match="durations"):
        acc.load_state(str(tmp_path / "ckpt"))

    (tmp_path / "ckpt" / STATE_FILE).unlink()
    with pytest.raises(AltParamsError, match=STATE_FILE):
        acc.load_state(str(tmp_path / "ckpt"))


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_plain_optimizer_without_groups_is_refused_at_prepare() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AltParamsError, match=r"\['SGD'\].*`groups=ParamGroups\(model, \.\.\.\)`"):
        acc.prepare(model, opt)
    assert acc.phase is None and not acc._models  # nothing half-applied


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_user_built_ddp_is_refused_with_a_message_that_says_so() -> None:
    from torch.nn.parallel import DistributedDataParallel

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(["a", "b"]), cpu=True)
    model = _net()
    opt = _grouped_sgd(model)
    # What a user's DistributedDataParallel(model) looks like to `prepare`, without a process group.
    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    nn.Module.__init__(ddp)
    ddp.module = model
    with pytest.raises(AltParamsError, match=r"DistributedDataParallel you built around the grouped model"):
        acc.prepare(ddp, opt)
    assert acc.phase is None and not acc._models


class _Killed(Exception):
    """Stands for the process dying part-way through a save (a test cannot lose its own process)."""


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("stage", ["state_file_tmp", "state_file", "before_marker", "marker_tmp"])
def test_a_save_killed_at_any_stage_is_refused_and_skipped_by_automatic_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    from accelerate.utils import ProjectConfiguration

    from hf_altparams.integrations.accelerate import PhasedAccelerator
    from tests.support.faults import SaveFault

    def killed(at: str) -> NoReturn:
        raise _Killed(at)

    fault = SaveFault(monkeypatch, killed)

    def make() -> tuple[Any, Any, Any]:
        config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        acc = PhasedAccelerator(Alternating({"a": 2, "b": 1}), cpu=True, project_config=config)
        model = _net()
        model, opt = acc.prepare(model, _grouped_sgd(model))
        return acc, model, opt

    acc, model, opt = make()
    _train_steps(acc, model, opt, 2)
    acc.save_state()  # checkpoint_0, complete: step 2 trains "b"
    _train_steps(acc, model, opt, 1)  # step 3 trains "a"
    fault.arm(stage)
    with pytest.raises(_Killed):
        acc.save_state()  # checkpoint_1, torn at `stage`
    fault.disarm()
    torn = tmp_path / "checkpoints" / "checkpoint_1"
    assert torn.is_dir()
    acc.free_memory()

    acc, model, opt = make()
    with pytest.raises(AltParamsError, match="interrupted"):
        acc.load_state(str(torn))
    assert acc.schedule_step == 0  # refused before anything loaded
    assert acc.latest_checkpoint() == str(tmp_path / "checkpoints" / "checkpoint_0")
    acc.load_state()  # automatic resume: skips checkpoint_1
    assert acc.schedule_step == 2
    assert (model[0].weight.requires_grad, model[2].weight.requires_grad) == (False, True)
    # The next save goes after the highest folder, torn ones included (plain Accelerate: checkpoint_0, refused).
    assert acc.project_configuration.iteration == 2
    assert os.path.basename(acc.save_state()) == "checkpoint_2"


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_automatic_checkpoint_naming_without_a_project_dir_is_refused_naming_it(tmp_path: Path) -> None:
    """Accelerate's own save fails there on a bare TypeError (``os.path.join(None, ...)``); nothing is written."""
    from accelerate.utils import ProjectConfiguration

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(
        Alternating({"a": 2, "b": 1}), cpu=True, project_config=ProjectConfiguration(automatic_checkpoint_naming=True)
    )
    model = _net()
    model, opt = acc.prepare(model, _grouped_sgd(model))
    _train_steps(acc, model, opt, 1)
    for call in (acc.save_state, acc.load_state, acc.latest_checkpoint):
        with pytest.raises(AltParamsError, match=r"automatic_checkpoint_naming=True.*no.*project_dir"):
            call()
    assert acc.schedule_step == 1


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_load_state_takes_accelerates_load_kwargs_positionally(tmp_path: Path) -> None:
    """``load_state(folder, load_kwargs)`` as on a plain Accelerator (passed on to ``torch.load``)."""
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating({"a": 2, "b": 1}), cpu=True)
    model = _net()
    model, opt = acc.prepare(model, _grouped_sgd(model))
    _train_steps(acc, model, opt, 2)
    acc.save_state(str(tmp_path / "ckpt"))
    _train_steps(acc, model, opt, 1)
    acc.load_state(str(tmp_path / "ckpt"), {"weights_only": True})
    assert acc.schedule_step == 2


def test_bf16_model_with_mixed_precision_steps_fp32_masters_like_a_plain_loop() -> None:
    """A model loaded in bf16 + `mixed_precision="bf16"`: a PrecisionOptimizer goes through `prepare`."""
    from hf_altparams.engine import PhaseSwitcher, PrecisionOptimizer
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    def build() -> tuple[nn.Module, ParamGroups, PrecisionOptimizer]:
        model = _net().to(torch.bfloat16)
        groups = ParamGroups(model, {"a": "0.*", "b": "2.*"})
        return (
            model,
            groups,
            PrecisionOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-2), master_policy="drop"),
        )

    schedule = Alternating({"a": 2, "b": 1})
    acc = PhasedAccelerator(schedule, cpu=True, mixed_precision="bf16")
    model, _, opt = build()
    prepared, prepared_opt = acc.prepare(model, opt)
    reference, ref_groups, ref_opt = build()
    switcher = PhaseSwitcher(ref_groups, schedule, optimizer=ref_opt)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)
        with acc.autocast():
            loss = nn.functional.mse_loss(prepared(x), y)
        acc.backward(loss)
        prepared_opt.step()
        prepared_opt.zero_grad()

        switcher.step_to(step)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    # after step 4 ("a"): a's master, then the accelerator switched to "b" for step 5 (drop: a's is gone,
    # b's was dropped at step 3 and comes back from the bf16 weights at its next step)
    assert opt.master_bytes() == {}
    switcher.step_to(5)
    assert ref_opt.master_bytes() == {}
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)


# ------------------------------------------------------------- the user's own optimizers, one per group
class _Seed(nn.Module):
    """The seed user's model: two layers, one optimizer each (and an ungrouped, frozen `extra`)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer1, self.layer2, self.extra = nn.Linear(4, 8), nn.Linear(8, 1), nn.Linear(1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(torch.tanh(self.layer1(x)))


SEED_SPECS = {"layer1": "layer1.*", "layer2": "layer2.*"}
SEED_SCHEDULE = {"layer1": 2, "layer2": 1}


def _adam(params: Any) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=1e-2)


def _seed_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def _grouped_reference(steps: int) -> nn.Module:
    """The same schedule driven by a GroupedOptimizer built from the factory form."""
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    acc = PhasedAccelerator(Alternating(SEED_SCHEDULE), cpu=True)
    model = _Seed()
    model, opt = acc.prepare(model, GroupedOptimizer(ParamGroups(model, SEED_SPECS), _adam))
    for x, y in _seed_batches(steps):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    acc.free_memory()
    return model


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("style", ["step_all_then_zero_all", "step_zero_each", "active_only", "reversed", "zero_first"])
def test_own_optimizers_one_per_group_train_like_a_grouped_optimizer(style: str) -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    steps = 7
    reference = _grouped_reference(steps)
    model = _Seed()
    opt1, opt2 = _adam(model.layer1.parameters()), _adam(model.layer2.parameters())
    acc = PhasedAccelerator(Alternating(SEED_SCHEDULE), groups=ParamGroups(model, SEED_SPECS), cpu=True)
    if style == "reversed":
        model, h2, h1 = acc.prepare(model, opt2, opt1)
    else:
        model, h1, h2 = acc.prepare(model, opt1, opt2)
    assert (h1.group, h1.optimizer, h2.group, h2.optimizer) == ("layer1", opt1, "layer2", opt2)
    assert len(acc._optimizers) == 1 and isinstance(acc._optimizers[0].optimizer, GroupedOptimizer)
    for x, y in _seed_batches(steps):
        if style == "zero_first":  # zero_grad(); backward(); step()
            h1.zero_grad()
            h2.zero_grad()  # noqa: E702
        acc.backward(nn.functional.mse_loss(model(x), y))
        if style == "zero_first":
            h1.step()
            h2.step()  # noqa: E702
        elif style == "step_zero_each":
            h1.step()
            h1.zero_grad()
            h2.step()
            h2.zero_grad()  # noqa: E702
        elif style == "active_only":
            active = h1 if acc.phase is not None and "layer1" in acc.phase.trainable else h2
            active.step()
            active.zero_grad()
        else:
            h1.step()
            h2.step()
            h1.zero_grad()
            h2.zero_grad()  # noqa: E702
    assert acc.schedule_step == steps, "one schedule step per iteration, not one per handle"
    # layer1 trains at steps 0, 1, 3, 4, 6; layer2 at 2, 5: each Adam stepped only while its group trained.
    assert opt1.state[model.layer1.weight]["step"] == 5 and opt2.state[model.layer2.weight]["step"] == 2
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_own_optimizers_keep_their_lr_schedulers_and_checkpoint_as_one(tmp_path: Path) -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    def make() -> tuple[Any, nn.Module, Any, Any, Any]:
        model = _Seed()
        opt1, opt2 = _adam(model.layer1.parameters()), _adam(model.layer2.parameters())
        sched1 = torch.optim.lr_scheduler.StepLR(opt1, 1, gamma=0.5)
        acc = PhasedAccelerator(Alternating(SEED_SCHEDULE), groups=ParamGroups(model, SEED_SPECS), cpu=True)
        return (acc, *acc.prepare(model, opt1, opt2, sched1))

    acc, model, h1, h2, sched1 = make()
    for x, y in _seed_batches(4):
        acc.backward(nn.functional.mse_loss(model(x), y))
        h1.step()
        h2.step()
        sched1.step()
        h1.zero_grad()
        h2.zero_grad()  # noqa: E702
    assert h1.param_groups[0]["lr"] == 1e-2 * 0.5**4 and h2.param_groups[0]["lr"] == 1e-2
    acc.save_state(str(tmp_path / "ckpt"))
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    step1 = h1.state_dict()["state"][0]["step"]
    acc.free_memory()

    acc, model, h1, h2, sched1 = make()
    acc.load_state(str(tmp_path / "ckpt"))
    assert acc.schedule_step == 4 and acc.phase is not None and acc.phase.name == "layer1"
    assert h1.state_dict()["state"][0]["step"] == step1 == 3
    assert h1.param_groups[0]["lr"] == 1e-2 * 0.5**4
    assert all(torch.equal(saved[n], p) for n, p in model.named_parameters())


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_a_handle_loads_its_optimizers_state_and_the_grouped_step_uses_it() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    model = _Seed()
    opt1, opt2 = _adam(model.layer1.parameters()), _adam(model.layer2.parameters())
    acc = PhasedAccelerator(Alternating(SEED_SCHEDULE), groups=ParamGroups(model, SEED_SPECS), cpu=True)
    model, h1, h2 = acc.prepare(model, opt1, opt2)
    state = h1.state_dict()
    state["param_groups"][0]["lr"] = 0.0
    h1.load_state_dict(state)
    assert h1.param_groups[0]["lr"] == 0.0 and acc.phase is not None and acc.phase.name == "layer1"
    assert [g["lr"] for g in h1.driving.param_groups] == [0.0, 1e-2], "the grouped optimizer sees the new group"
    before = [p.detach().clone() for p in model.layer1.parameters()]
    x, y = next(iter(_seed_batches(1)))
    acc.backward(nn.functional.mse_loss(model(x), y))
    h1.step()
    h2.step()  # noqa: E702
    assert acc.schedule_step == 1, "the grouped step ran"
    assert all(torch.equal(b, p) for b, p in zip(before, model.layer1.parameters())), "the loaded lr (0) applied"


def _refused(acc: Any, model: nn.Module, *optimizers: Any) -> str:
    flags = [p.requires_grad for p in model.parameters()]
    with pytest.raises(AltParamsError) as info:
        acc.prepare(model, *optimizers)
    assert acc.phase is None and not acc._models and not acc._optimizers, "nothing half-applied"
    assert [p.requires_grad for p in model.parameters()] == flags
    return str(info.value)


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize(
    "case", ["spans", "missing", "extra", "twice", "group_left_out", "single_leaves_out", "grouped_and_plain"]
)
def test_optimizers_that_cannot_drive_the_schedule_are_refused_at_prepare(case: str) -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    model = _Seed()
    specs = {**SEED_SPECS, "extra": "extra.*"} if case == "group_left_out" else SEED_SPECS
    groups = ParamGroups(model, specs)
    acc = PhasedAccelerator(Alternating(list(specs)), groups=groups, cpu=True)
    opt1, opt2 = _adam(model.layer1.parameters()), _adam(model.layer2.parameters())
    passed, expected = {
        "spans": (
            [_adam(model.parameters()), opt2],
            r"argument #2 \(Adam\) holds parameters of groups \['layer1', 'layer2'\]",
        ),
        "missing": (
            [_adam([model.layer1.weight]), opt2],
            r"argument #2 \(Adam\) holds group 'layer1'.*missing: \['layer1.bias'\]; extra .*: \[\]",
        ),
        "extra": (
            [_adam([*model.layer1.parameters(), model.extra.weight]), opt2],
            r"missing: \[\]; extra \(not in group 'layer1'\): \['extra.weight'\]",
        ),
        "twice": (
            [opt1, _adam(model.layer1.parameters()), opt2],
            r"argument #2 and `prepare` argument #3 \(Adam\) both hold group 'layer1'",
        ),
        "group_left_out": ([opt1, opt2], r"no optimizer holds group\(s\) \['extra'\]"),
        "single_leaves_out": (
            [opt1],
            r"argument #2 \(Adam\) leaves out 2 parameter\(s\) that the schedule trains "
            r"\(group\(s\) \['layer2'\]: 'layer2.weight', 'layer2.bias'\)",
        ),
        "grouped_and_plain": ([GroupedOptimizer(groups, _adam), opt2], r"a GroupedOptimizer and 1 more optimizer\(s\)"),
    }[case]
    message = _refused(acc, model, *passed)
    assert re.search(expected, message), message
    assert "Accepted next to the grouped model" in message


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_model_and_its_optimizer_may_come_in_separate_prepare_calls() -> None:
    """`model = acc.prepare(model)` then `opt = acc.prepare(opt)` (the form FSDP2 users are told to use)."""
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    model, reference = _Seed(), _Seed()
    groups = ParamGroups(model, SEED_SPECS)
    acc = PhasedAccelerator(Alternating(list(SEED_SPECS)), groups=groups, cpu=True)
    model = acc.prepare(model)
    assert acc.phase is not None and acc.phase.name == "layer1"  # applied before DDP was built
    assert not any(p.requires_grad for p in model.layer2.parameters())
    x, y = _seed_batches(1)[0]
    with pytest.raises(PlanError, match=r"no optimizer over its parameters was passed to `prepare` yet"):
        acc.backward(nn.functional.mse_loss(model(x), y))  # the phases could never advance
    with pytest.warns(UserWarning, match=r"2 parameter\(s\) that no group names .*'extra.weight', 'extra.bias'"):
        opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))  # `extra` is in no group: said, then frozen
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_seed_batches(4)):
        active = reference.layer1 if step % 2 == 0 else reference.layer2
        reference.requires_grad_(False)
        active.requires_grad_(True)
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    assert acc.schedule_step == 4 and acc.phase.name == "layer1"
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


@pytest.mark.usefixtures("fresh_accelerate_state")
@pytest.mark.parametrize("form", ["own_optimizers", "grouped"])
def test_trainable_ungrouped_parameters_without_an_optimizer_are_refused_at_prepare(form: str) -> None:
    # Before: they got gradients every step, were never updated, and the first switch failed on them.
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    model = _Seed()
    groups = ParamGroups(model, SEED_SPECS, ungrouped="trainable")
    acc = PhasedAccelerator(Alternating(list(SEED_SPECS)), groups=groups, cpu=True)
    passed = (
        [_adam(model.layer1.parameters()), _adam(model.layer2.parameters())]
        if form == "own_optimizers"
        else [GroupedOptimizer(groups, _adam)]
    )
    message = _refused(acc, model, *passed)
    assert re.search(r"leaves out 2 parameter\(s\) .*\['<ungrouped>'\]: 'extra.weight', 'extra.bias'", message)
    who = "the optimizers passed, one per group," if form == "own_optimizers" else "argument #2 (GroupedOptimizer)"
    assert who in message, message


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_optimizers_of_the_grouped_model_without_it_are_refused_and_others_pass_through() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    model, other = _Seed(), nn.Linear(2, 2)
    acc = PhasedAccelerator(Alternating(list(SEED_SPECS)), groups=ParamGroups(model, SEED_SPECS), cpu=True)
    opt1, opt2 = _adam(model.layer1.parameters()), _adam(model.layer2.parameters())
    with pytest.raises(
        AltParamsError,
        match=r"argument #1 \(Adam\) is an optimizer of the grouped model, passed "
        r"without the model",
    ):
        acc.prepare(opt1, opt2)
    assert acc.phase is None and not acc._optimizers
    other_opt = _adam(other.parameters())  # another model's optimizer: prepared by Accelerate as usual
    model, h1, prepared_other, h2 = acc.prepare(model, opt1, other_opt, opt2)
    assert (h1.group, h2.group) == ("layer1", "layer2") and prepared_other.optimizer is other_opt
    assert len(acc._optimizers) == 2
    with pytest.raises(AltParamsError, match="after the model was prepared"):
        acc.prepare(_adam(model.layer1.parameters()))
    assert acc.prepare(h1) is h1  # a handle is prepared already


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_fp16_unscale_through_each_handle_unscales_the_grouped_optimizer_once() -> None:
    """`unscale_gradients(opt1)`, `(opt2)` and `clip_grad_norm_` in one iteration: one unscale, exact updates.

    The CPU stand-in for CUDA fp16 of the two-rank ``fp16_scaler`` scenario: a CPU GradScaler
    handed over before ``prepare``, ``native_amp`` on after it, a power-of-two scale (exact).
    """
    from hf_altparams.integrations.accelerate import PhasedAccelerator
    from hf_altparams.plan import PhaseSequence

    def sgd(params: Any) -> torch.optim.SGD:
        return torch.optim.SGD(params, lr=0.1)

    model, reference = _Seed(), _Seed()
    groups = ParamGroups(model, SEED_SPECS)
    acc = PhasedAccelerator(PhaseSequence([(("layer1", "layer2"), 1)]), groups=groups, mixed_precision="fp16", cpu=True)
    init_scale = 2.0**10
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1)
    model, h1, h2 = acc.prepare(model, sgd(model.layer1.parameters()), sgd(model.layer2.parameters()))
    acc.native_amp = True
    ref_opt = sgd([*reference.layer1.parameters(), *reference.layer2.parameters()])
    for x, y in _seed_batches(2):
        acc.backward(nn.functional.mse_loss(model(x), y))
        acc.unscale_gradients(optimizer=h1)  # the user's per-optimizer unscale, as in many GAN loops
        acc.unscale_gradients(optimizer=h2)
        acc.clip_grad_norm_(model.parameters(), 1e6)  # unscales every prepared optimizer; clips nothing
        h1.step()
        h2.step()
        h1.zero_grad()
        h2.zero_grad()  # noqa: E702
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    acc.native_amp = False
    assert acc.scaler.get_scale() == init_scale * 2**2, "one scaler update per iteration"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if name.startswith("layer"):
            assert torch.equal(p, q), name


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_own_optimizers_without_groups_are_refused_naming_the_way_out() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    model = _Seed()
    acc = PhasedAccelerator(Alternating(list(SEED_SPECS)), cpu=True)
    message = _refused(acc, model, _adam(model.layer1.parameters()), _adam(model.layer2.parameters()))
    assert "['Adam', 'Adam']" in message and "`groups=ParamGroups(model, ...)`" in message
