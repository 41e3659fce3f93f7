"""2 gloo ranks: the 🤗 Trainer with AlternatingFreeze refuses diverged weights, damaged checkpoints, other groups.

Usage (``tests/integrations/test_trainer_integrity.py`` launches it)::

    torchrun --nproc_per_node 2 trainer_integrity.py OUT_DIR

Scenarios (a tiny BERT built from a config, as in ``trainer_phases``), one
after another in the same processes; each rank writes ``OUT_DIR/rank{r}.json``:

* ``drift_at_save``: rank 1 changes one element of the (never trained)
  embeddings after step 1; the save at step 2 must raise a ``DriftError`` on
  both ranks naming group ``emb`` and rank 1, and no ``checkpoint-2`` is written.
* ``drift_at_switch``: ``switcher_options={"drift_check": "switch"}``; the same
  change; the switch at step 2 raises.
* ``saved``: a complete run saving ``checkpoint-2`` (the next scenarios resume it).
* ``other_groups``: resuming it with the two layer groups swapped (same sizes:
  the old record's parameter counts match) is refused naming both groups.
* ``no_optimizer_file``: resuming a copy of it whose ``optimizer.pt`` is gone
  (the Trainer then silently starts a fresh optimizer) is refused naming the file.
* ``unreached``: the phase trains a head the forward never uses: the library's
  error names the phase, not torch's "element 0 of tensors does not require grad".
* ``fsdp2_resume_save``: FSDP2 (``fully_shard`` per ``BertLayer``, on CPU
  ranks) over six layer groups with ``GradualUnfreeze(["layer4", "layer5"])``
  (``emb`` and ``layer0``-``layer3`` never train): an uninterrupted 6-step run
  saving every 2 steps; a run resumed from its ``checkpoint-2`` that saves
  again (at 4 and 6); a run resumed from that second run's ``checkpoint-4``;
  the final parameters of both resumed runs against the uninterrupted one.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from transformers import BertForSequenceClassification, Trainer, TrainerCallback

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError
from hf_altparams.integrations.trainer import AlternatingFreeze
from hf_altparams.plan import Alternating, GradualUnfreeze, ParamGroups
from hf_altparams.testing.fsdp2 import fresh_accelerator_state, use_accelerate_fsdp2
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))
from tests.scripts.trainer_phases import EXTRA_GROUPS, TokenDataset, arguments, groups_of, tiny_bert  # noqa: E402

FSDP = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}}


class Nudge(TrainerCallback):
    """On rank 1 only, after optimizer step ``at``: add 1e-3 to one element of ``param`` (a drifting rank)."""

    def __init__(self, param: torch.Tensor, at: int) -> None:
        self.param, self.at = param, at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at and dist.get_rank() == 1:
            with torch.no_grad():
                self.param.view(-1)[0] += 1e-3


def caught(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        call()
    except Exception as exc:  # what the test checks
        return {"type": type(exc).__name__, "message": str(exc), "is_library_error": isinstance(exc, AltParamsError)}
    return {"type": None, "message": ""}


def trainer(
    out: Path, model: nn.Module, freeze: AlternatingFreeze, *extra: TrainerCallback, **overrides: Any
) -> Trainer:
    fresh_accelerator_state()  # the Trainer's Accelerator reads its own FSDP plugin (or none)
    args = arguments(out, **{"max_steps": 3, "gradient_accumulation_steps": 1, **overrides})
    built = Trainer(model=model, args=args, train_dataset=TokenDataset(64), callbacks=[freeze, *extra])
    if "fsdp" in overrides and not built.is_fsdp_enabled:  # CPU ranks: Accelerate skips FSDP
        use_accelerate_fsdp2(built.accelerator, FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
        built.is_fsdp_enabled = True
    return built


def drifting(out: Path, options: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    model = tiny_bert()
    freeze = AlternatingFreeze(groups_of, Alternating(["head", "layer1"], every=2), switcher_options=options)
    nudge = Nudge(model.bert.embeddings.word_embeddings.weight, at=1)
    error = caught(lambda: trainer(out, model, freeze, nudge, **overrides).train())
    return {"error": error, "checkpoint_2_written": (out / "checkpoint-2").exists()}


def swapped_layers(model: nn.Module) -> ParamGroups:
    return ParamGroups(model, {"layer0": "bert.encoder.layer.1.*", "layer1": "bert.encoder.layer.0.*", **EXTRA_GROUPS})


def resumes(out: Path) -> dict[str, Any]:
    saved = out / "saved"
    schedule = Alternating(["head", "layer1"], every=2)
    trainer(saved, tiny_bert(), AlternatingFreeze(groups_of, schedule), save_strategy="steps", save_steps=2).train()
    dist.barrier()
    checkpoint = saved / "checkpoint-2"
    other = caught(
        lambda: trainer(out / "other", tiny_bert(), AlternatingFreeze(swapped_layers, schedule)).train(
            resume_from_checkpoint=str(checkpoint)
        )
    )
    damaged = out / "damaged" / "checkpoint-2"
    if dist.get_rank() == 0:
        shutil.copytree(checkpoint, damaged)
        os.remove(damaged / "optimizer.pt")
    dist.barrier()
    no_optimizer = caught(
        lambda: trainer(out / "damaged_run", tiny_bert(), AlternatingFreeze(groups_of, schedule)).train(
            resume_from_checkpoint=str(damaged)
        )
    )
    return {"other_groups": other, "no_optimizer_file": no_optimizer}


class WithAux(BertForSequenceClassification):
    """A tiny BERT with an extra head its forward never uses (a task head this batch skips)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.aux = nn.Linear(config.hidden_size, 2)


