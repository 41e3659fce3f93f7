"""What :meth:`PhasedAccelerator.save_state` does around Accelerate's save.

Before anything is written:

1. the drift check (:meth:`~hf_altparams.engine.PhaseSwitcher.check_weights`,
   unless ``drift_check=False``): ranks holding different weights get a
   :class:`~hf_altparams.errors.DriftError` on every rank, and nothing is
   written (an older checkpoint in the same folder stays complete);
2. the completion marker an earlier save left in the target folder
   (``save_state("latest")`` again) is removed by every process that writes
   markers, then a barrier: from then on a save killed part-way leaves a
   folder without a marker, never one whose old marker vouches for new files;
3. ``ProjectConfiguration(total_limit=N)`` with automatic naming is set aside
   for Accelerate's save, which would count torn folders and delete the
   oldest ones before saving (the last complete checkpoint among them).

After the marker: :func:`after_save` keeps the N newest complete checkpoints
and deletes older ones and torn ones below the new checkpoint
(:func:`~._checkpoint_files.prune`), so at most N + 1 folders exist while a
save runs, and the last complete checkpoint goes only once a newer one is
complete.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Iterator, Optional

from ._checkpoint_files import COMPLETE_MARKER, numbered_folders, prune, remove_file

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ..engine.switch import PhaseSwitcher

__all__ = ["after_save", "before_save", "save_target", "total_limit_counted_by_us", "writes_state_files"]


def writes_state_files(acc: Accelerator) -> bool:
    """Whether this process writes the state file and the marker (the main one; per node with ``save_on_each_node``)."""
    on_each_node = acc.project_configuration.save_on_each_node
    return bool(acc.is_main_process or (on_each_node and acc.is_local_main_process))


def save_target(acc: Accelerator, output_dir: Optional[str]) -> Optional[str]:
    """The folder Accelerate's ``save_state(output_dir)`` is about to write."""
    config = acc.project_configuration
    if config.automatic_checkpoint_naming:
        return os.path.join(acc.project_dir, "checkpoints", f"checkpoint_{config.iteration}")
    return None if output_dir is None else os.path.expanduser(str(output_dir))


def before_save(acc: Accelerator, switcher: PhaseSwitcher, output_dir: Optional[str]) -> Optional[int]:
    """Steps 1 and 2 of the module docstring, on every rank; returns the ``total_limit`` set aside (or ``None``)."""
    if switcher.drift.at_save:
        switcher.check_weights(f"before save_state at step {switcher.driver.step}",
                               "save_state refused: nothing was written")
    target = save_target(acc, output_dir)
    if target is not None and writes_state_files(acc):
        remove_file(os.path.join(target, COMPLETE_MARKER))
    acc.wait_for_everyone()  # no rank writes into the folder while its old marker stands
    config = acc.project_configuration
    return config.total_limit if config.automatic_checkpoint_naming else None


@contextlib.contextmanager
def total_limit_counted_by_us(acc: Accelerator, limit: Optional[int]) -> Iterator[None]:
    """Within the block Accelerate sees no ``total_limit`` (step 3); restored after, whatever happens."""
    if limit is None:
        yield
        return
    config = acc.project_configuration
    config.total_limit = None
    try:
        yield
    finally:
        config.total_limit = limit


def after_save(acc: Accelerator, location: str, limit: Optional[int]) -> None:
    """Once ``location`` is complete: delete what ``total_limit`` lets go (each process that writes markers)."""
    if limit is None or not writes_state_files(acc):
        return
    checkpoints_dir = os.path.dirname(os.path.abspath(location))
    numbered = numbered_folders(checkpoints_dir, "checkpoint_")
    complete = {n for n, folder in numbered if os.path.isfile(os.path.join(folder, COMPLETE_MARKER))}
    newest = int(os.path.basename(os.path.abspath(location)).rpartition("_")[2])
    prune(numbered, complete, newest, max(int(limit), 1))
