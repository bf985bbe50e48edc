"""One writer per worktree across daemons: two daemons of the user on one
state directory (each its own socket; the systemd service and one started by
hand) never let two sessions write one worktree, or one inside the other, at
once (dispatchd/daemon/writers.py)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, shell, wait_for_pool, wait_until


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = Daemon(tmp_path / "a", "--cgroup", "off")
    second = None
    try:
        second = Daemon(tmp_path / "b", "--cgroup", "off", state=first.state)
        yield first, second
    finally:
        for d, killed in ((second, False), (first, first.proc.poll() == -signal.SIGKILL)):
            if d is not None:
                assert d.stop() == (-signal.SIGKILL if killed else 0), d.log()


def _refusal(worktree: Path, sid: str, daemon: Daemon) -> str:
    return (f"write_file: the worktree {worktree} is being written by session {sid} of another dispatchd "
            f"(pid {daemon.proc.pid}; holds it since ")


def test_a_second_daemon_s_session_cannot_write_while_the_first_s_does(two: tuple[Daemon, Daemon],
                                                                       worktree: Path) -> None:
    first, second = two
    with first.connect() as c1, second.connect() as c2, \
            c1.open_session(str(worktree)) as s1, c2.open_session(str(worktree)) as s2:
        assert s1.registry.get("write_file").call({"path": "a.txt", "content": "first"}).is_success
        refused = s2.registry.get("write_file").call({"path": "a.txt", "content": "second"})
        assert refused.is_failure
        assert refused.error.startswith(_refusal(worktree, s1.id, first)), refused.error
        assert refused.error.endswith("only one session at a time may write a worktree: close that session, "
                                      "or use this one to read"), refused.error
        assert refused.metadata == {"write_locked": True}
        assert shell(s2, "touch b.txt").metadata == {"write_locked": True}
        assert (worktree / "a.txt").read_text() == "first" and not (worktree / "b.txt").exists()
        # The holder writes on; reading stays open to the other.
        assert s1.registry.get("write_file").call({"path": "a.txt", "content": "1st"}).is_success
        assert s2.registry.get("read_file").call({"path": "a.txt"}).output == "0: 1st"
        s1.close()
        # The twin: once it ends, the other daemon's session writes.
        assert s2.registry.get("write_file").call({"path": "a.txt", "content": "second"}).is_success
        assert (worktree / "a.txt").read_text() == "second"


def test_a_lock_given_back_passes_to_the_other_daemon(two: tuple[Daemon, Daemon], worktree: Path) -> None:
    first, second = two
    with first.connect() as c1, second.connect() as c2, \
            c1.open_session(str(worktree)) as s1, c2.open_session(str(worktree)) as s2:
        assert shell(s1, "true").is_success
        assert shell(s2, "true").metadata == {"write_locked": True}
        assert s1.release_write_lock()["writes"] is False
        assert shell(s2, "touch by-second").is_success
        refused = s1.registry.get("write_file").call({"path": "a.txt", "content": "late"})
        assert refused.error.startswith(_refusal(worktree, s2.id, second)), refused.error


def test_nested_worktrees_on_two_daemons_count_as_one(two: tuple[Daemon, Daemon], worktree: Path,
                                                      tmp_path: Path) -> None:
    first, second = two
    sibling = tmp_path / "sibling"
    sibling.mkdir()
    with first.connect() as c1, second.connect() as c2, c1.open_session(str(worktree)) as outer, \
            c2.open_session(str(worktree / "src")) as inner, c2.open_session(str(sibling)) as beside:
        assert shell(outer, "true").is_success
        refused = inner.registry.get("create_file").call({"path": "x", "content": ""})
        assert refused.error.startswith(f"create_file: the worktree {worktree / 'src'} is being written by "
                                        f"session {outer.id} of another dispatchd"), refused.error
        assert shell(beside, "touch x").is_success  # the twin: another worktree is another lock


def test_a_restore_is_refused_while_another_daemon_s_session_writes(two: tuple[Daemon, Daemon],
                                                                     worktree: Path) -> None:
    first, second = two
    with first.connect() as c1, second.connect() as c2, \
            c1.open_session(str(worktree)) as s1, c2.open_session(str(worktree)) as s2:
        cid = s2.checkpoint()
        assert s1.registry.get("write_file").call({"path": "a.txt", "content": "first"}).is_success
        with pytest.raises(dispatch.RequestFailed) as err:
            s2.restore(cid)
        assert err.value.code == "write_locked"
        assert str(err.value).startswith(f"restore refused: the worktree {worktree} is being written by session "
                                         f"{s1.id} of another dispatchd"), str(err.value)
        assert (worktree / "a.txt").read_text() == "first"
        s1.close()
        assert s2.restore(cid)["checkpoint"] == cid  # the twin: restored once the writer has ended
        assert not (worktree / "a.txt").exists()


def test_a_killed_daemon_s_lock_is_gone_with_it(two: tuple[Daemon, Daemon], worktree: Path) -> None:
    first, second = two
    with second.connect() as c2, c2.open_session(str(worktree)) as s2:
        c1 = first.connect()
        s1 = c1.open_session(str(worktree))
        assert shell(s1, "touch by-first").is_success
        assert shell(s2, "true").metadata == {"write_locked": True}  # the twin: alive, it holds
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(timeout=10)
        with contextlib.suppress(dispatch.DispatchError, OSError):
            s1.close()
        c1.close()
        assert shell(s2, "touch by-second").is_success
        assert (worktree / "by-second").exists()


def _writers_dir(d: Daemon) -> Path:
    return d.state / "dispatchd" / "writers"


def test_a_grant_that_cannot_be_recorded_is_refused(two: tuple[Daemon, Daemon], worktree: Path) -> None:
    """Fail closed: the other daemons could not be told, so the session reads only."""
    first, _ = two
    with first.connect() as c1, c1.open_session(str(worktree)) as s1, c1.open_session(str(worktree)) as s2:
        assert shell(s1, "true").is_success  # the table exists
        s1.close()
        _writers_dir(first).chmod(0o500)
        try:
            refused = s2.registry.get("write_file").call({"path": "a.txt", "content": "x"})
        finally:
            _writers_dir(first).chmod(0o700)
        assert refused.error == (f"write_file: the worktree {worktree}: its write lock could not be recorded for "
                                 "the other daemons on this state directory (Permission denied); this session may "
                                 "only read it"), refused.error
        assert not (worktree / "a.txt").exists()
        # The twin: recorded, it writes.
        assert s2.registry.get("write_file").call({"path": "a.txt", "content": "x"}).is_success


def test_an_entry_that_cannot_be_read_refuses_every_worktree(two: tuple[Daemon, Daemon], worktree: Path) -> None:
    """A locked entry of another daemon's that does not parse (never written
    so: each is whole before it is seen) holds everything while it stands."""
    first, _ = two
    with first.connect() as c1, c1.open_session(str(worktree)) as s1:
        assert s1.registry.get("read_file").call({"path": "README.md"}).is_success
        _writers_dir(first).mkdir(mode=0o700, exist_ok=True)
        planted = _writers_dir(first) / "999-00000000.000000000000.held"
        fd = os.open(planted, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, b"{not json")
            refused = s1.registry.get("write_file").call({"path": "a.txt", "content": "x"})
            assert refused.error.startswith(f"write_file: the worktree {worktree} is being written by a session "
                                            "of another dispatchd, on this state directory; "), refused.error
        finally:
            os.close(fd)
        assert s1.registry.get("write_file").call({"path": "a.txt", "content": "x"}).is_success  # unlocked: gone
        assert not planted.exists()


def test_writing_sessions_leave_no_descriptor_and_no_entry(two: tuple[Daemon, Daemon], worktree: Path) -> None:
    first, _ = two
    with first.connect() as c1:
        with c1.open_session(str(worktree)) as s:
            assert shell(s, "true").is_success  # the first grant: what a grant opens for good, if anything
        wait_for_pool(c1, "default/off", 2)  # the pool's sandboxes hold descriptors of the daemon's too
        fds = len(os.listdir(f"/proc/{first.proc.pid}/fd"))
        for i in range(5):
            with c1.open_session(str(worktree)) as s:
                assert s.registry.get("write_file").call({"path": "a.txt", "content": f"{i}"}).is_success
                s.release_write_lock()
                assert shell(s, f"echo {i} > b.txt").is_success
                assert sorted(n.rpartition(".")[2] for n in os.listdir(_writers_dir(first)) if n[0] != ".") == \
                    ["grants", "held", "loose"]  # held again, and loose since the release: its processes live
        wait_for_pool(c1, "default/off", 2)
        assert wait_until(lambda: len(os.listdir(f"/proc/{first.proc.pid}/fd")) == fds), \
            (fds, os.listdir(f"/proc/{first.proc.pid}/fd"))
        assert sorted(os.listdir(_writers_dir(first))) == [".mutex", "grants"]
