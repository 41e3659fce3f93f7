"""Fixtures for the integration tests that build an Accelerator or a Trainer inside the test process."""

from __future__ import annotations

from typing import Iterator

import pytest

from hf_altparams.integrations import accelerate_internals


@pytest.fixture
def fresh_accelerate_state() -> Iterator[None]:
    """Accelerate's process-wide state forgotten before and after the test: each Accelerator reads its own settings.

    (``os.environ``, where Accelerate also writes settings, is put back by ``tests/conftest.py``.)
    """
    accelerate_internals.fresh_accelerator_state(partial=True)
    yield
    accelerate_internals.fresh_accelerator_state(partial=True)
