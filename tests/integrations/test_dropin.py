"""``PhasedAccelerator`` wherever ``Accelerator`` runs: no schedule, late schedule, several models.

What a user of Accelerate would check when swapping the class in:

* Accelerate's own shipped test scripts (``test_sync.py``, ``test_script.py``)
  pass on 2 CPU ranks with ``accelerate.Accelerator`` rebound to
  ``PhasedAccelerator`` (nothing else changed);
* a two-module GAN (separate generator and discriminator, one Adam each)
  alternates under DDP: the ranks end identical, equal to one process on the
  full batch, and each step all-reduces exactly the active model's bytes;
* the schedule can come after the accelerator (``set_phases``), and misuse is
  refused clearly before anything is prepared.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hf_altparams.errors import PlanError
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path


@pytest.mark.distributed
@pytest.mark.parametrize("script", ["test_sync", "test_script"])
def test_accelerates_own_test_scripts_pass_with_the_class_rebound(script: str, tmp_out: Path) -> None:
    launch(
        script_path("accelerate_shipped.py"),
        script,
        str(tmp_out),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=600,
    )
    results = rank_results(tmp_out, nproc=2)
    assert all(r["script"] == script and r["phased_accelerators_built"] > 0 for r in results)


@pytest.fixture(scope="module")
def gan(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("gan")
    launch(
        script_path("gan_check.py"),
        str(out),
        nproc=2,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=300,
    )
    return rank_results(out, nproc=2)


@pytest.mark.distributed
def test_a_two_model_gan_alternates_with_identical_ranks_equal_to_one_process(gan: list[dict[str, Any]]) -> None:
    assert len({r["digest"] for r in gan}) == 1
    assert all(r["wrappers"] == 2 for r in gan)  # one DDP per model, driven as one
    assert all(r["max_diff"] < 1e-5 for r in gan), [r["max_diff"] for r in gan]


@pytest.mark.distributed
def test_each_gan_step_all_reduces_exactly_the_active_models_bytes(gan: list[dict[str, Any]]) -> None:
    for r in gan:
        phases = [s["phase"] for s in r["steps"]]
        assert phases == ["discriminator", "discriminator", "generator"] * 3
        assert all(s["reduced"] == s["active_bytes"] > 0 for s in r["steps"]), r["steps"]


def test_without_a_schedule_it_is_a_plain_accelerator() -> None:
    from accelerate.state import AcceleratorState

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    acc = PhasedAccelerator(cpu=True)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.ones(3, 2)).sum())
    opt.step()
    assert acc.phase is None and acc.switcher is None and acc.schedule_step == 0
    assert all(p.requires_grad for p in model.parameters())


def test_set_phases_comes_before_the_prepare_of_the_grouped_model() -> None:
    from accelerate.state import AcceleratorState

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    AcceleratorState._reset_state(reset_partial_state=True)
    gen, disc = nn.Linear(2, 3), nn.Linear(3, 1)
    acc = PhasedAccelerator(cpu=True)
    acc.set_phases(Alternating(["generator", "discriminator"]), groups={"generator": gen, "discriminator": disc})
    gen, disc, _, _ = acc.prepare(
        gen, disc, torch.optim.SGD(gen.parameters(), lr=0.1), torch.optim.SGD(disc.parameters(), lr=0.1)
    )
    assert acc.phase.name == "generator" and not any(p.requires_grad for p in disc.parameters())
    with pytest.raises(PlanError, match="`set_phases` came after `prepare` of the grouped model"):
        acc.set_phases(Alternating(["generator", "discriminator"]))


def test_groups_without_a_schedule_and_bad_models_are_refused() -> None:
    from hf_altparams.integrations.accelerate import PhasedAccelerator

    with pytest.raises(PlanError, match="`groups` was given without a `schedule`"):
        PhasedAccelerator(groups={"g": nn.Linear(2, 2)}, cpu=True)
    with pytest.raises(PlanError, match=r"names without '\.' mapped to nn.Module"):
        ParamGroups.of_models({"g.1": nn.Linear(2, 2)})


def test_fsdp2_asked_for_where_accelerate_runs_ddp_is_said_not_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_altparams.integrations.accelerate import PhasedAccelerator

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the plugin sets ACCELERATE_USE_FSDP: not for later tests
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        acc = PhasedAccelerator(
            Alternating(["a", "b"]),
            groups=ParamGroups(model, {"a": "0.*", "b": "1.*"}),
            cpu=True,
            fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2),
        )
        with pytest.warns(
            UserWarning,
            match=r"FSDP2 was asked for .* this run trains with plain DDP .*"
            r"use_accelerate_fsdp2",
        ):
            acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
