"""Two-rank check of compiled regions under :class:`~hf_altparams.integrations.accelerate.PhasedAccelerator`.

Usage (every rank runs it)::

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 compile_regions_check.py OUT_DIR

A 2-layer Llama (hidden 32) alternates its two decoder layers every step (the
final norm and the head train always, the embeddings stay frozen), for two
full cycles and more, in the same processes (imports and compiles cost more
than the training):

* ``plain``: uncompiled, the reference: the parameters' digest after every step.
* ``plugin``: ``TorchDynamoPlugin(backend="eager", use_regional_compilation=True)``:
  ``prepare`` compiles every region in place before DDP wraps the model.
* ``by_hand``: each decoder layer compiled in place by hand before ``prepare``
  (what ``compile_regions_in_place`` does to them) with a counting backend
  that hands the graph to ``aot_eager``: how often each layer was compiled
  (a compile counted for the layer whose parameters the graph takes), against
  the distinct trainable states it went through.
* ``refusals``: whole-model compile (``dynamo_backend``; ``torch.compile(model)``
  before ``prepare``) refused naming regional compilation; a forward through
  ``accelerate.utils.compile_regions`` of the *prepared* wrapper (a copy that
  keeps the reducer it was made with) refused before any step.

The backends: ``aot_eager`` builds the joint forward-backward graph the way
inductor does (it is where a region's frozen or trainable parameters change
the graph) without generating code; inductor on CPU compiles C++ for each
graph, minutes on a loaded 2-core machine. ``eager`` (dynamo's capture and
guards, the same recompiles) keeps the plugin run short. Recompiles are
counted with dynamo's counters (``torch._dynamo.utils.counters``, a private
API, used here only) and the per-region backends. Each rank writes
``OUT_DIR/rank{r}.json``.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch._dynamo
from accelerate.utils import TorchDynamoPlugin, compile_regions
from torch import nn
from torch._dynamo.utils import counters

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError
from hf_altparams.integrations import accelerate_internals
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.integrations.regions import regions
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.digests import param_sha  # noqa: E402
from tests.support.models import llama_decoder  # noqa: E402

SPECS = {"l0": "model.layers.0.*", "l1": "model.layers.1.*", "head": ["model.norm.*", "lm_head.*"]}
SCHEDULE = functools.partial(Alternating, ["l0", "l1"], always=["head"])
STEPS = 5  # two full cycles, and a step more
VOCAB = 64


def fresh_model() -> nn.Module:
    return llama_decoder(layers=2, hidden=32, intermediate=64, heads=2, vocab=VOCAB, seed=0)


def batches() -> list[torch.Tensor]:
    rank = torch.distributed.get_rank()
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own data: DDP must average
    return [torch.randint(0, VOCAB, (2, 8), generator=generator) for _ in range(STEPS)]


def layer_states(model: nn.Module) -> list[tuple[bool, ...]]:
    """Each decoder layer's trainable state: its parameters' ``requires_grad`` flags."""
    return [tuple(p.requires_grad for p in layer.parameters()) for layer in model.model.layers]


def train(acc: PhasedAccelerator, model: nn.Module, net: nn.Module, opt: Any) -> dict[str, Any]:
    """The stock loop; per step: the digest after it, dynamo's frames so far, the layers' states in it."""
    digests, frames, states = [], [], []
    for ids in batches():
        states.append(layer_states(net))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        digests.append(param_sha(net))
        frames.append(int(counters["frames"]["ok"]))
    return {
        "digests": digests,
        "frames": frames,
        "states": [[list(s) for s in step] for step in states],
        "phases": [r.phase for r in acc.switch_records],
    }


def run(
    name: str,
    *,
    dynamo_plugin: Optional[TorchDynamoPlugin] = None,
    before_prepare: Optional[Callable[[nn.Module], None]] = None,
) -> dict[str, Any]:
    accelerate_internals.fresh_accelerator_state()  # each run its own dynamo plugin
    torch._dynamo.reset()  # each run compiles from scratch (and the recompile limit counts it alone)
    counters.clear()
    net = fresh_model()
    if before_prepare is not None:
        before_prepare(net)
    groups = ParamGroups(net, SPECS)
    kwargs: dict[str, Any] = {} if dynamo_plugin is None else {"dynamo_plugin": dynamo_plugin}
    acc = PhasedAccelerator(SCHEDULE(), count_comm=True, **kwargs)
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-2))
    model, opt = acc.prepare(net, opt)
    result = train(acc, model, net, opt)
    assert acc.comm_counter is not None
    result.update(
        allreduce_bytes_measured=list(acc.comm_counter.history),
        allreduce_bytes_expected=[
            sum(groups.nbytes(g) for g in acc.schedule.phase_at(s).trainable)  # type: ignore[union-attr]
            for s in range(STEPS)
        ],
        prepared_is_ddp_of_model=getattr(model, "module", None) is net,
        compiled_regions=sorted(n for n, m in net.named_modules() if _compiled(m)),
        regions=sorted(name for name, _ in regions(net)),
    )
    acc.switcher.release_wrappers()  # type: ignore[union-attr]
    acc.free_memory()
    return result


def _compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None  # nn.Module.compile's mark


def by_hand() -> dict[str, Any]:
    """Each decoder layer compiled in place before ``prepare``; each compile counted for the layer it compiles.

    One backend for every layer (so layers may share a graph, as they do with
    one backend): it attributes a compile to the layer whose parameters the
    graph takes as inputs, then hands the graph to ``aot_eager``.
    """
    compiles: dict[str, int] = {}

    def compile_layers(net: nn.Module) -> None:
        owner = {id(p): f"model.layers.{i}" for i, layer in enumerate(net.model.layers) for p in layer.parameters()}
        compiles.update({name: 0 for name in owner.values()})
        aot_eager = torch._dynamo.lookup_backend("aot_eager")

        def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
            for name in {owner[id(t)] for t in example_inputs if id(t) in owner}:
                compiles[name] += 1
            return aot_eager(graph, example_inputs)

        for layer in net.model.layers:
            layer.compile(backend=backend)

    result = run("by_hand", before_prepare=compile_layers)
    result["compiles_per_region"] = compiles
    return result


def refusals() -> dict[str, str]:
    """Whole-model compile and a forward through a copy of the prepared wrapper, each refused."""
    found: dict[str, str] = {}
    accelerate_internals.fresh_accelerator_state()
    torch._dynamo.reset()
    counters.clear()
    try:
        PhasedAccelerator(SCHEDULE(), dynamo_backend="eager")
    except AltParamsError as exc:
        found["dynamo_backend"] = str(exc)
    accelerate_internals.fresh_accelerator_state()
    net = fresh_model()
    groups = ParamGroups(net, SPECS)
    acc = PhasedAccelerator(SCHEDULE())
    opt = GroupedOptimizer(groups, functools.partial(torch.optim.AdamW, lr=1e-2))
    try:
        acc.prepare(torch.compile(net, backend="eager"), opt)
    except AltParamsError as exc:
        found["compiled_model"] = str(exc)
    model, opt = acc.prepare(net, opt)
    copy = compile_regions(model, backend="eager")  # Accelerate's by-hand form, on the prepared wrapper
    ids = batches()[0]
    try:
        copy(input_ids=ids, labels=ids, use_cache=False)
    except AltParamsError as exc:
        found["copy_of_wrapper"] = str(exc)
    found["compiled_frames"] = str(int(counters["frames"]["ok"]))  # the refusal came before any region ran
    del copy  # it holds the wrapper's reducer too: gone before the process group goes
    acc.switcher.release_wrappers()  # type: ignore[union-attr]
    acc.free_memory()
    return found


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    scenarios: dict[str, Callable[[], Any]] = {
        "plain": lambda: run("plain"),
        "plugin": lambda: run(
            "plugin", dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
        ),
        "by_hand": by_hand,
        "refusals": refusals,
    }
    results: dict[str, Any] = {"seconds": {}}
    for name, scenario in scenarios.items():
        started = time.perf_counter()
        results[name] = scenario()
        results["seconds"][name] = round(time.perf_counter() - started, 3)
    write_rank_result(out, results, rank=int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
