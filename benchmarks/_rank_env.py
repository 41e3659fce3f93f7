"""The environment a benchmark gives the ranks it launches with :func:`hf_altparams.testing.launch`.

``launch`` keeps every rank on the CPU (``CUDA_VISIBLE_DEVICES=""``), one
thread each, offline; a benchmark also measures GPUs, and its ranks import
``benchmarks/`` and ``tests/`` modules from this checkout whether or not the
library is installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def rank_env(device: str, threads: int = 1) -> dict[str, str]:
    """What to pass as ``launch(..., env=...)`` for ranks on ``device`` (``"cpu"`` or ``"cuda"``).

    On ``"cuda"`` the GPUs this process sees stay visible (``CUDA_VISIBLE_DEVICES`` as set, else every device);
    each rank picks its own by ``LOCAL_RANK``.
    """
    env = {
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }
    if device == "cuda":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible or ",".join(str(i) for i in range(torch.cuda.device_count()))
    return env
