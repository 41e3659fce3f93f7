"""Session-wide test settings: offline, CPU-only, quiet tokenizers.

Set at import, before any test module imports transformers or datasets, which
read these variables once.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"


@pytest.fixture
def tmp_out(tmp_path: Path) -> Path:
    """An empty folder for launched scripts' ``rank{r}.json`` results."""
    out = tmp_path / "out"
    out.mkdir()
    return out
