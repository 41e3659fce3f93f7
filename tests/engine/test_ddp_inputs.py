"""The reducer's inputs built from one walk of the module tree equal DDP's own methods' output.

``_ddp.reducer_inputs`` replaces ``_build_params_for_reducer``,
``_build_debug_param_to_name_mapping`` and ``_assign_modules_buffers`` at every
rebuild after a wrapper's first; these tests hold it to DDP's result on models
with the awkward cases (shared and duplicate parameters, sparse embeddings,
``None`` parameters and buffers, a root parameter, ignored names), check the
first-rebuild comparison and its fallback, and that switches keep the reducer,
the broadcast buffers and ``_module_parameters`` what DDP would build.
"""

from __future__ import annotations

from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hf_altparams.engine import PhaseSwitcher
from hf_altparams.engine.ddp import _inputs
from hf_altparams.engine.ddp import _surgery as _ddp
from hf_altparams.engine.ddp._inputs import ReducerInputs
from hf_altparams.plan import Alternating, ParamGroups


class Awkward(nn.Module):
    """Every case DDP's walks treat specially, in one module."""

    def __init__(self, sparse: bool = True) -> None:
        super().__init__()
        self.root = nn.Parameter(torch.zeros(3))  # named ".root" by DDP's parameter walk
        self.emb = nn.Embedding(10, 4, sparse=sparse)
        self.tok = nn.Embedding(10, 4)
        self.bag = nn.EmbeddingBag(10, 4, mode="sum")
        self.proj = nn.Linear(4, 4, bias=False)  # _parameters["bias"] is None
        self.head = nn.Linear(4, 10)
        self.head.weight = self.tok.weight  # shared across modules: first module wins, last name
        self.twice = nn.Linear(4, 4)
        self.twice.alias = self.twice.weight  # the same tensor twice in one module
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("nothing", None)
        self.norm.register_buffer("shared_scale", self.scale)  # one buffer under two names

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids).mean(1) + self.tok(ids).mean(1) + self.bag(ids)
        h = self.norm(self.twice(self.proj(h))) * self.scale
        return self.head(h).sum() + self.root.sum()


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
    )
    return BertForMaskedLM(config)  # the decoder weight is tied to the word embeddings


MODELS: dict[str, Callable[[], nn.Module]] = {
    "awkward": Awkward,
    "sequential": lambda: nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))),
    "bert_tied": _bert,
}


def _theirs(ddp: DDP) -> tuple[list[nn.Parameter], list[bool], dict[int, str], dict[str, torch.Tensor]]:
    params, sparse = ddp._build_params_for_reducer()  # assigns the buffers
    names = ddp._build_debug_param_to_name_mapping(params)
    return params, list(sparse), names, dict(ddp.named_module_buffers)


def _ours(
    module: nn.Module, ignore: set[str]
) -> tuple[list[nn.Parameter], list[bool], dict[int, str], dict[str, torch.Tensor]]:
    inputs = ReducerInputs(module)
    params, sparse, names = inputs.parameters(ignore)
    return params, sparse, names, inputs.buffers(ignore)


def _ids(tensors: object) -> list[int]:
    return [id(t) for t in tensors]  # type: ignore[attr-defined]


def _assert_same(ours: tuple, theirs: tuple) -> None:
    assert _ids(ours[0]) == _ids(theirs[0])
    assert ours[1] == theirs[1]
    assert ours[2] == theirs[2]
    assert list(ours[3]) == list(theirs[3])
    assert _ids(ours[3].values()) == _ids(theirs[3].values())


@pytest.fixture
def world(gloo_world_1: dist.ProcessGroup) -> Iterator[None]:
    _inputs.fast_inputs = True
    yield
    _inputs.fast_inputs = True


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("frozen", ["none", "every_other", "all_but_one"])
@pytest.mark.parametrize("ignore_some", [False, True])
def test_same_parameters_names_and_buffers_as_ddp(world: None, model_name: str, frozen: str, ignore_some: bool) -> None:
    torch.manual_seed(0)
    module = MODELS[model_name]()
    named = list(module.named_parameters())
    if frozen == "every_other":
        for _, param in named[::2]:
            param.requires_grad_(False)
    elif frozen == "all_but_one":
        for _, param in named[1:]:
            param.requires_grad_(False)
    ddp = DDP(module)
    if ignore_some:  # a parameter name, a buffer name, and a root parameter under both spellings
        buffers = [n for n, _ in module.named_buffers()]
        ddp.parameters_to_ignore = {named[-1][0], *buffers[:1], "root", ".root"}
    _assert_same(_ours(module, ddp.parameters_to_ignore), _theirs(ddp))


