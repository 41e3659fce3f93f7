"""Helpers for hf_altparams' own multi-process tests (and for users who test their set-ups).

See :mod:`hf_altparams.testing.launch` for the example.
"""

from __future__ import annotations

from .launch import (
    SCRIPTS_DIR,
    LaunchError,
    free_port,
    launch,
    launch_command,
    rank_results,
    script_path,
    write_rank_result,
)

__all__ = [
    "SCRIPTS_DIR",
    "LaunchError",
    "free_port",
    "launch",
    "launch_command",
    "rank_results",
    "script_path",
    "write_rank_result",
]
