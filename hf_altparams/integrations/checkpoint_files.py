"""What a checkpoint folder of hf_altparams holds and how it is checked: markers, manifests, pruning, membership.

Shared by both integrations' checkpoints (:mod:`.accelerate_checkpoints`,
:mod:`.trainer_checkpoints`):

* **atomic writes** (:func:`write_atomically`): a JSON file is written to a
  temporary name and renamed, so a reader sees the old file or the whole new
  one, never a part;
* **the completion marker and its manifest**: a marker says the save ran to its
  end; it does not say the files are still there. So the marker records every
  file of the folder with its size (:func:`manifest`), and a load first checks
  them (:func:`manifest_problem`): a file deleted or truncated since (a disk
  that filled up, a partial copy, a cleanup script) is refused by name, before
  torch or Accelerate reads anything (Accelerate, missing
  ``model.safetensors``, would look for ``pytorch_model.bin`` and name that).
  Sizes, not contents: reading every byte back would cost as much as the load;
* **pruning** (:func:`prune`): the ``total_limit`` of automatic checkpoint
  naming, counted in complete checkpoints (Accelerate counts every folder,
  torn ones included, and deletes before it saves, so torn folders could push
  out the last complete one);
* **group membership** (:func:`membership`, :func:`membership_difference`): a
  resume with other groups trains other parameters at the saved schedule
  position: the same step now unfreezes another layer, and the optimizer state
  of one group lands on another's parameters (refused by torch only when the
  shapes differ: under Adam, by luck; under SGD without momentum, never). So
  both integrations save the membership (group -> parameter names) and refuse,
  naming the groups that differ, a resume whose groups are not the saved ones,
  whatever the optimizer. Names are compared as the user's model names them:
  the parts wrappers insert (activation checkpointing, ``torch.compile``) are
  dropped, so a checkpoint saved under FSDP2 compares equal with the same
  groups on the plain model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Iterable, Mapping, Optional

from ..plan.groups import ParamGroups
from .fsdp2 import canonical_name

__all__ = [
    "COMPLETE_MARKER",
    "manifest",
    "manifest_problem",
    "membership",
    "membership_difference",
    "numbered_folders",
    "prune",
    "remove_file",
    "write_atomically",
]

#: File written last by a save (both integrations), once every rank has written its part.
COMPLETE_MARKER = "hf_altparams_complete.json"

_TEMPORARY = re.compile(r".*\.tmp[0-9]+$")  # write_atomically's temporary files


def write_atomically(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` as JSON to ``path``: readers see the old file or the whole new one, never a part."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def manifest(folder: str, skip: Iterable[str] = ()) -> dict[str, int]:
    """Every file under ``folder`` (relative path, ``/``-separated) with its size in bytes.

    ``skip``: top-level names left out (the marker itself); temporary files of
    atomic writes are left out too.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "sub").mkdir()
        >>> _ = (d / "a.bin").write_bytes(b"123"); _ = (d / "sub" / "b").write_bytes(b"")
        >>> manifest(str(d))
        {'a.bin': 3, 'sub/b': 0}
    """
    skipped = set(skip)
    found: dict[str, int] = {}
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder).replace(os.sep, "/")
            if relative in skipped or _TEMPORARY.fullmatch(name):
                continue
            found[relative] = os.path.getsize(path)
    return found


def manifest_problem(folder: str, files: Mapping[str, int]) -> Optional[str]:
    """Why ``folder`` no longer holds what its marker recorded (``None``: every file, at its size).

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); _ = (d / "model.safetensors").write_bytes(b"12")
        >>> manifest_problem(str(d), {"model.safetensors": 2}) is None
        True
        >>> manifest_problem(str(d), {"model.safetensors": 5, "optimizer.bin": 9})
        "its file 'model.safetensors' has 2 bytes where the save wrote 5 (truncated or replaced since), and 'optimizer.bin' is missing"
    """
    problems = []
    for relative, size in sorted(files.items()):
        path = os.path.join(folder, *relative.split("/"))
        if not os.path.isfile(path):
            problems.append(f"{relative!r} is missing")
        elif os.path.getsize(path) != size:
            problems.append(
                f"{relative!r} has {os.path.getsize(path)} bytes where the save wrote {size} "
                "(truncated or replaced since)"
            )
    if not problems:
        return None
    return (
        f"its file {problems[0]}"
        + "".join(f", and {p}" for p in problems[1:3])
        + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    )


def remove_file(path: str) -> None:
    """Remove ``path`` if it exists (a marker about to become stale)."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def numbered_folders(parent: str, prefix: str) -> list[tuple[int, str]]:
    """Every ``{prefix}<n>`` folder in ``parent``, complete or not, as ``(n, path)`` (none: ``[]``)."""
    found = []
    for name in os.listdir(parent) if os.path.isdir(parent) else []:
        match = re.fullmatch(re.escape(prefix) + r"([0-9]+)", name)
        if match and os.path.isdir(os.path.join(parent, name)):
            found.append((int(match.group(1)), os.path.join(parent, name)))
    return found


