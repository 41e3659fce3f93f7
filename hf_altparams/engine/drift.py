"""The drift check: do all ranks still hold the same weights? One small all-gather says, per group.

Data-parallel ranks must hold bit-identical weights; nothing in DDP checks it.
A rank drifts when something updates its weights alone: a gradient DDP never
reduced (``requires_grad`` turned on outside the schedule), user code writing
weights on one rank (an EMA, a load), a faulty kernel, a bit flip. A checkpoint
written then holds rank 0's weights while the other ranks train on others.

:func:`check_drift` digests every parameter of the model (all of them, trainable
or not; :mod:`.digest`: exact integer sums of the raw bytes, one memory pass),
per group (plus ``(ungrouped)``), and compares the digests across ranks in one
all-gather of a few int64 per group. When they differ, every rank raises the
same :class:`~hf_altparams.errors.DriftError`, naming the groups and the ranks
that differ. It runs where :class:`DriftCheck` says (``PhaseSwitcher(drift_check=...)``):
before every checkpoint of the integrations by default, optionally after every
switch or every N optimizer steps. Single process: nothing to compare, no-op.

What is compared:

* **parameters**, by value: every rank must hold the same bytes;
* **not buffers**: under DDP they legitimately differ between broadcasts (each
  rank's norm layers update their running statistics from their own batch after
  DDP broadcast rank 0's at the start of the forward; ``buffer_sync="auto"``
  stops broadcasting frozen ones), so they cannot be compared as weights are;
* **FSDP2** (``DTensor`` parameters): each rank digests its local shard, and
  shards are compared only between ranks that should hold the same one: the
  ranks with the same coordinates on the mesh dimensions a parameter is
  sharded on (HSDP replicas). With one shard per rank (``fully_shard`` on a
  1-D mesh, Accelerate's FSDP2) each element lives on exactly one rank, so
  there is no copy that could drift and nothing to compare for sharded
  parameters; plain (unsharded) parameters are still compared.

The digest's cost is a memory-bound pass over the weights (a few tens of ms per
GiB on a CPU core, far less on a GPU); ``benchmarks/RESULTS.md`` puts it next
to a training step of the same model.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from ..errors import AltParamsError, Cause, DriftError, PlanError
from ..plan.groups import ParamGroups
from .collective import gather_rows, is_distributed
from .digest import combine, digest_many, digest_values
from .fsdp2 import is_dtensor, local_tensor

__all__ = [
    "UNGROUPED",
    "DriftCheck",
    "DriftSetting",
    "check_drift",
    "check_drift_setting",
    "find_drift",
    "local_digests",
]

#: The entry of parameters in no group.
UNGROUPED = "(ungrouped)"

#: ``"save"``, ``"switch"``, a positive int N, or ``False`` (see :class:`DriftCheck`).
DriftSetting = Union[str, int, bool]

_NOTHING = -1  # the shard key of an entry with no sharded parameter


def check_drift_setting(setting: object) -> None:
    """Validate the ``drift_check`` setting: ``"save"``, ``"switch"``, a positive int, or ``False``."""
    valid = (
        setting in ("save", "switch")
        if isinstance(setting, str)
        else setting is False or (isinstance(setting, int) and not isinstance(setting, bool) and setting >= 1)
    )
    if not valid:
        raise PlanError(
            f"`drift_check` must be 'save' (before every checkpoint, the default), 'switch' (also after every "
            f"phase switch), a positive int N (also every N optimizer steps) or False (never), got {setting!r}"
        )


class DriftCheck:
    """When the drift check runs: the ``drift_check`` setting of :class:`~hf_altparams.engine.PhaseSwitcher`.

    Args:
        setting: ``"save"`` (default): before every checkpoint written through
            the integrations (``PhasedAccelerator.save_state``, the Trainer's
            saves with ``AlternatingFreeze``). ``"switch"``: also right after
            every phase switch. An int ``N`` >= 1: also every ``N`` optimizer
            steps (at the step boundary where ``step % N == 0``). ``False``:
            never, not even before a checkpoint.

    Raises:
        PlanError: any other value, naming the accepted ones.

    Example:
        >>> DriftCheck("save").at_save, DriftCheck(False).at_save
        (True, False)
        >>> every4 = DriftCheck(4)
        >>> every4.due_at_step(8), every4.due_at_step(8), every4.due_at_step(6), DriftCheck("switch").after_switch
        (True, False, False, True)
    """

    def __init__(self, setting: DriftSetting = "save") -> None:
        check_drift_setting(setting)
        self.setting: DriftSetting = setting
        self._checked_at: Optional[int] = None  # the step of the last every-N check (a step asked twice: once)

    @property
    def at_save(self) -> bool:
        """Whether checkpoints are checked (every setting but ``False``)."""
        return self.setting is not False

    @property
    def after_switch(self) -> bool:
        return self.setting == "switch"

    def due_at_step(self, step: Optional[int]) -> bool:
        """Whether the every-N-steps check is due at optimizer-step boundary ``step`` (once per step)."""
        every = self.setting
        due = (
            isinstance(every, int)
            and not isinstance(every, bool)
            and step is not None
            and step > 0
            and step % every == 0
            and step != self._checked_at
        )
        if due:
            self._checked_at = step
        return due


def _entries(groups: ParamGroups) -> list[str]:
    return [*groups.names, UNGROUPED]


def _shard_key(param: torch.Tensor) -> Optional[tuple[int, ...]]:
    """``None`` for a tensor every rank holds whole; else this rank's coordinates on the sharded mesh dims."""
    if not is_dtensor(param):
        return None
    placements = list(param.placements)  # type: ignore[attr-defined]
    if all(p.is_replicate() for p in placements):
        return None
    coordinate = param.device_mesh.get_coordinate()  # type: ignore[attr-defined]
    if coordinate is None:  # this rank is outside the parameter's mesh
        return (-2,)
    return tuple(c for c, p in zip(coordinate, placements) if not p.is_replicate())


