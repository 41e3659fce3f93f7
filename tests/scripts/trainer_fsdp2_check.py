"""2 gloo ranks: the 🤗 Trainer with ``fsdp_config={"version": 2}`` and AlternatingFreeze, vs the DDP run.

Usage (the tests launch it; it then runs ``accelerate_fsdp2_check``'s checks too, one launch)::

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 trainer_fsdp2_check.py OUT_DIR
    torchrun --nproc_per_node 1 trainer_fsdp2_check.py OUT_DIR   # on a GPU: the Trainer's FSDP2 for real

On CPU the Trainer's accelerator picks MULTI_CPU and drops the FSDP plugin, so
right after ``Trainer(...)`` it is switched to FSDP with the plugin built from
the arguments (:func:`hf_altparams.testing.fsdp2.use_accelerate_fsdp2`, plus the
Trainer's own ``is_fsdp_enabled`` flag): ``train()`` then runs the Trainer's
FSDP2 branch (``accelerator.prepare(model, optimizer)`` -> ``fully_shard`` per
``BertLayer``). Each rank writes rank{r}.json (``trainer`` here, ``accelerate``
from ``accelerate_fsdp2_check``): per-group checksums after every
step (which groups changed), the final full parameters' max difference to the
same schedule trained with the Trainer's DDP, reduce-scatter bytes counted per
step vs the switcher's figure, and a digest of the full parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import Trainer, TrainerCallback

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.trainer import AlternatingFreeze
from hf_altparams.plan.schedules import PhaseSequence
from hf_altparams.testing.fsdp2 import fresh_accelerator_state, use_accelerate_fsdp2
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.scripts.trainer_phases import TokenDataset, arguments, groups_of, sha, tiny_bert  # noqa: E402

PHASES = [(["head"], 2), (["layer1", "head"], 2), (["layer0"], 2), (["layer1", "head"], 2)]
# The checkpoint at step 3 is inside the second phase, before layer0 first trains (at step 4): the
# Trainer's FSDP2 resume then needs forget_untrained_state (docs/fsdp2.md).
STEPS, SAVE_AT = 8, 3
FSDP = {"fsdp": "full_shard", "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["BertLayer"]}}


class Expected(TrainerCallback):
    """After the callback's switch, what the switcher expects the next step to reduce-scatter."""

    def __init__(self, freeze: AlternatingFreeze) -> None:
        self.freeze, self.per_step = freeze, []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= len(self.per_step):  # once per optimizer step, not per micro-step
            self.per_step.append(self.freeze.switcher.allreduce_bytes_per_step())


def full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
        for n, p in model.named_parameters()
    }


def run(out: Path, fsdp: bool, save: bool = False, resume: str | None = None) -> dict[str, Any]:
    model = tiny_bert()
    schedule = PhaseSequence([(t, n) for t, n in PHASES])
    freeze = AlternatingFreeze(groups_of, schedule, count_comm=True)
    expected = Expected(freeze)
    saving = {"save_strategy": "steps", "save_steps": SAVE_AT} if save else {}
    fresh_accelerator_state()  # the Trainer's Accelerator reads its own FSDP plugin (or none)
    args = arguments(
        out / ("fsdp2" if fsdp else "ddp"),
        max_steps=STEPS,
        use_cpu=not torch.cuda.is_available(),
        **(FSDP if fsdp else {}),
        **saving,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(64 * STEPS), callbacks=[freeze, expected])
    if fsdp and not trainer.is_fsdp_enabled:  # CPU ranks, or a single GPU: Accelerate skips FSDP
        use_accelerate_fsdp2(trainer.accelerator, FullyShardedDataParallelPlugin(**args.fsdp_plugin_args))
        trainer.is_fsdp_enabled = True
    sums: list[dict[str, str]] = []

    class Sums(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            groups = freeze.groups
            sums.append(
                {
                    g: sha([p.full_tensor() if hasattr(p, "full_tensor") else p for p in groups.params(g)])
                    for g in groups.names
                }
            )

    trainer.add_callback(Sums())
    trainer.train(resume_from_checkpoint=resume)
    params = full(trainer.model)
    return {
        "params": params,
        "sums": sums,
        "counted": freeze.comm.history if freeze.comm else None,
        "expected": expected.per_step,
        "sharded": type(trainer.model).__name__.startswith("FSDP"),
        "phases": [r.phase for r in freeze.records],
    }


def check(out: Path) -> dict[str, Any]:
    """Run the checks (every rank); the rank's results."""
    reference = run(out, fsdp=False)
    sharded = run(out, fsdp=True, save=True)
    resumed = run(out, fsdp=True, resume=str(out / "fsdp2" / f"checkpoint-{SAVE_AT}"))
    diff = max(float((sharded["params"][n] - reference["params"][n]).abs().max()) for n in reference["params"])
    return {
        "sharded": sharded["sharded"],
        "max_diff_to_ddp": diff,
        "sums": sharded["sums"],
        "counted": sharded["counted"],
        "expected": sharded["expected"],
        "phases": sharded["phases"],
        "digest": sha(list(sharded["params"].values())),
        "resume_bitwise_equal": all(torch.equal(resumed["params"][n], p) for n, p in sharded["params"].items()),
        "resume_max_diff": max(float((resumed["params"][n] - p).abs().max()) for n, p in sharded["params"].items()),
    }


def main() -> None:
    """The Trainer checks, then (same processes, one launch) PhasedAccelerator's: ``accelerate_fsdp2_check``."""
    from tests.scripts.accelerate_fsdp2_check import check as accelerate_check

    out = Path(sys.argv[1])
    trainer = check(out)
    (out / "accelerate").mkdir(exist_ok=True)
    write_rank_result(
        out, {"trainer": trainer, "accelerate": accelerate_check(str(out / "accelerate"))}, rank=dist.get_rank()
    )


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()
