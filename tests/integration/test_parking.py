"""Idle connections cost no thread (daemon/parking.py): a real daemon, real
clients. A greeted connection idle for the park time gives its thread back
(counted in /proc/PID/task), is served again at its next request, keeps the
sessions it holds, and its end lets them go as any connection's end does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from dispatchd import protocol
from dispatchd.cli import PARK_AFTER_FLAG
from tests.conftest import Daemon, wait_until
from tests.integration.test_protocol import REPLIES, greeted
from tests.integration.test_lifetimes import _daemon, _ids

CLIENTS = 100


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _idle_clients(d: Daemon, parks: bool) -> tuple[int, int, int]:
    """The daemon's threads with one client, then with CLIENTS more, all
    greeted and idle, and how many status said were parked; each of them
    then served again."""
    with d.connect() as first:
        first.status()
        time.sleep(0.5)  # past the short park time: the first one is parked too
        before = _threads(d.proc.pid)
        clients = [d.connect() for _ in range(CLIENTS)]  # each says hello, then nothing
        try:
            time.sleep(0.5)
            if parks:  # (a loaded machine may take longer to park a hundred)
                wait_until(lambda: _threads(d.proc.pid) <= before + 1, timeout=10)
            during = _threads(d.proc.pid)
            parked = first.status_reply().daemon.parked  # what status says (``first`` served again)
            for c in clients:  # served again, each, in its turn
                assert c.status()["pid"] == d.proc.pid
        finally:
            for c in clients:
                c.close()
    return before, during, parked


def test_idle_connections_give_their_threads_back_and_are_served_again(tmp_path: Path) -> None:
    d = _daemon(tmp_path, "d", PARK_AFTER_FLAG, "0.2")
    try:
        before, during, parked = _idle_clients(d, parks=True)
        assert during <= before + 1, (before, during)  # the parked ones wait on one thread
        assert parked >= CLIENTS, parked
        with d.connect() as client:
            assert client.status_reply().daemon.parked == 0  # all closed since
        assert "event=connection_parked" in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_busy_or_short_idle_connections_keep_a_thread_each(tmp_path: Path) -> None:
    """The twin: not yet idle for the park time, each connection has its thread."""
    d = _daemon(tmp_path, "d", PARK_AFTER_FLAG, "3600")
    try:
        before, during, parked = _idle_clients(d, parks=False)
        assert during >= before + CLIENTS, (before, during)
        assert parked == 0
        assert "event=connection_parked" not in d.log()
    finally:
        assert d.stop() == 0, d.log()


def test_a_parked_connection_holds_its_session_and_its_end_lets_it_go(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path, "d", PARK_AFTER_FLAG, "0.2")
    proc: subprocess.Popen[str] | None = None
    try:
        code = textwrap.dedent(f"""
            import sys, dispatch
            client = dispatch.connect({d.socket!r})
            s = client.open_session({str(worktree)!r}, policy="brief")
            print(s.id, flush=True)
            sys.stdin.read()  # idle, holding its session, until the test lets go
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        assert proc.stdout is not None
        sid = proc.stdout.readline().strip()
        with d.connect() as client:
            assert wait_until(lambda: "event=connection_parked" in d.log(), timeout=10), d.log()
            time.sleep(1.5)  # more than the policy's orphan grace (1 s): held all the same
            assert sid in _ids(client)
            proc.send_signal(signal.SIGKILL)  # its connection ends while parked
            proc.wait()
            assert wait_until(lambda: sid not in _ids(client), timeout=30)
        assert f"session={sid} reason=orphaned" in d.log()
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
        assert d.stop() == 0, d.log()


def test_a_request_cut_across_the_park_time_is_answered_and_a_parked_one_too(tmp_path: Path) -> None:
    """Nothing for longer than the park time *inside* a frame is a slow
    sender: the connection keeps its thread and waits for the rest (up to
    FRAME_TIMEOUT_S: test_frame_deadline.py). The twin: the same request whole, after as long a silence
    (parked, then given a thread again), is answered alike."""
    d = _daemon(tmp_path, "d", PARK_AFTER_FLAG, "0.2")
    try:
        with greeted(d) as frames:
            for rid, cut in ((2, 3), (3, 0)):
                data = protocol.encode(protocol.Status(id=rid))
                frames.sock.sendall(data[:cut])
                time.sleep(0.6)  # three park times
                frames.sock.sendall(data[cut:])
                reply = frames.recv(REPLIES)
                assert isinstance(reply, protocol.StatusReply) and reply.id == rid, reply
        assert d.log().count("event=connection_parked") >= 1
    finally:
        assert d.stop() == 0, d.log()
