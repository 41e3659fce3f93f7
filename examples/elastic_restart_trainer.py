"""Elastic restart of a phased 🤗 Trainer run: a rank dies mid-phase, the job restarts and resumes by itself.

Run it (two CPU processes; rank 1 kills itself after step 6 of the first attempt)::

    ACCELERATE_USE_CPU=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes 1 --nproc-per-node 2 \\
        --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29400 \\
        examples/elastic_restart_trainer.py --output-dir /tmp/elastic_trainer --kill-at-step 6

(on GPUs drop ``ACCELERATE_USE_CPU``; ``accelerate launch --max_restarts 1
--rdzv_backend c10d`` passes the same options to the same torch elastic agent;
``docs/faults.md`` says why the c10d rendezvous with a fresh store per attempt).

The recipe, what a Trainer job needs to survive a lost rank:

1. ``save_strategy="steps"``: the Trainer writes ``checkpoint-<step>`` folders;
   AlternatingFreeze saves the schedule position, the phase and the idle
   groups' optimizer state with them, and marks each folder complete last.
2. ``trainer.train(resume_from_checkpoint=last_complete_checkpoint(output_dir))``
   on every start: the latest *complete* checkpoint (a save killed part-way is
   skipped; ``None`` starts from scratch). ``resume_from_checkpoint=True``
   would take the highest folder, and AlternatingFreeze refuses a torn one.
3. The data order is the Trainer's: its sampler is seeded by ``seed`` and a
   resumed run skips the batches already seen (keep ``ignore_data_skip=False``).
4. Bound the time a surviving rank waits for a dead or hung one:
   ``ddp_timeout`` (seconds; 30 min by default) and the switch's
   ``collective_timeout``. On one node torchrun stops the other ranks at once
   when one dies; across nodes these timeouts do.

The launcher restarts every rank (``--max-restarts`` times); the restarted job
(``TORCHELASTIC_RESTART_COUNT`` > 0) resumes and ends bit-equal to an
uninterrupted run: every rank's last line, ``final parameter sha256``, is the
same (``tests/integrations/test_elastic_restart.py`` checks it).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import sys
from typing import Any

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

from hf_altparams.engine import shutdown
from hf_altparams.integrations.trainer import AlternatingFreeze, grouped_optimizer, last_complete_checkpoint
from hf_altparams.plan import Alternating, ParamGroups

SEQ_LEN = 12


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir (checkpoints)")
    parser.add_argument("--max-steps", type=int, default=12, help="optimizer steps in all")
    parser.add_argument("--save-every", type=int, default=4, help="a checkpoint every N steps")
    parser.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="on the first attempt only, --kill-rank SIGKILLs itself after this optimizer step",
    )
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--group-timeout", type=int, default=60, help="process group timeout, seconds")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def say(line: str) -> None:
    """Print ``line`` in one write, newline included: the ranks share the launcher's output, and with unbuffered
    output (``python -u``, ``PYTHONUNBUFFERED``) ``print`` writes the text and the newline apart, so another
    rank's line could land between them (the digests below are read back line by line)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class TokenDataset(torch.utils.data.Dataset):
    """Random token sequences; the label says whether token 7 occurs."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 64, (n, SEQ_LEN), generator=gen)
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class KillOnce(TrainerCallback):
    """On the first attempt, ``rank`` SIGKILLs itself after optimizer step ``step`` (a lost node)."""

    def __init__(self, step: int | None, rank: int, freeze: AlternatingFreeze) -> None:
        self.step, self.rank, self.freeze = step, rank, freeze

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and state.global_step == self.step and args.process_index == self.rank:
            phase = self.freeze.phase.name if self.freeze.phase else None
            say(f"rank {self.rank}: SIGKILL after step {self.step}, mid-phase {phase}")
            os.kill(os.getpid(), signal.SIGKILL)


def digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode())
        sha.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return sha.hexdigest()


def main() -> None:
    args = parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(args.seed)
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=SEQ_LEN,
            type_vocab_size=1,
            num_labels=2,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=args.save_every,
        logging_strategy="no",
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
        ddp_timeout=args.group_timeout,
        ddp_find_unused_parameters=False,
    )
    groups = ParamGroups.from_layers(
        model, "bert.encoder.layer", extra={"emb": "bert.embeddings.*", "head": ["bert.pooler.*", "classifier.*"]}
    )
    # Steps 0-2 train layer0, 3-4 layer1, 5-6 head, 7-9 layer0 again, ...; idle groups' AdamW state
    # lives on the host (offload) or is dropped (drop): a checkpoint holds both kinds.
    freeze = AlternatingFreeze(
        groups,
        Alternating({"layer0": 3, "layer1": 2, "head": 2}),
        switcher_options={"collective_timeout": args.group_timeout},
    )
    optimizer = grouped_optimizer(
        groups, lr=1e-3, state_policy={"emb": "keep", "layer0": "offload", "layer1": "drop", "head": "keep"}
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=TokenDataset(256, args.seed),
        optimizers=(optimizer, None),
        callbacks=[freeze, KillOnce(args.kill_at_step, args.kill_rank, freeze)],
    )

    resume = last_complete_checkpoint(args.output_dir)  # None: from scratch; torn saves are skipped
    if trainer.is_world_process_zero():
        say(
            f"attempt {attempt}: "
            + (f"resuming from {os.path.basename(resume)}" if resume else "no complete checkpoint, starting at step 0")
        )
    trainer.train(resume_from_checkpoint=resume)

    if trainer.is_world_process_zero():
        say(f"attempt {attempt}: done, {trainer.state.global_step} steps")
    say(f"rank {training_args.process_index} final parameter sha256: {digest(model)}")
    shutdown(trainer.model_wrapped)  # free the DDP reducer, let the gloo threads finish, destroy the group


if __name__ == "__main__":
    main()
