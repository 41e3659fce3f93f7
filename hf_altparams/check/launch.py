"""How ``check`` gets its ranks: it starts them itself, or it is one of them.

* Started plainly (``python -m hf_altparams check``): :func:`self_launch` starts
  the ranks with ``torchrun --standalone`` (a free local port), or with
  ``accelerate launch`` when an Accelerate config file exists and ``--ranks``
  is not given, so the user's config (processes, FSDP) applies. Each rank writes
  its result to a folder (:data:`RESULTS_ENV` names it); this process reads them
  all, judges and prints. A rank that wrote nothing is reported lost; a job
  that runs past ``--deadline`` is stopped with every process it started
  (:func:`hf_altparams.testing.launch.run_launchers`: SIGTERM to the
  launcher, then SIGKILL to the ranks, whatever session they are in).
* Started by a launcher (``torchrun ... -m hf_altparams check``,
  ``accelerate launch -m hf_altparams check``): every rank runs, rank 0 gathers
  the results and prints (:func:`decide_on_rank0`), and every rank exits with
  the verdict's code.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..testing.launch import run_launchers, write_rank_result
from .rank import RankResult

__all__ = ["RESULTS_ENV", "accelerate_config", "decide_on_rank0", "launched", "read_results", "self_launch",
           "write_result"]

#: The folder a self-launched rank writes its ``rank{r}.json`` to.
RESULTS_ENV = "HF_ALTPARAMS_CHECK_RESULTS"


def launched() -> bool:
    """Whether this process is a rank started by a launcher (torchrun, accelerate launch)."""
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def accelerate_config() -> Optional[Path]:
    """The user's default Accelerate config file, where one exists (``accelerate config`` writes it)."""
    try:
        from accelerate.commands.config import default_config_file
    except ImportError:
        return None
    path = Path(default_config_file)
    return path if path.is_file() else None


def write_result(folder: str, result: RankResult) -> None:
    """Write ``rank{r}.json`` atomically (a reader never sees half a file)."""
    write_rank_result(folder, result.as_dict(), rank=result.rank)


def read_results(folder: Path, world: int) -> list[Optional[RankResult]]:
    """Every rank's result, ``None`` for a rank that wrote none."""
    out: list[Optional[RankResult]] = []
    for rank in range(world):
        path = folder / f"rank{rank}.json"
        out.append(RankResult.from_dict(json.loads(path.read_text())) if path.is_file() else None)
    return out


def decide_on_rank0(result: RankResult, decide: Callable[[list[Optional[RankResult]]], int], timeout: float
                    ) -> int:
    """Gather every rank's result on rank 0, let ``decide`` judge and print there; its exit code on every rank.

    Runs while the training's process group is still up, on a gloo group of its
    own (``gather_object`` needs one that carries CPU tensors). When the gather
    fails (a rank is lost), rank 0 judges what it has: its own result, the
    others missing; the other ranks exit 1.
    """
    if result.world == 1:
        return decide([result])
    import datetime

    import torch.distributed as dist

    gathered: Optional[list[Any]] = [None] * result.world if result.rank == 0 else None
    try:
        if not dist.is_initialized():
            raise RuntimeError("no process group (the accelerator was never built)")
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        dist.gather_object(result.as_dict(), gathered, dst=0, group=group)
        code = torch.tensor([0])
        if gathered is not None:
            code[0] = decide([RankResult.from_dict(d) if d else None for d in gathered])
        dist.broadcast(code, src=0, group=group)
        return int(code.item())
    except RuntimeError:  # a rank is gone: judge this rank's own result
        if result.rank != 0:
            return 1
        return decide([result] + [None] * (result.world - 1))


def _default_ranks() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _command(argv: Sequence[str], ranks: Optional[int]) -> tuple[list[str], str]:
    config = accelerate_config() if ranks is None else None
    if config is not None:
        return ([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                 "-m", "hf_altparams", "check", *argv], f"accelerate launch (your config {config})")
    count = ranks or _default_ranks()
    return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(count),
             "-m", "hf_altparams", "check", *argv], f"torchrun, {count} rank{'s' if count > 1 else ''}")


def self_launch(argv: Sequence[str], ranks: Optional[int], deadline: float
                ) -> tuple[list[Optional[RankResult]], str, str]:
    """Start the ranks, wait for them (at most ``deadline`` seconds); ``(results, how, log tail)``."""
    command, how = _command(argv, ranks)
    with tempfile.TemporaryDirectory(prefix="hf_altparams_check_") as folder:
        env = dict(os.environ, **{RESULTS_ENV: folder})
        if not torch.cuda.is_available():
            env.setdefault("ACCELERATE_USE_CPU", "1")  # else Accelerate runs each CPU rank alone
        (done,), timed_out = run_launchers([command], env, timeout=deadline)
        tail = "\n".join((done.stdout or "").splitlines()[-40:])
        world_file = Path(folder) / "world"
        world = int(world_file.read_text()) if world_file.is_file() else (ranks or _default_ranks())
        if timed_out:
            tail = f"(stopped after --deadline {deadline:.0f} s)\n{tail}"
        return read_results(Path(folder), world), how, tail