def prune(numbered: Iterable[tuple[int, str]], complete: Iterable[int], newest: int, limit: int) -> list[str]:
    """Delete what ``total_limit=limit`` lets go once checkpoint ``newest`` is complete; the deleted folders.

    ``numbered``: every ``(n, folder)``; ``complete``: the ``n`` whose save
    completed. Kept: the ``limit`` newest complete checkpoints (``newest``
    among them) and every folder above ``newest``. Deleted: the older complete
    ones, and every torn folder below ``newest`` (no load accepts it). So a torn
    folder never takes the place of a complete one, and the last complete
    checkpoint is deleted only after a newer one is complete.

    Example:
        >>> import tempfile, os
        >>> root = tempfile.mkdtemp()
        >>> folders = [(n, os.path.join(root, f"checkpoint_{n}")) for n in range(4)]
        >>> for _, f in folders: os.mkdir(f)
        >>> [os.path.basename(f) for f in prune(folders, complete={0, 3}, newest=3, limit=2)]
        ['checkpoint_1', 'checkpoint_2']
        >>> [os.path.basename(f) for f in prune(folders[:1] + folders[3:], complete={0, 3}, newest=3, limit=1)]
        ['checkpoint_0']
    """
    numbered, done = list(numbered), set(complete)
    keep = set(sorted((n for n, _ in numbered if n in done and n <= newest), reverse=True)[:limit])
    deleted = []
    for n, folder in sorted(numbered):
        if n < newest and n not in keep:
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(folder)
    return deleted


def membership(groups: ParamGroups) -> dict[str, list[str]]:
    """``{group: [parameter names]}`` in definition order (what a checkpoint records).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> membership(ParamGroups(net, {"a": "0.*", "b": "1.weight"}))
        {'a': ['0.weight', '0.bias'], 'b': ['1.weight']}
    """
    return {g: [canonical_name(n) for n in groups.param_names(g)] for g in groups.names}


def _preview(names: list[str]) -> str:
    return repr(names[:3])[:-1] + (f", ... {len(names) - 3} more]" if len(names) > 3 else "]")


def membership_difference(saved: Mapping[str, Any], groups: ParamGroups) -> Optional[str]:
    """How ``groups`` differ from the ``saved`` membership (``None``: the same groups, the same parameters).

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> now = ParamGroups(net, {"a": "0.*", "b": "1.*"})
        >>> membership_difference(membership(now), now) is None
        True
        >>> print(membership_difference({"a": ["1.weight", "1.bias"], "b": ["0.weight", "0.bias"]}, now))
        group 'a' held ['1.weight', '1.bias'] in the checkpoint only and holds ['0.weight', '0.bias'] now only; group 'b' held ['0.weight', '0.bias'] in the checkpoint only and holds ['1.weight', '1.bias'] now only
    """
    mine = membership(groups)
    parts = []
    for group in [*saved, *(g for g in mine if g not in saved)]:
        before, now = saved.get(group), mine.get(group)
        if before is None:
            parts.append(f"group {group!r} is new (not in the checkpoint)")
        elif now is None:
            parts.append(f"group {group!r} of the checkpoint is gone")
        elif [canonical_name(n) for n in before] != now:
            lost = [n for n in before if canonical_name(n) not in set(now)]
            gained = [n for n in now if n not in {canonical_name(m) for m in before}]
            bits = ([f"held {_preview(lost)} in the checkpoint only"] if lost else []) + (
                [f"holds {_preview(gained)} now only"] if gained else []
            )
            parts.append(f"group {group!r} " + (" and ".join(bits) or "holds the same parameters in another order"))
    return "; ".join(parts) or None
