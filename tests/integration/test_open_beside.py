"""An open takes the worktree's trusted baseline while its sandbox is given
the session (dispatchd/daemon/beside.py), with a real daemon: a baseline
refused refuses the open as before, and leaves no sandbox of it running."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import Daemon, shell, wait_for_pool


def _deep(top: Path, levels: int) -> None:
    """``levels`` nested directories under ``top`` (by descriptor: no path is that long)."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(levels):
            os.mkdir("d", dir_fd=fd)
            nxt = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nxt
    finally:
        os.close(fd)


def test_a_baseline_refused_beside_the_sandbox_refuses_the_open_and_ends_it(
        tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--cgroup", "off", "--log-level", "debug")
    try:
        with d.connect() as client:
            wait_for_pool(client, "default/off", 2)
            _deep(worktree, 4100)  # deeper than the baseline's walk goes (runnables.MAX_DEPTH)
            with pytest.raises(dispatch.DispatchError, match=(
                    "deeper than 4096 directories, more than dispatchd checks for repositories and files "
                    "your tools run; no session opened")):
                client.open_session(str(worktree))
            assert client.list_sessions() == []
            # The sandbox it was given (made ahead) is gone, not left waiting.
            adopted = re.findall(r"event=worker_ready session=(\w+) pid=(\d+) made_ahead=1", d.log())
            assert adopted, d.log()
            deadline = time.monotonic() + 10
            pid = int(adopted[-1][1])
            while time.monotonic() < deadline and psutil.pid_exists(pid) and \
                    psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                time.sleep(0.05)
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            # The allowed twin: the same worktree without the deep tree opens, and its calls run.
            subprocess.run(["rm", "-rf", str(worktree / "d")], check=True)  # shutil.rmtree recurses
            with client.open_session(str(worktree)) as s:
                assert shell(s, "echo ok").output == "ok\n"
    finally:
        assert d.stop() == 0, d.log()
