"""Run a script as real separate processes (gloo on CPU), to test a multi-process set-up.

:func:`launch` runs a script under ``torchrun`` or ``accelerate launch`` (or
forks its ranks from a warm server, ``launcher="forked"``, see
:mod:`hf_altparams.testing.forked`) on a free local port, with an environment
that keeps it on the CPU and offline, and
raises :class:`LaunchError` (an ``AssertionError``, so pytest shows it as a
failure) with the command and the tail of the output when anything goes wrong.
:func:`launch_nodes` does the same for several simulated nodes (one
``torchrun`` per node on this machine, see below). Both start their launchers
through :func:`run_launchers`, which stops every process they started on a
timeout, a failure or an interrupt. hf_altparams' own test suite runs its
multi-process tests with them; ``docs/testing.md`` shows how to test a training
set-up of your own with them.

Scripts report back through files, not through stdout: each rank writes
``{out_dir}/rank{r}.json`` (:func:`write_rank_result`) and the test reads them
all with :func:`rank_results`.

Example (a test)::

    import pytest
    from hf_altparams.testing import launch, rank_results

    @pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
    def test_two_ranks_agree(tmp_path, launcher):
        launch("check_ranks.py", str(tmp_path), nproc=2, launcher=launcher)
        rank0, rank1 = rank_results(tmp_path, nproc=2)
        assert rank0["param_sha256"] == rank1["param_sha256"]

and the script it runs (``check_ranks.py``)::

    import sys
    import torch.distributed as dist
    from hf_altparams.testing import write_rank_result

    dist.init_process_group("gloo")
    ...  # train a few steps
    write_rank_result(sys.argv[1], {"param_sha256": digest_of_the_parameters})

Environment given to every launch (the caller's ``env`` overrides it):

* ``CUDA_VISIBLE_DEVICES=""`` always, so the ranks use gloo on the CPU even on
  a machine with GPUs, and tests behave the same everywhere. A GPU test passes
  ``env={"CUDA_VISIBLE_DEVICES": "0,1"}``.
* ``OMP_NUM_THREADS=1`` (two ranks on two cores must not oversubscribe).
* ``HF_HUB_OFFLINE=1``, ``TRANSFORMERS_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``:
  tests never reach a hub.
* ``TOKENIZERS_PARALLELISM=false``, ``PYTHONUNBUFFERED=1``.
* ``PYTHONPATH`` starts with the directory that holds this checkout's
  ``hf_altparams`` when it is not an installed copy, so an uninstalled checkout
  works too.
* ``ACCELERATE_USE_CPU=1`` for ``launcher="accelerate"``.

:func:`launch_env` returns it, to start a launcher of one's own (``torchrun
--max-restarts``, say) with :func:`run_launchers`.

Several nodes: a multi-node job differs from a single-node one in what the
ranks see: ``RANK`` (global) and ``LOCAL_RANK`` (on its node) differ on every
node but the first, each node has its own local main process
(``LOCAL_RANK == 0``), and a node may have its own disk. :func:`launch_nodes`
starts ``nnodes`` launchers together, exactly as one would on separate
machines, with a static rendezvous on 127.0.0.1 (:func:`node_command`)::

    python -m torch.distributed.run --nnodes 2 --node-rank 0 --nproc-per-node 2 \\
        --rdzv-backend static --master-addr 127.0.0.1 --master-port PORT script.py ARGS
    python -m torch.distributed.run --nnodes 2 --node-rank 1 --nproc-per-node 2 \\
        --rdzv-backend static --master-addr 127.0.0.1 --master-port PORT script.py ARGS

Every rank sees the usual torchrun variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``) and ``GROUP_RANK``, the node's index, which
a script can use to give each simulated node its own folder ("disk")::

    from hf_altparams.testing import launch_nodes, rank_results

    def test_two_nodes(tmp_path):
        launch_nodes("check_ranks.py", str(tmp_path), nnodes=2, nproc_per_node=2)
        assert len(rank_results(tmp_path, nproc=4)) == 4

Launcher facts (torch 2.13, accelerate 1.15):

* ``launcher="accelerate"`` runs ``ACCELERATE_USE_CPU=1 accelerate launch
  --multi_gpu --num_processes N``: N gloo ranks on the CPU (checked by
  ``tests/test_smoke_distributed.py``). ``accelerate launch --cpu
  --num_processes N`` silently runs ONE process (world size 1; its "simple"
  launcher ignores the count), so it is never used.
* Both launchers start each rank in a session of its own, so on a timeout
  killing the launcher's process group is not enough: :func:`run_launchers`
  stops the whole process tree, and reads output from a file so an orphaned
  rank can never block it. When one node of :func:`launch_nodes` fails, the
  others may wait for it forever: they get 20 s to end, then are stopped.
  Every process a launch starts carries :data:`LAUNCH_TAG_ENV` in its
  environment; after a run that did not end cleanly, any process still
  carrying the run's tag (a rank whose launcher died first, so no longer in
  its tree) is stopped too.
* A port taken between :func:`free_port` and the launch makes torchrun fail
  with ``EADDRINUSE`` (retried here once on a new port); ``accelerate launch``
  notices a busy port itself and falls back to a free one.
* A developer's ``accelerate config`` default file can still add settings the
  flags here do not name (``gpu_ids`` for instance).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal

import psutil  # required by accelerate, so always installed with hf_altparams (which does not name it)

from .forked import ForkServer, server_for

__all__ = [
    "LAUNCH_TAG_ENV",
    "LaunchError",
    "free_port",
    "launch",
    "launch_command",
    "launch_env",
    "launch_ranks",
    "launch_nodes",
    "node_command",
    "rank_env",
    "rank_results",
    "run_launchers",
    "write_rank_result",
]

Launcher = Literal["torchrun", "accelerate", "forked"]

_TAIL_LINES = 200  # lines of output a LaunchError quotes (shared among the nodes of launch_nodes)
_ADDRESS_IN_USE = re.compile(r"address already in use|EADDRINUSE|errno 98", re.IGNORECASE)
#: Seconds the other launchers get to end by themselves once one has failed.
_GRACE_AFTER_FAILURE = 20.0
#: The environment variable each :func:`run_launchers` run sets to a tag of its own in every process it starts.
LAUNCH_TAG_ENV = "HF_ALTPARAMS_LAUNCH_TAG"
#: The signals held back while a run's processes are being stopped (a second Ctrl-C must not cut the cleanup).
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_BASE_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


class LaunchError(AssertionError):
    """A launched multi-process run failed, timed out, or reported the wrong number of ranks."""


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_command(
    script: str | os.PathLike[str],
    *script_args: str,
    nproc: int = 2,
    launcher: Launcher = "torchrun",
    port: int,
) -> list[str]:
    """Return the argv that :func:`launch` runs (useful for printing or debugging by hand).

    For ``launcher="forked"`` (no command of its own) it is the equivalent ``torchrun`` command.
    """
    if launcher in ("torchrun", "forked"):
        head = [
            sys.executable, "-m", "torch.distributed.run",
            "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1",
            "--master_port", str(port),
        ]  # fmt: skip
    elif launcher == "accelerate":
        head = [
            sys.executable, "-m", "accelerate.commands.launch",
            "--multi_gpu",  # NOT --cpu: that silently runs a single process
            "--num_processes", str(nproc),
            "--num_machines", "1",
            "--mixed_precision", "no",
            "--dynamo_backend", "no",
            "--main_process_port", str(port),
        ]  # fmt: skip
    else:
        raise ValueError(f"`launcher` must be 'torchrun', 'accelerate' or 'forked', got {launcher!r}")
    return [*head, os.fspath(script), *script_args]


def _checkout_root() -> Path | None:
    """The folder holding ``hf_altparams`` if it is a source checkout, else None (installed copy)."""
    root = Path(__file__).resolve().parents[2]
    if (root / "pyproject.toml").is_file() or (root / "setup.cfg").is_file():
        return root
    return None


def launch_env(launcher: Launcher = "torchrun", env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment :func:`launch` gives a run: this process's, plus the defaults listed above, plus `env`.

    Example:
        >>> full = launch_env("accelerate", {"OMP_NUM_THREADS": "2"})
        >>> full["CUDA_VISIBLE_DEVICES"], full["ACCELERATE_USE_CPU"], full["OMP_NUM_THREADS"]
        ('', '1', '2')
    """
    full = dict(os.environ)
    full.update(_BASE_ENV)
    if launcher == "accelerate":
        full["ACCELERATE_USE_CPU"] = "1"
    root = _checkout_root()
    if root is not None:
        rest = full.get("PYTHONPATH", "")
        full["PYTHONPATH"] = os.pathsep.join([str(root), rest]) if rest else str(root)
    if env:
        full.update(env)
    return full


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    kept = text.splitlines()[-lines:]
    return "\n".join(kept)


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Stop the launcher and every process it started, whatever session they are in.

    Both launchers start each rank in a session of its own (torch elastic does,
    so it can signal a rank's whole group), so killing the launcher's process
    group alone would leave the ranks running, orphaned. The launcher first gets
    SIGTERM (it forwards it to its ranks and cleans up); after a short grace
    period everything still alive, and each rank's process group, gets SIGKILL.
    """
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=5)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    own_group = os.getpgrp()
    groups = {proc.pid}
    for child in tree:
        try:
            groups.add(os.getpgid(child.pid))
        except ProcessLookupError:
            pass
    for group in groups - {own_group}:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for child in tree:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=5)
    proc.wait()


def _tagged(tag: str) -> list[psutil.Process]:
    """The processes of this machine whose environment carries ``LAUNCH_TAG_ENV=tag`` (those this user may read)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.pid != os.getpid() and process.environ().get(LAUNCH_TAG_ENV) == tag:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def _kill_tagged(tag: str) -> None:
    """SIGKILL every process still carrying ``tag``: ranks whose launcher died before them (reparented away)."""
    stragglers = _tagged(tag)
    for process in stragglers:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(stragglers, timeout=5)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP back within the block (delivered after it); a no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, _HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def run_launchers(
    cmds: Sequence[list[str]],
    env: Mapping[str, str],
    *,
    timeout: float,
    cwd: str | os.PathLike[str] | None = None,
    on_poll: Callable[[], None] | None = None,
) -> tuple[list[subprocess.CompletedProcess[str]], bool]:
    """Start every command at once, each in a session of its own, and wait for all of them.

    Output goes to a temporary file per command, not a pipe, so a rank that
    outlives its launcher can never block the read. Once one command has
    failed, the others get 20 s to end by themselves (they may be waiting for
    it). On `timeout`, after that grace, or on any exception while waiting
    (``KeyboardInterrupt``, pytest-timeout, one a signal handler of the
    caller's raises) every command still running is stopped with all the
    processes it started; SIGINT, SIGTERM and SIGHUP are held back until that
    is done, so a second Ctrl-C cannot leave ranks behind. After a run that
    did not end cleanly, processes still carrying the run's
    :data:`LAUNCH_TAG_ENV` are stopped too. Nothing is raised for a failed
    command: the caller reads the exit codes.

    Args:
        cmds: one argv per launcher (e.g. :func:`launch_command`, :func:`node_command`).
        env: their environment (e.g. :func:`launch_env`); :data:`LAUNCH_TAG_ENV` is added.
        timeout: seconds before every command still running is stopped.
        cwd: working directory of the commands.
        on_poll: called about every 0.1 s while the commands run (to watch them); what
            it raises ends the run as an interrupt does.

    Returns:
        One finished process per command, in order (``stdout`` holds its stdout
        and stderr, interleaved; ``stderr`` is None), and whether the run timed
        out (False when a command failed before the timeout).

    Example:
        >>> (done,), timed_out = run_launchers([[sys.executable, "-c", "print('hi')"]], launch_env(), timeout=60)
        >>> done.returncode, done.stdout, timed_out
        (0, 'hi\\n', False)
    """
    procs: list[subprocess.Popen[bytes]] = []
    timed_out = False
    clean = False
    tag = uuid.uuid4().hex
    tagged_env = {**env, LAUNCH_TAG_ENV: tag}
    with contextlib.ExitStack() as files:
        logs: list[IO[bytes]] = [files.enter_context(tempfile.TemporaryFile()) for _ in cmds]
        try:
            for cmd, log in zip(cmds, logs):
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=tagged_env, cwd=cwd, start_new_session=True
                    )
                )
            deadline = time.monotonic() + timeout
            while True:
                codes = [p.poll() for p in procs]  # poll every one (any() would stop at the first running)
                if all(code is not None for code in codes):
                    clean = all(code == 0 for code in codes)
                    break
                if any(code not in (None, 0) for code in codes):  # one failed: the others may wait forever
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
                if time.monotonic() > deadline:
                    timed_out = all(code in (None, 0) for code in codes)
                    break
                if on_poll is not None:
                    on_poll()
                time.sleep(0.1)
        finally:  # a timeout, one failed command, an interrupt: leave no rank behind
            with _signals_held():
                for proc in procs:
                    if proc.poll() is None:
                        _kill_tree(proc)
                if not clean:
                    _kill_tagged(tag)
        results = []
        for cmd, proc, log in zip(cmds, procs, logs):
            log.seek(0)
            results.append(
                subprocess.CompletedProcess(cmd, proc.returncode, log.read().decode("utf-8", "replace"), None)
            )
    return results, timed_out


