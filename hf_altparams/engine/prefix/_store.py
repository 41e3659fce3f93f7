"""Per-sample activation store: host memory up to a budget, then a memory-mapped file.

Rows are keyed by the dataset index of their sample. Memory holds any row shape;
the disk tier holds rows of one shape and dtype (the first spilled row fixes
them; a row of another shape that does not fit in memory is not stored and
simply misses again). Each process owns its store: under DDP every rank keeps
the rows of the samples it saw, in its own file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["ActivationStore"]


class ActivationStore:
    """Rows of activations by sample index, in memory then on disk.

    Args:
        memory_budget_bytes: bytes of rows held in host memory before spilling to
            disk (``None``: no limit; ``0``: everything on disk).
        disk_dir: folder for the memory-mapped file (a fresh temporary folder
            inside it, removed by :meth:`clear`); ``None``: the system's temp dir.

    Example:
        >>> store = ActivationStore(memory_budget_bytes=16)
        >>> store.put([3, 5], torch.arange(8.0).reshape(2, 4))
        >>> store.get([5, 3]).tolist(), store.memory_bytes, store.disk_bytes
        ([[4.0, 5.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0]], 16, 16)
        >>> store.get([3, 9]) is None
        True
        >>> store.clear(); len(store)
        0
    """

    def __init__(self, memory_budget_bytes: Optional[int] = None, disk_dir: Optional[str] = None) -> None:
        self.memory_budget_bytes = memory_budget_bytes
        self.disk_dir = disk_dir
        self._memory: dict[int, torch.Tensor] = {}
        self.memory_bytes = 0
        self._slots: dict[int, int] = {}
        self._row: Optional[tuple[tuple[int, ...], torch.dtype, int]] = None  # shape, dtype, nbytes
        self._map: Optional[np.memmap] = None
        self._folder: Optional[str] = None
        self.skipped_rows = 0

    # ------------------------------------------------------------------ size
    def __len__(self) -> int:
        return len(self._memory) + len(self._slots)

    def __contains__(self, index: int) -> bool:
        return index in self._memory or index in self._slots

    @property
    def disk_bytes(self) -> int:
        """Bytes of rows held in the memory-mapped file."""
        return 0 if self._row is None else len(self._slots) * self._row[2]

    @property
    def path(self) -> Optional[str]:
        """The memory-mapped file, once something was spilled."""
        return None if self._folder is None else os.path.join(self._folder, "rows.bin")

    # ------------------------------------------------------------------ rows
    def put(self, indices: Sequence[int], rows: torch.Tensor) -> None:
        """Store ``rows[j]`` (moved to host memory) under ``indices[j]``; known indices are kept."""
        for j, index in enumerate(indices):
            if index in self:
                continue
            row = rows[j].detach().to("cpu").clone()  # not a view: the batch tensor is freed
            size = row.numel() * row.element_size()
            budget = self.memory_budget_bytes
            if budget is None or self.memory_bytes + size <= budget:
                self._memory[index] = row
                self.memory_bytes += size
            elif not self._spill(index, row):
                self.skipped_rows += 1

    def get(self, indices: Sequence[int]) -> Optional[torch.Tensor]:
        """The stacked rows of ``indices`` (on the host), or ``None`` unless all are held with one shape."""
        rows: list[torch.Tensor] = []
        for index in indices:
            row = self._memory.get(index)
            if row is None:
                slot = self._slots.get(index)
                if slot is None:
                    return None
                row = self._read(slot)
            if rows and row.shape != rows[0].shape:
                return None
            rows.append(row)
        return torch.stack(rows) if rows else None

    def clear(self) -> None:
        """Forget every row and delete the file."""
        self._memory.clear()
        self._slots.clear()
        self.memory_bytes = 0
        self._row, self._map = None, None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None

    def __del__(self) -> None:  # the file is a cache: never leave it behind
        try:
            self.clear()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # ------------------------------------------------------------------ disk tier
    def _spill(self, index: int, row: torch.Tensor) -> bool:
        if self._row is None:
            self._row = (tuple(row.shape), row.dtype, row.numel() * row.element_size())
            self._folder = tempfile.mkdtemp(prefix=f"hf_altparams_prefix_{os.getpid()}_", dir=self.disk_dir)
        shape, dtype, nbytes = self._row
        if tuple(row.shape) != shape or row.dtype != dtype:
            return False
        slot = len(self._slots)
        if self._map is None or slot >= self._map.shape[0]:
            self._grow(max(64, 2 * slot))
        assert self._map is not None
        self._map[slot] = row.reshape(-1).view(torch.uint8).numpy()
        self._slots[index] = slot
        return True

    def _grow(self, capacity: int) -> None:
        assert self._row is not None and self.path is not None
        nbytes = self._row[2]
        if self._map is not None:
            self._map.flush()
        self._map = None
        with open(self.path, "ab") as f:
            f.truncate(capacity * nbytes)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r+", shape=(capacity, nbytes))

    def _read(self, slot: int) -> torch.Tensor:
        assert self._map is not None and self._row is not None
        shape, dtype, _ = self._row
        return torch.from_numpy(np.array(self._map[slot])).view(dtype).reshape(shape)
