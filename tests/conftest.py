"""Session-wide test settings: offline, CPU-only, quiet tokenizers.

Set at import, before any test module imports transformers or datasets, which
read these variables once.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Iterator

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in each test process, as every launched rank has (``OMP_NUM_THREADS=1``).

    CI runs two test processes on two cores (pytest-xdist) next to the ranks they launch; a second
    intra-op thread per process only oversubscribes the cores, and its spinning costs more CPU than
    the tiny in-process models gain (an in-process check run: 8.5 CPU-s with two threads, 3.0 with one).
    A test that needs more threads sets them itself and puts the count back.
    """
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked ``cuda`` on a machine without a CUDA device (CI); gpu.sh runs them."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `bash benchmarks/gpu.sh` on a GPU machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture
def tmp_out(tmp_path: Path) -> Path:
    """An empty folder for launched scripts' ``rank{r}.json`` results."""
    out = tmp_path / "out"
    out.mkdir()
    return out


@pytest.fixture(autouse=True)
def restore_environment() -> Iterator[None]:
    """Put ``os.environ`` back after each test: Accelerate writes settings there as a side effect (an FSDP
    plugin sets ``ACCELERATE_USE_FSDP=true``), and the next test's Trainer or Accelerator would read them."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def imports_frozen() -> Iterator[None]:
    """For a module of in-process Trainer runs: the objects alive before its first test are left out of collections.

    Every ``Trainer.train()`` runs a full ``gc.collect()`` (Accelerate's ``free_memory``), which walks every object
    of torch, transformers and pytest: about half a CPU-second a run. Frozen (``gc.freeze``) for the module, they
    are not walked; what the tests make is still collected, and the module's end gives them back (``gc.unfreeze``).
    """
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()
