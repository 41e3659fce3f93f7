"""Compiled regions with phases: two gloo ranks in one launch, plus in-process checks.

The launch (``tests/scripts/compile_regions_check.py``) trains a 2-layer Llama
alternating its layers every step, uncompiled, with
``TorchDynamoPlugin(use_regional_compilation=True)`` (backend ``eager``) and
with its layers compiled in place by hand (``aot_eager``, each compile counted
for the layer it compiles); the script's docstring says why not inductor. Every test of the
launch shares it.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from accelerate.utils import TorchDynamoPlugin, compile_regions
from torch import nn

from hf_altparams import (
    Alternating,
    AltParamsError,
    GroupedOptimizer,
    ParamGroups,
    PhasedAccelerator,
    PlanError,
    compile_regions_in_place,
)
from hf_altparams.integrations.accelerate import configuration
from hf_altparams.integrations.accelerate_prepare import find_grouped
from hf_altparams.integrations.refusals import REFUSALS
from hf_altparams.integrations.regions import regions
from hf_altparams.testing import launch, rank_results
from tests.scripts import script_path
from tests.support.digests import param_sha

NPROC = 2
COMPILED = ("plugin", "by_hand")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("compile_regions")
    launch(
        script_path("compile_regions_check.py"),
        str(out),
        nproc=NPROC,
        launcher="forked",
        env={"ACCELERATE_USE_CPU": "1"},
        timeout=420,
    )
    return rank_results(out, nproc=NPROC)


# --------------------------------------------------------------------------- two ranks
@pytest.mark.distributed
@pytest.mark.parametrize("form", COMPILED)
def test_compiled_regions_train_bit_identically_to_the_uncompiled_run_at_every_step(ranks: Any, form: str) -> None:
    for r in ranks:
        assert r[form]["phases"] == r["plain"]["phases"] and len(set(r[form]["phases"])) == 2  # it switched
        assert r[form]["digests"] == r["plain"]["digests"]
        assert r[form]["prepared_is_ddp_of_model"]  # one DDP wrapper, around the model itself: no copy
    assert ranks[0][form]["digests"] == ranks[1][form]["digests"], "ranks must stay bit-identical"
    assert ranks[0]["plain"]["digests"] != ranks[0]["plain"]["digests"][:1] * len(ranks[0]["plain"]["digests"])


@pytest.mark.distributed
@pytest.mark.parametrize("form", COMPILED)
def test_bytes_all_reduced_per_step_equal_the_trainable_bytes_after_every_switch(ranks: Any, form: str) -> None:
    for r in ranks:
        assert r[form]["allreduce_bytes_measured"] == r[form]["allreduce_bytes_expected"]
        assert all(n > 0 for n in r[form]["allreduce_bytes_measured"])


@pytest.mark.distributed
def test_a_region_compiles_at_most_once_per_trainable_state(ranks: Any) -> None:
    # A layer's state is its parameters' flags and whether its input needs a gradient; here the second follows
    # the first (layer 0's input never needs one, layer 1's does exactly when layer 0 trains), so the layers'
    # own flags count the states.
    for r in ranks:
        run = r["by_hand"]
        for index, region in enumerate(sorted(run["compiles_per_region"])):
            states = {tuple(step[index]) for step in run["states"]}
            assert len(states) == 2  # trainable, then frozen, and back
            assert run["compiles_per_region"][region] <= len(states), (region, run["compiles_per_region"])
        assert sum(run["compiles_per_region"].values()) >= 1  # compiled at all (the layers may share graphs)


@pytest.mark.distributed
@pytest.mark.parametrize("form", COMPILED)
def test_no_recompile_after_the_first_cycle_of_phases(ranks: Any, form: str) -> None:
    for r in ranks:
        frames = r[form]["frames"]  # dynamo's compiled frames so far, after each step
        assert frames[0] > 0
        assert frames[1] == frames[-1], frames  # steps 0 and 1 saw every phase: later switches reuse the graphs


@pytest.mark.distributed
def test_the_plugin_compiles_every_region_of_the_model_in_place(ranks: Any) -> None:
    plugin = ranks[0]["plugin"]
    assert plugin["compiled_regions"] == plugin["regions"] and "model.layers.1" in plugin["regions"]
    assert ranks[0]["by_hand"]["compiled_regions"] == ["model.layers.0", "model.layers.1"]
    assert ranks[0]["plain"]["compiled_regions"] == []


@pytest.mark.distributed
def test_whole_model_compile_is_still_refused_naming_regional_compilation(ranks: Any) -> None:
    for r in ranks:
        refused = r["refusals"]
        assert "cannot drive dynamo_backend='EAGER' (torch.compile)" in refused["dynamo_backend"]
        assert "`TorchDynamoPlugin(backend=..., use_regional_compilation=True)`" in refused["dynamo_backend"]
        assert "compiled with `torch.compile` before `prepare`, in several processes" in refused["compiled_model"]
        assert "use_regional_compilation=True" in refused["compiled_model"]


@pytest.mark.distributed
def test_compile_regions_of_the_prepared_wrapper_is_refused_at_its_first_forward(ranks: Any) -> None:
    for r in ranks:
        refused = r["refusals"]
        assert refused["copy_of_wrapper"].startswith(
            "the training forward ran through a copy of the DistributedDataParallel that `accelerator.prepare` returned"
        )
        assert "ranks would diverge" in refused["copy_of_wrapper"]
        assert "use_regional_compilation=True" in refused["copy_of_wrapper"]
        assert refused["compiled_frames"] == "0"  # refused before any region ran


# --------------------------------------------------------------------------- one process
class Blocks(nn.Module):
    """Embeddings, a stack of three blocks, a head: four regions' worth of a decoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


