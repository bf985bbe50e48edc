"""How ``dispatch mcp`` ends: a real daemon, ``dispatch mcp`` as a subprocess
driven with raw JSON-RPC lines, its stdin left open as a host leaves it.

- SIGTERM, SIGINT or SIGHUP, after ``initialize`` and a call (finished, or
  still running), end it within seconds with status 0: the call in flight is
  answered "Connection closed", its command ends, and the session is gone
  from the daemon (its write lock with it: another session writes). The
  twin: the client closing stdin ends it the same way. So does a stop while
  the host reads none of its answers (its stdout pipe full).
- A session that ends under it (closed from outside, or its daemon
  restarted) makes the next call's answer say so and why, and ``dispatch
  mcp`` exits 4 with one line on stderr; the twin: the call before is served.
"""

from __future__ import annotations

import array
import fcntl
import json
import signal
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import dispatch
from tests.conftest import Daemon, running, wait_until
from tests.integration.test_mcp import _sessions_on
from tests.integration.test_mcp_unreadable import _Mcp, started

EXIT_WITHIN_S = 5.0  # from the signal (or the close of stdin) to the process's exit
STOPPING = ("\n[dispatch mcp stops serving: its dispatchd session has ended. The MCP host must start it again "
            "for a new session.]")


@contextmanager
def _started(daemon: Daemon, worktree: Path, tmp_path: Path) -> Iterator[tuple[_Mcp, Path]]:
    """``dispatch mcp`` initialized, its stdin open; and the file of its stderr."""
    errors = tmp_path / "mcp-stderr.log"
    with open(errors, "wb") as err, started(daemon, worktree, err) as mcp:
        yield mcp, errors


