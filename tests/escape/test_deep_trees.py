"""Trees a session shapes cannot break the daemon's walks (``dispatchd/treewalk.py``):
1,500 nested directories in its /tmp or its worktree, then a close, a daemon
killed with such a scratch directory left, a new start."""

from __future__ import annotations

import os
import shlex
import signal
from pathlib import Path

import dispatch
from tests.conftest import Daemon, shell, wait_until

# Nested directories by descriptor (a path that long is past PATH_MAX).
NEST = r"""
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
for _ in range(int(sys.argv[2])):
    os.mkdir("d", dir_fd=fd)
    n = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = n
print("made", flush=True)
"""


def _nest(session: dispatch.Session, where: str, depth: int) -> None:
    r = shell(session, f"/usr/bin/python3 -c {shlex.quote(NEST)} {where} {depth}")
    assert r.output == "made\n", r


def test_a_deep_tree_in_tmp_and_in_the_worktree_and_the_close_still_works(tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--pool", "0")
    try:
        with d.connect() as client:
            # The allowed twin: a shallow tree, closed as ever.
            session = client.open_session(str(worktree))
            _nest(session, "/tmp", 3)
            session.close()
            session = client.open_session(str(worktree))
            _nest(session, "/tmp", 1500)
            (worktree / "deep").mkdir()
            _nest(session, str(worktree / "deep"), 1500)
            scratch = Path(d.state) / "dispatchd" / "sessions" / session.id
            assert scratch.exists()
            session.close()  # raised "internal error: RecursionError" before
            assert wait_until(lambda: not scratch.exists())  # removed after the close's reply
            assert "RecursionError" not in d.log() and "internal_error" not in d.log()
            with client.open_session(str(worktree)) as again:  # the daemon goes on
                assert shell(again, "echo ok").output == "ok\n"
    finally:
        assert d.stop() == 0, d.log()


def test_a_daemon_killed_with_a_deep_scratch_tree_left_starts_again_and_removes_it(
        tmp_path: Path, worktree: Path) -> None:
    state = tmp_path / "state"
    (tmp_path / "one").mkdir()
    first = Daemon(tmp_path / "one", "--pool", "0", state=state)
    with first.connect() as client:
        session = client.open_session(str(worktree))
        _nest(session, "/tmp", 1500)
        scratch = state / "dispatchd" / "sessions" / session.id
        assert scratch.exists()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
        first.stop()
        session.detach()
    (tmp_path / "two").mkdir()
    second = Daemon(tmp_path / "two", "--pool", "0", state=state)  # died in remove_stale before
    try:
        assert not scratch.exists()
        assert "event=stale_scratch_removed count=1" in second.log()
        with second.connect() as c2, c2.open_session(str(worktree)) as s2:
            assert shell(s2, "echo ok").output == "ok\n"
    finally:
        assert second.stop() == 0, second.log()
    assert os.listdir(state / "dispatchd" / "sessions") == []
