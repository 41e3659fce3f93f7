"""Ranks forked from a warm server: a launch without paying Python's start-up for every rank.

Every rank ``torchrun`` starts is a fresh interpreter that imports torch,
transformers and accelerate again: on a small CPU machine that costs more
CPU-seconds than the short scripts a test suite launches. A fork server does
the imports once and forks each rank from that state; ``launch(...,
launcher="forked")`` (:mod:`hf_altparams.testing.launch`) runs a script that way.

The server (``python -c "from hf_altparams.testing.forked import serve; serve()"``, started by
:func:`server_for`) imports :data:`PRELOADED` and nothing else, and runs no
torch operation, so no thread pool exists when it forks. Its protocol is one
JSON object per line: the client writes a request per rank on the server's
stdin; the server answers on its stdout with ``started`` (the rank's pid) and,
once it has reaped the rank, ``exited`` (its exit status, a signal as ``-N``
like :class:`subprocess.Popen`). When its stdin closes (the client is gone) it
SIGKILLs the ranks still running and exits.

Each forked rank, before it runs the script:

* starts a session of its own (``setsid``: its pid is its process group, which
  the client kills on a timeout, a failure or an interrupt);
* gets the rank's whole environment in ``os.environ`` (and so in the C
  library's ``environ``), the working directory, stdin from ``/dev/null`` and
  stdout and stderr in a log file of its own;
* gets ``sys.argv = [script, *args]`` and ``sys.path[0]`` = the script's
  folder, as ``python script.py`` does (plus the ``PYTHONPATH`` entries not yet
  on ``sys.path``);

* gets fresh entropy for numpy's global random state (Python's ``random``
  reseeds itself in a fork; torch's default generator starts from its fixed
  default seed in any process);

then runs the script with ``runpy.run_path(script, run_name="__main__")`` and
ends as ``python script.py`` would: ``sys.exit(code)`` is honoured, an uncaught
exception prints its traceback (to the log) and exits 1, and ``atexit``
handlers and non-daemon threads run as usual.

What a fork cannot give: every rank of a server shares its string-hash seed
(``PYTHONHASHSEED``, drawn once per interpreter), so the iteration order of a
``set`` of strings is the same on every forked rank, where ranks of torchrun
may differ; code whose ranks must agree on an order has to be tested under
torchrun for that.

Which server: modules read some environment variables when they are imported
(``OMP_NUM_THREADS``, ``CUDA_VISIBLE_DEVICES``, ``HF_HOME``, ``TRANSFORMERS_*``,
``ACCELERATE_*``, ``PYTHONPATH`` ...). A server imported its modules with one
set of them and would give a rank whose environment differs there the wrong
module state, so servers are keyed by :func:`server_key`: the Python
executable and every variable whose name starts with one of
:data:`KEYED_PREFIXES` or is one of :data:`KEYED_NAMES`. A launch whose key
differs gets a server of its own; servers live as long as the process that
started them (closed at exit).

Example (what ``launch(..., launcher="forked")`` does, by hand)::

    server = server_for(launch_env())
    pid = server.start_rank("check.py", ["out"], rank_env, cwd=".", log="rank0.log")
    codes = server.wait_exits([pid], timeout=60)  # {pid: 0}
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

__all__ = [
    "KEYED_NAMES",
    "KEYED_PREFIXES",
    "PRELOADED",
    "ForkServer",
    "ForkServerError",
    "close_servers",
    "server_for",
    "server_key",
]

#: The modules a server imports before it forks ranks (nothing else: no torch op, no thread).
PRELOADED = (
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "accelerate",
    "hf_altparams",
    "hf_altparams.integrations",
    "hf_altparams.testing",
)

#: Environment variables with these prefixes key a server (read at import by the preloaded modules, or by
#: the interpreter at start-up).
KEYED_PREFIXES = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TOKENIZERS_",
    "TORCH",
    "PYTORCH_",
    "OMP_",
    "MKL_",
    "KMP_",
    "OPENBLAS_",
    "CUDA_",
    "NCCL_",
    "ACCELERATE_",
    "DS_",
    "PYTHON",
    "LD_",
    "MALLOC_",
    "XDG_",
)
#: Single variables that key a server too (default cache folders are derived from ``HOME`` at import).
KEYED_NAMES = ("HOME", "VIRTUAL_ENV")
#: Variables a launch sets per run or per rank, read when a script runs, not at import: never part of a key
#: (torchrun's ``TORCHELASTIC_*``, its ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the launch's tag).
_UNKEYED_PREFIXES = ("TORCHELASTIC_",)
_UNKEYED = frozenset({"TORCH_NCCL_ASYNC_ERROR_HANDLING", "HF_ALTPARAMS_LAUNCH_TAG"})

#: Seconds a server may take to import :data:`PRELOADED` before the client gives up.
_START_TIMEOUT = 300.0
#: Seconds the server gets to answer a request, and killed ranks to be reported reaped.
_REPLY_TIMEOUT = 60.0


class ForkServerError(RuntimeError):
    """The fork server failed to start, died, or stopped answering."""


def server_key(env: Mapping[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
    """The part of a launch's environment that selects its server: the executable and the keyed variables.

    Example:
        >>> key = server_key({"OMP_NUM_THREADS": "1", "MASTER_PORT": "29500", "HF_HUB_OFFLINE": "1"})
        >>> key[1]
        (('HF_HUB_OFFLINE', '1'), ('OMP_NUM_THREADS', '1'))
    """
    keyed = sorted(
        (name, value)
        for name, value in env.items()
        if name not in _UNKEYED
        and not name.startswith(_UNKEYED_PREFIXES)
        and (name in KEYED_NAMES or name.startswith(KEYED_PREFIXES))
    )
    return sys.executable, tuple(keyed)


class ForkServer:
    """The client's handle on one fork server process (see the module docstring).

    Args:
        env: the server's environment (its :func:`server_key` decides which ranks it may fork).
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.key = server_key(env)
        self._lock = threading.Lock()
        self._buffer = b""
        self._exits: dict[int, int] = {}
        self._stderr: IO[bytes] = tempfile.TemporaryFile()
        self._next_id = 0
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from hf_altparams.testing.forked import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=dict(env),
            start_new_session=True,  # a Ctrl-C in the terminal is the client's to handle
        )
        ready = self._next_event(time.monotonic() + _START_TIMEOUT)
        if ready.get("event") != "ready":
            raise ForkServerError(f"the fork server sent {ready!r} instead of 'ready'")

    @property
    def pid(self) -> int:
        """The server process's id."""
        return self._proc.pid

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self._proc.poll() is None

    def start_rank(
        self,
        script: str | os.PathLike[str],
        args: Sequence[str],
        env: Mapping[str, str],
        *,
        cwd: str | os.PathLike[str],
        log: str | os.PathLike[str],
    ) -> int:
        """Fork one rank running ``script`` with ``args`` in ``env`` and ``cwd``, its output in ``log``; its pid."""
        if server_key(env) != self.key:
            raise ValueError("this rank's environment differs from the server's in keyed variables (server_key)")
        with self._lock:
            self._next_id += 1
            request = {
                "id": self._next_id,
                "script": os.fspath(script),
                "args": list(args),
                "env": dict(env),
                "cwd": os.fspath(cwd),
                "log": os.fspath(log),
            }
            self._send(request)
            deadline = time.monotonic() + _REPLY_TIMEOUT
            while True:
                event = self._next_event(deadline)
                if event.get("event") == "started" and event.get("id") == request["id"]:
                    return int(event["pid"])

    def exits(self, timeout: float = 0.0) -> dict[int, int]:
        """The exit statuses reported so far (pid -> code, a signal as ``-N``), waiting up to `timeout` for news."""
        with self._lock:
            deadline = time.monotonic() + timeout
            while self._readable(max(0.0, deadline - time.monotonic())):
                self._read_events()
                if time.monotonic() >= deadline:
                    break
            return dict(self._exits)

    def wait_exits(self, pids: Sequence[int], timeout: float) -> dict[int, int]:
        """Wait until every pid in `pids` is reported reaped (or `timeout`); the codes of those that were."""
        deadline = time.monotonic() + timeout
        while True:
            codes = self.exits(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
            if all(pid in codes for pid in pids) or time.monotonic() >= deadline:
                return {pid: codes[pid] for pid in pids if pid in codes}

    def forget(self, pids: Sequence[int]) -> None:
        """Drop the reported exits of `pids` (a run that has read them)."""
        with self._lock:
            for pid in pids:
                self._exits.pop(pid, None)

    def close(self) -> None:
        """Close the server's stdin (it kills its remaining ranks and exits) and wait for it."""
        with contextlib.suppress(OSError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._stderr.close()

    # --- the protocol ---

    def _failure(self, what: str) -> ForkServerError:
        self._stderr.seek(0)
        tail = "\n".join(self._stderr.read().decode("utf-8", "replace").splitlines()[-40:])
        code = self._proc.poll()
        state = "running" if code is None else f"exited with code {code}"
        return ForkServerError(f"fork server (pid {self._proc.pid}, {state}) {what}; its stderr:\n{tail}")

    def _send(self, message: Mapping[str, Any]) -> None:
        assert self._proc.stdin is not None
        try:
            self._proc.stdin.write(json.dumps(message).encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, ValueError) as err:
            raise self._failure(f"could not take a request ({err})") from err

    def _readable(self, timeout: float) -> bool:
        assert self._proc.stdout is not None
        if b"\n" in self._buffer:
            return True
        ready, _, _ = select.select([self._proc.stdout.fileno()], [], [], timeout)
        return bool(ready)

    def _read_events(self) -> list[dict[str, Any]]:
        """Read what the server has sent (without blocking once the buffer holds a line); record exits."""
        assert self._proc.stdout is not None
        if b"\n" not in self._buffer:
            chunk = os.read(self._proc.stdout.fileno(), 65536)
            if not chunk:
                raise self._failure("closed its pipe")
            self._buffer += chunk
        events = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            event = json.loads(line)
            if event.get("event") == "exited":
                self._exits[int(event["pid"])] = int(event["code"])
            events.append(event)
        return events

    def _next_event(self, deadline: float) -> dict[str, Any]:
        """The next event other than ``exited`` (those are recorded), waiting until `deadline`."""
        pending: list[dict[str, Any]] = []
        while not pending:
            if not self._readable(max(0.0, deadline - time.monotonic())):
                raise self._failure("did not answer in time")
            pending = [e for e in self._read_events() if e.get("event") != "exited"]
        if len(pending) > 1:
            raise self._failure(f"sent unexpected events {pending[1:]!r}")
        return pending[0]


_SERVERS: dict[tuple[str, tuple[tuple[str, str], ...]], ForkServer] = {}
_SERVERS_LOCK = threading.Lock()


def server_for(env: Mapping[str, str]) -> ForkServer:
    """The running server for `env`'s :func:`server_key`, started (with `env`) if there is none or it died."""
    key = server_key(env)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is not None and not server.alive():
            server.close()
            server = None
        if server is None:
            server = ForkServer(env)
            _SERVERS[key] = server
        return server


def close_servers() -> None:
    """Close every server this process started (registered with ``atexit``)."""
    with _SERVERS_LOCK:
        for server in _SERVERS.values():
            server.close()
        _SERVERS.clear()


atexit.register(close_servers)


# --- the server side ---

#: In a rank: the script's globals, kept (as ``__main__``'s are) until the interpreter's own exit.
_SCRIPT_GLOBALS: dict[str, Any] = {}
#: In a rank: its exit code, once the script has ended (read by :func:`_end_rank`).
_RANK_EXIT: list[int] = []


def _send_line(fd: int, message: Mapping[str, Any]) -> None:
    data = json.dumps(message).encode() + b"\n"
    while data:
        data = data[os.write(fd, data) :]


def _become_rank(request: Mapping[str, Any], replies: int) -> None:
    """In the forked child: set up the rank's process state as described in the module docstring, run the script.

    Returns only through the script's ``SystemExit`` or exception, which the interpreter then handles as for
    ``python script.py``.
    """
    os.setsid()
    os.close(replies)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGCHLD", "SIGPIPE"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    numpy_random = sys.modules.get("numpy.random")  # Python's `random` reseeds itself in a fork; numpy's does not
    if numpy_random is not None:
        numpy_random.seed()  # fresh entropy: every rank its own stream, as in a fresh interpreter
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = os.path.abspath(request["script"])
    sys.argv = [request["script"], *request["args"]]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    for entry in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(1, entry)
    try:
        _SCRIPT_GLOBALS.update(runpy.run_path(script, run_name="__main__"))  # alive until the interpreter's exit
        code = 0
    except SystemExit as stop:  # as the interpreter reads it: None is 0, an int is itself, anything else printed
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - the script's uncaught exception, reported as python would
        traceback.print_exc()
        code = 1
    _RANK_EXIT.append(code)
    sys.exit(code)  # non-daemon threads are joined, atexit handlers run, then _end_rank ends the process


def _end_rank() -> None:
    """Registered with ``atexit`` before the preloads, so it runs last: in a rank, end it without tearing down.

    The interpreter's own teardown of the preloaded modules costs seconds of CPU per rank and nothing a
    script relies on; logging's handlers are closed and stdio flushed first. A no-op in the server.
    """
    if not _RANK_EXIT:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(_RANK_EXIT[0])


def _reap(replies: int, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        _send_line(replies, {"event": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    """The server's loop: import :data:`PRELOADED`, then fork a rank per request until stdin closes."""
    replies = os.dup(1)
    os.dup2(2, 1)  # a stray print of an imported module must not corrupt the replies
    atexit.register(_end_rank)  # before the preloads register theirs: it runs after them
    for name in PRELOADED:
        importlib.import_module(name)
    # The ~440,000 objects of the imports go to the permanent generation: a rank's full collections (the
    # Trainer's and Accelerate's ``free_memory`` run one, ~0.5 CPU-s each) skip them, and no collection
    # writes to the pages a rank shares with the server.
    gc.collect()
    gc.freeze()
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    _send_line(replies, {"event": "ready", "pid": os.getpid(), "threads": threads})
    children: set[int] = set()
    buffer = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05 if children else None)
        if ready:
            chunk = os.read(0, 1 << 20)
            if not chunk:
                break  # the client is gone
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _become_rank(request, replies)  # leaves by SystemExit or the script's exception only
                children.add(pid)
                _send_line(replies, {"event": "started", "id": request["id"], "pid": pid})
        _reap(replies, children)
    for pid in children:  # the client is gone: stop what it left running
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
