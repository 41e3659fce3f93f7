"""Exit stress: how many 2-rank CPU runs abort at interpreter exit ("terminate called ...").

Each run trains a tiny model a few steps on 2 gloo ranks and returns from the
script without tearing anything down (see
``tests/scripts/exit_check.py``, run by
:func:`tests.support.exits.repeat_exits`); a rank that dies of SIGABRT
counts as an abort. Scenarios, run one after the other in one command, once per ``--loads``
value (that many busy-loop processes run meanwhile; the abort is a race that
CPU load makes *rarer*, so the quiet pass matters as much as the loaded one):

* ``plain``: plain DDP, no hf_altparams (the baseline: the abort is torch's,
  see :mod:`hf_altparams.engine.shutdown` for the cause);
* ``phased``: a ``PhasedAccelerator`` loop (its exit hook lets the gloo
  threads finish before the interpreter finalizes);
* ``shutdown``: plain DDP ended by ``hf_altparams.engine.shutdown(ddp)``.

Usage::

    python benchmarks/exit_stress.py --runs 100 --other-runs 20 --loads 0 1   # 200 exits of `phased` per load
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _machine import machine  # noqa: E402
from tests.support.exits import repeat_exits  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="runs of `phased` per load level (2 exits each)")
    parser.add_argument("--other-runs", type=int, default=20, help="runs of `plain` and `shutdown` per load level")
    parser.add_argument(
        "--loads", type=int, nargs="+", default=[0, 1], help="busy-loop processes meanwhile, one pass per value"
    )
    parser.add_argument("--scenarios", nargs="+", default=["plain", "phased", "shutdown"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    rows = []
    load_before = os.getloadavg()[0]
    for load in args.loads:
        for mode in args.scenarios:
            runs = args.runs if mode == "phased" else args.other_runs
            tally = repeat_exits(mode, runs, load=load)
            rows.append(
                {
                    "scenario": mode,
                    "load_processes": load,
                    "runs": tally.runs,
                    "exits": 2 * tally.runs,
                    "aborted_runs": tally.aborted,
                    "other_failures": tally.failed,
                    "seconds": round(tally.seconds, 1),
                    "failures": tally.failures[:3],
                }
            )
            print(
                f"{mode} (load {load}): {tally.aborted} aborted / {tally.runs} runs ({2 * tally.runs} exits), "
                f"{tally.failed} other failures, {tally.seconds:.0f} s, loadavg {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    result = {
        "machine": machine("cpu", 2),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg()[0],
        "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "exit_stress.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))


if __name__ == "__main__":
    main()
