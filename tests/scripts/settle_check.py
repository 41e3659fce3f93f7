"""The switch's collectives on three ranks, where one rank can be the odd one out.

Usage (every rank runs it; results go to ``OUT_DIR/rank{r}.json``)::

    python -m torch.distributed.run --nproc_per_node 3 settle_check.py OUT_DIR

With two ranks, "one rank differs" and "half the ranks differ" are the same
case; with three, a rank in the majority must still take the slow path. Each
case calls :func:`hf_altparams.engine.collective.settle` (or ``agree`` /
``any_rank_failed``) directly, with a per-rank phase, refusal or failure, and
records what it returned or raised, so the test can check that every rank
took the same branch with the same text.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch.distributed as dist

from hf_altparams.engine.collective import agree, any_rank_failed, settle
from hf_altparams.errors import SwitchError
from hf_altparams.plan.phase import Phase
from hf_altparams.testing.launch import write_rank_result

A, B = Phase(["a"]), Phase(["b"])


def _outcome(call: Callable[[], Any]) -> dict[str, Any]:
    try:
        return {"returned": call()}
    except SwitchError as exc:
        return {"error": str(exc)}


def main() -> None:
    out_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    last = dist.get_world_size() - 1
    out: dict[str, Any] = {"world_size": dist.get_world_size()}
    out["settle_all_agree"] = _outcome(lambda: list(settle(None, A, 7, None, None)))
    out["settle_last_disagrees"] = _outcome(lambda: list(settle(None, B if rank == last else A, 7, None, None)))
    out["settle_first_disagrees"] = _outcome(lambda: list(settle(None, B if rank == 0 else A, 7, None, None)))
    out["settle_other_step"] = _outcome(
        lambda: list(settle(None, B if rank == 1 else A, 8 if rank == 1 else 7, None, None))
    )
    out["settle_one_refuses"] = _outcome(lambda: list(settle(None, A, 7, "busy" if rank == 1 else None, None)))
    out["settle_all_refuse"] = _outcome(lambda: list(settle(None, A, 7, f"busy on {rank}", None)))
    out["settle_one_fails"] = _outcome(lambda: list(settle(None, A, 7, None, "OOM" if rank == last else None)))
    out["settle_timeout_path"] = _outcome(lambda: list(settle(None, A, 7, None, None, timeout=60.0)))
    out["agree_all"] = _outcome(lambda: agree(None, A, 7, None))
    out["agree_last_disagrees"] = _outcome(lambda: agree(None, B if rank == last else A, 7, None))
    out["agree_one_refuses"] = _outcome(lambda: agree(None, A, 7, "busy" if rank == 0 else None, timeout=60.0))
    out["failed_none"] = _outcome(lambda: any_rank_failed(None, False))
    out["failed_last"] = _outcome(lambda: any_rank_failed(None, rank == last, timeout=60.0))
    # After every slow path above, the ranks are still in step: one more collective pairs up.
    out["in_step_after"] = _outcome(lambda: list(settle(None, A, 9, None, None)))
    write_rank_result(out_dir, out, rank=rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
