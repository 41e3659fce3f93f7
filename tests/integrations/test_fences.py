"""The fences around Accelerate's and transformers' internals: one test per use, against the installed versions.

``integrations/accelerate_internals.py`` and ``integrations/transformers_internals.py``
are the only modules of the library that touch a private name of those
libraries. Each use below is exercised on a real ``Accelerator`` or ``Trainer``,
so a release that renames or changes what the library relies on fails here,
not in a user's run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin, ProjectConfiguration
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import DefaultFlowCallback

from hf_altparams.errors import AltParamsError
from hf_altparams.integrations import accelerate_internals as acc_fence
from hf_altparams.integrations import transformers_internals as tf_fence


# ------------------------------------------------------------------ Accelerate
def test_accelerate_has_every_name_the_fence_lists() -> None:
    assert acc_fence.missing_names() == []
    assert set(acc_fence.USES) >= {
        "prepared_optimizers",
        "is_prepared",
        "shared_accelerator_state",
        "without_total_limit",
    }


def test_prepared_optimizers_are_the_list_prepare_appends_to(fresh_accelerate_state: None) -> None:
    acc = Accelerator(cpu=True)
    model = nn.Linear(2, 2)
    raw = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not acc_fence.is_prepared(raw)
    _, prepared = acc.prepare(model, raw)
    assert acc_fence.prepared_optimizers(acc) == [prepared]
    assert acc_fence.is_prepared(prepared)
    extra = type(prepared)(torch.optim.SGD(model.parameters(), lr=0.1))
    acc_fence.register_prepared_optimizer(acc, extra)
    assert acc_fence.prepared_optimizers(acc) == [prepared, extra]


def test_a_registered_scheduler_is_marked_and_saved_like_accelerates_own(
    fresh_accelerate_state: None, tmp_path: Path
) -> None:
    acc = Accelerator(cpu=True)
    model = nn.Linear(2, 2)
    _, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.StepLR(opt.optimizer, step_size=1)
    from accelerate.scheduler import AcceleratedScheduler

    wrapped = AcceleratedScheduler(scheduler, opt)
    acc_fence.register_prepared_scheduler(acc, wrapped)
    assert acc_fence.is_prepared(wrapped)
    acc.save_state(str(tmp_path / "ckpt"))
    assert (tmp_path / "ckpt" / "scheduler.bin").is_file()  # save_state saved the registered scheduler


def test_prepared_dataloaders_are_the_loaders_prepare_returned(fresh_accelerate_state: None) -> None:
    acc = Accelerator(cpu=True)
    assert acc_fence.prepared_dataloaders(acc) == []
    loader = acc.prepare(torch.utils.data.DataLoader(list(range(6)), batch_size=2))
    assert acc_fence.prepared_dataloaders(acc) == [loader] and len(loader) == 3


def test_shared_state_holds_the_distributed_type_and_resets(fresh_accelerate_state: None) -> None:
    Accelerator(cpu=True)
    shared = acc_fence.shared_accelerator_state()
    assert "distributed_type" in shared
    acc_fence.fresh_accelerator_state()
    assert "distributed_type" not in acc_fence.shared_accelerator_state()


def test_run_fsdp_state_makes_an_accelerator_run_fsdp2(fresh_accelerate_state: None) -> None:
    acc = Accelerator(cpu=True)
    assert not acc.is_fsdp2
    acc_fence.run_fsdp_state(acc, FullyShardedDataParallelPlugin(fsdp_version=2))
    assert acc.is_fsdp2


def test_without_total_limit_stops_accelerate_from_deleting_before_it_saves(
    fresh_accelerate_state: None, tmp_path: Path
) -> None:
    config = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    acc = Accelerator(cpu=True, project_config=config)
    acc.prepare(nn.Linear(2, 2))
    acc.save_state()
    with acc_fence.without_total_limit(acc, 1):
        assert acc.project_configuration.total_limit is None
        acc.save_state()
    assert acc.project_configuration.total_limit == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_0", "checkpoint_1"]  # nothing deleted
    acc.save_state()  # outside: Accelerate applies the limit itself, deleting the oldest first
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["checkpoint_2"]


def test_launch_configs_read_as_accelerate_launch_reads_them(tmp_path: Path) -> None:
    """`distributed_type: NO` unquoted is a YAML boolean to Accelerate's loader; NO and MULTI_CPU start one process."""

    def config(name: str, body: str) -> acc_fence.LaunchConfig:
        path = tmp_path / name
        path.write_text(f"compute_environment: LOCAL_MACHINE\n{body}mixed_precision: 'no'\nuse_cpu: true\n")
        return acc_fence.read_launch_config(path)

    quoted, bare = config("a.yaml", "distributed_type: 'NO'\n"), config("b.yaml", "distributed_type: NO\n")
    assert quoted.distributed_type == bare.distributed_type == "NO" and quoted.processes() == bare.processes() == 1
    cpu = config("c.yaml", "distributed_type: MULTI_CPU\nnum_processes: 4\n")
    assert cpu.one_process and cpu.num_processes == 4 and cpu.processes(4) == 1 and cpu.elsewhere() is None
    gpu = config("d.yaml", "distributed_type: MULTI_GPU\nnum_processes: 2\nnum_machines: 2\n")
    assert not gpu.one_process and gpu.processes() == 2 and "num_machines 2" in (gpu.elsewhere() or "")
    with pytest.raises(AltParamsError, match="cannot be read"):
        acc_fence.read_launch_config(tmp_path / "missing.yaml")


