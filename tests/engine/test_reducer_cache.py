"""``keep_reducers``: idle phases' DDP reducers kept and re-installed at a switch back.

One process on a world-size-1 gloo group (the reducer is built and re-installed
exactly as on N ranks; ``tests/engine/test_switch_distributed.py`` runs the
same option on 2 ranks against the one-process reference). What a user would
notice: the same training result as without the option, the reducer of a phase
coming back (with the bucket layout it learned instead of DDP's first-iteration
single bucket), the memory it holds reported, and a clear refusal or warning.
"""

from __future__ import annotations

import copy
import functools
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import GroupedOptimizer, PhaseSwitcher, memory_report
from hf_altparams.engine.ddp import free_reducer
from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups, PhaseSequence, Schedule

WIDTH, LAYERS = 16, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    half = lambda: [m for _ in range(LAYERS) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]  # noqa: E731
    return nn.Sequential(nn.Sequential(*half()), nn.Sequential(*half()))


def _half_bytes(model: nn.Module, index: int) -> int:
    return sum(p.numel() * p.element_size() for p in model[index].parameters())


@pytest.fixture
def world(gloo_world_1: dist.ProcessGroup) -> Iterator[None]:
    yield


def _setup(
    keep: int, schedule: Schedule | None = None, **ddp_kwargs: object
) -> tuple[nn.Sequential, DDP, PhaseSwitcher, torch.optim.Optimizer]:
    model = _model()
    groups = ParamGroups(model, {"lower": "0.*", "upper": "1.*"})
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.Adam, lr=1e-2))
    switcher = PhaseSwitcher(groups, schedule or Alternating(["lower", "upper"]), optimizer=opt, keep_reducers=keep)
    switcher.step_to(0)
    ddp = DDP(model, **ddp_kwargs)  # type: ignore[arg-type]
    switcher.attach(ddp)
    return model, ddp, switcher, opt


def _step(ddp: DDP, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(step))
    ddp(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _buckets(ddp: DDP) -> int:
    return len(ddp.reducer._get_zeros_like_grad_buckets())


def test_training_is_the_same_with_and_without_kept_reducers(world: None) -> None:
    finals = []
    for keep in (0, 1):
        model, ddp, switcher, opt = _setup(keep)
        for step in range(12):
            _step(ddp, opt, step)
            switcher.step_to(step + 1)
        finals.append(copy.deepcopy(model.state_dict()))
    for name, value in finals[0].items():
        assert torch.equal(value, finals[1][name]), name


def test_a_switch_back_reinstalls_the_phase_reducer(world: None) -> None:
    model, ddp, switcher, opt = _setup(1)
    seen: dict[str, list[int]] = {"lower": [], "upper": []}
    for step in range(8):
        seen[switcher.current.name].append(id(ddp.reducer))
        _step(ddp, opt, step)
        switcher.step_to(step + 1)
    # DDP's own first reducer (step 0) is freed; from the second visit on, one reducer per phase.
    assert len(set(seen["lower"][1:])) == 1 and len(set(seen["upper"])) == 1
    assert set(seen["lower"][1:]).isdisjoint(seen["upper"])
    cache = switcher.backend.cache
    assert cache is not None and cache.hits == 8 - 2
    assert len(cache) == 1 and cache.kept_bytes == _half_bytes(model, 0 if switcher.current.name == "upper" else 1)


def test_a_kept_reducer_keeps_the_bucket_layout_it_learned(world: None) -> None:
    # docs/design.md, fact 3: a new reducer puts every gradient in one bucket in its first
    # iteration and re-buckets (here: one bucket per layer, by a tiny cap) in the next.
    for keep, learned in ((0, False), (1, True)):
        model, ddp, switcher, opt = _setup(keep, bucket_cap_mb=WIDTH * WIDTH * 4 / 2**20)
        for step in range(8):
            _step(ddp, opt, step)
            switcher.step_to(step + 1)
        # Third visit of this phase: built anew (one bucket) or kept (its learned layout).
        assert ddp._has_rebuilt_buckets is learned
        _step(ddp, opt, 8)
        assert (_buckets(ddp) > 1) is learned, keep


def test_memory_report_counts_the_kept_buckets(world: None) -> None:
    model, ddp, switcher, opt = _setup(1)
    for step in range(3):
        _step(ddp, opt, step)
        switcher.step_to(step + 1)
    idle = 0 if switcher.current.name == "upper" else 1
    kept = _half_bytes(model, idle)
    assert switcher.backend.kept_reducer_bytes() == kept
    report = memory_report(switcher)
    live = _half_bytes(model, 1 - idle)  # the active reducer's buckets (no grads held now)
    assert report.total("ddp_buckets") == live + kept


def test_the_limit_frees_the_oldest_and_zero_frees_all(world: None) -> None:
    model, ddp, switcher, opt = _setup(
        1, schedule=PhaseSequence([("lower", 1), ("upper", 1), (["lower", "upper"], 1)], repeat=True)
    )
    cache = switcher.backend.cache
    assert cache is not None
    for step in range(9):
        _step(ddp, opt, step)
        switcher.step_to(step + 1)
        assert len(cache) <= 1
    assert cache.hits == 0  # three phases in turn, one kept: the one coming back was the oldest, freed
    switcher.backend.keep_reducers(0)
    assert switcher.backend.cache is None and len(cache) == 0


def test_free_reducer_frees_the_kept_ones_too(world: None) -> None:
    model, ddp, switcher, opt = _setup(1)
    for step in range(3):
        _step(ddp, opt, step)
        switcher.step_to(step + 1)
    cache = switcher.backend.cache
    assert cache is not None and len(cache) == 1
    free_reducer(ddp)  # the end of a run: nothing may hold the process group after this
    assert len(cache) == 0 and ddp.reducer is None


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1", None])
def test_a_bad_keep_reducers_is_refused_before_anything_changes(bad: object) -> None:
    model = _model()
    groups = ParamGroups(model, {"lower": "0.*", "upper": "1.*"})
    with pytest.raises(PlanError, match="`keep_reducers` must be a whole number >= 0"):
        PhaseSwitcher(groups, Alternating(["lower", "upper"]), keep_reducers=bad)  # type: ignore[arg-type]
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("setting", ["find_unused_parameters", "static_graph", "powersgd"])
def test_settings_that_cannot_keep_a_reducer_warn_and_build_each_time(world: None, setting: str) -> None:
    model = _model()
    groups = ParamGroups(model, {"lower": "0.*", "upper": "1.*"})
    switcher = PhaseSwitcher(groups, Alternating(["lower", "upper"]), keep_reducers=1)
    switcher.step_to(0)
    ddp = DDP(model, **({setting: True} if setting != "powersgd" else {}))
    if setting == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    with pytest.warns(UserWarning, match="keep_reducers=1 is not used with this DDP wrapper"):
        switcher.attach(ddp)
    assert switcher.backend.cache is None
    switcher.step_to(1)
    assert switcher.backend.kept_reducer_bytes() == 0
