"""Helpers for hf_altparams' own multi-process tests (and for users who test their set-ups).

See :mod:`hf_altparams.testing.launch` for the example. Note that the function
``launch`` re-exported here shadows the submodule of the same name as an
attribute of this package: ``from hf_altparams.testing.launch import X`` works,
but ``import hf_altparams.testing.launch as m`` binds the function; use
``sys.modules["hf_altparams.testing.launch"]`` to reach the module (to
monkeypatch ``free_port``, say).
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
from .nodes import launch_nodes

__all__ = [
    "SCRIPTS_DIR",
    "LaunchError",
    "free_port",
    "launch",
    "launch_command",
    "launch_nodes",
    "rank_results",
    "script_path",
    "write_rank_result",
]
