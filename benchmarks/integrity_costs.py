"""What the integrity checks cost: the drift check's digest next to a training step, the prefix check next to a hit.

Two measurements, each taken side by side in one process (alternating, so the
machine's load hits both alike) and reported as ratios:

* **drift check** (``hf_altparams.engine.drift``): the local part, a digest of
  every parameter per group (:func:`~hf_altparams.engine.drift.local_digests`),
  against one training step (forward, backward, AdamW step) of the same model:
  MiniLM-L6 with a classification head (22.7 M parameters, batch x 128
  tokens) and a 256 MiB stack of linear layers (to read ms per GiB on more
  weights). The all-gather that follows is a few int64 per group (the switch's
  all-gather of the same size: ``benchmarks/RESULTS.md``, "the switch's collective").
* **frozen-prefix check** (``hf_altparams.engine.prefix._weights``): comparing the
  frozen prefix's weights (embeddings and layers 0-3 of MiniLM) by identity and
  content before a training forward, against a whole training step on a batch
  the cache serves (a hit), with the check and without it (the check replaced by
  "unchanged"), alternating.

    python benchmarks/integrity_costs.py             # CPU, a few minutes on 2 loaded cores
    python benchmarks/integrity_costs.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine  # noqa: E402
from frozen_prefix import Classifier, dataset  # noqa: E402
from hf_altparams.engine.drift import local_digests  # noqa: E402
from hf_altparams.engine.prefix import FrozenPrefix, FrozenPrefixCache  # noqa: E402
from hf_altparams.plan import ParamGroups  # noqa: E402

LAYERS = 6
GIB = float(1 << 30)


def timed(call: Callable[[], Any]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def side_by_side(calls: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each call, the calls alternating (their order rotating) ``repeats`` times."""
    names = list(calls)
    for name in names:  # warm-up: first-call costs out
        calls[name]()
    seconds: dict[str, list[float]] = {n: [] for n in names}
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            seconds[name].append(timed(calls[name]))
    return {n: statistics.median(s) for n, s in seconds.items()}


def minilm_groups(model: nn.Module) -> ParamGroups:
    return ParamGroups(
        model,
        {
            "emb": "bert.embeddings.*",
            **{f"layer{i}": f"bert.encoder.layer.{i}.*" for i in range(LAYERS)},
            "head": ["head.*", "bert.pooler.*"],
        },
    )


def minilm_step(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], **extra: Any
) -> Callable[[], None]:
    def step() -> None:
        model(**batch, **extra).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def drift_minilm(data: dict[str, torch.Tensor], batch: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Classifier(classes=4)
    groups = minilm_groups(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = {k: v[:batch] for k, v in data.items()}
    got = side_by_side({"digest": lambda: local_digests(groups), "step": minilm_step(model, opt, rows)}, repeats)
    return _drift_result(got, nbytes(model), f"MiniLM-L6 + head, batch {batch} x {data['input_ids'].shape[1]}")


class Stack(nn.Module):
    """Linear layers of ``width`` with GELU, about ``mib`` MiB of fp32 weights, and a squared-error loss."""

    def __init__(self, width: int, mib: int) -> None:
        super().__init__()
        per = (width * width + width) * 4
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(max(1, mib * (1 << 20) // per)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = nn.functional.gelu(layer(x))
        return x.square().mean()


def drift_stack(mib: int, tokens: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Stack(1024, mib)
    groups = ParamGroups(model, {f"layer{i}": f"layers.{i}.*" for i in range(len(model.layers))})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(tokens, 1024)

    def step() -> None:
        model(x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    got = side_by_side({"digest": lambda: local_digests(groups), "step": step}, repeats)
    return _drift_result(got, nbytes(model), f"{len(model.layers)} x Linear(1024, 1024), {tokens} rows")


def _drift_result(got: dict[str, float], weight_bytes: int, what: str) -> dict[str, Any]:
    return {
        "model": what,
        "weights_mib": round(weight_bytes / (1 << 20), 1),
        "digest_ms": round(got["digest"] * 1e3, 2),
        "step_ms": round(got["step"] * 1e3, 1),
        "digest_ms_per_gib": round(got["digest"] * 1e3 * GIB / weight_bytes, 1),
        "digest_over_step": round(got["digest"] / got["step"], 4),
    }


def prefix_check(data: dict[str, torch.Tensor], batch: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Classifier(classes=4)
    groups = minilm_groups(model)
    frozen = ["emb", "layer0", "layer1", "layer2", "layer3"]
    for name in frozen:
        for p in groups.params(name):
            p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    cache = FrozenPrefixCache(model, FrozenPrefix(embeddings="bert.embeddings", blocks="bert.encoder.layer")).attach()
    rows = {k: v[:batch] for k, v in data.items()}
    index = torch.arange(batch)
    step = minilm_step(model, opt, rows, sample_index=index)
    step()  # a miss: computes and stores the rows
    weights = cache._weights
    check = weights.changed

    def unchecked_step() -> None:
        weights.changed = lambda stages: False  # type: ignore[method-assign]
        try:
            step()
        finally:
            weights.changed = check  # type: ignore[method-assign]

    prefix_stages = cache.stages[: cache.depth]
    got = side_by_side(
        {"check": lambda: check(prefix_stages), "hit_step": step, "hit_step_unchecked": unchecked_step}, repeats
    )
    prefix_bytes = sum(p.numel() * p.element_size() for s in prefix_stages for p in s.parameters())
    assert cache.record.miss_batches == 1 and cache.record.hit_batches >= repeats, cache.record
    return {
        "model": f"MiniLM-L6, embeddings + layers 0-3 frozen and cached, batch {batch} x {data['input_ids'].shape[1]}",
        "prefix_weights_mib": round(prefix_bytes / (1 << 20), 1),
        "depth": cache.depth,
        "check_ms": round(got["check"] * 1e3, 2),
        "hit_step_ms": round(got["hit_step"] * 1e3, 1),
        "hit_step_unchecked_ms": round(got["hit_step_unchecked"] * 1e3, 1),
        "check_over_hit_step": round(got["check"] / got["hit_step_unchecked"], 4),
        "check_ms_per_gib": round(got["check"] * 1e3 * GIB / prefix_bytes, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--stack-mib", type=int, default=256)
    parser.add_argument("--stack-rows", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="default: results/integrity_costs_cpu[_threadsN].json")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.repeats, args.stack_mib, args.stack_rows = 4, 32, 2, 16, 16
    if args.threads:
        torch.set_num_threads(args.threads)
    data = dataset(max(args.batch, 4), args.seq)
    result = {
        "machine": machine("cpu", 1) + " (shared with other jobs: timings are noisy, ratios were taken side by side)",
        "torch_threads": torch.get_num_threads(),
        "drift_minilm": drift_minilm(data, args.batch, args.repeats),
        "drift_stack": drift_stack(args.stack_mib, args.stack_rows, args.repeats),
        "prefix_check": prefix_check(data, args.batch, args.repeats),
    }
    print(json.dumps(result, indent=1))
    if not args.quick:
        name = "integrity_costs_cpu" + (f"_threads{args.threads}" if args.threads else "") + ".json"
        Path(args.out or Path(__file__).parent / "results" / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
