"""Every client wait is bounded: a daemon or tool server
stopped with SIGSTOP (processes this test started) makes requests fail with a
clear error after the configured wait, never hang; after SIGCONT the same
connection serves again (the allowed twin)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import dispatch
from dispatchd.policy import default_policy_dir
from tests.conftest import Daemon, _refuse_root


@contextlib.contextmanager
def stopped(*pids: int) -> Iterator[None]:
    for pid in pids:
        psutil.Process(pid).send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5  # a signal is delivered, not obeyed, when kill() returns
    while any(psutil.Process(pid).status() != psutil.STATUS_STOPPED for pid in pids):
        assert time.monotonic() < deadline, "the processes did not stop"
        time.sleep(0.01)
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def quick_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose policy 'quick' gives commands a 1 s time limit."""
    _refuse_root()
    base = tmp_path_factory.mktemp("timeouts")
    policies = base / "policies"
    shutil.copytree(default_policy_dir(), policies)
    text = (policies / "default.toml").read_text().replace("command_timeout_s = 120", "command_timeout_s = 1")
    (policies / "quick.toml").write_text(text)
    d = Daemon(base, "--policies", str(policies))
    yield d
    assert d.stop() == 0


def test_a_stopped_daemon_fails_requests_after_the_wait(quick_daemon: Daemon) -> None:
    client = dispatch.connect(quick_daemon.socket, timeout=1)
    try:
        with stopped(quick_daemon.proc.pid):
            started = time.monotonic()
            with pytest.raises(dispatch.RequestTimeout) as info:
                client.list_sessions()
            assert 0.9 < time.monotonic() - started < 3
            assert str(info.value).startswith(f"dispatchd at {quick_daemon.socket} did not answer within 1 s")
            started = time.monotonic()
            with pytest.raises(dispatch.RequestTimeout):
                dispatch.connect(quick_daemon.socket, timeout=1)  # connected (the backlog), the hello unanswered
            assert time.monotonic() - started < 3
        assert client.list_sessions() == []  # the twin: running again, the same connection serves
    finally:
        client.close()


def test_dispatch_status_against_a_stopped_daemon(quick_daemon: Daemon) -> None:
    with stopped(quick_daemon.proc.pid):
        started = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--socket", quick_daemon.socket, "--no-autostart",
                              "--request-timeout", "1", "status"], capture_output=True, text=True, timeout=30)
        assert time.monotonic() - started < 10
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"dispatch: dispatchd at {quick_daemon.socket} did not answer within 1 s")


def test_a_stopped_tool_server_fails_the_call_after_its_limit_and_margin(quick_daemon: Daemon, worktree: Path) -> None:
    with dispatch.connect(quick_daemon.socket, timeout=5, call_margin=1) as client:
        with client.open_session(str(worktree), policy="quick") as session:
            read = session.registry.get("read_file")
            assert read.call({"path": "README.md"}).is_success
            sandbox = [p.pid for p in psutil.Process(quick_daemon.proc.pid).children(recursive=True)]
            with stopped(*sandbox):
                started = time.monotonic()
                result = read.call({"path": "README.md"})
                waited = time.monotonic() - started
            assert result.is_failure and result.metadata == {"client_timeout_s": 2.0}
            assert result.error == (
                f"read_file: no reply from the sandbox of session {session.id} within 2 s (the call's own limit "
                "of 1 s plus a margin of 1 s): its tool server is stopped or overloaded; the call may still "
                "finish, so its outcome is unknown")
            assert 1.9 < waited < 4
            # The twin: running again, the late reply is dropped and the next call is served.
            assert read.call({"path": "README.md"}).output == "0: hello\n1: world"
