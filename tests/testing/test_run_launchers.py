"""``run_launchers`` stops what a launch started even when the launcher itself is gone first."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import psutil

from hf_altparams.testing.launch import launch_env, run_launchers

# A "launcher" that starts a rank in a session of its own (as torchrun does), the rank ignoring SIGTERM,
# and dies before it: the rank is reparented away from the launcher's tree.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    rank = ("import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); "
            "time.sleep(600)")
    subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]], start_new_session=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.05)
    sys.exit(1)
""")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_rank_whose_launcher_died_first_is_stopped_too(tmp_path: Path) -> None:
    pid_file = tmp_path / "rank.pid"
    polls: list[int] = []
    (done,), timed_out = run_launchers(
        [[sys.executable, "-c", LAUNCHER, str(pid_file)]], launch_env(), timeout=120, on_poll=lambda: polls.append(1)
    )
    assert done.returncode == 1 and not timed_out and polls, done.stdout
    pid = int(pid_file.read_text())
    try:
        assert not _alive(pid), "the orphaned rank outlived run_launchers"
    finally:
        if _alive(pid):
            psutil.Process(pid).kill()