def unreached(out: Path) -> dict[str, Any]:
    config = tiny_bert().config
    torch.manual_seed(0)
    model = WithAux(config)
    freeze = AlternatingFreeze(
        {"aux": "aux.*", "head": ["bert.pooler.*", "classifier.*"]}, Alternating(["aux", "head"])
    )
    return {"error": caught(lambda: trainer(out, model, freeze).train())}


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
        for n, p in model.named_parameters()
    }


def fsdp2_run(out: Path, resume: str | None = None) -> dict[str, torch.Tensor]:
    model = tiny_bert(layers=6)
    freeze = AlternatingFreeze(
        layers="bert.encoder.layer",
        extra=EXTRA_GROUPS,
        schedule=GradualUnfreeze(["layer4", "layer5"], every=2, always=["head"]),
    )
    built = trainer(out, model, freeze, max_steps=6, save_strategy="steps", save_steps=2, **FSDP)
    built.train(resume_from_checkpoint=resume)
    return full(built.model)


def fsdp2_resume_save(out: Path) -> dict[str, Any]:
    reference = fsdp2_run(out / "uninterrupted")
    resumed: dict[str, dict[str, torch.Tensor]] = {}

    def resume(name: str, source: Path) -> None:
        resumed[name] = fsdp2_run(out / name, str(source))

    first = caught(lambda: resume("first", out / "uninterrupted" / "checkpoint-2"))  # saves at 4 and 6
    second = caught(lambda: resume("second", out / "first" / "checkpoint-4"))
    equal = {name: all(torch.equal(got[n], p) for n, p in reference.items()) for name, got in resumed.items()}
    return {
        "first_resume": first,
        "second_resume": second,
        "bitwise_equal": equal,
        "checkpoints_of_first": sorted(p.name for p in (out / "first").glob("checkpoint-*")),
    }


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    # Every Trainer.train() runs gc.collect() (Accelerate's free_memory); a full collection walks every object of
    # torch and transformers, about half a CPU-second each time. Frozen, the modules' objects are left out of it;
    # what the scenarios make is still collected.
    gc.collect()
    gc.freeze()
    report = {
        "drift_at_save": drifting(out / "drift_save", {}, save_strategy="steps", save_steps=2),
        "drift_at_switch": drifting(out / "drift_switch", {"drift_check": "switch"}),
        **resumes(out),
        "unreached": unreached(out / "unreached"),
        "fsdp2_resume_save": fsdp2_resume_save(out / "fsdp2"),
    }
    write_rank_result(out, report, rank=dist.get_rank())
    dist.barrier()


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
