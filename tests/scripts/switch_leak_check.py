"""Per-step alternation on two gloo ranks: every switch frees the old reducer and buckets, memory stays flat.

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 2 switch_leak_check.py OUT_DIR

Runs :func:`tests.support.switch_leaks.guard_alternation` (which raises on a
reducer or bucket that outlives its switch, or on memory that grows) with
``gradient_as_bucket_view`` off (a probe hook watches the buckets) and on, and
records each report and a digest of the weights, which must be equal on the ranks.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for tests.support

from hf_altparams.testing.launch import write_rank_result  # noqa: E402
from tests.support.digests import param_sha  # noqa: E402
from tests.support.switch_leaks import Alternation, guard_alternation  # noqa: E402


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    digests = []
    for mode, bucket_view in (("copy_grads", False), ("bucket_view", True)):
        rig = Alternation(gradient_as_bucket_view=bucket_view, probe=not bucket_view)
        try:
            out[mode] = guard_alternation(rig).as_dict()
            digests.append(param_sha(rig.model))
        finally:
            rig.close()
    out["digest"] = digests
    write_rank_result(out_dir, out, rank=dist.get_rank())
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