def _call(mcp: _Mcp, rid: int, name: str, arguments: dict[str, Any]) -> None:
    mcp.send(json.dumps({"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                         "params": {"name": name, "arguments": arguments}}).encode())


def _text(reply: dict[str, Any]) -> str:
    text: str = reply["result"]["content"][0]["text"]
    return text


def _exit_within(mcp: _Mcp, seconds: float) -> tuple[int, float]:
    started = time.monotonic()
    code = mcp.proc.wait(timeout=seconds + 25)  # a hang fails below, with the time it took
    return code, time.monotonic() - started


@pytest.mark.parametrize("in_flight", [False, True], ids=["after-a-call", "call-in-flight"])
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "SIGHUP", "close-stdin"])
def test_a_stop_ends_it_at_once_with_stdin_open_and_closes_the_session(
    daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path, stop: str, in_flight: bool
) -> None:
    marker = "318.7"
    with _started(daemon, worktree, tmp_path) as (mcp, errors):
        _call(mcp, 1, "write_file", {"path": "taken.txt", "content": "the write lock is this session's\n"})
        assert mcp.read()["result"]["isError"] is False
        [session] = _sessions_on(client, worktree)
        assert session["writes"] is True
        if in_flight:
            _call(mcp, 2, "shell_exec", {"command": f"sleep {marker}; echo finished > late.txt"})
            assert wait_until(lambda: running(marker) != [])
        if stop == "close-stdin":
            assert mcp.proc.stdin is not None
            mcp.proc.stdin.close()
        else:
            mcp.proc.send_signal(getattr(signal, stop))
        code, took = _exit_within(mcp, EXIT_WITHIN_S)
        assert mcp.proc.stdout is not None
        rest = [json.loads(line) for line in mcp.proc.stdout.read().splitlines()]
    stderr = errors.read_text()
    assert (code, "Traceback" not in stderr) == (0, True), stderr
    assert took < EXIT_WITHIN_S, f"{stop}: exited after {took:.1f} s"
    # The call in flight has its answer; nothing else was written.
    expected = [{"jsonrpc": "2.0", "id": 2, "error": {"code": -32000, "message": "Connection closed"}}] if in_flight else []
    assert rest == expected
    # The session is gone from the daemon, its command with it.
    assert _sessions_on(client, worktree) == []
    assert not any(s["worktree"] == str(worktree) for s in client.status()["sessions"])
    assert running(marker) == []
    assert not (worktree / "late.txt").exists()
    # Its write lock went with it: the next session writes.
    with client.open_session(str(worktree)) as after:
        assert after.registry.get("write_file").call({"path": "next.txt", "content": "mine\n"}).is_success


def test_a_stop_ends_it_while_the_host_reads_none_of_its_answers(
    daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path
) -> None:
    """Its stdout pipe full (answers of 16 KiB the host never reads): the
    writer waits for room, and a stop still ends it."""
    with _started(daemon, worktree, tmp_path) as (mcp, errors):
        assert mcp.proc.stdout is not None
        stdout = mcp.proc.stdout.fileno()

        def unread() -> int:
            count = array.array("i", [0])
            fcntl.ioctl(stdout, termios.FIONREAD, count)
            return count[0]

        for rid in range(1, 9):
            _call(mcp, rid, "shell_exec", {"command": "seq 1 20000"})
        assert wait_until(lambda: unread() >= 65536 - 16384)  # about full: the next answer does not fit
        mcp.proc.send_signal(signal.SIGTERM)
        code, took = _exit_within(mcp, EXIT_WITHIN_S)
    assert code == 0 and took < EXIT_WITHIN_S, (code, took, errors.read_text())
    assert _sessions_on(client, worktree) == []


def test_a_session_closed_from_outside_is_said_and_it_exits_4(
    daemon: Daemon, client: dispatch.Client, worktree: Path, tmp_path: Path
) -> None:
    with _started(daemon, worktree, tmp_path) as (mcp, errors):
        # The twin: with the session open, a call is served.
        _call(mcp, 1, "shell_exec", {"command": "echo alive"})
        alive = mcp.read()
        assert (_text(alive), alive["result"]["isError"]) == ("alive\n", False)
        [session] = _sessions_on(client, worktree)
        client.close_session(session["id"])
        _call(mcp, 2, "shell_exec", {"command": "echo after"})
        ended = mcp.read()
        code, took = _exit_within(mcp, EXIT_WITHIN_S)
    why = f"no such session: {session['id']!r} (it has ended: it was closed)"
    assert ended["id"] == 2 and ended["result"]["isError"] is True
    assert _text(ended).startswith(f"the sandbox of session {session['id']} went away during "
                                   f"shell_exec: {why} (")
    assert _text(ended).endswith(STOPPING)
    assert ended["result"]["structuredContent"]["session_ended"] == why
    assert code == 4 and took < EXIT_WITHIN_S
    stderr = errors.read_text()
    assert stderr.splitlines()[-1] == f"dispatch mcp: stopped serving: session {session['id']} has ended: {why}"
    assert "Traceback" not in stderr


def test_a_daemon_restarted_under_it_is_said_and_it_exits_4(worktree: Path, tmp_path: Path) -> None:
    (tmp_path / "daemon").mkdir()
    first = Daemon(tmp_path / "daemon")
    second: Daemon | None = None
    try:
        with _started(first, worktree, tmp_path) as (mcp, errors):
            _call(mcp, 1, "shell_exec", {"command": "echo alive"})
            assert _text(mcp.read()) == "alive\n"
            first.stop()
            second = Daemon(tmp_path / "daemon")
            _call(mcp, 2, "shell_exec", {"command": "echo after"})
            ended = mcp.read()
            code, took = _exit_within(mcp, EXIT_WITHIN_S)
        assert ended["id"] == 2 and ended["result"]["isError"] is True
        why = ended["result"]["structuredContent"]["session_ended"]
        assert why.startswith("dispatchd is gone (lost the connection to dispatchd at ") and \
            why.endswith("; the session ended with it")
        assert _text(ended).endswith(STOPPING)
        assert code == 4 and took < EXIT_WITHIN_S
        stderr = errors.read_text()
        assert stderr.splitlines()[-1].startswith("dispatch mcp: stopped serving: session ")
        assert stderr.splitlines()[-1].endswith(f" has ended: {why}")
        assert "Traceback" not in stderr
        with second.connect() as c:
            assert _sessions_on(c, worktree) == []
    finally:
        first.stop()
        if second is not None:
            second.stop()