def _run_with_port_retry(
    run: Callable[[int], tuple[list[subprocess.CompletedProcess[str]], bool]],
) -> tuple[list[subprocess.CompletedProcess[str]], bool]:
    """``run`` on a free port; once more on a new port if the first was taken in the meantime."""
    for attempt in (1, 2):
        results, timed_out = run(free_port())
        if timed_out or all(r.returncode == 0 for r in results):
            break
        if attempt == 1 and any(_ADDRESS_IN_USE.search(r.stdout or "") for r in results):
            continue  # port race with another process: one more try on a new port
        break
    return results, timed_out


def _launchers_on(
    cmds_for_port: Callable[[int], list[list[str]]],
    env: Mapping[str, str],
    timeout: float,
    cwd: str | os.PathLike[str] | None,
) -> Callable[[int], tuple[list[subprocess.CompletedProcess[str]], bool]]:
    """A run of :func:`run_launchers` with the commands for a port (for :func:`_run_with_port_retry`)."""
    return lambda port: run_launchers(cmds_for_port(port), env, timeout=timeout, cwd=cwd)


def rank_env(
    env: Mapping[str, str], *, rank: int, nproc: int, port: int, error_file: str | os.PathLike[str]
) -> dict[str, str]:
    """The environment of rank `rank` of a one-node run of `nproc` ranks: `env` plus what torchrun gives a rank.

    The variables and their values are those torch 2.13's ``torchrun`` sets, but
    ``TORCHELASTIC_USE_AGENT_STORE`` is ``"False"``: no agent holds a store, so
    rank 0 serves the rendezvous on ``MASTER_PORT`` itself (``env://``).

    Example:
        >>> e = rank_env({}, rank=1, nproc=2, port=29500, error_file="/tmp/err1.json")
        >>> e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["MASTER_PORT"], e["TORCHELASTIC_USE_AGENT_STORE"]
        ('1', '1', '2', '29500', 'False')
    """
    return {
        **env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "TORCHELASTIC_ERROR_FILE": os.fspath(error_file),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _stop_ranks(server: ForkServer, pids: Sequence[int]) -> dict[int, int]:
    """SIGKILL the process group of every rank not yet reaped; every rank's exit code once the server reaped it."""
    reaped = server.exits()
    for pid in pids:
        if pid in reaped:
            continue
        try:
            os.killpg(pid, signal.SIGKILL)  # the rank's own session (setsid): the rank and what it started
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # still before its setsid
    return server.wait_exits(pids, timeout=60)


def _run_forked(
    script: str | os.PathLike[str],
    script_args: Sequence[str],
    *,
    nproc: int,
    env: Mapping[str, str],
    timeout: float,
    cwd: str | os.PathLike[str] | None,
    port: int,
) -> tuple[list[subprocess.CompletedProcess[str]], bool]:
    """One ``launcher="forked"`` run: `nproc` ranks forked from :func:`server_for`'s server.

    The ranks are watched as :func:`run_launchers` watches launchers: the others get the grace period once
    one failed, every rank still running is stopped (its process group SIGKILLed) on a timeout, after that
    grace or on an interrupt, with SIGINT, SIGTERM and SIGHUP held back meanwhile.

    Returns one finished "process" per rank (``args``: the equivalent torchrun command, ``returncode``: the
    rank's exit status, ``stdout``: its output) and whether the run timed out.
    """
    server = server_for(env)
    tag = uuid.uuid4().hex
    pids: list[int] = []
    timed_out = False
    clean = False
    codes: dict[int, int] = {}
    with tempfile.TemporaryDirectory(prefix="hf_altparams_forked_") as folder:
        logs = [Path(folder) / f"rank{rank}.log" for rank in range(nproc)]
        try:
            for rank in range(nproc):
                renv = rank_env(env, rank=rank, nproc=nproc, port=port, error_file=Path(folder) / f"error{rank}.json")
                renv[LAUNCH_TAG_ENV] = tag
                with _signals_held():  # a Ctrl-C between the request and its pid would leave the rank unknown
                    pids.append(server.start_rank(script, script_args, renv, cwd=cwd or os.getcwd(), log=logs[rank]))
            deadline = time.monotonic() + timeout
            while True:
                reaped = server.exits(timeout=0.1)
                states = [reaped.get(pid) for pid in pids]
                if all(code is not None for code in states):
                    clean = all(code == 0 for code in states)
                    break
                if any(code not in (None, 0) for code in states):  # one failed: the others may wait forever
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
                if time.monotonic() > deadline:
                    timed_out = all(code in (None, 0) for code in states)
                    break
        finally:  # a timeout, one failed rank, an interrupt: leave no rank behind
            with _signals_held():
                codes = _stop_ranks(server, pids)
                server.forget(pids)
                if not clean:
                    _kill_tagged(tag)  # what a rank started in a session of its own
        command = launch_command(script, *script_args, nproc=nproc, launcher="torchrun", port=port)
        results = [
            subprocess.CompletedProcess(
                command,
                codes.get(pid, -int(signal.SIGKILL)),  # not reported reaped within a minute of its SIGKILL
                log.read_text("utf-8", "replace") if log.exists() else "",
                None,
            )
            for pid, log in zip(pids, logs)
        ]
    return results, timed_out


def _forked_ranks(
    script: str | os.PathLike[str],
    script_args: Sequence[str],
    *,
    nproc: int,
    env: Mapping[str, str],
    timeout: float,
    cwd: str | os.PathLike[str] | None,
) -> tuple[list[subprocess.CompletedProcess[str]], bool]:
    """:func:`_run_forked` on a free port (retried once on a new one if it was taken in the meantime)."""
    if not hasattr(os, "fork"):
        raise ValueError("`launcher='forked'` needs os.fork (Linux, macOS); use launcher='torchrun'")

    def forked_on(port: int) -> tuple[list[subprocess.CompletedProcess[str]], bool]:
        return _run_forked(script, script_args, nproc=nproc, env=env, timeout=timeout, cwd=cwd, port=port)

    return _run_with_port_retry(forked_on)


def _forked_failure(
    script: str | os.PathLike[str], ranks: Sequence[subprocess.CompletedProcess[str]], timed_out: bool, timeout: float
) -> str:
    """What a :class:`LaunchError` of a forked run says: what went wrong, the command, each rank's tail."""
    what = f"timed out after {timeout:g} s" if timed_out else f"failed (exit codes {[r.returncode for r in ranks]})"
    tail_lines = max(1, _TAIL_LINES // len(ranks))
    return (
        f"forked run of {os.fspath(script)} with {len(ranks)} processes {what}.\n"
        f"command (torchrun equivalent): {subprocess.list2cmdline(ranks[0].args)}\n"
        + "\n".join(
            f"--- rank {r}: exit code {rank.returncode}; last {tail_lines} lines ---\n{_tail(rank.stdout, tail_lines)}"
            for r, rank in enumerate(ranks)
        )
    )


def launch_ranks(
    script: str | os.PathLike[str],
    *script_args: str,
    nproc: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike[str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` as :func:`launch` with ``launcher="forked"`` does, and return how each rank ended.

    For a test that expects ranks to fail: a non-zero exit is not an error
    here, each rank's exit code and output (stdout and stderr) are returned, in
    rank order. Only a run past ``timeout`` raises (every rank stopped first).

    Raises:
        LaunchError: the run timed out, with every rank's exit code and output's tail.

    Example (a script whose ranks exit with ``10 + rank``)::

        ends = launch_ranks("exits.py", nproc=2)
        [end.returncode for end in ends]  # [10, 11]
    """
    if nproc < 1:
        raise ValueError(f"`nproc` must be >= 1, got {nproc}")
    ranks, timed_out = _forked_ranks(
        script, script_args, nproc=nproc, env=launch_env("forked", env), timeout=timeout, cwd=cwd
    )
    if timed_out:
        raise LaunchError(_forked_failure(script, ranks, timed_out, timeout))
    return ranks


def launch(
    script: str | os.PathLike[str],
    *script_args: str,
    nproc: int = 2,
    launcher: Launcher = "torchrun",
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` as ``nproc`` separate processes (gloo on CPU) and wait for it.

    Args:
        script: path of the Python script every rank runs.
        *script_args: arguments passed to the script (strings).
        nproc: number of processes (ranks).
        launcher: ``"torchrun"`` (``python -m torch.distributed.run``),
            ``"accelerate"`` (``accelerate launch --multi_gpu``) or ``"forked"``
            (ranks forked from a server that imported torch, transformers,
            accelerate and hf_altparams once, :mod:`hf_altparams.testing.forked`;
            a torchrun rank's environment, no agent; ``docs/testing.md``).
        env: extra environment variables; they override the defaults listed in
            the module docstring.
        timeout: seconds before the launcher and all its ranks are killed.
        cwd: working directory of the run.

    Returns:
        The finished process; ``stdout`` holds stdout and stderr of the launcher
        and all ranks, interleaved (``"forked"``: each rank's output in turn,
        under a ``--- rank r (exit code c) ---`` line; ``args`` is the equivalent
        torchrun command); ``stderr`` is None.

    Raises:
        LaunchError: on a non-zero exit or a timeout, with the command and the
            last 200 lines of output. A run that failed because its port was
            taken in the meantime (``address already in use``) is retried once
            on a new port first.
    """
    if nproc < 1:
        raise ValueError(f"`nproc` must be >= 1, got {nproc}")
    launch_command(script, nproc=nproc, launcher=launcher, port=0)  # a bad `launcher` fails here, before any start
    full_env = launch_env(launcher, env)
    if launcher == "forked":
        ranks, timed_out = _forked_ranks(script, script_args, nproc=nproc, env=full_env, timeout=timeout, cwd=cwd)
        if timed_out or any(rank.returncode != 0 for rank in ranks):
            raise LaunchError(_forked_failure(script, ranks, timed_out, timeout))
        output = "\n".join(
            f"--- rank {r} (exit code {rank.returncode}) ---\n{rank.stdout}" for r, rank in enumerate(ranks)
        )
        return subprocess.CompletedProcess(ranks[0].args, 0, output, None)

    def cmds_for_port(port: int) -> list[list[str]]:
        return [launch_command(script, *script_args, nproc=nproc, launcher=launcher, port=port)]

    (result,), timed_out = _run_with_port_retry(_launchers_on(cmds_for_port, full_env, timeout, cwd))
    if result.returncode == 0 and not timed_out:
        return result
    what = f"timed out after {timeout:g} s" if timed_out else f"exited with code {result.returncode}"
    raise LaunchError(
        f"{launcher} run of {os.fspath(script)} with {nproc} processes {what}.\n"
        f"command: {subprocess.list2cmdline(result.args)}\n"
        f"--- last {_TAIL_LINES} lines of output ---\n{_tail(result.stdout or '')}"
    )


def node_command(
    script: str | os.PathLike[str],
    *script_args: str,
    node_rank: int,
    nnodes: int = 2,
    nproc_per_node: int = 2,
    port: int,
) -> list[str]:
    """The argv of node ``node_rank``'s launcher in :func:`launch_nodes` (static rendezvous on 127.0.0.1:``port``).

    Example:
        >>> node_command("check.py", "out", node_rank=1, port=29500)[3:9]
        ['--nnodes', '2', '--node-rank', '1', '--nproc-per-node', '2']
    """
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--nproc-per-node", str(nproc_per_node),
        "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port", str(port),
        os.fspath(script), *script_args,
    ]  # fmt: skip


def launch_nodes(
    script: str | os.PathLike[str],
    *script_args: str,
    nnodes: int = 2,
    nproc_per_node: int = 2,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
    cwd: str | os.PathLike[str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` on ``nnodes`` simulated nodes of ``nproc_per_node`` ranks each (gloo on CPU).

    Args:
        script: path of the Python script every rank runs.
        *script_args: arguments passed to the script (strings).
        nnodes: number of launchers ("nodes"), started together.
        nproc_per_node: ranks per node; the world size is ``nnodes * nproc_per_node``.
        env: extra environment variables (override the defaults of :func:`launch`).
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

    def cmds_for_port(port: int) -> list[list[str]]:
        return [
            node_command(script, *script_args, node_rank=n, nnodes=nnodes, nproc_per_node=nproc_per_node, port=port)
            for n in range(nnodes)
        ]

    results, timed_out = _run_with_port_retry(_launchers_on(cmds_for_port, launch_env("torchrun", env), timeout, cwd))
    if not timed_out and all(r.returncode == 0 for r in results):
        return results
    what = f"timed out after {timeout:g} s" if timed_out else "failed"
    parts = [f"{nnodes}-node run of {os.fspath(script)} ({nproc_per_node} ranks per node) {what}."]
    for node, result in enumerate(results):
        parts.append(
            f"--- node {node}: exit code {result.returncode}; command: {subprocess.list2cmdline(result.args)}\n"
            f"--- last {_TAIL_LINES // nnodes} lines ---\n{_tail(result.stdout or '', _TAIL_LINES // nnodes)}"
        )
    raise LaunchError("\n".join(parts))


def write_rank_result(out_dir: str | os.PathLike[str], payload: Mapping[str, Any], rank: int | None = None) -> Path:
    """Write ``payload`` (plus ``"rank"``) to ``{out_dir}/rank{rank}.json`` atomically.

    ``rank`` defaults to the ``RANK`` environment variable set by both launchers.
    For use inside launched scripts.
    """
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"rank{rank}.json"
    tmp = out / f".rank{rank}.json.tmp"
    tmp.write_text(json.dumps({**payload, "rank": rank}, indent=1, sort_keys=True))
    os.replace(tmp, final)
    return final


def rank_results(out_dir: str | os.PathLike[str], nproc: int = 2) -> list[dict[str, Any]]:
    """Load ``{out_dir}/rank{r}.json`` for r in 0..nproc-1, in rank order.

    Raises:
        LaunchError: if the files present are not exactly ranks ``0..nproc-1``
            (a rank died silently, or fewer processes were started than asked).
    """
    out = Path(out_dir)
    files = {int(m.group(1)): p for p in out.glob("rank*.json") if (m := re.fullmatch(r"rank(\d+)\.json", p.name))}
    if sorted(files) != list(range(nproc)):
        raise LaunchError(f"expected result files for ranks 0..{nproc - 1} in {out}, found ranks {sorted(files)}")
    return [json.loads(files[r].read_text()) for r in range(nproc)]
