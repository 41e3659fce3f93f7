"""Simulate several nodes on one machine: one ``torchrun`` launcher per "node".

A multi-node job differs from a single-node one in what the ranks see: ``RANK``
(global) and ``LOCAL_RANK`` (on its node) differ on every node but the first,
each node has its own local main process (``LOCAL_RANK == 0``), and a node may
have its own disk. :func:`launch_nodes` starts ``nnodes`` launchers together,
exactly as one would on separate machines, with a static rendezvous on
127.0.0.1::

    python -m torch.distributed.run --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --rdzv-backend static --master-addr 127.0.0.1 --master-port PORT script.py ARGS
    python -m torch.distributed.run --nnodes 2 --node-rank 1 --nproc-per-node 2 \\
        --rdzv-backend static --master-addr 127.0.0.1 --master-port PORT script.py ARGS

Every rank sees the usual torchrun variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) and ``GROUP_RANK``, the node's index, which
a script can use to give each simulated node its own folder ("disk"). The
environment is the one :func:`~hf_altparams.testing.launch.launch` gives.

Example (a test; ``check_ranks.py`` writes ``rank{r}.json`` with
:func:`~hf_altparams.testing.launch.write_rank_result`)::

    from hf_altparams.testing import launch_nodes, rank_results

    def test_two_nodes(tmp_path):
        launch_nodes("check_ranks.py", str(tmp_path), nnodes=2, nproc_per_node=2)
        assert len(rank_results(tmp_path, nproc=4)) == 4
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import IO

from .launch import _ADDRESS_IN_USE, _TAIL_LINES, LaunchError, _kill_tree, _launch_env, _tail, free_port

__all__ = ["launch_nodes", "node_command"]

#: Seconds the other launchers get to end by themselves once one has failed.
_GRACE_AFTER_FAILURE = 20.0


def node_command(script: str | os.PathLike[str], *script_args: str, node_rank: int, nnodes: int = 2,
                 nproc_per_node: int = 2, port: int) -> list[str]:
    """The argv of node ``node_rank``'s launcher (static rendezvous on 127.0.0.1:``port``)."""
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
        os.fspath(script), *script_args,
    ]  # fmt: skip


def _run_nodes(cmds: list[list[str]], env: dict[str, str], timeout: float,
               cwd: str | os.PathLike[str] | None) -> tuple[list[subprocess.CompletedProcess[str]], bool]:
    """Start every launcher at once; wait for all; stop them all on a timeout or after one failed."""
    logs: list[IO[bytes]] = [tempfile.TemporaryFile() for _ in cmds]
    procs: list[subprocess.Popen[bytes]] = []
    timed_out = False
    try:
        for cmd, log in zip(cmds, logs):
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]  # poll every one (any() would stop at the first running)
            if all(code is not None for code in codes):
                break
            if any(code not in (None, 0) for code in codes):  # one node failed: the others may wait forever
                deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
            if time.monotonic() > deadline:
                timed_out = all(code in (None, 0) for code in codes)
                break
            time.sleep(0.1)
    finally:  # a timeout, one failed node, KeyboardInterrupt: leave no rank behind
        for proc in procs:
            if proc.poll() is None:
                _kill_tree(proc)
    results = []
    for cmd, proc, log in zip(cmds, procs, logs):
        log.seek(0)
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, log.read().decode("utf-8", "replace"), None))
        log.close()
    return results, timed_out


def launch_nodes(script: str | os.PathLike[str], *script_args: str, nnodes: int = 2, nproc_per_node: int = 2,
                 env: Mapping[str, str] | None = None, timeout: float = 300,
                 cwd: str | os.PathLike[str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` on ``nnodes`` simulated nodes of ``nproc_per_node`` ranks each (gloo on CPU).

    Args:
        script: path of the Python script every rank runs.
        *script_args: arguments passed to the script (strings).
        nnodes: number of launchers ("nodes"), started together.
        nproc_per_node: ranks per node; the world size is ``nnodes * nproc_per_node``.
        env: extra environment variables (override the defaults of
            :func:`~hf_altparams.testing.launch.launch`).
        timeout: seconds before every launcher and its ranks are killed.
        cwd: working directory of the run.

    Returns:
        One finished process per node, in node order (stdout and stderr of that
        node's launcher and ranks, interleaved).

    Raises:
        LaunchError: when any node exits non-zero or the run times out, with
            each node's command and the tail of its output. A port taken in the
            meantime (``address already in use``) is retried once on a new port.
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError(f"`nnodes` and `nproc_per_node` must be >= 1, got {nnodes} and {nproc_per_node}")
    full_env = _launch_env("torchrun", env)
    for attempt in (1, 2):
        port = free_port()
        cmds = [node_command(script, *script_args, node_rank=n, nnodes=nnodes, nproc_per_node=nproc_per_node,
                             port=port) for n in range(nnodes)]
        results, timed_out = _run_nodes(cmds, full_env, timeout, cwd)
        if not timed_out and all(r.returncode == 0 for r in results):
            return results
        if attempt == 1 and not timed_out and any(_ADDRESS_IN_USE.search(r.stdout or "") for r in results):
            continue
        break
    what = f"timed out after {timeout:g} s" if timed_out else "failed"
    parts = [f"{nnodes}-node run of {os.fspath(script)} ({nproc_per_node} ranks per node) {what}."]
    for node, result in enumerate(results):
        parts.append(f"--- node {node}: exit code {result.returncode}; command: {subprocess.list2cmdline(result.args)}\n"
                     f"--- last {_TAIL_LINES // nnodes} lines ---\n{_tail(result.stdout or '', _TAIL_LINES // nnodes)}")
    raise LaunchError("\n".join(parts))
