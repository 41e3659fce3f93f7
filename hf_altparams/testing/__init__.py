"""Test a multi-process training set-up on CPU ranks (``docs/testing.md``).

* :func:`launch` runs a script as ``nproc`` real processes (``torchrun``,
  ``accelerate launch``, or forked from a warm server that imported the heavy
  modules once, :mod:`hf_altparams.testing.forked`; gloo on the CPU, offline) and raises
  :class:`LaunchError` with the output's tail when it fails or hangs;
  :func:`write_rank_result` / :func:`rank_results` carry each rank's figures
  back to the test (see :mod:`hf_altparams.testing.launch` for the example).
* :func:`launch_nodes` simulates several nodes on one machine (one ``torchrun``
  per node); :func:`~hf_altparams.testing.launch.launch_env` and
  :func:`~hf_altparams.testing.launch.run_launchers` start a launcher command of
  one's own the same way (``torchrun --max-restarts``, say).
* :func:`use_accelerate_fsdp2` makes an ``Accelerator`` (or a Trainer's)
  built on CPU ranks run Accelerate's FSDP2 code, which Accelerate skips on CPU
  (:mod:`hf_altparams.testing.fsdp2`); :func:`fresh_accelerator_state` lets the
  next ``Accelerator`` of the process read its own plugins.

Note that the function ``launch`` re-exported here shadows the submodule of the
same name as an attribute of this package: ``from hf_altparams.testing.launch
import X`` works, but ``import hf_altparams.testing.launch as m`` binds the
function; use ``sys.modules["hf_altparams.testing.launch"]`` to reach the module
(to monkeypatch ``free_port``, say).
"""

from __future__ import annotations

from .fsdp2 import fresh_accelerator_state, use_accelerate_fsdp2
from .launch import LaunchError, free_port, launch, launch_command, launch_nodes, rank_results, write_rank_result

__all__ = [
    "LaunchError",
    "free_port",
    "fresh_accelerator_state",
    "launch",
    "launch_command",
    "launch_nodes",
    "rank_results",
    "use_accelerate_fsdp2",
    "write_rank_result",
]