def test_awkward_cases_come_out_as_ddp_has_them(world: None) -> None:
    module = Awkward()
    params, sparse, names, buffers = _ours(module, set())
    at = {id(p): i for i, p in enumerate(params)}
    assert names[at[id(module.root)]] == ".root"
    assert sparse[at[id(module.emb.weight)]] is True and sparse[at[id(module.bag.weight)]] is False
    assert names[at[id(module.tok.weight)]] == "head.weight"  # shared: the last module's name
    assert _ids(params).count(id(module.twice.weight)) == 1
    assert "scale" in buffers and "norm.shared_scale" not in buffers and "nothing" not in buffers


def test_first_rebuild_compares_then_keeps_the_fast_path(world: None) -> None:
    ddp = DDP(Awkward())
    verdict = _ddp.InputsVerdict()  # what a DDPBackend keeps for its wrapper
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    assert verdict.checked and isinstance(verdict.inputs, ReducerInputs)


def test_a_difference_from_ddp_falls_back_to_ddp_methods(world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = DDP(module)
    real = ReducerInputs.parameters

    def reversed_order(self: ReducerInputs, ignore: set[str]) -> tuple:
        params, sparse, names = real(self, ignore)
        return params[::-1], sparse[::-1], {len(params) - 1 - i: n for i, n in names.items()}

    monkeypatch.setattr(ReducerInputs, "parameters", reversed_order)
    calls = []
    build = DDP._build_params_for_reducer
    monkeypatch.setattr(DDP, "_build_params_for_reducer", lambda self: calls.append(1) or build(self))
    verdict = _ddp.InputsVerdict()
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    assert verdict.checked and verdict.inputs is None
    module[0].requires_grad_(False)
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    assert len(calls) == 2  # DDP's own method at both rebuilds, once each
    assert _ddp.reducer_parameter_names(ddp) == {"1.weight", "1.bias"}


def test_nothing_trainable_at_the_first_rebuild_decides_later(world: None) -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    ddp = DDP(module)
    module.requires_grad_(False)
    verdict = _ddp.InputsVerdict()
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    assert not verdict.checked and ddp._delay_all_reduce_all_params
    module[1].requires_grad_(True)
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    assert isinstance(verdict.inputs, ReducerInputs)
    assert _ddp.reducer_parameter_names(ddp) == {"1.weight", "1.bias"}


@pytest.mark.parametrize("fast", [True, False])
def test_switches_build_what_ddp_would(world: None, fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    module = Awkward(sparse=False)  # the bucket reader below cannot read a sparse bucket
    groups = ParamGroups(
        module, {"a": ["root", "emb.*", "tok.*", "bag.*", "proj.*"], "b": ["twice.*", "norm.*", "head.bias"]}
    )
    switcher = PhaseSwitcher(groups, Alternating(["a", "b"]))
    switcher.step_to(0)
    _inputs.fast_inputs = fast
    ddp = DDP(module)
    switcher.attach(ddp)
    calls = []
    build = DDP._build_params_for_reducer
    monkeypatch.setattr(DDP, "_build_params_for_reducer", lambda self: calls.append(1) or build(self))
    ids = torch.randint(0, 10, (4, 3))
    for step in range(1, 6):
        ddp(ids).backward()
        module.zero_grad(set_to_none=True)  # an optimizer-step boundary
        switcher.step_to(step)
        expected = {n for n, p in module.named_parameters() if p.requires_grad}
        assert _ddp.reducer_parameter_names(ddp) == expected
        bucketed_buffers = dict(ddp.named_module_buffers)
        ours_module_params = _ids(ddp._module_parameters)
        ddp._assign_modules_buffers()  # DDP's own view, now
        assert list(bucketed_buffers) == list(ddp.named_module_buffers)
        assert _ids(bucketed_buffers.values()) == _ids(ddp.named_module_buffers.values())
        assert _ids(ddp.modules_buffers) == _ids(bucketed_buffers.values())
        assert ours_module_params == _ids(p for n, p in module.named_parameters() if n not in ddp.parameters_to_ignore)
    # DDP's own walk: at the first rebuild only (then compared) on the fast path; at every one without it.
    assert len(calls) == (1 if fast else 5)


def test_a_buffer_replaced_after_wrapping_is_broadcast_from_the_next_rebuild(world: None) -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    ddp = DDP(module)
    verdict = _ddp.InputsVerdict()
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    _ddp.rebuild_reducer(ddp, inputs=verdict)  # the fast path from here on
    assert isinstance(verdict.inputs, ReducerInputs)
    module[1].running_mean = torch.full((4,), 2.0)  # a new tensor under the same name
    _ddp.rebuild_reducer(ddp, inputs=verdict)
    assert ddp.named_module_buffers["1.running_mean"] is module[1].running_mean
    assert any(b is module[1].running_mean for b in ddp.modules_buffers)
