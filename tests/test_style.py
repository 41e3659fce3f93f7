"""The code passes ruff, lint and format (settings in ruff.toml); ``bash tools/style.sh`` applies both.

``ruff check`` (pycodestyle, pyflakes, import order, pyupgrade, bugbear) and
``ruff format --check`` over :data:`PATHS`; a failure names each file and
what to run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What ruff checks (tools/style.sh fixes the same paths).
PATHS = ("hf_altparams", "tests", "examples", "benchmarks", "typings")

pytestmark = pytest.mark.style


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *PATHS], cwd=ROOT, capture_output=True, text=True)


def test_ruff_lint_finds_nothing() -> None:
    result = _ruff("check", "--no-fix", "--output-format", "concise")
    findings = [line for line in result.stdout.splitlines() if re.match(r"\S+:\d+:\d+: ", line)]
    files = sorted({line.split(":", 1)[0] for line in findings})
    assert result.returncode == 0, (
        f"ruff check: {len(findings)} finding(s) in {len(files)} file(s): {files}; `bash tools/style.sh` fixes "
        f"what ruff can, the rest needs a hand:\n" + "\n".join(findings or [result.stdout + result.stderr])
    )


def test_ruff_format_changes_nothing() -> None:
    result = _ruff("format", "--check", "--output-format", "concise")  # `path:line:col: unformatted: ...`
    files = sorted({line.split(":", 1)[0] for line in result.stdout.splitlines() if ": unformatted" in line})
    assert result.returncode == 0, (
        f"ruff format would reformat {len(files)} file(s): {files}; run `bash tools/style.sh`"
        + ("" if files else f"\n{result.stdout}{result.stderr}")
    )