SPECS = {"a": ["blocks.0.*", "blocks.2.*"], "b": "blocks.1.*", "head": "head.*"}


def _llama() -> nn.Module:
    from tests.support.models import llama_decoder

    return llama_decoder(layers=2, hidden=32, intermediate=64, heads=2, vocab=64, seed=0)


def test_regions_are_the_repeated_blocks_and_each_child_beside_them() -> None:
    assert [name for name, _ in regions(Blocks())] == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [name for name, _ in regions(_llama())] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "model.rotary_emb",
        "lm_head",
    ]
    assert [name for name, _ in regions(nn.Linear(2, 2))] == [""]  # no repeated blocks: the model is the one region


def test_compiling_in_place_keeps_modules_names_and_parameters() -> None:
    net = Blocks()
    before = [(name, id(p)) for name, p in net.named_parameters()]
    modules = [id(m) for m in net.modules()]
    assert compile_regions_in_place(net, backend="eager") == ["embed", "blocks.0", "blocks.1", "blocks.2", "head"]
    assert [(name, id(p)) for name, p in net.named_parameters()] == before
    assert [id(m) for m in net.modules()] == modules


def test_compiling_in_place_refuses_a_model_without_repeated_blocks_and_names_why() -> None:
    with pytest.raises(PlanError, match=r"Linear has no repeated blocks.*would compile it whole"):
        compile_regions_in_place(nn.Linear(2, 2), backend="eager")


def _train(acc: PhasedAccelerator, model: nn.Module, opt: Any, steps: int = 4) -> list[str]:
    digests = []
    for step in range(steps):
        acc.backward(model(torch.full((2, 4), 0.1 * (step + 1))).square().mean())
        opt.step()
        opt.zero_grad()
        digests.append(param_sha(acc.groups.module))  # type: ignore[union-attr]
    return digests


def _run(plugin: TorchDynamoPlugin | None) -> tuple[list[str], nn.Module, PhasedAccelerator]:
    from hf_altparams.integrations import accelerate_internals

    accelerate_internals.fresh_accelerator_state(partial=True)
    net = Blocks()
    groups = ParamGroups(net, SPECS)
    acc = PhasedAccelerator(
        Alternating(["a", "b"], always=["head"]),
        groups=groups,
        cpu=True,
        **({} if plugin is None else {"dynamo_plugin": plugin}),
    )
    model, opt = acc.prepare(net, GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1)))
    return _train(acc, model, opt), model, acc


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_regional_plugin_trains_one_process_like_the_uncompiled_run() -> None:
    plain, _, _ = _run(None)
    compiled, model, acc = _run(TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    assert compiled == plain
    assert model is acc.groups.module  # one process: the model itself, its regions compiled in place
    assert configuration(acc).compiled is None


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_regional_plugin_with_a_grouped_model_without_repeated_blocks_is_refused_before_anything_changes() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    groups = ParamGroups(net, {"a": "0.*", "b": "1.*"})
    acc = PhasedAccelerator(
        Alternating(["a", "b"]),
        groups=groups,
        cpu=True,
        dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True),
    )
    flags = [p.requires_grad for p in net.parameters()]
    with pytest.raises(PlanError, match=r"argument #1 \(Sequential\), the grouped model, has no repeated blocks"):
        acc.prepare(net, GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1)))
    assert [p.requires_grad for p in net.parameters()] == flags and acc.switcher is None


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_the_configuration_refuses_whole_model_compile_and_regions_under_fsdp_only() -> None:
    acc = PhasedAccelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    assert configuration(acc).compiled is None
    fsdp = configuration(acc, fsdp_plugin_given=type("Plugin", (), {"fsdp_version": 2})())
    assert fsdp.compiled == "dynamo_backend='EAGER' with `use_regional_compilation=True` under FSDP"
    row = next(r for r in REFUSALS if r.name == "compiled")
    assert row.applies(fsdp) and "compiled regions are verified under DDP and in one process" in row.reason


def test_compile_regions_before_prepare_with_groups_on_the_original_names_the_fix() -> None:
    net = Blocks()
    groups = ParamGroups(net, SPECS)
    copy = compile_regions(net, backend="eager")  # Accelerate's by-hand form: a copy of the module tree
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(
        AltParamsError,
        match=r"argument #1 is `accelerate.utils.compile_regions\(model\)` of the "
        r"grouped model.*Build the groups on the model `compile_regions` "
        r"returned.*compile_regions_in_place",
    ):
        find_grouped(
            (copy, opt),
            groups,
            Alternating(["a", "b"], always=["head"]),
            prepared_models=set(),
            driving_bound=False,
            multi_process=True,
        )


@pytest.mark.usefixtures("fresh_accelerate_state")
def test_compile_regions_before_prepare_with_groups_on_its_copy_trains_like_the_uncompiled_run() -> None:
    plain, _, _ = _run(None)
    from hf_altparams.integrations import accelerate_internals

    accelerate_internals.fresh_accelerator_state(partial=True)
    net = Blocks()
    copy = compile_regions(net, backend="eager")
    groups = ParamGroups(copy, SPECS)  # 'blocks.0.*' matches 'blocks.0._orig_mod.weight' too
    acc = PhasedAccelerator(Alternating(["a", "b"], always=["head"]), groups=groups, cpu=True)
    model, opt = acc.prepare(copy, GroupedOptimizer(groups, functools.partial(torch.optim.SGD, lr=0.1)))
    assert _train(acc, model, opt) == plain
