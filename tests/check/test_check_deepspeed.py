"""``python -m hf_altparams check --deepspeed``: ZeRO-1/2 judged on CPU ranks, ZeRO-3 refused before any rank starts.

The flags are checked in this process (nothing starts); two runs train the
check for real under DeepSpeed on 2 CPU ranks of the user's own launcher
(``check_launched``: a plain ``torchrun`` environment, no C++ op built): the
library's LISA passes, the usual LISA callback (freeze all layers, unfreeze the
drawn one, the schedule training everything) fails naming ``idle_group_changed``.
That the check's own launch gives its DeepSpeed ranks that environment is
checked on :func:`~hf_altparams.check.launch.rank_env`. The runs are skipped
without deepspeed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_altparams.check import main
from hf_altparams.check.launch import RESULTS_ENV, rank_env
from hf_altparams.check.weights import IdleWatch, frozen_groups
from hf_altparams.check.zero import complete, deepspeed_config, refusal, strategy_config
from hf_altparams.engine.strategies import strategy_named
from hf_altparams.plan import Alternating, ParamGroups
from tests.check.test_check_runs import check_launched


@pytest.fixture(scope="module")
def extensions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``TORCH_EXTENSIONS_DIR`` for every DeepSpeed run here: where a C++ op would be built (none must be). One
    folder for both runs: the forked ranks' server is chosen by it (``TORCH*`` is read at import)."""
    return tmp_path_factory.mktemp("torch_extensions")


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("flags", [("--deepspeed", "3"), ("--strategy", "zero3"), ("--strategy", "deepspeed-zero3")])
def test_zero3_is_refused_before_any_rank_starts_with_the_librarys_reason(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, str]
) -> None:
    code, verdict = _refused(capsys, *flags)
    assert code == 2 and not verdict["passed"] and verdict["causes"] == ["strategy_refused"]
    detail = verdict["failures"][0]["detail"]
    assert detail == refusal(strategy_config(3))  # the refusal table's own message, its measured reason
    assert "ZeRO-3 all-gathers every weight" in detail and "Use ZeRO-2" in detail
    assert verdict["ranks"] == []  # nothing was started


def test_a_config_file_the_library_refuses_is_named_with_its_setting(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    code, verdict = _refused(capsys, "--deepspeed", str(config))
    assert code == 2 and verdict["causes"] == ["strategy_refused"]
    assert "offload_optimizer" in verdict["failures"][0]["detail"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--deepspeed", "no-such.json"], "`--deepspeed` takes a ZeRO stage (1, 2) or a DeepSpeed config file"),
        (["--deepspeed", "2", "--fsdp2"], "`--fsdp2` and `--deepspeed` exclude each other"),
        (["--deepspeed", "1", "--strategy", "zero2"], "`--deepspeed 1` (ZeRO stage 1) and `--strategy zero2` disagree"),
        (["--strategy", "zero2", "--fsdp2"], "`--fsdp2` and `--strategy zero2` disagree"),
    ],
)
def test_bad_deepspeed_flags_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    assert main(argv) == 2
    assert named in capsys.readouterr().err


def test_a_config_file_that_is_not_an_object_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text("[1, 2]")
    with pytest.raises(Exception, match="holds a JSON list, not a DeepSpeed config"):
        deepspeed_config(str(config))


def test_the_config_is_completed_for_the_loop_and_its_own_figures_kept() -> None:
    own = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "zero_optimization": {"stage": 1}}
    assert complete(own, accumulation=1, world=2) == 3  # the config's accumulation is the one trained
    assert own["train_batch_size"] == 4 * 3 * 2  # the ranks of the job, not Accelerate's one process per rank
    left = strategy_config(2)
    assert complete(left, accumulation=2, world=2) == 2
    assert (left["train_micro_batch_size_per_gpu"], left["train_batch_size"]) == (1, 4)


def test_zero2_declares_a_reduction_per_micro_batch_and_zero1_one_per_step() -> None:
    assert strategy_named("zero2").pricing.reduces_per_micro_batch
    assert not strategy_named("zero1").pricing.reduces_per_micro_batch
    assert not strategy_named("ddp").pricing.reduces_per_micro_batch


def test_a_group_frozen_behind_the_schedule_that_changes_is_an_idle_change() -> None:
    """The phase trains both groups; code outside the schedule froze ``b``, and something stepped it anyway."""
    net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    phase = Alternating([("a", "b")]).phase_at(0)
    watch = IdleWatch(groups, phase)
    net[1].requires_grad_(False)
    assert frozen_groups(groups, phase) == {"b"}
    assert watch.flags(0, frozen_groups(groups, phase)) == []  # nothing changed before step 0
    with torch.no_grad():
        net[0].weight.add_(1.0)  # the trained group moves: fine
        net[1].weight.mul_(0.5)  # the frozen one moves too
    changes = watch.boundary(1, phase)
    assert [(c.group, c.since, c.until, c.frozen) for c in changes] == [("b", 0, 1, True)]
    net[1].requires_grad_(True)
    assert watch.flags(1, frozen_groups(groups, phase)) == []  # unfrozen: judged as the schedule says again
    with torch.no_grad():
        net[1].weight.mul_(0.5)
    assert watch.boundary(2, None) == []


