"""Run one of Accelerate's own test scripts with ``accelerate.Accelerator`` rebound to ``PhasedAccelerator``.

    torchrun --nproc_per_node 2 tests/scripts/accelerate_shipped.py test_sync OUT_DIR

The script runs as shipped with the installed accelerate (its ``main()``), with
only the class its ``Accelerator(...)`` calls name replaced: the plain
rebinding a user would make. Each rank then writes ``rank{r}.json`` with how
many ``PhasedAccelerator`` objects the script built (so a run that never used
the rebinding cannot pass).
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import sys

import accelerate
import accelerate.accelerator

from hf_altparams.engine.shutdown import shutdown
from hf_altparams.integrations.accelerate import PhasedAccelerator

built = 0


class Counted(PhasedAccelerator):
    """``PhasedAccelerator`` counting its constructions (the class the shipped script gets)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        global built
        built += 1
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    accelerate.Accelerator = Counted  # type: ignore[misc]
    accelerate.accelerator.Accelerator = Counted  # type: ignore[misc]
    sys.argv = [name]
    runpy.run_module(f"accelerate.test_utils.scripts.{name}", run_name="__main__")
    gc.collect()  # the script's wrappers (and their reducers) go with its namespace
    shutdown()  # gloo's threads finish, then the process group ends (no abort at interpreter exit)
    rank = int(os.environ.get("RANK", "0"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"script": name, "phased_accelerators_built": built}, f)


if __name__ == "__main__":
    main()