def local_digests(groups: ParamGroups) -> list[int]:
    """This rank's row: per entry (groups, then ``(ungrouped)``), the digests of its parameters.

    Three ints per entry: the digest of the parameters every rank holds whole,
    the digest of its sharded parameters' local shards, and the key saying which
    ranks must hold the same shards (``-1``: none sharded). The module's
    parameters are read as they are now (a parameter object replaced since the
    groups were built is read, not the old one).
    """
    entries = _entries(groups)
    index = {name: i for i, name in enumerate(entries)}
    whole: list[list[torch.Tensor]] = [[] for _ in entries]
    sharded: list[list[torch.Tensor]] = [[] for _ in entries]
    keys: list[list[tuple[int, ...]]] = [[] for _ in entries]
    for name, param in groups.module.named_parameters():
        try:
            group = groups.group_of(name)
        except PlanError:  # a parameter added after the groups were built
            group = None
        slot = index[UNGROUPED if group is None else group]
        key = _shard_key(param)
        if key is None:
            whole[slot].append(local_tensor(param.detach()))
        else:
            sharded[slot].append(local_tensor(param.detach()))
            keys[slot].append(key)
    parts = [digest_many(tensors) for tensors in (*whole, *sharded)]  # few kernels: small tensors concatenated
    values = iter(digest_values([d for part in parts for d in part]))
    resolved = [[next(values) for _ in part] for part in parts]
    row: list[int] = []
    for i in range(len(entries)):
        row.append(combine(resolved[i]))
        row.append(combine(resolved[len(entries) + i]))
        row.append(combine(keys[i]) if keys[i] else _NOTHING)
    return row


