"""``python -m hf_altparams check ARGS`` as one rank of a launcher (a script path, for ``launch_ranks``)."""

from __future__ import annotations

import sys

from hf_altparams.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["check", *sys.argv[1:]]))
