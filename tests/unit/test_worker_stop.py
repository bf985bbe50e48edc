"""A stopped session's processes are all gone when ``Worker.stop`` returns,
not only its pid 1 (daemon/spawn.py): what follows it, the git check, must
never race a process of the session. Real pid namespaces (unprivileged,
in a user namespace of their own), a real writer looping in each."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest

from dispatchd.confine import _sys
from dispatchd.daemon.spawn import Worker

pytestmark = pytest.mark.process

TRIES = 30
WRITERS = 3  # more of them, more often one runs in the window a wrong stop would leave


def _namespace_with_a_writer(out: Path) -> tuple[int, socket.socket]:
    """A pid namespace whose pid 1 holds the other end of the returned
    socket (as a tool server holds its control channel) and whose second
    processes (``WRITERS``) append timestamps to ``out`` in a loop until killed. Returns
    pid 1's pid, as this namespace sees it, once a writer has written."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)  # here: no user is mapped there
    ours, theirs = socket.socketpair()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - a forked child
        try:
            ours.close()
            os.close(r)
            if libc.unshare(_sys.CLONE_NEWUSER | _sys.CLONE_NEWPID) != 0:
                os._exit(3)
            pid1 = os.fork()
            if pid1 == 0:
                for n in range(WRITERS):
                    if os.fork() == 0:
                        theirs.close()  # a command holds no end of the channel
                        os.write(fd, b"%d\n" % time.monotonic_ns())
                        if n == 0:
                            os.write(w, b"w")
                        while True:
                            os.write(fd, b"%d\n" % time.monotonic_ns())
                while True:
                    time.sleep(60)
            os.write(w, b"%10d" % pid1)
            os._exit(0)
        finally:
            os._exit(4)
    theirs.close()
    os.close(w)
    os.close(fd)
    os.waitpid(child, 0)  # pid 1 and its writer are reparented: they outlive it
    got = b""
    while len(got) < 11:
        more = os.read(r, 64)
        assert more, f"the namespace was not made: {got!r}"
        got += more
    os.close(r)
    return int(got.replace(b"w", b"")), ours


def test_stop_returns_only_once_every_process_of_the_namespace_is_gone(tmp_path: Path) -> None:
    """With ``Worker.kill``'s wait for the pidfd taken out (the channel's end
    alone trusted), 3 runs of 4 of this test failed, a write coming up to
    3.7 ms after the stop returned; with it, none ever did."""
    for i in range(TRIES):
        out = tmp_path / f"stamps{i}"
        pid1, channel = _namespace_with_a_writer(out)
        worker = Worker(pid1, os.pidfd_open(pid1))
        ended = threading.Event()

        def watch(channel: socket.socket = channel, ended: threading.Event = ended) -> None:
            channel.recv(1)  # the channel's end: what the daemon's watch sees
            ended.set()
        threading.Thread(target=watch, daemon=True).start()
        time.sleep(0.02)  # the writer loops
        assert worker.stop(signal.SIGKILL, ended, 5.0)
        done = time.monotonic_ns()
        time.sleep(0.1)
        stamps = [int(x) for x in out.read_text().split()]
        # The twin: the writer was running right up to the stop ...
        assert done - max(stamps) < 2_000_000_000, (done, max(stamps))
        # ... and wrote nothing once it returned.
        assert max(stamps) < done, f"try {i}: a write {(max(stamps) - done) / 1e3:.0f} us after stop returned"
        channel.close()


def test_a_stop_whose_exit_was_not_seen_does_not_count_the_processes_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``stop`` is True only when the tool server's end came and the worker's
    exit was seen (its pidfd readable); a pidfd that stays unreadable (a
    process stuck in the kernel past the wait, faked here: the wait's
    answer) makes it False, whatever the end said. The twin: a real child
    stopped, seen gone."""
    from dispatchd import fdwait
    from dispatchd.daemon import spawn

    def child() -> Worker:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - a forked child
            time.sleep(60)
            os._exit(0)
        return Worker(pid, os.pidfd_open(pid))

    ended = threading.Event()
    ended.set()
    worker = child()
    assert worker.stop(signal.SIGKILL, ended, 5.0) is True
    os.waitpid(worker.pid, 0)
    worker = child()
    monkeypatch.setattr(spawn.fdwait, "readable", lambda fd, timeout_s: False)
    assert worker.stop(signal.SIGKILL, ended, 5.0) is False
    monkeypatch.setattr(spawn.fdwait, "readable", fdwait.readable)
    os.waitpid(worker.pid, 0)
