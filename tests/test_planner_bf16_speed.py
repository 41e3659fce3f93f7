"""Is bf16 fast here? The verdict on given figures, its override, and the planner's warning where it is slow.

No test here depends on how fast this machine is: the decision is tested on given
timings (``cpu_verdict``, an injected ``probe``) and on the ``HF_ALTPARAMS_BF16``
override; the real probe is only run to check what it returns, never how fast.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.planner import Bf16Speed, bf16_speed, main, plan_cost
from hf_altparams.planner.hardware import BF16_ENV, SLOW_RATIO, cpu_verdict, cuda_verdict, time_matmul

# The machine: a 2-core AMD EPYC, torch CPU capability AVX2 (its 256x2048 @ 2048x5632 matmul).
AVX2_FP32, AVX2_BF16 = 0.161, 16.205
NATIVE_FP32, NATIVE_BF16 = 0.035, 0.016  # this project's AVX-512 bf16 machine, the same matmul


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(BF16_ENV, raising=False)


def test_cpu_without_bf16_arithmetic_is_slow_and_the_reason_names_the_figures() -> None:
    speed = cpu_verdict("AVX2", AVX2_FP32, AVX2_BF16)
    assert not speed.fast and speed.source == "probe" and speed.capability == "AVX2"
    assert speed.slowdown == pytest.approx(100.65, abs=0.01)
    assert "slow on this CPU" in speed.reason and "16205.00 ms in bf16" in speed.reason
    assert "161.00 ms in fp32" in speed.reason and "AVX2" in speed.reason
    warning = speed.warning()
    assert warning is not None and "keep the weights in fp32" in warning and BF16_ENV in warning


def test_cpu_with_native_bf16_is_fast_and_gives_no_warning() -> None:
    speed = cpu_verdict("AVX512", NATIVE_FP32, NATIVE_BF16)
    assert speed.fast and speed.warning() is None
    assert "fast on this CPU" in speed.reason and "AVX512" in speed.reason


def test_the_threshold_is_the_slow_ratio() -> None:
    assert cpu_verdict("AVX512", 1.0, SLOW_RATIO).fast
    assert not cpu_verdict("AVX512", 1.0, SLOW_RATIO * 1.01).fast


@pytest.mark.parametrize("fp32, bf16", [(0.0, 1.0), (1.0, -1.0), (True, 1.0), ("1", 1.0)])
def test_timings_must_be_positive_seconds(fp32: object, bf16: object) -> None:
    with pytest.raises(PlanError, match="seconds > 0"):
        cpu_verdict("AVX2", fp32, bf16)  # type: ignore[arg-type]


def test_cuda_verdict_follows_the_compute_capability() -> None:
    ampere, turing = cuda_verdict("NVIDIA A100", (8, 0)), cuda_verdict("Tesla T4", (7, 5), device="cuda:1")
    assert ampere.fast and "compute capability 8.0" in ampere.reason
    assert not turing.fast and turing.device == "cuda:1" and "emulated" in turing.reason
    assert turing.warning() is not None


def test_an_injected_probe_decides_and_is_asked_for_both_dtypes() -> None:
    asked: list[torch.dtype] = []

    def slow_bf16(dtype: torch.dtype) -> float:
        asked.append(dtype)
        return AVX2_BF16 if dtype == torch.bfloat16 else AVX2_FP32

    speed = bf16_speed("cpu", probe=slow_bf16)
    assert sorted(map(str, asked)) == ["torch.bfloat16", "torch.float32"]
    assert not speed.fast and speed.capability == torch.backends.cpu.get_cpu_capability()
    # an injected probe is not cached: the next one decides afresh
    assert bf16_speed("cpu", probe=lambda d: NATIVE_BF16 if d == torch.bfloat16 else NATIVE_FP32).fast


@pytest.mark.parametrize("value, fast", [("slow", False), ("FAST", True), (" fast ", True)])
def test_the_environment_variable_forces_the_verdict_without_measuring(
    monkeypatch: pytest.MonkeyPatch, value: str, fast: bool
) -> None:
    monkeypatch.setenv(BF16_ENV, value)

    def no_probe(dtype: torch.dtype) -> float:
        raise AssertionError("the override must not measure")

    speed = bf16_speed("cpu", probe=no_probe)
    assert speed.fast is fast and speed.source == "environment" and BF16_ENV in speed.reason
    assert speed.slowdown is None


def test_a_bad_override_or_device_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PlanError, match="`device` must be 'cpu', 'cuda' or 'cuda:N', got 'mps'"):
        bf16_speed("mps")
    with pytest.raises(PlanError, match="`device` must be"):
        bf16_speed("no-such-device")
    if not torch.cuda.is_available():
        with pytest.raises(PlanError, match="no CUDA device is visible"):
            bf16_speed("cuda")
    monkeypatch.setenv(BF16_ENV, "maybe")
    with pytest.raises(PlanError, match=f"{BF16_ENV} must be 'fast' or 'slow'.*got 'maybe'"):
        bf16_speed("cpu")


def test_the_real_probe_gives_figures_and_is_cached_per_process() -> None:
    threads = torch.get_num_threads()
    first = bf16_speed("cpu")
    assert first.source == "probe" and first.fp32_seconds and first.bf16_seconds
    assert bf16_speed(torch.device("cpu")) is first  # measured once per process
    assert torch.get_num_threads() == threads  # the one-thread probe puts the thread count back
    assert time_matmul(torch.float32, (4, 4, 4), repeats=1) > 0
    json.dumps(first.as_dict())


def _net(dtype: torch.dtype = torch.float32) -> tuple[nn.Module, ParamGroups]:
    with torch.device("meta"):
        net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).to(dtype)
    return net, ParamGroups(net, {"body": "0.*", "head": "1.*"})


SLOW = cpu_verdict("AVX2", AVX2_FP32, AVX2_BF16)
FAST = cpu_verdict("AVX512", NATIVE_FP32, NATIVE_BF16)


def test_a_bf16_plan_on_a_slow_cpu_warns_with_the_figures_and_the_way_out() -> None:
    net, groups = _net()
    plan = plan_cost(net, groups, Alternating(["body", "head"]), storage_dtype=torch.bfloat16, bf16_check=SLOW)
    assert plan.bf16_speed is SLOW
    table = plan.table()
    warning = next(line for line in table.splitlines() if "bf16 is slow" in line)
    assert warning.startswith("WARNING: ") and "16205.00 ms in bf16 against 161.00 ms in fp32" in warning
    assert "leave out `--storage-dtype`" in warning
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["bf16_speed"]["fast"] is False and data["bf16_speed"]["slowdown"] == pytest.approx(100.65, abs=0.01)
    fsdp2 = plan_cost(
        net, groups, Alternating(["body", "head"]), storage_dtype=torch.bfloat16, bf16_check=SLOW, backend="fsdp2"
    )
    assert "WARNING: bf16 is slow" in fsdp2.table()


def test_a_bf16_plan_on_a_fast_device_says_so_without_a_warning() -> None:
    net, groups = _net()
    table = plan_cost(net, groups, Alternating(["body", "head"]), storage_dtype=torch.bfloat16, bf16_check=FAST).table()
    assert "bf16: bf16 is fast on this CPU" in table and "WARNING: bf16" not in table


def test_plans_that_do_not_compute_in_bf16_carry_no_verdict() -> None:
    net, groups = _net()
    for storage in (None, torch.float16):
        plan = plan_cost(net, groups, Alternating(["body", "head"]), storage_dtype=storage, bf16_check=SLOW)
        assert plan.bf16_speed is None and "bf16 is" not in plan.table()
        assert plan.as_dict()["bf16_speed"] is None
    bf16_net, bf16_groups = _net(torch.bfloat16)  # a model stored in bf16, no PrecisionOptimizer: it computes in bf16
    plan = plan_cost(bf16_net, bf16_groups, Alternating(["body", "head"]), bf16_check=SLOW)
    assert plan.bf16_speed is SLOW and "plan the model in fp32" in plan.table()
    assert plan_cost(bf16_net, bf16_groups, Alternating(["body", "head"]), bf16_check=None).bf16_speed is None


def test_bf16_check_accepts_a_device_and_refuses_other_values(monkeypatch: pytest.MonkeyPatch) -> None:
    net, groups = _net()
    monkeypatch.setenv(BF16_ENV, "slow")
    plan = plan_cost(net, groups, Alternating(["body", "head"]), storage_dtype=torch.bfloat16, bf16_check="cpu")
    assert isinstance(plan.bf16_speed, Bf16Speed) and plan.bf16_speed.source == "environment"
    with pytest.raises(PlanError, match="`bf16_check` must be 'auto', a device"):
        plan_cost(net, groups, Alternating(["body", "head"]), storage_dtype=torch.bfloat16, bf16_check=3)  # type: ignore[arg-type]


def test_the_command_line_warns_on_a_slow_cpu_and_puts_the_verdict_in_the_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--model",
        "torch.nn:PReLU",
        "--group",
        "slope=weight",
        "--schedule",
        "sequence",
        "--phase",
        "slope:2",
        "--storage-dtype",
        "bfloat16",
    ]
    monkeypatch.setattr("sys.argv", ["plan"])
    monkeypatch.setenv(BF16_ENV, "slow")
    assert main([*argv, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "WARNING: bf16 is taken as slow on cpu: set by HF_ALTPARAMS_BF16=slow" in out
    assert "leave out `--storage-dtype`" in out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["bf16_speed"]["fast"] is False
    assert main([*argv, "--device", "none"]) == 0
    assert "bf16 is" not in capsys.readouterr().out
    monkeypatch.setenv(BF16_ENV, "fast")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "bf16: bf16 is taken as fast" in out and "WARNING: bf16" not in out
    with pytest.raises(SystemExit):
        main([*argv, "--device", "gpu"])
    assert "`--device` must be auto, cpu, cuda, cuda:N or none, got 'gpu'" in capsys.readouterr().err
