"""Where CUDA memory goes: the caching allocator's snapshots, grouped by where each live block was allocated.

torch records, while asked to, the Python stack that allocated each block of
the CUDA caching allocator (``torch.cuda.memory._record_memory_history``) and
returns every segment and block in a snapshot (``torch.cuda.memory._snapshot``).
Both are private torch APIs: :func:`start_recording`, :func:`snapshot` and
:func:`stop_recording` call them inside ``try`` and return a note instead of
failing when they are absent or refuse. The rest is pure: :func:`block_groups`
sums the live blocks of a snapshot by allocation site (the innermost frames and
the innermost frame of this repository), :func:`diff_groups` says which sites
hold more bytes in one snapshot than in another, so a growth between two
readings is attributed to the code that allocated it without another GPU run.
Blocks allocated before recording started have no frames; they form one group.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = [
    "NO_FRAMES",
    "block_groups",
    "diff_groups",
    "site",
    "snapshot",
    "start_recording",
    "stop_recording",
    "top_groups",
]

#: The group of blocks without a recorded stack (allocated before recording, or from C++ only).
NO_FRAMES = "<no Python frames: allocated before recording started, or by a C++ thread (autograd's device thread)>"

#: Path pieces that mark a frame as this repository's code.
_OURS = ("hf_altparams/", "benchmarks/", "tests/")


def _frame(frame: dict[str, Any]) -> str:
    return f"{frame.get('name', '?')} ({str(frame.get('filename', '?')).split('/')[-1]}:{frame.get('line', '?')})"


def site(frames: list[dict[str, Any]], depth: int = 2) -> str:
    """One allocation site: the ``depth`` innermost frames, then the innermost frame of this repository."""
    python = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    if not python:
        return NO_FRAMES
    parts = [_frame(f) for f in python[:depth]]
    ours = next((f for f in python if any(piece in str(f.get("filename", "")) for piece in _OURS)), None)
    if ours is not None and _frame(ours) not in parts:
        parts.append("... " + _frame(ours))
    return " < ".join(parts)


def block_groups(snap: dict[str, Any], depth: int = 2) -> dict[str, dict[str, int]]:
    """Live (``active_allocated``) bytes and block counts of ``snap``, by allocation :func:`site`.

    Example:
        >>> snap = {"segments": [{"blocks": [
        ...     {"size": 512, "state": "active_allocated", "frames": [{"name": "f", "filename": "/x/a.py", "line": 3}]},
        ...     {"size": 512, "state": "inactive", "frames": []}]}]}
        >>> block_groups(snap)
        {'f (a.py:3)': {'bytes': 512, 'blocks': 1}}
    """
    groups: dict[str, dict[str, int]] = {}
    for segment in snap.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            group = groups.setdefault(site(block.get("frames") or [], depth), {"bytes": 0, "blocks": 0})
            group["bytes"] += int(block.get("size", 0))
            group["blocks"] += 1
    return groups


def diff_groups(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], top: int = 10
) -> list[dict[str, Any]]:
    """The sites whose live bytes changed from ``before`` to ``after``, largest change first (``top`` of them).

    Example:
        >>> diff_groups({"x": {"bytes": 10, "blocks": 1}}, {"x": {"bytes": 30, "blocks": 3}, "y": {"bytes": 5, "blocks": 1}})
        [{'site': 'x', 'bytes': 20, 'blocks': 2}, {'site': 'y', 'bytes': 5, 'blocks': 1}]
    """
    rows = []
    for key in set(before) | set(after):
        old, new = before.get(key, {"bytes": 0, "blocks": 0}), after.get(key, {"bytes": 0, "blocks": 0})
        change = new["bytes"] - old["bytes"]
        if change or new["blocks"] != old["blocks"]:
            rows.append({"site": key, "bytes": change, "blocks": new["blocks"] - old["blocks"]})
    rows.sort(key=lambda row: (-abs(row["bytes"]), row["site"]))
    return rows[:top]


def top_groups(groups: dict[str, dict[str, int]], top: int = 10) -> list[dict[str, Any]]:
    """The ``top`` sites of :func:`block_groups` by live bytes."""
    rows = [{"site": key, **value} for key, value in groups.items()]
    rows.sort(key=lambda row: (-row["bytes"], row["site"]))
    return rows[:top]


def start_recording() -> Optional[str]:
    """Record the Python stack of each CUDA allocation from now on; ``None``, or why not (a note)."""
    try:
        import torch

        # "state": stacks of live blocks only (no alloc/free history); Python frames only
        # (C++ frames would need symbolizing, which can take minutes).
        torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
    except Exception as exc:  # a private API: absent, renamed or refusing in this torch
        return f"torch.cuda.memory._record_memory_history unavailable: {type(exc).__name__}: {exc}"
    return None


def snapshot() -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """The caching allocator's snapshot, or ``None`` and why not."""
    try:
        import torch

        return torch.cuda.memory._snapshot(), None
    except Exception as exc:
        return None, f"torch.cuda.memory._snapshot unavailable: {type(exc).__name__}: {exc}"


def stop_recording() -> None:
    """Stop recording stacks (no-op where recording could not start)."""
    try:
        import torch

        torch.cuda.memory._record_memory_history(enabled=None)
    except Exception:  # noqa: S110  (never started, see start_recording's note)
        pass
