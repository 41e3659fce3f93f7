"""Check scripts the test suite runs as separate processes (never part of the installed package).

Each script is run by path (``torchrun``, ``accelerate launch``, or plain
``python``) through :func:`hf_altparams.testing.launch`; some tests also import
one to reuse its model and reference loop (``from tests.scripts import
engine_check``). A script that imports ``tests.*`` puts the repository root on
``sys.path`` itself, so it runs the same whoever starts it.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SCRIPTS_DIR", "script_path"]

#: This folder.
SCRIPTS_DIR: Path = Path(__file__).resolve().parent


def script_path(name: str) -> Path:
    """Return the path of the check script ``name`` in this folder.

    Example::

        >>> script_path("smoke_allreduce.py").name
        'smoke_allreduce.py'
    """
    path = SCRIPTS_DIR / name
    if not path.is_file():
        available = sorted(p.name for p in SCRIPTS_DIR.glob("*.py") if p.name != "__init__.py")
        raise FileNotFoundError(f"no script named {name!r} in {SCRIPTS_DIR}; available: {available}")
    return path
