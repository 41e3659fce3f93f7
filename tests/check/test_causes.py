"""Each cause a library error can carry, raised the way the library raises it, is what the check's verdict names.

The errors are produced by the library's own code on small models in this
process; each is recorded as a rank records it (:meth:`Failure.from_error`) and
classified. The switch's refusals carry theirs too (``tests/engine``: a trainable
parameter without a gradient on a one-rank DDP, ranks disagreeing on the phase on
two); the multi-rank causes go through the real ``check`` run in
``test_check_runs.py`` (``schedule_differs_per_rank``, ``ranks_drift``,
``trainable_param_unused`` on two gloo ranks).
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hf_altparams.check import CAUSES, CheckOptions, RankResult, judge
from hf_altparams.check.rank import Failure, run_rank
from hf_altparams.check.verdict import classify
from hf_altparams.engine.collective import collective_errors
from hf_altparams.engine.drift import drift_message
from hf_altparams.engine.invariants import check_before_step
from hf_altparams.engine.optim.grouped import match_to_groups
from hf_altparams.errors import AltParamsError, AltParamsWarning, Cause, DriftError
from hf_altparams.integrations import accelerate_internals
from hf_altparams.integrations.trainer import check_optimizer_covers
from hf_altparams.integrations.unreached import check_loss
from hf_altparams.plan import Alternating, ParamGroups, Phase


def raised(make: Callable[[], object]) -> BaseException:
    """The exception ``make()`` raises."""
    try:
        make()
    except BaseException as err:  # noqa: BLE001 - what is raised is the subject
        return err
    raise AssertionError(f"{make} raised nothing")


def raised_on_a_thread(make: Callable[[], object]) -> BaseException:
    """The exception ``make()`` raises, run on a thread of its own: for a host allocation made to fail.

    When glibc's ``malloc`` fails in a thread, it moves that thread to a new arena for good, and
    ``malloc_trim`` does not give back the free top of an arena other than the main one. Failed on the
    test process's main thread, once an earlier free had raised glibc's dynamic mmap threshold above
    16 MiB, a later test that reads memory through the resident set (``test_readings.py`` on the same
    xdist worker) saw a freed 16 MiB tensor stay resident. A short-lived thread takes the move with it.
    """
    out: list[BaseException] = []
    thread = threading.Thread(target=lambda: out.append(raised(make)))
    thread.start()
    thread.join()
    return out[0]


def named(err: BaseException, stage: str = "step") -> Cause:
    """The cause the check's verdict gives ``err``, recorded as a rank records it."""
    return classify(Failure.from_error(stage, 3, err))


