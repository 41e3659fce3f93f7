"""``python -m hf_altparams check``: prove a phased run on this machine's own devices, ranks and launcher.

In about a minute it trains a short phased run (a built-in small Llama by
default, ``--model`` for one's own config or checkpoint, ``--setup`` for one's
own groups, schedule, optimizer, data and per-step code) under
``PhasedAccelerator``, DDP or FSDP2 as configured, and reports:

* the ranks hold bit-identical weights after every switch;
* the bytes all-reduced per step equal the trainable bytes;
* memory after each switch stays flat once warmed up, and what a step holds
  stays within the memory model's plan for its phase;
* the switch's share of the step time.

It exits 1 on a failure, naming its cause (:data:`~hf_altparams.check.verdict.CAUSES`),
and ``--json`` prints the verdict for CI. Started plainly it launches its ranks
once, says how, and first prices the run against this machine's memory;
Ctrl-C, SIGTERM and ``--deadline`` stop every process it started.
``docs/check.md`` describes each check, its tolerance, the launch and the
failures it names.

Modules: :mod:`.workload` (what is trained), :mod:`.readings` (memory readings),
:mod:`.rank` (one rank's run), :mod:`.verdict` (the judgement and the report),
:mod:`.launch` (which launch, started once, or being one of its ranks),
:mod:`.preflight` (will it fit, priced before any rank starts), :mod:`.watch`
(how far each rank got, and why a launch ended early), :mod:`.cli` (the flags).

Example (a set-up of one's own, ``my_check.py``)::

    from hf_altparams.check import CheckSetup
    from hf_altparams.plan import ParamGroups, lisa

    def setup():
        model = build_my_model()  # seeded: the same on every rank
        groups = ParamGroups.from_layers(model, "model.layers", extra={"head": "lm_head.*"})
        return CheckSetup(groups, lisa([g for g in groups.names if g != "head"], k=2, every=5,
                                       always=["head"]))

    # python -m hf_altparams check --setup my_check:setup --ranks 2
"""

from .cli import main
from .rank import CheckOptions, RankResult, run_rank
from .verdict import CAUSES, Tolerances, Verdict, judge
from .workload import CheckSetup, builtin_model, builtin_setup

__all__ = [
    "CAUSES",
    "CheckOptions",
    "CheckSetup",
    "RankResult",
    "Tolerances",
    "Verdict",
    "builtin_model",
    "builtin_setup",
    "judge",
    "main",
    "run_rank",
]
