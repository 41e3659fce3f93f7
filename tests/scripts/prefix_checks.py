"""Two-rank checks of the frozen-prefix cache through :class:`PhasedAccelerator`.

Usage (every rank runs it)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 prefix_checks.py OUT_DIR

Scenarios, one after another in the same processes; each rank writes
``OUT_DIR/rank{r}.json``:

* ``progressive`` (gradient accumulation 2) and ``gradual``: an epoch-unit
  schedule trained with ``frozen_prefix=FrozenPrefix(cache=False)`` (the frozen
  prefix in eval mode) and again with the cache; parameters compared, ranks
  compared, the per-prefix records and the ``altparams/prefix_*`` keys that
  reached the tracker. Each rank reads a fixed shard (:class:`ShardSampler`).
* ``global_shuffle``: ``progressive`` with Accelerate's prepared loader (another
  shard on every rank each epoch): the same parameters, whatever the hits.
* ``resume``: the cached progressive run saves its state mid-phase (the cache
  holds rows by then); a new accelerator, model and optimizer load it, skip the
  batches already seen and finish; final parameters against the uninterrupted run.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Optional

import torch
from accelerate.utils import DataLoaderConfiguration

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.prefix import FrozenPrefix, ShardSampler
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.plan import GradualUnfreeze, ParamGroups, ProgressiveFreeze, Schedule
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.scripts.accelerate_checks import ListTracker  # noqa: E402
from tests.support.digests import state_sha  # noqa: E402
from tests.support.models import TinyEncoder  # noqa: E402

N, SEQ, BATCH, LAYERS, EPOCHS = 32, 6, 4, 4, 6
GROUPS = {"emb": "embeddings.*", **{f"layer{i}": f"layers.{i}.*" for i in range(LAYERS)}, "head": "head.*"}
SAVE_EPOCH, SAVE_BATCH = 3, 2  # inside the second epoch of the phase freezing emb+layer0 (cache warm)
DROPOUT = 0.1


def schedule(kind: str) -> Schedule:
    if kind == "gradual":
        return GradualUnfreeze(["emb", "layer0", "layer1", "layer2", "layer3"], every=2, unit="epoch", always=["head"])
    return ProgressiveFreeze(["emb", "layer0", "layer1"], every=2, unit="epoch", always=["layer2", "layer3", "head"])


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 50, (N, SEQ), generator=gen), torch.randint(0, 4, (N,), generator=gen)
    return torch.utils.data.TensorDataset(x, y, torch.arange(N))  # the index travels with the sample


def setup(
    kind: str,
    option: FrozenPrefix,
    ga: int,
    shard: bool = True,
) -> tuple[PhasedAccelerator, Any, Any, Any, ListTracker]:
    tracker = ListTracker()
    acc = PhasedAccelerator(
        schedule(kind),
        frozen_prefix=option,
        gradient_accumulation_steps=ga,
        log_with=[tracker],
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    acc.init_trackers(kind)
    torch.manual_seed(0)
    model = TinyEncoder(layers=LAYERS, dropout=DROPOUT)
    opt = GroupedOptimizer(ParamGroups(model, GROUPS), functools.partial(torch.optim.AdamW, lr=1e-2))
    if shard:  # a per-rank loader, not prepared: Accelerate would shard it again
        sampler = ShardSampler(N, acc.num_processes, acc.process_index, seed=5)
        ddp, opt = acc.prepare(model, opt)
        # its own generator: iterating must not draw from the global RNG the dropout uses (resume)
        loader = torch.utils.data.DataLoader(
            dataset(), batch_size=BATCH, sampler=sampler, generator=torch.Generator().manual_seed(0)
        )
        return acc, ddp, opt, loader, tracker
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True)
    ddp, opt, loader = acc.prepare(model, opt, loader)
    return acc, ddp, opt, loader, tracker


def run_epochs(
    acc: PhasedAccelerator, ddp: Any, opt: Any, loader: Any, start: int = 0, skip: int = 0, save: Optional[Path] = None
) -> None:
    """The stock Accelerate loop; the batch's third tensor is the dataset index."""
    for epoch in range(start, EPOCHS):
        acc.set_epoch(epoch)
        (loader.sampler if isinstance(loader.sampler, ShardSampler) else loader).set_epoch(epoch)
        for b, batch in enumerate(loader):
            if epoch == start and b < skip:
                continue
            if save is not None and (epoch, b) == (SAVE_EPOCH, SAVE_BATCH):
                acc.save_state(str(save))
            x, y, idx = (t.to(acc.device) for t in batch)
            with acc.accumulate(ddp):
                acc.backward(ddp(x, labels=y, sample_index=idx))
                opt.step()
                opt.zero_grad()


def records(acc: PhasedAccelerator) -> list[dict[str, Any]]:
    assert acc.frozen_prefix is not None
    cache = acc.frozen_prefix
    return [
        {"depth": r.depth, "hit": r.hit_samples, "miss": r.miss_samples, "memory_bytes": r.memory_bytes}
        for r in [*cache.records, cache.record]
    ]


def equivalence(kind: str, ga: int, shard: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, option in (("plain", FrozenPrefix(cache=False)), ("cached", FrozenPrefix())):
        acc, ddp, opt, loader, tracker = setup(kind, option, ga, shard)
        torch.manual_seed(1 + acc.process_index)  # the suffix's dropout: same draws in both runs
        run_epochs(acc, ddp, opt, loader)
        out[name] = {k: v.detach().clone() for k, v in acc.unwrap_model(ddp).state_dict().items()}
        out[f"{name}_sha"] = state_sha(acc.unwrap_model(ddp))
        out[f"{name}_records"] = records(acc)
        out[f"{name}_logged_keys"] = sorted({k for _, values in tracker.logs for k in values if "prefix_" in k})
        acc.free_memory(ddp, opt)
    plain, cached = out.pop("plain"), out.pop("cached")
    out["max_abs_diff"] = max(float((plain[k] - cached[k]).abs().max()) for k in plain)
    return out


def resume(out_dir: Path, option: FrozenPrefix) -> dict[str, Any]:
    ckpt = out_dir / "prefix_ckpt"
    acc, ddp, opt, loader, _ = setup("progressive", option, 1)
    torch.manual_seed(1 + acc.process_index)
    run_epochs(acc, ddp, opt, loader, save=ckpt)
    uninterrupted = state_sha(acc.unwrap_model(ddp))
    held_at_end = records(acc)
    acc.free_memory(ddp, opt)

    acc, ddp, opt, loader, _ = setup("progressive", option, 1)
    acc.load_state(str(ckpt))  # restores the RNG states too
    run_epochs(acc, ddp, opt, loader, start=SAVE_EPOCH, skip=SAVE_BATCH)
    result = {
        "uninterrupted_sha": uninterrupted,
        "resumed_sha": state_sha(acc.unwrap_model(ddp)),
        "records_uninterrupted": held_at_end,
        "records_resumed": records(acc),
    }
    acc.free_memory(ddp, opt)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    result = {
        "progressive": equivalence("progressive", ga=2),
        "gradual": equivalence("gradual", ga=1),
        "global_shuffle": equivalence("progressive", ga=1, shard=False),
        "resume": resume(out_dir, FrozenPrefix()),
    }
    write_rank_result(out_dir, result)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