class Net(nn.Module):
    """Two layers, and a spare one in layer ``b``'s group that the forward uses only when asked."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.spare = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_spare: bool = False) -> torch.Tensor:
        h = self.b(self.a(x))
        return self.spare(h) if use_spare else h


def groups_of(net: Net) -> ParamGroups:
    return ParamGroups(net, {"a": "a.*", "b": ["b.*", "spare.*"]})


def named_params(net: nn.Module, prefix: str) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in net.named_parameters() if n.startswith(prefix)]


@pytest.fixture
def accelerate_state() -> Iterator[None]:
    accelerate_internals.fresh_accelerator_state(partial=True)
    yield
    accelerate_internals.fresh_accelerator_state(partial=True)


def test_every_cause_has_a_title_and_a_fix() -> None:
    assert set(CAUSES) == set(Cause)
    for cause in Cause:
        title, fix = CAUSES[cause]
        assert title.strip() and fix.strip(), cause
    assert CAUSES["ranks_drift"] is CAUSES[Cause.RANKS_DRIFT]  # the ids of --json look them up


# ------------------------------------------------------------------ errors of one process
def test_a_gradient_outside_the_phase_under_ddp_is_requires_grad_behind_the_schedule() -> None:
    net = Net()
    net(torch.ones(2, 4)).sum().backward()  # as if `b` had been unfrozen behind the schedule
    err = raised(
        lambda: check_before_step(
            Phase(["a"]),
            named_params(net, "a."),
            named_params(net, "b."),
            ddp_reduces=True,
            find_unused=False,
            warned=set(),
        )
    )
    assert isinstance(err, AltParamsError) and "behind the schedule's back" in str(err)
    assert named(err) == Cause.REQUIRES_GRAD_BEHIND_SCHEDULE


def test_a_trainable_parameter_without_a_gradient_at_the_step_is_its_own_cause() -> None:
    net = Net()
    net.a.requires_grad_(False)  # phase "b"
    net(torch.ones(2, 4)).sum().backward()  # `spare` trains in phase "b" but the forward skipped it
    err = raised(
        lambda: check_before_step(
            Phase(["b"]),
            named_params(net, "b.") + named_params(net, "spare."),
            named_params(net, "a."),
            ddp_reduces=True,
            find_unused=False,
            warned=set(),
            check_missing=True,
        )
    )
    # The message also names `requires_grad` changed behind the schedule as a possible cause: the text alone
    # misled the verdict before causes were carried.
    assert "find_unused_parameters" in str(err) and "behind the schedule's back" in str(err)
    assert named(err) == Cause.TRAINABLE_PARAM_UNUSED


def test_a_mended_requires_grad_flag_is_a_warning_that_carries_its_cause() -> None:
    net = Net()
    net.a.requires_grad_(True)  # idle in phase "b", turned on before any gradient reached it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_before_step(
            Phase(["b"]),
            named_params(net, "b."),
            named_params(net, "a."),
            ddp_reduces=False,
            find_unused=False,
            warned=set(),
        )
    assert [type(w.message) for w in caught] == [AltParamsWarning]
    message = caught[0].message
    assert isinstance(message, AltParamsWarning) and message.cause is Cause.REQUIRES_GRAD_BEHIND_SCHEDULE
    assert issubclass(caught[0].category, UserWarning)  # filters on UserWarning still catch it


@pytest.mark.usefixtures("accelerate_state")
def test_an_optimizer_missing_parameters_is_named_in_each_of_its_wordings() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    net = Net()
    groups = groups_of(net)
    schedule = Alternating(["a", "b"])
    acc = PhasedAccelerator(schedule, groups=groups, cpu=True)
    only_a = torch.optim.SGD(net.a.parameters(), lr=0.1)  # built over the first phase's parameters only
    errors = [
        raised(lambda: acc.prepare(net, only_a)),
        raised(lambda: check_optimizer_covers(groups, schedule, only_a)),
        raised(lambda: match_to_groups(groups, [("opt", only_a)], forms="")),
    ]
    assert ["leaves out" in str(e) for e in errors] == [True, True, False]
    assert "no optimizer holds group(s) ['b']" in str(errors[2])
    assert [named(e, "prepare") for e in errors] == [Cause.OPTIMIZER_MISSES_PARAMETERS] * 3


@pytest.mark.usefixtures("accelerate_state")
def test_a_prepared_model_without_its_optimizer_is_an_optimizer_missing_parameters() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    net = Net()
    acc = PhasedAccelerator(Alternating(["a", "b"]), groups=groups_of(net), cpu=True)
    model = acc.prepare(net)
    err = raised(lambda: acc.backward(model(torch.ones(2, 4)).sum()))
    assert "no optimizer over its parameters" in str(err)
    assert named(err) == Cause.OPTIMIZER_MISSES_PARAMETERS


def test_a_loss_reaching_no_trainable_parameter() -> None:
    net = Net()
    groups = groups_of(net)
    for p in net.parameters():
        p.requires_grad_(False)  # the loss was computed from nothing that trains
    loss = net(torch.ones(2, 4)).sum()
    err = raised(lambda: check_loss(loss, Phase(["a"]), groups, "accelerator.backward(loss)", "the phase"))
    assert named(err) == Cause.LOSS_REACHES_NO_TRAINABLE


def test_the_drift_check_s_error_is_ranks_drift() -> None:
    err = DriftError(drift_message({"b": [1]}, 2, "after the switch to 'b' at step 3"))  # what check_drift raises
    assert named(err) == Cause.RANKS_DRIFT


def test_a_collective_of_the_switch_that_fails_is_a_lost_rank() -> None:
    def switch_whose_peer_died() -> None:
        with collective_errors(Phase(["a"]), 3, None, 5.0):
            raise RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29500")

    err = raised(switch_whose_peer_died)
    assert isinstance(err, AltParamsError) and "restart it from the latest complete checkpoint" in str(err)
    assert named(err) == Cause.RANK_LOST


@pytest.mark.parametrize(
    "err",
    [
        dist.DistBackendError("NCCL communicator was aborted on rank 0"),  # NCCL's errors: by their type
        RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:29500"),  # gloo's
        RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv operation"),
    ],
    ids=["nccl", "gloo-closed", "gloo-timeout"],
)
def test_torch_s_own_distributed_errors_in_a_step_are_a_lost_rank(err: RuntimeError) -> None:
    assert named(err) == Cause.RANK_LOST


def test_out_of_memory_is_told_by_its_type() -> None:
    host = raised_on_a_thread(lambda: bytearray(1 << 62))  # what Python raises when the host allocation fails
    assert isinstance(host, MemoryError) and named(host) == Cause.OUT_OF_MEMORY
    assert named(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) == Cause.OUT_OF_MEMORY
    # torch 2.13's CPU allocator raises a plain RuntimeError: nothing types it, so it stays an error.
    cpu = raised_on_a_thread(lambda: torch.empty(1 << 60, dtype=torch.uint8))
    assert type(cpu) is RuntimeError and named(cpu) == Cause.ERROR


@pytest.mark.usefixtures("accelerate_state")
def test_a_refused_strategy_and_a_refused_set_up() -> None:
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    fsdp1 = raised(
        lambda: PhasedAccelerator(
            Alternating(["a", "b"]), cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=1)
        )
    )
    assert "cannot drive FSDP version 1" in str(fsdp1)
    assert named(fsdp1, "accelerator") == Cause.STRATEGY_REFUSED
    bad_group = raised(lambda: ParamGroups(Net(), {"a": "nothing.*"}))
    assert named(bad_group, "setup") == Cause.SETUP_REFUSED
    net = Net()
    accelerate_internals.fresh_accelerator_state(partial=True)
    acc = PhasedAccelerator(Alternating(["a", "b"]), groups=groups_of(net), cpu=True)
    acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    twice = raised(lambda: acc.prepare(net))  # a library error of no particular cause ...
    assert type(twice) is AltParamsError and twice.cause is Cause.ERROR
    assert named(twice, "prepare") == Cause.SETUP_REFUSED  # ... refuses the set-up before training
    assert named(twice, "step") == Cause.ERROR  # ... and is just an error during it


def test_a_result_written_before_causes_reads_back_and_is_told_by_its_class() -> None:
    old = {
        "rank": 0,
        "world": 2,
        "device": "cpu",
        "parallel": "DDP",
        "memory_source": "RSS",
        "failure": {
            "stage": "step",
            "step": 3,
            "kind": "DriftError",
            "message": "the ranks hold ...",
            "where": "x.py:1",
        },
    }
    result = RankResult.from_dict(old)
    assert result.failure is not None and result.failure.cause is None and result.warning_causes == []
    assert classify(result.failure) == Cause.RANKS_DRIFT
    other = Failure("step", 3, "SwitchError", "ranks disagree on the phase at step 3 (...)")
    assert classify(other) == Cause.ERROR  # the message is not read


# ------------------------------------------------------------------ through a rank of the check
@pytest.mark.usefixtures("accelerate_state")
def test_a_rank_records_the_cause_of_its_failure_and_of_its_warnings() -> None:
    """One rank (one process) of the check, as ``run_rank`` runs it: a callback turning ``requires_grad`` on."""
    from hf_altparams.check import CheckSetup

    def setup() -> CheckSetup:
        net = Net()

        def unfreeze(model: nn.Module, step: int) -> None:
            model.a.requires_grad_(True)  # a callback of one's own, behind the schedule

        return CheckSetup(
            groups_of(net), Alternating(["b", "a"]), on_step=unfreeze, batch=lambda step, rank: {"x": torch.ones(2, 4)}
        )

    result = run_rank(setup, CheckOptions(steps=4), finish=lambda r: r)
    assert result.failure is None  # one process: the library put the flags back, with a warning
    assert [cause for cause, _ in result.warning_causes] == ["requires_grad_behind_schedule"]
    assert RankResult.from_dict(result.as_dict()) == result
    # and its consequence: group "a" trained while idle (the flags were put back after its gradient was made)
    assert judge([result]).causes == [Cause.REQUIRES_GRAD_BEHIND_SCHEDULE, Cause.IDLE_GROUP_CHANGED]

    def refused() -> CheckSetup:
        return CheckSetup(ParamGroups(Net(), {"a": "nothing.*"}), Alternating(["a"]))  # a pattern matching nothing

    accelerate_internals.fresh_accelerator_state(partial=True)
    result = run_rank(refused, CheckOptions(steps=4), finish=lambda r: r)
    assert result.failure is not None and result.failure.cause == "setup_refused"
    assert judge([result]).causes == ["setup_refused"]
