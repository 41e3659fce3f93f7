"""glibc's host heap: ``host_heap()`` and the ``mmap_large_host_allocations`` opt-in.

The opt-in changes the whole process for good, so every scenario that calls it
for real runs in a process of its own: a one-rank run forked from the suite's
warm server (``launch_ranks``: torch imported once, not once per scenario;
glibc's heap settings are the defaults there, as in a fresh interpreter), or a
fresh interpreter when this environment sets glibc's malloc variables (they are
dropped for it), or launched ranks; the tests of argument checking replace
glibc with a recorder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from hf_altparams.engine import HostHeap, host_heap, mmap_large_host_allocations
from hf_altparams.engine.memory import MAX_MMAP_THRESHOLD
from hf_altparams.engine.memory import release as memory_module
from hf_altparams.errors import AltParamsError
from hf_altparams.testing import launch, rank_results
from hf_altparams.testing.launch import launch_ranks
from tests.scripts import script_path

MIB = 2**20
REPO = Path(__file__).resolve().parents[2]
RESULT = "HOST-HEAP-RESULT"  # the scenarios' output line (a forked run's output holds its warnings too)
needs_glibc = pytest.mark.skipif(host_heap() is None, reason="needs glibc >= 2.33 (mallinfo2)")

# Free a 20 MiB tensor (mmapped by default: glibc then raises its dynamic
# threshold to ~20 MiB), then create and free a 16 MiB one: the free heap held
# and the RSS, before and after the 16 MiB tensor lived.
_FREED_BLOCK = """
import json, sys, torch
from hf_altparams.engine import host_heap, mmap_large_host_allocations, rss_bytes
applied = mmap_large_host_allocations(1 << 20) if sys.argv[1] == "on" else None
x = torch.ones(5 << 20); del x
held0, rss0 = host_heap().free_bytes, rss_bytes()
y = torch.ones(4 << 20)
rss_live = rss_bytes()
del y
held1, rss1 = host_heap().free_bytes, rss_bytes()
print(_RESULT, json.dumps({"applied": applied, "held": held1 - held0, "rss_live": rss_live - rss0, "rss_after": rss1 - rss0}))
"""


def _malloc_settings(env: dict[str, str]) -> list[str]:
    """The variables of `env` that change glibc's malloc (the fork server would carry them to its ranks)."""
    return [k for k in env if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]


def _python(code: str, *args: str) -> Any:
    """Run ``code`` as a script in a process of its own with glibc's defaults; the JSON it printed after
    ``_RESULT`` (a name the script is given)."""
    script = f"_RESULT = {RESULT!r}\n{code}"
    if not _malloc_settings(dict(os.environ)):
        with tempfile.TemporaryDirectory(prefix="host_heap_") as folder:
            path = Path(folder) / "scenario.py"
            path.write_text(script)
            (rank,) = launch_ranks(path, *args, nproc=1, timeout=120)
        assert rank.returncode == 0, rank.stdout[-3000:]
        output = rank.stdout
    else:
        env = {k: v for k, v in os.environ.items() if k not in _malloc_settings(dict(os.environ))}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env["OMP_NUM_THREADS"] = "1"
        proc = subprocess.run(
            [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        output = proc.stdout
    lines = [line for line in output.splitlines() if line.startswith(RESULT + " ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1][len(RESULT) + 1 :])


@needs_glibc
def test_without_the_opt_in_a_freed_16_mib_tensor_stays_in_the_heap() -> None:
    out = _python(_FREED_BLOCK, "off")
    assert out["rss_live"] >= 15 * MIB  # the tensor was resident
    assert out["held"] >= 15 * MIB, out  # glibc keeps it as free heap ...
    assert out["rss_after"] >= 15 * MIB, out  # ... and the process keeps the pages


@needs_glibc
def test_with_the_opt_in_a_freed_16_mib_tensor_goes_back_to_the_os() -> None:
    out = _python(_FREED_BLOCK, "on")
    assert out["applied"] is True
    assert out["rss_live"] >= 15 * MIB
    assert out["held"] < 1 * MIB, out
    assert out["rss_after"] < 1 * MIB, out


@needs_glibc
def test_glibc_takes_the_largest_threshold_accepted() -> None:
    code = """
import json
from hf_altparams.engine import mmap_large_host_allocations
from hf_altparams.engine.memory import MAX_MMAP_THRESHOLD
print(_RESULT, json.dumps(mmap_large_host_allocations(MAX_MMAP_THRESHOLD)))
"""
    assert _python(code) is True


class _RecordingLibc:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def mallopt(self, param: Any, value: Any) -> int:
        self.calls.append((param.value, value.value))
        return 1


@pytest.mark.parametrize("bad", [True, 1.5, "1M", None, 0, -1, MAX_MMAP_THRESHOLD + 1])
def test_a_bad_threshold_is_refused_before_anything_changes(bad: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _RecordingLibc()
    monkeypatch.setattr(memory_module, "_glibc", lambda: libc)
    with pytest.raises(AltParamsError) as info:
        mmap_large_host_allocations(bad)
    message = str(info.value)
    assert "`threshold`" in message and repr(bad) in message
    assert (
        f"accepted: {'an int number of bytes, ' if not isinstance(bad, int) or bad is True else ''}1 to "
        f"{MAX_MMAP_THRESHOLD}" in message
    )
    assert libc.calls == []


def test_a_good_threshold_reaches_mallopt(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = _RecordingLibc()
    monkeypatch.setattr(memory_module, "_glibc", lambda: libc)
    assert mmap_large_host_allocations(3 * MIB) is True
    assert libc.calls == [(-3, 3 * MIB)]  # M_MMAP_THRESHOLD


def test_without_glibc_both_are_no_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_module, "_glibc", lambda: None)
    assert mmap_large_host_allocations() is False
    assert host_heap() is None
    with pytest.raises(AltParamsError):  # bad input is refused on every platform
        mmap_large_host_allocations(0)


@needs_glibc
def test_host_heap_adds_up() -> None:
    heap = host_heap()
    assert isinstance(heap, HostHeap)
    assert heap.arena_bytes == heap.in_use_bytes + heap.free_bytes > 0


@pytest.mark.distributed
@needs_glibc
def test_per_step_drop_alternation_peaks_at_one_half_alone_with_the_opt_in(tmp_path: Path) -> None:
    """Two 32 MiB halves alternating every step on 2 gloo ranks with ``drop``: the peak of one half alone.

    Without the opt-in (``--mmap-threshold 0``) one rank or both peaked 1.13-1.33x above one half alone.
    """
    launch(
        script_path("mmap_alternation.py"),
        str(tmp_path),
        "--size-mib",
        "32",
        "--mmap-threshold",
        str(MIB),
        nproc=2,
        launcher="forked",
        timeout=300,
    )
    for rank in rank_results(tmp_path, nproc=2):
        assert rank["applied"] is True
        drop, alone = rank["peak_growth_bytes"]["alt_drop"], rank["peak_growth_bytes"]["alone_a"]
        assert alone >= 3 * rank["half_bytes"]  # its gradient (or bucket) and Adam's two moments were measured
        assert drop <= 1.02 * alone, f"rank {rank['rank']}: alt_drop {drop / MIB:.1f} vs alone {alone / MIB:.1f} MiB"