def test_the_check_s_launch_gives_deepspeed_ranks_a_plain_torchrun_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ACCELERATE_USE_CPU`` (which makes Accelerate drop DeepSpeed) is left out for DeepSpeed's ranks, even where
    the user set it; CPU ranks without DeepSpeed get it (else Accelerate runs each alone)."""
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    env = rank_env("/results", deepspeed=True)
    assert "ACCELERATE_USE_CPU" not in env and env[RESULTS_ENV] == "/results"
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    if not torch.cuda.is_available():
        assert rank_env("/results", deepspeed=False)["ACCELERATE_USE_CPU"] == "1"
    assert "ACCELERATE_USE_CPU" not in rank_env("/results", deepspeed=True)


@pytest.mark.distributed
def test_zero2_with_the_librarys_lisa_passes_every_judgement(extensions: Path) -> None:
    pytest.importorskip("deepspeed")
    code, verdict = check_launched(  # the environment the check's own launch gives DeepSpeed ranks (above)
        "--setup",
        "tests.check.setups:lisa_small",
        "--strategy",
        "zero2",
        steps=12,
        env={"TORCH_EXTENSIONS_DIR": str(extensions)},
        cpu=False,
    )
    assert code == 0 and verdict["passed"], verdict["failures"]
    assert list(extensions.iterdir()) == []  # no C++ op built
    status = {f["check"]: f for f in verdict["findings"]}
    for name in (
        "ranks bit-identical after each switch",
        "bytes all-reduced = trainable bytes",
        "idle groups unchanged",
        "idle optimizer state as its policy says",
        "memory held vs plan",
    ):
        assert status[name]["status"] == "pass", status[name]
    assert all(r["parallel"] == "DeepSpeed ZeRO-2" and r["world"] == 2 for r in verdict["ranks"])
    for result in verdict["ranks"]:
        for step in result["steps"]:  # what DeepSpeed ran: the reduction plus the all-gather of the updated part
            assert step["expected_reduced"] > step["grad_bytes"], step  # the strategy's figure, gathers included
            assert 0 <= step["reduced_bytes"] - step["expected_reduced"] <= step["reduced_slack"], step
            assert step["reduced_bytes"] - step["expected_reduced"] < step["expected_reduced"] // 1000  # scalars only
            assert step["grad_bytes"] < result["trainable_everything"]
        assert sum(s["idle_checked"] for s in result["switches"]) > 0


@pytest.mark.distributed
def test_the_usual_lisa_callback_under_zero_fails_naming_the_layers_that_moved(
    tmp_path: Path, extensions: Path
) -> None:
    pytest.importorskip("deepspeed")
    config = tmp_path / "ds_zero1.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": 1.0}))
    code, verdict = check_launched(  # the user's own launcher, without ACCELERATE_USE_CPU (it would drop DeepSpeed)
        "--setup",
        "tests.check.setups:lisa_callback_of_ones_own",
        "--deepspeed",
        str(config),
        steps=6,
        env={"TORCH_EXTENSIONS_DIR": str(extensions)},
        cpu=False,
    )
    assert code == 1 and "idle_group_changed" in verdict["causes"], verdict["failures"]
    failure = next(f for f in verdict["failures"] if f["cause"] == "idle_group_changed")
    assert "frozen by its requires_grad flags" in failure["detail"]
    assert "DeepSpeed ZeRO steps every partition it was built with" in failure["detail"]


@pytest.mark.parametrize(("over", "passes"), [(0, True), (24, True), (-4, False), (4096, False)])
def test_under_zero_the_count_may_exceed_the_declared_figure_by_scalars_not_by_a_group(over: int, passes: bool) -> None:
    """DeepSpeed's counter sees its scalar collectives too (24 bytes a step measured); a group's gradients or
    partition (here 4 KiB, the smallest group) beyond the declared figure, or anything short of it, is a finding."""
    from hf_altparams.check import judge
    from tests.check.test_judgement import CPU, result

    ranks = [result(0), result(1)]
    for r in ranks:
        r.parallel = "DeepSpeed ZeRO-2"
        for row in r.steps:
            row.expected_reduced = 2 * row.grad_bytes
            row.reduced_bytes = row.expected_reduced + over
            row.reduced_slack = 4096 - 1
    verdict = judge(ranks, CPU)
    found = next(f for f in verdict.findings if f.check == "bytes all-reduced = trainable bytes")
    assert (found.status == "pass") is passes, found.detail
    assert ("bytes_mismatch" in verdict.causes) is not passes
    if passes:
        assert f"plus {over} bytes of its scalar collectives" in found.detail
    else:
        assert "that DeepSpeed ZeRO-2 declares for the phase's" in found.detail
