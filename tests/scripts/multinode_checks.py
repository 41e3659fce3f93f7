"""Two simulated nodes of two ranks each: :class:`PhasedAccelerator` across nodes.

Usage (see :func:`hf_altparams.testing.launch.launch_nodes`)::

    python -m torch.distributed.run --nnodes 2 --node-rank {0,1} --nproc-per-node 2 \\
        --rdzv-backend static --master-addr 127.0.0.1 --master-port PORT multinode_checks.py OUT_DIR

On node 1, ``LOCAL_RANK`` (0, 1) differs from ``RANK`` (2, 3); each node has its
own local main process. Each node writes under ``OUT_DIR/node{GROUP_RANK}``, its
own "disk". Every rank writes ``OUT_DIR/rank{r}.json``. Scenarios, in order:

* ``ranks``: RANK, LOCAL_RANK, GROUP_RANK and what Accelerate makes of them.
* ``engine``: every schedule case of ``engine_check.py`` (plain DDP and
  :class:`PhaseSwitcher`, no Accelerate); final parameters go to
  ``OUT_DIR/node{n}/{case}_rank{r}.pt`` for the test's one-process reference.
* ``ga1`` and ``per_task``: the two-rank equivalence checks of
  ``accelerate_checks.py`` on four ranks: parameters against one process on the
  concatenated (gathered) batch, bytes all-reduced per step against the phase's
  trainable bytes (per-task residency: the trunk and the current head only).
* ``each_node``: ``ProjectConfiguration(save_on_each_node=True)`` and a project
  folder per node: checkpoints (automatic naming) at a phase boundary, with
  offloaded and dropped optimizer state, and one step later; the run to its end.
  The second save is then torn on node 1 only (its marker removed there). In the
  same processes a fresh accelerator resumes with ``load_state()``, each node
  from its own folder: every rank must take the first checkpoint (the latest
  complete on EVERY node; before, node 0 took the second and node 1 the first,
  the ranks stood at different steps and waited in mismatched collectives until
  the process-group timeout) and end bit-equal to the uninterrupted run.
  Which ranks wrote the state file and the completion marker, which files each
  node's folder holds.
* ``shared``: ``save_on_each_node=False`` and ONE folder for both nodes (shared
  storage); saves at a phase boundary and one step later (mid-phase), resumes
  from the first (bitwise) and, with ``load_state()``, from the latest (equal
  to float rounding on four ranks: see SAVE_AT).
* ``main_only_separate``: ``save_on_each_node=False`` but a folder per node, so
  node 1 never sees the main node's files: ``load_state()`` must raise the same
  clear error on every rank, not let node 0 train on while node 1 failed (before
  the ranks agreed on the folder, node 0 loaded and trained while node 1 raised).

The process group gets a 90 s timeout, so a rank left waiting fails the run
instead of hanging it for gloo's default 30 minutes.
"""

from __future__ import annotations

import datetime
import functools
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from accelerate.utils import ProjectConfiguration
from torch import nn

from hf_altparams.engine import GroupedOptimizer
from hf_altparams.engine.shutdown import shutdown
from hf_altparams.errors import AltParamsError
from hf_altparams.integrations import accelerate_checkpoints as checkpoints
from hf_altparams.integrations.accelerate import PhasedAccelerator
from hf_altparams.integrations.accelerate_checkpoints import writes_state_files
from hf_altparams.plan import Alternating, ParamGroups
from hf_altparams.testing.launch import write_rank_result

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # tests.scripts, tests.support: however the script is started
    sys.path.insert(0, str(REPO))

from tests.scripts import engine_check  # noqa: E402
from tests.scripts.accelerate_checks import (  # noqa: E402
    LR,
    RESUME_POLICY,
    RESUME_SCHEDULE,
    RESUME_STEPS,
    SPECS,
    equivalence,
    fresh_model,
    loader,
    per_task_scenario,
)
from tests.support.digests import state_sha  # noqa: E402

GA = 2
# Saved at the first step of the l1 phase (steps 3-4): a phase boundary. On more than two ranks a
# resume is bit-exact only there: mid-phase, the uninterrupted run reduces in the bucket order DDP
# rebuilt after the phase's first step, the resumed one in DDP's initial order, and with 4 ranks
# the summation order differs in the last bits (plain Accelerate without this library too).
SAVE_AT = 3
WRITES: list[str] = []  # what this rank wrote through the library's checkpoint writers


def _recording(name: str, original: Callable[..., None]) -> Callable[..., None]:
    def record(output_dir: str, **state: Any) -> None:
        WRITES.append(name)
        original(output_dir, **state)

    return record


checkpoints.write_state = _recording("state_file", checkpoints.write_state)  # type: ignore[assignment]
checkpoints.mark_complete = _recording("marker", checkpoints.mark_complete)  # type: ignore[assignment]


def ranks_scenario(acc: PhasedAccelerator) -> dict[str, Any]:
    return {
        "RANK": int(os.environ["RANK"]),
        "LOCAL_RANK": int(os.environ["LOCAL_RANK"]),
        "GROUP_RANK": int(os.environ["GROUP_RANK"]),
        "process_index": acc.process_index,
        "local_process_index": acc.local_process_index,
        "is_local_main_process": acc.is_local_main_process,
        "num_processes": acc.num_processes,
        "backend": dist.get_backend(),
    }


