"""The ``release`` policy decided from the schedule, and the bounded switch history (no process group)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from hf_altparams.engine import PhaseSwitcher, memory_report
from hf_altparams.engine import switch as transaction_module
from hf_altparams.errors import AltParamsError
from hf_altparams.plan import Alternating, ParamGroups


def _switcher(
    durations: dict[str, int], monkeypatch: pytest.MonkeyPatch, **kwargs: object
) -> tuple[PhaseSwitcher, list[int]]:
    net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024), nn.Linear(4, 4))  # 4 MiB, 4 MiB, tiny
    groups = ParamGroups(net, {"big": "0.*", "big2": "1.*", "small": "2.*"})
    released: list[int] = []
    monkeypatch.setattr(transaction_module, "release_memory", lambda **kw: released.append(1))
    return PhaseSwitcher(groups, Alternating(durations), **kwargs), released  # type: ignore[arg-type]


def test_auto_skips_release_when_equal_groups_alternate_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    switcher, released = _switcher({"big": 1, "big2": 1}, monkeypatch)
    records = [switcher.step_to(step) for step in range(6)]
    assert released == []
    assert all(r is not None and r.released is False for r in records)
    assert "as much memory" in (records[-1].release_reason or "")  # type: ignore[union-attr]


def test_auto_releases_before_a_long_smaller_phase_only(monkeypatch: pytest.MonkeyPatch) -> None:
    switcher, released = _switcher({"big": 2, "small": 20}, monkeypatch)
    first = switcher.step_to(0)
    assert first is not None and first.released is False and "first phase" in (first.release_reason or "")
    into_small = switcher.step_to(2)
    assert into_small is not None and into_small.released is True and released == [1]
    back = switcher.step_to(22)  # the big phase needs the memory again: no release
    assert back is not None and back.released is False and released == [1]
    assert switcher.history.releases == 1


def test_auto_skips_release_before_a_short_smaller_phase(monkeypatch: pytest.MonkeyPatch) -> None:
    switcher, released = _switcher({"big": 2, "small": 1}, monkeypatch)
    switcher.step_to(0)
    record = switcher.step_to(2)
    assert record is not None and record.released is False and released == []
    assert "lasts 1 step(s)" in (record.release_reason or "")


@pytest.mark.parametrize("setting, expected", [(True, [1, 1, 1]), (False, [])])
def test_explicit_release_settings_are_kept(
    setting: bool, expected: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    switcher, released = _switcher({"big": 1, "big2": 1}, monkeypatch, release=setting)
    for step in range(3):
        switcher.step_to(step)
    assert released == expected


@pytest.mark.parametrize("bad", ["sometimes", 1, None])
def test_bad_release_setting_is_refused_by_name(bad: object, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AltParamsError, match=r"`release` is .*accepted: 'auto', True or False"):
        _switcher({"big": 1, "big2": 1}, monkeypatch, release=bad)


def test_history_keeps_a_window_and_totals_every_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    switcher, _ = _switcher({"big": 1, "big2": 1}, monkeypatch, history_window=4)
    for step in range(50):
        switcher.step_to(step)
    assert switcher.history.count == 50
    assert [r.step for r in switcher.records] == [46, 47, 48, 49]
    assert switcher.history.seconds >= sum(r.seconds for r in switcher.records)
    report = memory_report(switcher)
    assert report.switches["switches"] == 50
    assert report.as_log()["altparams/memory/switches"] == 50
    assert "50 switches so far" in report.table()


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_bad_history_window_is_refused(bad: object, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(AltParamsError, match="`history_window`"):
        _switcher({"big": 1, "big2": 1}, monkeypatch, history_window=bad)


def test_cached_layouts_set_the_same_flags_as_the_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    switcher, _ = _switcher({"big": 1, "big2": 1, "small": 1}, monkeypatch)
    net = switcher.module
    for step in range(7):  # every phase twice or more: cached layouts reused
        record = switcher.step_to(step)
        assert record is not None
        active = switcher.current.trainable  # type: ignore[union-attr]
        flags = {g: all(p.requires_grad for p in switcher.groups.params(g)) for g in ("big", "big2", "small")}
        assert flags == {g: g in active for g in flags}
        assert record.trainable_bytes == sum(p.numel() * 4 for p in net.parameters() if p.requires_grad)
    assert torch.is_grad_enabled()


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["keep", "drop", "offload"])
def test_memory_allocated_returns_to_the_same_value_after_every_switch(policy: str) -> None:
    from hf_altparams.engine import GroupedOptimizer

    net = nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512)).cuda()
    groups = ParamGroups(net, {"a": "0.*", "b": "2.*"})
    opt = GroupedOptimizer(groups, lambda params: torch.optim.Adam(params, lr=1e-4), state_policy=policy)
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]), optimizer=opt)
    x = torch.randn(16, 512, device="cuda")
    # Other tests in this process may leave garbage in reference cycles; a gc pass during the loop
    # would free it and move memory_allocated for reasons that are not the switch's. Collect it now
    # and keep the automatic collector off during the loop (the switch's own release may still run one).
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    after_switch: dict[str, list[int]] = {"a": [], "b": []}
    after_step: dict[str, list[int]] = {"a": [], "b": []}
    try:
        for step in range(40):
            switcher.step_to(step)
            torch.cuda.synchronize()
            phase = switcher.current.name  # type: ignore[union-attr]
            if step >= 4:  # both phases' state exists from step 2 on
                after_switch[phase].append(torch.cuda.memory_allocated())
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if step >= 4:
                after_step[phase].append(torch.cuda.memory_allocated())
    finally:
        if gc_was_enabled:
            gc.enable()
    distinct = {phase: sorted(set(values)) for phase, values in after_switch.items()}
    assert all(len(values) == 1 for values in distinct.values()), distinct
    distinct = {phase: sorted(set(values)) for phase, values in after_step.items()}
    assert all(len(values) == 1 for values in distinct.values()), distinct


def test_per_phase_caches_stay_bounded_under_a_random_schedule() -> None:
    from hf_altparams.engine.layouts import CACHED_PHASES
    from hf_altparams.plan import RandomBlocks

    net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(10)])
    groups = ParamGroups(net, {f"g{i}": f"{i}.*" for i in range(10)})
    switcher = PhaseSwitcher(groups, RandomBlocks([f"g{i}" for i in range(10)], k=3, every=1, seed=0))
    seen = set()
    for step in range(400):  # 120 possible phases, far more than the caches hold
        switcher.step_to(step)
        active = switcher.current.trainable  # type: ignore[union-attr]
        seen.add(active)
        assert all(p.requires_grad == (f"g{i}" in active) for i, layer in enumerate(net) for p in layer.parameters())
    assert len(seen) > CACHED_PHASES
    caches = (switcher._layouts._by_groups, switcher._layouts._flags, switcher._reduced_bytes, switcher._footprints)
    assert all(len(cache) <= CACHED_PHASES for cache in caches)