def _odd_ones(values: Sequence[int]) -> list[int]:
    """The positions whose value is not the reference (the most common value; ties: the first)."""
    counts: dict[int, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    reference = max(counts, key=lambda v: (counts[v], -values.index(v)))
    return [i for i, v in enumerate(values) if v != reference]


def find_drift(entries: Sequence[str], rows: Sequence[Sequence[int]]) -> dict[str, list[int]]:
    """Which ranks differ, per entry: ``{entry: [ranks that differ from the others]}`` (empty: none).

    ``rows`` are every rank's :func:`local_digests`, in rank order. Whole
    parameters are compared across all ranks; sharded ones between the ranks
    with the same shard key. The reference is the value most ranks hold (on a
    tie, the lowest rank's).

    Example:
        >>> find_drift(["a", "b"], [[1, 0, -1, 2, 0, -1], [1, 0, -1, 3, 0, -1]])
        {'b': [1]}
        >>> find_drift(["a"], [[1, 5, 7], [1, 6, 8]])  # different shards: nothing to compare
        {}
    """
    out: dict[str, list[int]] = {}
    for i, entry in enumerate(entries):
        odd = set(_odd_ones([row[3 * i] for row in rows]))
        by_key: dict[int, list[int]] = {}
        for rank, row in enumerate(rows):
            if row[3 * i + 2] != _NOTHING:
                by_key.setdefault(row[3 * i + 2], []).append(rank)
        for ranks in by_key.values():
            if len(ranks) > 1:
                odd.update(ranks[j] for j in _odd_ones([rows[r][3 * i + 1] for r in ranks]))
        if odd:
            out[entry] = sorted(odd)
    return out


def check_drift(
    groups: ParamGroups,
    group: Optional[dist.ProcessGroup] = None,
    *,
    when: str,
    refused: str = "",
    timeout: Optional[float] = None,
) -> None:
    """Raise the same :class:`~hf_altparams.errors.DriftError` on every rank unless all hold the same weights.

    A collective: call it on every rank of ``group`` (default: the world) at the
    same point. Single process: returns at once.

    Args:
        groups: the groups of the model (their module is digested, all of it).
        group: the process group of the ranks that must agree.
        when: where the run is, for the message (``"before save_state at step 4"``).
        refused: what was refused, for the message (``"nothing was written"``).
        timeout: seconds to wait for the other ranks (``None``: the group's timeout).

    Example:
        >>> from hf_altparams.plan import ParamGroups
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> check_drift(ParamGroups(net, {"a": "0.*"}), when="now")  # one process: nothing to compare
    """
    if not is_distributed(group):
        return
    entries = _entries(groups)
    row = local_digests(groups)
    try:
        rows = gather_rows(row, group, timeout)
    except RuntimeError as exc:  # torch.distributed's errors: a rank died or hangs
        raise AltParamsError(
            f"the drift check {when}: rank {dist.get_rank()} of {dist.get_world_size(group)} got no answer from the "
            f"other ranks in its all-gather ({type(exc).__name__}: {str(exc).strip()[:300]}); a rank died, hangs or "
            "skipped this point (every rank must reach it: a save, a switch); stop the job and restart it from the "
            "latest complete checkpoint (docs/faults.md)",
            cause=Cause.RANK_LOST,
        ) from exc
    drift = find_drift(entries, rows)
    if drift:
        raise DriftError(drift_message(drift, len(rows), when, refused))


def drift_message(drift: dict[str, list[int]], world: int, when: str, refused: str = "") -> str:
    """The error text (built from gathered data only: the same on every rank).

    Example:
        >>> print(drift_message({"b": [1]}, 2, "before save_state at step 4", "nothing was written")[:89])
        the ranks hold different weights before save_state at step 4: group 'b' differs on rank 1
    """
    parts = [
        f"{'group ' + repr(e) if e != UNGROUPED else 'the ungrouped parameters'} differs on "
        f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
        for e, r in drift.items()
    ]
    others = sorted(set(range(world)) - {r for ranks in drift.values() for r in ranks})
    against = f" (compared with rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})" if others else ""
    return (
        f"the ranks hold different weights {when}: {'; '.join(parts)}{against}. "
        f"{refused + '. ' if refused else ''}"
        "Data-parallel ranks must hold identical weights; once they differ, the run trains a different model on "
        "each rank and a checkpoint would keep only one of them. Likely causes: a parameter outside the phase got "
        "a gradient on some ranks and an optimizer stepped it (`requires_grad` set outside the schedule: "
        "`model.requires_grad_(True)`, peft's `set_adapter`, `prepare_model_for_kbit_training`); code that writes "
        "weights on some ranks only (an EMA, a load, an edit under `if rank == 0`); a non-deterministic or faulty "
        "kernel, or a bit flip. Restart from the latest complete checkpoint (docs/faults.md)."
    )