def _run(project_dir: Path, on_each_node: bool) -> tuple[PhasedAccelerator, nn.Module, Any, Any, Any]:
    config = ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True, save_on_each_node=on_each_node
    )
    acc = PhasedAccelerator(Alternating(RESUME_SCHEDULE), gradient_accumulation_steps=GA, project_config=config)
    model = fresh_model()
    opt = GroupedOptimizer(
        ParamGroups(model, SPECS), functools.partial(torch.optim.AdamW, lr=LR), state_policy=RESUME_POLICY
    )
    ddp, prepared_opt, dl = acc.prepare(model, opt, loader(acc.num_processes * GA * RESUME_STEPS))
    return acc, model, ddp, prepared_opt, dl


def tear_on_node1(saved: list[str]) -> None:
    """The last save never completed on node 1 (its marker is missing there), only on node 0."""
    if os.environ["GROUP_RANK"] == "1" and os.environ["LOCAL_RANK"] == "0":
        os.remove(os.path.join(saved[-1], checkpoints.COMPLETE_MARKER))


def _train(acc: PhasedAccelerator, ddp: Any, opt: Any, batches: Any, save_at: tuple[int, ...] = ()) -> list[str]:
    """Train to RESUME_STEPS; save at each step of ``save_at`` (top of an iteration: a step boundary)."""
    saved: list[str] = []
    for x, y in batches:
        if acc.schedule_step in save_at[len(saved) : len(saved) + 1]:
            saved.append(str(acc.save_state()))
        with acc.accumulate(ddp):
            acc.backward(nn.functional.mse_loss(ddp(x), y))
            opt.step()
            opt.zero_grad()
        if acc.schedule_step >= RESUME_STEPS:
            break
    return saved


def _resume(
    project_dir: Path, on_each_node: bool, folder: str | None, uninterrupted: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A fresh accelerator loads ``folder`` (None: automatic, the latest complete) and trains to the end."""
    acc, model, ddp, opt, dl = _run(project_dir, on_each_node)
    latest = acc.latest_checkpoint()  # a collective: the same answer on every rank
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.load_state(folder)
    except AltParamsError as exc:
        acc.free_memory()
        return {"load_error": str(exc)}
    result: dict[str, Any] = {
        "load_error": "",
        "phase_after_load": acc.phase.name if acc.phase else None,
        "step_after_load": acc.schedule_step,
        "latest_checkpoint": os.path.basename(latest) if latest else None,
        "next_save_iteration": acc.project_configuration.iteration,
        "load_warnings": [str(w.message) for w in caught if "load_state" in str(w.message)],
    }
    _train(acc, ddp, opt, acc.skip_first_batches(dl, GA * acc.schedule_step))
    state = model.state_dict()
    result.update(
        resumed_steps=acc.schedule_step,
        resumed_sha256=state_sha(model),
        bitwise_equal_to_uninterrupted=all(torch.equal(state[k], uninterrupted[k]) for k in uninterrupted),
        max_abs_diff=max(float((state[k] - uninterrupted[k]).abs().max()) for k in uninterrupted),
    )
    acc.free_memory()
    return result


def checkpoint_scenario(
    project_dir: Path,
    on_each_node: bool,
    save_at: tuple[int, ...] = (SAVE_AT,),
    resume_from: tuple[int | None, ...] = (None,),
    before_resume: Callable[[list[str]], None] | None = None,
) -> dict[str, Any]:
    """The uninterrupted run saving at ``save_at``; ``before_resume(saved folders)``; then one resume per
    ``resume_from`` entry (an index into the saves, or None: ``load_state()`` with automatic naming)."""
    WRITES.clear()
    acc, model, ddp, opt, dl = _run(project_dir, on_each_node)
    saved = _train(acc, ddp, opt, dl, save_at=save_at)
    uninterrupted = {k: v.clone() for k, v in model.state_dict().items()}
    result: dict[str, Any] = {
        "saved": saved,
        "writes": list(WRITES),
        "writes_state_files": writes_state_files(acc),
        "uninterrupted_sha256": state_sha(model),
        "steps": acc.schedule_step,
    }
    acc.wait_for_everyone()
    result["files_seen"] = sorted(os.listdir(saved[0])) if saved and os.path.isdir(saved[0]) else []
    if before_resume is not None:
        before_resume(saved)
    acc.wait_for_everyone()
    acc.free_memory()
    result["resumes"] = [
        _resume(project_dir, on_each_node, None if i is None else saved[i], uninterrupted) for i in resume_from
    ]
    return result


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=90))  # Accelerate adopts it
    node_dir = out / f"node{os.environ['GROUP_RANK']}"
    node_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    acc = PhasedAccelerator(Alternating(["l0", "l1"]))
    results["ranks"] = ranks_scenario(acc)
    # the engine alone (plain DDP + PhaseSwitcher), every schedule kind of engine_check.py
    results["engine"] = engine_check.run_cases(node_dir, dist.get_rank(), dist.get_world_size())
    results["ga1"] = equivalence("ga1", Alternating({"l0": 2, "l1": 1, "head": 1}), ga=1, clip=None, out=node_dir)
    results["per_task"] = per_task_scenario()
    results["each_node"] = checkpoint_scenario(
        node_dir / "each_node", on_each_node=True, save_at=(SAVE_AT, SAVE_AT + 1), before_resume=tear_on_node1
    )
    # saves at step 3 (phase boundary) and 4 (mid-phase); resumes from the first, then from the latest
    results["shared"] = checkpoint_scenario(
        out / "shared", on_each_node=False, save_at=(SAVE_AT, SAVE_AT + 1), resume_from=(0, None)
    )
    results["main_only_separate"] = checkpoint_scenario(node_dir / "main_only", on_each_node=False)
    write_rank_result(out, results)


if __name__ == "__main__":
    try:
        main()
    finally:
        shutdown()  # let the gloo threads finish, then destroy the group
