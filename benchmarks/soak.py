"""Soak: 10,000 switches of a random schedule on 2 ranks; ranks bit-identical, RSS flat, history bounded.

The ranks run ``tests/scripts/soak_check.py`` (a tiny trunk /
four blocks / two task heads model under ``PhasedAccelerator``; each step draws
a ``RandomBlocks`` phase or a ``PerTaskCycle`` phase whose other task head is
not resident; per-group ``keep`` / ``offload`` / ``drop`` optimizer state).
This driver launches them (gloo on CPU), then checks:

* the digest of parameters, buffers and optimizer state is the same on every rank;
* RSS (after ``gc.collect()`` and ``malloc_trim``) grows by at most 1 MiB from
  the end of the warm-up to the end;
* the switch history keeps at most its window of records while counting every switch.

Run::

    python benchmarks/soak.py                                  # 10,000 switches, warm-up 2,000
    python benchmarks/soak.py --switches 1000 --warmup 300     # a quick look

It prints a markdown table and writes ``soak_cpu.json`` under ``--out``
(default ``benchmarks/results``). The test suite runs a 300-switch version
(``tests/integrations/test_soak.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from _machine import machine  # noqa: E402  (benchmarks/ is the script's folder)

KIB, MIB = 2**10, 2**20


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=2_000, help="switches before the first RSS reading")
    parser.add_argument("--sample-every", type=int, default=1_000, help="switches between RSS readings")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random schedule")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.switches:
        parser.error(f"--warmup ({args.warmup}) must be between 0 and --switches ({args.switches})")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    from hf_altparams.testing.launch import launch, rank_results
    from tests.scripts import script_path

    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        launch(
            script_path("soak_check.py"),
            tmp,
            "--switches",
            str(args.switches),
            "--warmup",
            str(args.warmup),
            "--sample-every",
            str(args.sample_every),
            "--seed",
            str(args.seed),
            nproc=args.ranks,
            launcher="accelerate",
            timeout=args.timeout,
        )
        ranks = rank_results(tmp, nproc=args.ranks)
    load = (load_before, os.getloadavg()[0])
    identical = len({r["digest"] for r in ranks}) == 1
    bounded = all(r["records_kept"] <= r["window"] < r["switches"] for r in ranks)
    worst = max(r["rss_growth_after_warmup"] for r in ranks)
    lines = [
        f"### {machine('cpu', args.ranks)}; {args.switches} switches of a random schedule (seed {args.seed}), "
        f"warm-up {args.warmup}; 1-min load average {load[0]:.1f} before, {load[1]:.1f} after",
        "",
        "| rank | steps | switches | records kept (window) | phases: random blocks / per task | digest "
        "| RSS growth after warm-up | RSS readings (KiB from the first) | mean switch | mean iteration |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ranks:
        first = r["rss_samples"][0][1]
        readings = ", ".join(f"{(v - first) / KIB:+.0f}" for _, v in r["rss_samples"])
        kinds = r["phase_kinds_per_step"]
        lines.append(
            f"| {r['rank']} | {r['steps']} | {r['switches']} | {r['records_kept']} ({r['window']}) "
            f"| {kinds.get('random_blocks', 0)} / {kinds.get('per_task', 0)} | `{r['digest'][:12]}` "
            f"| {r['rss_growth_after_warmup'] / KIB:+.0f} KiB | {readings} "
            f"| {1e3 * r['switch_seconds_total'] / r['switches']:.2f} ms | {1e3 * r['seconds_total'] / r['steps']:.2f} ms |"
        )
    verdict = (
        f"ranks bit-identical: {'yes' if identical else 'NO'}; history bounded: {'yes' if bounded else 'NO'}; "
        f"RSS growth after warm-up <= 1 MiB: {'met' if worst <= MIB else 'MISSED'} "
        f"(worst {worst / KIB:+.0f} KiB)"
    )
    table = "\n".join([*lines, "", verdict])
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak_cpu.json").write_text(
        json.dumps(
            {
                "machine": machine("cpu", args.ranks),
                "args": vars(args),
                "load_average": load,
                "ranks_bit_identical": identical,
                "history_bounded": bounded,
                "worst_rss_growth_bytes": worst,
                "ranks": ranks,
            },
            indent=1,
        )
    )
    if not (identical and bounded):
        sys.exit(1)


if __name__ == "__main__":
    main()
