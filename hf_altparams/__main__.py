"""``python -m hf_altparams COMMAND ...``: the library's command line.

Commands:
    plan    what a schedule will cost per phase (see :mod:`hf_altparams.planner`).
    check   a short phased run on this machine's ranks, judged (see :mod:`hf_altparams.check`).

Example::

    python -m hf_altparams plan --model path/to/checkpoint --layers encoder.layer \
        --schedule gradual --every 100
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

_COMMANDS = {
    "plan": "what a schedule will cost per phase (python -m hf_altparams plan --help)",
    "check": "a short phased run on this machine's ranks, judged (python -m hf_altparams check --help)",
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch ``argv[0]`` to its command; print the command list for ``--help`` or none."""
    args = sys.argv[1:] if argv is None else list(argv)
    usage = "usage: python -m hf_altparams COMMAND [ARGS...]\ncommands:\n" + "\n".join(
        f"  {name:<8}{text}" for name, text in _COMMANDS.items()
    )
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    if args[0] not in _COMMANDS:
        print(f"{usage}\nerror: unknown command {args[0]!r}; accepted: {list(_COMMANDS)}", file=sys.stderr)
        return 2
    if args[0] == "check":
        from .check import main as check_main

        return check_main(args[1:])
    from .planner import main as plan_main

    return plan_main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