def test_the_default_launch_config_follows_hf_home(tmp_path: Path) -> None:
    """Accelerate works the path out when its config module is imported: a fresh process sees HF_HOME."""
    code = (
        "from hf_altparams.integrations.accelerate_internals import default_launch_config; "
        "print(default_launch_config())"
    )
    env = dict(os.environ, HF_HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == str(tmp_path / "accelerate" / "default_config.yaml"), done.stderr[-2000:]


# ------------------------------------------------------------------ transformers
class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": (self.linear(x).squeeze(-1) - labels).pow(2).mean()}


class _Rows(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((2,), float(index)), "labels": torch.tensor(float(index))}


class _Probe(TrainerCallback):
    def __init__(self) -> None:
        self.resumed: Any = "not called"
        self.moved = False
        self.trainer: Any = None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.moved = tf_fence.move_before_reporters(self, tf_fence.caller_frame())
        self.trainer = tf_fence.trainer_from_stack(tf_fence.caller_frame())

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.resumed = tf_fence.resumed_checkpoint_from_stack(tf_fence.caller_frame())


class _Other(TrainerCallback):
    pass


def _trainer(tmp_path: Path, probe: _Probe, steps: int) -> Trainer:
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=2,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        logging_steps=100,
    )
    return Trainer(model=_Tiny(), args=args, train_dataset=_Rows(), callbacks=[_Other(), probe])


def test_transformers_has_every_name_the_fence_lists() -> None:
    assert tf_fence.missing_names() == []


def test_the_callback_handler_is_found_and_the_callback_moved_before_the_others(tmp_path: Path) -> None:
    probe = _Probe()
    trainer = _trainer(tmp_path, probe, steps=2)
    callbacks = trainer.callback_handler.callbacks
    assert probe.moved
    assert isinstance(callbacks[0], DefaultFlowCallback) and callbacks[1] is probe


def test_the_trainer_under_construction_is_found_from_on_init_end(tmp_path: Path) -> None:
    probe = _Probe()
    trainer = _trainer(tmp_path, probe, steps=2)
    assert probe.trainer is trainer
    assert tf_fence.trainer_from_stack(tf_fence.caller_frame()) is None  # no Trainer being built here


def test_the_resumed_checkpoint_is_read_from_the_training_loop(tmp_path: Path) -> None:
    first = _Probe()
    _trainer(tmp_path, first, steps=2).train()
    assert first.resumed == (True, None)  # a fresh run
    checkpoint = str(tmp_path / "checkpoint-2")
    assert os.path.isdir(checkpoint)
    second = _Probe()
    _trainer(tmp_path, second, steps=4).train(resume_from_checkpoint=checkpoint)
    assert second.resumed == (True, checkpoint)
