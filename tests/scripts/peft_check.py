"""Two-rank checks of the peft integration (:mod:`hf_altparams.integrations.peft`) under ``PhasedAccelerator``.

Usage (every rank runs it)::

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 peft_check.py OUT_DIR

A tiny config-built BERT for sequence classification carries two LoRA
adapters ``a`` and ``b`` (query, value and the word embeddings, plus each
adapter's own copy of the classifier through ``modules_to_save``). Each rank
writes its findings to ``OUT_DIR/rank{r}.json``; the test asserts on them.

Scenarios:

* ``phased``: ``PerTaskCycle(["base"], ["a", "b"], every=2, train_trunk=False)``
  with :func:`follow_phases`: per step the task, peft's active adapters at the
  forward, the bytes all-reduced (comm counter) and the task adapter's bytes,
  and which groups changed; an evaluation of the idle adapter through
  ``adapters.visiting``; the final digests; each adapter saved with
  ``save_pretrained`` (rank 0) and reloaded on every rank into a fresh model,
  compared with the trained weights.
* ``behind_back``: ``Alternating(["a", "b"], every=2)`` without the hook; the loop calls
  ``set_adapter("b")`` during phase ``a``: the optimizer step's message, and
  whether any weight moved.
* ``behind_back_hooked``: with the hook; the same call: the forward's message,
  then ``adapters.restore()`` and two more steps.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.integrations.peft import adapter_groups, adapter_parameters, follow_phases
from hf_altparams.plan import Alternating, ParamGroups, PerTaskCycle, Schedule
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.support.digests import group_digests  # noqa: E402

VOCAB, BATCH, LR = 64, 4, 5e-2
ADAPTERS = ("a", "b")


def base_model() -> BertForSequenceClassification:
    torch.manual_seed(0)  # the same base weights on every rank and at reload
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=16,
        num_labels=2,
    )
    return BertForSequenceClassification(config)


def lora() -> LoraConfig:
    return LoraConfig(
        task_type="SEQ_CLS", r=2, target_modules=["query", "value", "word_embeddings"], init_lora_weights=False
    )  # B != 0: every LoRA parameter gets a gradient at step one


def peft_model() -> nn.Module:
    model = get_peft_model(base_model(), lora(), adapter_name="a")
    model.add_adapter("b", lora())
    return model


def task_loader(task: str) -> torch.utils.data.DataLoader:
    """Task ``a``: is the first token in the upper half; task ``b``: is the last token even."""
    gen = torch.Generator().manual_seed(1 if task == "a" else 2)
    ids = torch.randint(1, VOCAB, (64, 8), generator=gen)
    labels = (ids[:, 0] >= VOCAB // 2).long() if task == "a" else (ids[:, -1] % 2 == 0).long()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, labels), batch_size=BATCH)


def forever(loader: Any) -> Iterator[Any]:
    while True:
        yield from loader


def setup(
    hooked: bool, schedule: Schedule
) -> tuple[PhasedAccelerator, Any, Any, ParamGroups, dict[str, Iterator[Any]], Any]:
    model = peft_model()
    groups = adapter_groups(model, base="base")
    accelerator = PhasedAccelerator(schedule, groups=groups, count_comm=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # frozen ones get no gradient, hence no state
    ddp, optimizer, *loaders = accelerator.prepare(model, optimizer, *(task_loader(t) for t in ADAPTERS))
    adapters = follow_phases(accelerator) if hooked else None
    return accelerator, ddp, optimizer, groups, dict(zip(ADAPTERS, map(forever, loaders))), adapters


def step(accelerator: PhasedAccelerator, ddp: Any, optimizer: Any, batches: dict[str, Iterator[Any]]) -> str:
    phase = accelerator.phase
    assert phase is not None
    task = phase.task or phase.name
    ids, labels = next(batches[task])
    accelerator.backward(ddp(input_ids=ids, labels=labels).loss)
    optimizer.step()
    optimizer.zero_grad()
    return task


def phased(out: Path) -> dict[str, Any]:
    schedule = PerTaskCycle(["base"], list(ADAPTERS), every=2, train_trunk=False)
    accelerator, ddp, optimizer, groups, batches, adapters = setup(hooked=True, schedule=schedule)
    peft = accelerator.unwrap_model(ddp)
    seen: list[list[str]] = []
    peft.register_forward_pre_hook(lambda module, args: seen.append(list(module.active_adapters)))
    trace = []
    for _ in range(8):
        before = group_digests(groups)
        task = step(accelerator, ddp, optimizer, batches)
        after = group_digests(groups)
        trace.append(
            {
                "task": task,
                "active": seen[-1],
                "adapter_bytes": groups.nbytes(task),
                "changed": sorted(g for g in before if before[g] != after[g]),
            }
        )
    measured = accelerator.comm_counter.history if accelerator.comm_counter else []

    # Evaluate the adapter the phase does not train (phase "a" now), then check nothing was left behind.
    phase = accelerator.phase
    assert phase is not None
    idle = "b" if "a" in phase.trainable else "a"
    ids = torch.arange(1, 9).unsqueeze(0)
    peft.eval()  # no dropout: the logits are compared with the reloaded adapter's below
    with adapters.visiting(idle):
        visit = {
            "active": list(peft.active_adapters),
            "grad_enabled": torch.is_grad_enabled(),
            "logits": peft(input_ids=ids).logits.tolist(),
        }
    peft.train()
    trainable = groups.trainable_param_names(phase.trainable)
    visit["after_active"] = list(peft.active_adapters)
    visit["after_flags_match_phase"] = all(p.requires_grad == (n in trainable) for n, p in groups.all_named_params())

    # Save each adapter (rank 0), reload both on every rank into a fresh model, compare.
    folder = out / "adapters"
    if accelerator.is_main_process:
        for name in ADAPTERS:
            peft.save_pretrained(str(folder), selected_adapters=[name])
    accelerator.wait_for_everyone()
    reloaded = PeftModel.from_pretrained(base_model(), str(folder / "a"), adapter_name="a")
    reloaded.load_adapter(str(folder / "b"), adapter_name="b")
    mine, theirs = dict(peft.named_parameters()), dict(reloaded.named_parameters())
    reloaded.eval()
    with torch.no_grad():
        reloaded.set_adapter(idle)
        reloaded_logits = reloaded(input_ids=ids).logits.tolist()
    reload_diff = {
        a: max(float((mine[n] - theirs[n]).abs().max()) for n in names) for a, names in adapter_parameters(peft).items()
    }
    result = {
        "trace": trace,
        "measured": measured,
        "digests": group_digests(groups),
        "visit": visit,
        "reload_max_abs_diff": reload_diff,
        "reloaded_idle_logits": reloaded_logits,
        "adapter_param_names": {a: list(n) for a, n in adapter_parameters(peft).items()},
        "group_names": {g: list(groups.param_names(g)) for g in groups.names},
    }
    adapters.close()
    accelerator.free_memory()
    return result


def behind_back(hooked: bool) -> dict[str, Any]:
    # Every group resident (Alternating): without the hook, nothing but the per-step check stands in the way.
    schedule = Alternating(list(ADAPTERS), every=2)
    accelerator, ddp, optimizer, groups, batches, adapters = setup(hooked=hooked, schedule=schedule)
    peft = accelerator.unwrap_model(ddp)
    step(accelerator, ddp, optimizer, batches)  # step 0, phase "a"
    before = group_digests(groups)
    result: dict[str, Any] = {"phase": accelerator.phase.name if accelerator.phase else None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.set_adapter("b")  # the user's own call, behind the schedule's back
    try:
        step(accelerator, ddp, optimizer, batches)
        result["error"] = ""
    except AltParamsError as exc:
        result["error"] = str(exc)
    after = group_digests(groups)
    result["changed"] = sorted(g for g in before if before[g] != after[g])
    if hooked:
        optimizer.zero_grad()
        adapters.restore()
        result["restored_active"] = list(peft.active_adapters)
        for _ in range(2):
            step(accelerator, ddp, optimizer, batches)
        result["steps_after_restore"] = accelerator.schedule_step
        result["digests"] = group_digests(groups)
        adapters.close()
    accelerator.free_memory()
    return result


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    warnings.filterwarnings("ignore", message=".*modules_to_save.*")
    results = {
        "phased": phased(out),
        "behind_back": behind_back(hooked=False),
        "behind_back_hooked": behind_back(hooked=True),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
    }
    write_rank_result(out, results, rank=int(os.environ.get("RANK", "0")))


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
