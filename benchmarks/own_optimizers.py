"""What the user's own optimizers cost next to a GroupedOptimizer, in one process (PhasedAccelerator, CPU).

``prepare(model, opt1, opt2)`` hands back one handle per optimizer; a
post-accumulate-grad hook on every parameter of the groups tells the handles
that a backward ran. This measures, side by side in one run:

* the hook: forward + backward of a model of many tiny parameters (so the
  per-parameter overhead shows), without and with the hooks;
* a training step (forward, backward, step, zero_grad, alternating groups)
  through the handles against the same step through a GroupedOptimizer.

Figures are the minimum over repeats, interleaved (a loaded machine slows both
sides alike)::

    python benchmarks/own_optimizers.py
    python benchmarks/own_optimizers.py --layers 48 --width 512 --repeats 7
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))

from benchmarks._machine import machine  # noqa: E402
from hf_altparams.engine import GroupedOptimizer  # noqa: E402
from hf_altparams.integrations.accelerate import PhasedAccelerator  # noqa: E402
from hf_altparams.integrations.accelerate_prepare import GradientArrivals  # noqa: E402
from hf_altparams.plan import Alternating, ParamGroups  # noqa: E402


def seconds(run: Callable[[], None], n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        run()
    return (time.perf_counter() - started) / n


def hook_overhead(args: argparse.Namespace) -> dict[str, float]:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(args.tiny_layers)])
    x = torch.randn(1, 2)

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    off, on = [], []
    for _ in range(args.repeats):
        off.append(seconds(backward, args.iterations))
        arrivals = GradientArrivals(list(model.parameters()), None)  # type: ignore[arg-type]
        on.append(seconds(backward, args.iterations))
        arrivals.close()
    params = 2 * args.tiny_layers
    return {
        "params": params,
        "without_ms": min(off) * 1e3,
        "with_ms": min(on) * 1e3,
        "per_param_us": (min(on) - min(off)) / params * 1e6,
    }


def build(form: str, args: argparse.Namespace) -> tuple[Any, nn.Module, list[Any]]:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    half = args.layers // 2
    groups = ParamGroups(
        model, {"first": [f"{i}.*" for i in range(half)], "second": [f"{i}.*" for i in range(half, args.layers)]}
    )
    acc = PhasedAccelerator(Alternating(["first", "second"]), groups=groups, cpu=True, log_switches=False)
    adam = [torch.optim.Adam(groups.params(g), lr=1e-4) for g in groups.names]
    if form == "handles":
        model, *opts = acc.prepare(model, *adam)
    else:
        model, opt = acc.prepare(model, GroupedOptimizer(groups, dict(zip(groups.names, adam))))
        opts = [opt]
    return acc, model, opts


def step_time(args: argparse.Namespace) -> dict[str, float]:
    x = torch.randn(args.batch, args.width)
    best = {"handles": float("inf"), "grouped": float("inf")}
    for _ in range(args.repeats):
        for form in best:
            acc, model, opts = build(form, args)

            def step() -> None:
                acc.backward(model(x).square().mean())
                for opt in opts:  # every handle stepped: one grouped step runs
                    opt.step()
                for opt in opts:
                    opt.zero_grad()

            step()  # the first step allocates Adam state
            best[form] = min(best[form], seconds(step, args.iterations))
            acc.free_memory()
    return {
        "handles_ms": best["handles"] * 1e3,
        "grouped_ms": best["grouped"] * 1e3,
        "ratio": best["handles"] / best["grouped"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny-layers", type=int, default=100)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine('cpu', 1)}, 1 thread")
    hooks = hook_overhead(args)
    print(
        f"hooks: forward+backward of {hooks['params']} tiny parameters {hooks['without_ms']:.3f} ms without, "
        f"{hooks['with_ms']:.3f} ms with: {hooks['per_param_us']:.2f} us per parameter per backward"
    )
    steps = step_time(args)
    print(
        f"step ({args.layers} x Linear({args.width}), batch {args.batch}, Adam, alternating): handles "
        f"{steps['handles_ms']:.3f} ms, GroupedOptimizer {steps['grouped_ms']:.3f} ms, "
        f"ratio {steps['ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
