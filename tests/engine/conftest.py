"""Fixtures for the engine tests: a one-rank gloo process group inside the test process."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def gloo_world_1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dist.ProcessGroup]:
    """A world-size-1 gloo group (FileStore rendezvous: no port), destroyed after the module."""
    assert not dist.is_initialized(), "another test left a process group behind"
    store_file: Path = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", store=dist.FileStore(str(store_file), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()
