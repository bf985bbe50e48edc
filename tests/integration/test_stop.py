"""Clean stops: SIGTERM lets calls in flight finish, then ends every session."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import dispatch
from tests.conftest import Daemon, gone, processes_in, shell


def _until_started(worktree: Path, marker: str) -> None:
    """Wait for a command to have made ``marker`` in the worktree (its call
    is in flight from then on): a fixed wait before a signal was too short
    on a loaded machine."""
    deadline = time.monotonic() + 15
    while not (worktree / marker).exists():
        assert time.monotonic() < deadline, f"the call never started ({marker} not made)"
        time.sleep(0.02)
    (worktree / marker).unlink()


def _sigterm_during_a_call(d: Daemon, session: dispatch.Session, worktree: Path, command: str
                           ) -> tuple[threading.Thread, list[dispatch.Result]]:
    """``touch .started; COMMAND`` in flight in a thread (its result in the
    list once it returns), and the daemon sent SIGTERM once it has started."""
    results: list[dispatch.Result] = []
    call = threading.Thread(target=lambda: results.append(shell(session, f"touch .started; {command}")))
    call.start()
    _until_started(worktree, ".started")
    d.proc.send_signal(signal.SIGTERM)
    return call, results


def test_sigterm_lets_a_call_in_flight_finish_and_leaves_nothing(tmp_path: Path, worktree: Path) -> None:
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d")
    with d.connect() as client:
        session = client.open_session(str(worktree))
        shell(session, "sleep 300 > /dev/null 2>&1", background=True)  # a background job, to be ended
        # In flight long enough for the signal to reach the worker on a loaded machine.
        call, results = _sigterm_during_a_call(d, session, worktree, "sleep 3; echo finished")
        # Meanwhile (as soon as the daemon has told the worker) a new call is
        # refused, with the reason.
        deadline = time.monotonic() + 30
        refused = shell(session, "echo too late")
        while refused.is_success and time.monotonic() < deadline:
            time.sleep(0.05)
            refused = shell(session, "echo too late")
        call.join(20)
        assert results and results[0].is_success, results
        assert results[0].output == "finished\n"
        assert refused.is_failure and "dispatchd is stopping" in refused.error
        session.detach()
    assert d.stop() == 0
    assert not os.path.exists(d.socket)  # removed on the way out
    assert gone(lambda: processes_in(worktree))
    assert "event=tool_call session=" in d.log() and "tool=shell_exec" in d.log()
    assert "finished" not in d.log()  # outputs never reach the log


def test_a_client_whose_daemon_went_away_gets_a_clear_error(tmp_path: Path, worktree: Path) -> None:
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d")
    client = d.connect()
    try:
        assert d.stop() == 0
        try:
            client.list_sessions()
        except dispatch.ConnectionLost as exc:
            assert f"lost the connection to dispatchd at {d.socket}" in str(exc)
        else:
            raise AssertionError("expected ConnectionLost")
    finally:
        client.close()


def test_while_stopping_new_connections_are_answered_at_once(tmp_path: Path, worktree: Path) -> None:
    """SIGTERM with a call in flight: a new connection used to wait the whole stop
    timeout (29.6 s) and then read "Connection reset by peer"."""
    import socket

    from dispatchd import protocol

    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d")
    with d.connect() as client:
        session = client.open_session(str(worktree))
        call, results = _sigterm_during_a_call(d, session, worktree, "sleep 3; echo finished")
        deadline = time.monotonic() + 5
        while True:  # until the daemon has taken the signal (a fixed 0.3 s assumed a quiet machine)
            raw = socket.socket(socket.AF_UNIX)
            raw.settimeout(5)
            raw.connect(d.socket)
            frames = protocol.FrameSocket(raw)
            started = time.monotonic()
            try:
                raw.settimeout(0.5)
                reply = frames.recv(protocol.daemon_reply_decoder)
            except TimeoutError:  # not stopping yet: served, waiting for our Hello
                reply = None
            frames.close()
            if reply is not None or time.monotonic() > deadline:
                break
        assert isinstance(reply, protocol.ErrorReply) and (reply.id, reply.code) == (0, "stopping")
        assert reply.message.startswith("dispatchd is stopping (it takes no new connections)")
        try:
            dispatch.connect(d.socket)
        except dispatch.RequestFailed as exc:
            assert exc.code == "stopping"
        else:
            raise AssertionError("expected RequestFailed(stopping)")
        assert time.monotonic() - started < 15  # at once: not after the stop timeout (30 s)
        try:  # a client connected before: served, but no new session
            client.open_session(str(worktree))
        except dispatch.RequestFailed as exc:
            assert (exc.code, exc.message) == ("stopping", "the daemon is stopping and opens no new sessions")
        else:
            raise AssertionError("expected RequestFailed(stopping)")
        call.join(20)
        assert results and results[0].output == "finished\n"  # the call in flight still finished
        session.detach()
    assert d.stop() == 0


def test_a_call_cut_at_the_stop_deadline_says_so(tmp_path: Path, worktree: Path) -> None:
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--stop-timeout", "1")
    with d.connect() as client:
        session = client.open_session(str(worktree))
        call, results = _sigterm_during_a_call(d, session, worktree, "sleep 60; echo never")
        call.join(20)
        assert results, "the call never came back"
        result = results[0]
        assert result.is_failure and result.metadata.get("cut_by_stop") is True, result
        assert result.error == ("shell_exec: cut: dispatchd was stopped and its stop deadline (1 s) passed with "
                                "this call still running; its processes are ended")
        session.detach()
    assert d.stop() == 0


def test_a_sigterm_while_starting_ends_the_daemon_cleanly(tmp_path: Path) -> None:
    """The socket may accept before the daemon's handlers are in place: a
    SIGTERM then (a client's test harness, systemd stopping a unit just
    started) used to kill it half started (exit -15, its fork server and any
    sandbox made ahead cut off). Now it is honoured once the daemon serves:
    exit 0, "event=stopped". Sent the moment the socket file appears, long
    after the interpreter has started. The twin: the same daemon left alone
    serves (the rest of this file)."""
    import subprocess
    import sys

    sock = tmp_path / "run" / "d.sock"
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    log = tmp_path / "d.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dispatchd", "--socket", str(sock)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 20
        while not sock.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.001)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    text = log.read_text()
    assert code == 0, text
    assert "event=stopped" in text, text
    assert not sock.exists()
