"""The daemon heals or exits: its helper processes and its socket path watched
(``daemon/helpers.py``), and a stop that leaves nothing it made running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, listening, shell, wait_for_pool


def _fork_server_pid(client: dispatch.Client) -> int:
    helpers = client.status()["daemon"]["helpers"]
    found = re.search(r"fork server pid (\d+): running", helpers)
    assert found, helpers
    return int(found.group(1))


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _wait_exit(d: Daemon, timeout: float = 30) -> int:
    d.proc.wait(timeout)
    return d.stop()


def test_the_fork_server_killed_the_daemon_ends_its_sessions_with_the_cause_and_exits(
        tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--pool", "0")
    try:
        with d.connect() as client:
            session = client.open_session(str(worktree))
            # The allowed twin: with the fork server running, calls work and status says so.
            assert shell(session, "echo ok").output == "ok\n"
            pid = _fork_server_pid(client)
            os.kill(pid, signal.SIGKILL)
            # Once the daemon has seen it (its status says so; a call at once
            # could come before, and be served), and before it exits, the
            # session's calls fail and opens are refused.
            deadline = time.monotonic() + 30
            helpers = ""
            while time.monotonic() < deadline and "gone (" not in helpers:
                helpers = client.status()["daemon"]["helpers"]
                time.sleep(0.05)
            assert f"fork server pid {pid}: gone (dispatchd's fork server (pid {pid}) was killed by signal 9" \
                in helpers, helpers
            result = shell(session, "echo late")
            assert result.is_failure
            with pytest.raises(dispatch.DispatchError):
                client.open_session(str(worktree)).close()
            with contextlib.suppress(dispatch.DispatchError):
                session.close()
        code = _wait_exit(d)
    finally:
        d.stop()
    assert code == 1, d.log()
    log = d.log()
    assert f"event=helper_died helper=fork_server detail=\"dispatchd's fork server (pid {pid}) was killed by " \
           "signal 9 (Killed)" in log
    assert "reason=fork_server_died" in log
    assert "event=stopped code=1" in log
    assert not os.path.exists(d.socket)  # its own socket, unlinked on the way out
    # What systemd or autostart does next: a new daemon on the same path and state serves.
    (tmp_path / "again").mkdir()
    again = Daemon(tmp_path / "again", "--pool", "0", state=d.state)
    try:
        with again.connect() as client, client.open_session(str(worktree)) as session:
            assert shell(session, "echo ok").output == "ok\n"
            assert "running" in client.status()["daemon"]["helpers"]
    finally:
        assert again.stop() == 0, again.log()


def test_the_session_told_why_when_the_fork_server_died(tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--pool", "0")
    try:
        with d.connect() as client:
            session = client.open_session(str(worktree))
            os.kill(_fork_server_pid(client), signal.SIGKILL)
            deadline = time.monotonic() + 10
            message = ""
            while time.monotonic() < deadline:
                result = shell(session, "true")
                message = result.error or ""
                if "fork server" in message:
                    break
                time.sleep(0.05)
            with contextlib.suppress(dispatch.DispatchError):
                session.close()
        assert "dispatchd's fork server" in message and "was killed by signal 9" in message, message
        assert _wait_exit(d) == 1
    finally:
        d.stop()


def test_a_session_whose_network_stack_dies_ends_with_that_cause(tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--pool", "0")
    try:
        with d.connect() as client:
            other_wt = tmp_path / "other"
            other_wt.mkdir()
            with client.open_session(str(other_wt), network=True) as other:
                with client.open_session(str(worktree), network=True) as session:
                    stacks = re.findall(rf"event=stack_started session={session.id} pid=(\d+)", d.log())
                    assert stacks, d.log()
                    os.kill(int(stacks[-1]), signal.SIGKILL)
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and session.id in [s["id"] for s in client.list_sessions()]:
                        time.sleep(0.05)
                    assert session.id not in [s["id"] for s in client.list_sessions()]
                    assert f"event=helper_died helper=network_stack session={session.id}" in d.log()
                    # The allowed twin: the other session, its stack alive, goes on; so does the daemon.
                    assert shell(other, "echo ok").output == "ok\n"
                    assert "1 running, 1 ended a session" in client.status()["daemon"]["helpers"]
                    with client.open_session(str(worktree), network=True) as third:  # a new open, its own stack
                        assert shell(third, "echo ok").output == "ok\n"
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("replaced", [True, False])
def test_a_daemon_whose_socket_path_is_taken_exits_once_idle_and_leaves_the_new_socket(
        tmp_path: Path, worktree: Path, replaced: bool) -> None:
    state = tmp_path / "state"
    first = Daemon(tmp_path, "--pool", "0", state=state)
    second = None
    try:
        with first.connect() as client:
            session = client.open_session(str(worktree))
            os.unlink(first.socket)  # deleted under it
            if replaced:  # and a second daemon on the same path (an autostart would do that)
                second = Daemon(tmp_path, "--pool", "0", state=tmp_path / "state2")
            time.sleep(2.5)
            # Still serving what it holds: the session works, the daemon has not exited.
            assert shell(session, "echo ok").output == "ok\n"
            assert first.proc.poll() is None
            assert "socket: " + ("replaced" if replaced else "gone") in client.status()["daemon"]["helpers"]
            session.close()
        assert first.proc.wait(10) == (0 if replaced else 3), first.log()
        assert "event=socket_path_lost" in first.log()
        if replaced:
            assert second is not None
            assert "event=socket_not_unlinked" in first.log()
            assert os.path.exists(second.socket) and listening(second.socket)
            with second.connect() as c2:
                assert c2.status()["pid"] == second.proc.pid
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0
    assert not os.path.exists(first.socket)  # the second one's stop removed its own


def test_a_clean_stop_leaves_no_sandbox_made_ahead_running(tmp_path: Path, worktree: Path) -> None:
    d = Daemon(tmp_path, "--pool", "2")
    with d.connect() as client:
        # Sandboxes made ahead with a network stack too (pasta, the fork server's child).
        client.open_session(str(worktree), network=True).close()
        wait_for_pool(client, kind="default/on", n=2)
        fork_server = _fork_server_pid(client)
    made = _children(fork_server)
    assert len(made) >= 2  # the allowed twin: they run while the daemon serves
    pidfds = [os.pidfd_open(pid) for pid in made]
    try:
        assert d.stop() == 0
        left = [pid for pid, fd in zip(made, pidfds) if not _exited(fd)]
        assert left == [], left
    finally:
        for fd in pidfds:
            os.close(fd)


def _exited(pidfd: int) -> bool:
    import select
    p = select.poll()
    p.register(pidfd, select.POLLIN)
    return bool(p.poll(0))


def test_a_stop_while_sandboxes_are_being_made_ahead_waits_for_them(tmp_path: Path, worktree: Path) -> None:
    """The stop comes while the pool makes sandboxes (with their network
    stacks): every process the fork server had is gone when the daemon has exited."""
    import threading
    d = Daemon(tmp_path, "--pool", "2")
    seen: dict[int, int] = {}
    done = threading.Event()
    with d.connect() as client:
        fork_server = _fork_server_pid(client)

        def watch() -> None:
            while not done.is_set():
                for pid in _children(fork_server):
                    if pid not in seen:
                        try:
                            seen[pid] = os.pidfd_open(pid)
                        except OSError:
                            pass
                time.sleep(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        client.open_session(str(worktree), network=True).close()
        time.sleep(0.05)  # the pool starts on the kind just opened
    try:
        d.proc.send_signal(signal.SIGTERM)
        d.proc.wait(30)
        done.set()
        watcher.join()
        left = [pid for pid, fd in seen.items() if not _exited(fd)]
        assert seen and left == [], (left, d.log())
    finally:
        done.set()
        d.stop()
        for fd in seen.values():
            os.close(fd)
