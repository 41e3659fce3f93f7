"""``python -m hf_altparams.planner ...``: the same as ``python -m hf_altparams plan ...``."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
