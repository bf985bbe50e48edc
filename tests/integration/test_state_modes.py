"""The daemon sets the modes of its own files back (dispatchd/statemodes.py).

Without user namespaces (degraded mode) a session can chmod any file the
user owns (Landlock ABI <= 7 does not govern chmod), the daemon's state and
socket directories included. A mode of 000 on ``inuse/.mutex`` once made
every later open of every daemon on the state directory fail, restarts
included; 0777 on the socket's directory made every client refuse it. Each
attempt here runs from a real degraded session, with its twin showing the
chmod happened (the mode the session itself reads back, and the file's on
disk before the heal); the daemon's next open, its restart, or its watch of
the socket set it back, and say so in the log.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, shell, wait_until


def _degraded(base: Path, state: Path | None = None, home: Path | None = None) -> Daemon:
    """A degraded daemon whose passwd home is ``home`` (``base/home``): its
    table of worktrees in use (``inusedir.py``) is its own, never the one the
    other test daemons share, so that chmod-ing it here keeps none of them out."""
    home = home or base / "home"
    home.mkdir(parents=True, exist_ok=True)
    base.mkdir(parents=True, exist_ok=True)
    # No pool: each open makes its own scratch directory (what a changed sessions/ refused).
    return Daemon(base, "--no-user-namespaces", "--cgroup", "off", "--pool", "0", state=state,
                  prefix=(sys.executable, str(REPO / "tests" / "passwd_home.py"), str(home)))


def _table(d: Daemon) -> Path:
    """The table of worktrees in use of a daemon of ``_degraded`` (its passwd home's)."""
    return d.base / "home" / ".local" / "state" / "dispatchd" / "inuse"


def _repo(path: Path) -> Path:
    path.mkdir(parents=True)
    for args in (["init", "-q"], ["config", "user.email", "u@example.invalid"], ["config", "user.name", "u"]):
        subprocess.run(["git", *args], cwd=path, check=True, timeout=60)
    (path / "a.txt").write_text("a\n")
    subprocess.run(["git", "add", "."], cwd=path, check=True, timeout=60)
    subprocess.run(["git", "commit", "-qm", "init"], cwd=path, check=True, timeout=60)
    return Path(os.path.realpath(path))


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _chmod_from(session: dispatch.Session, path: Path, mode: str) -> str:
    """chmod from inside the session, and the mode it reads back (octal)."""
    r = shell(session, f"chmod {mode} '{path}' && stat -c %a '{path}'")
    assert r.is_success, (r.error, r.output)
    return r.output.strip()


def _repaired(d: Daemon, path: Path, was: int) -> bool:
    return re.search(rf"event=state_mode_repaired path={re.escape(str(path))} was=0o{was:03o} ", d.log()) is not None


@pytest.mark.parametrize("target, mode", [("inuse/.mutex", 0o600), ("inuse", 0o700), ("sessions", 0o700),
                                          ("baselines", 0o700)])
def test_a_state_file_made_000_by_a_session_is_set_back_by_the_next_open(tmp_path: Path, target: str,
                                                                         mode: int) -> None:
    d = _degraded(tmp_path / "d")
    first, second = _repo(tmp_path / "w" / "first"), _repo(tmp_path / "w" / "second")
    path = _table(d) / target[len("inuse/"):] if target.startswith("inuse") else d.state / "dispatchd" / target
    try:
        with d.connect() as client:
            with client.open_session(str(first)) as s:
                assert s.status()["protections"]["mode"] == "degraded"
                assert _chmod_from(s, path, "000") == "0"  # the session really changed it
                assert _mode(path) == 0  # and so it stays, until the daemon next needs it
                assert not _repaired(d, path, 0)
                with client.open_session(str(second)) as t:  # what was refused ("Permission denied")
                    assert shell(t, "cat a.txt").output == "a\n"
            assert _repaired(d, path, 0), d.log()
            assert _mode(path) == mode
    finally:
        assert d.stop() == 0, d.log()


def test_a_mutex_and_a_baseline_lock_made_000_are_set_back_at_the_next_start(tmp_path: Path) -> None:
    d = _degraded(tmp_path / "d")
    wt = _repo(tmp_path / "w" / "repo")
    top = d.state / "dispatchd"
    mutex = _table(d) / ".mutex"
    with d.connect() as client:
        s = client.open_session(str(wt))
        lock = next((top / "baselines").glob("*.lock"))
        assert _chmod_from(s, mutex, "000") == "0"
        assert _chmod_from(s, lock, "000") == "0"
        # Killed as it stands (a clean stop would take the mutex, and heal it, to give the entry back).
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        s.detach()
    d.stop()
    assert (_mode(mutex), _mode(lock)) == (0, 0)  # what the next daemon finds
    again = _degraded(d.base)
    try:
        # (Said as the start gets to each: the socket may answer a moment before the table is chosen.)
        assert wait_until(lambda: _repaired(again, mutex, 0) and _repaired(again, lock, 0)), again.log()
        assert _mode(mutex) == 0o600
        assert not lock.exists() or _mode(lock) == 0o600  # its dead domain recovered then dropped, or kept
        with again.connect() as client, client.open_session(str(wt)) as t:
            assert shell(t, "cat a.txt").output == "a\n"
    finally:
        assert again.stop() == 0, again.log()


def test_the_socket_directory_and_socket_changed_by_a_session_are_set_back_within_two_seconds(
        tmp_path: Path) -> None:
    d = _degraded(tmp_path / "d")
    wt = _repo(tmp_path / "w" / "repo")
    sock = Path(d.socket)
    run = sock.parent
    try:
        with d.connect() as client, client.open_session(str(wt)) as s:
            for path, mode, back in ((run, "777", 0o700), (sock, "000", 0o600)):
                t0 = time.monotonic()
                assert _chmod_from(s, path, mode) == f"{int(mode, 8):o}"  # the session really changed it
                assert wait_until(lambda: _mode(path) == back, timeout=10)
                assert time.monotonic() - t0 < 2.5  # the watch looks every second
                assert _repaired(d, path, int(mode, 8)), d.log()
        with dispatch.connect(d.socket) as again:  # a client trusts the directory again, and connects
            assert again.status()["daemon"]
    finally:
        assert d.stop() == 0, d.log()
