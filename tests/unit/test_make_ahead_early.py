"""A sandbox made ahead with namespaces of its own sends them first
(``WorkerNamespaces``), before its root, so that the daemon starts its
network stack while it goes on (``ForkServerClient.make_ahead``'s
``early``). The fork server is replaced here by a real process that says
what a sandbox says, on a real socket pair."""

from __future__ import annotations

import os
import socket
import subprocess
from types import SimpleNamespace

import pytest

from dispatchd import protocol
from dispatchd.daemon.spawn import ForkServerClient, Worker

pytestmark = pytest.mark.process


class Said:
    """A sandbox's process (``sleep``), its channel, and the client whose
    spawn hands them out."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, first: list[protocol.WorkerNamespaces]) -> None:
        self.proc = subprocess.Popen(["sleep", "30"])
        self.worker = Worker(self.proc.pid, os.pidfd_open(self.proc.pid))
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.control = protocol.FrameSocket(ours, fds=True)
        self.theirs = protocol.FrameSocket(theirs, fds=True)
        self.sent: list[int] = []  # the descriptors sent, as the daemon's side would receive them: inodes
        for msg in first:
            r, w = os.pipe()
            self.sent += [os.fstat(r).st_ino, os.fstat(w).st_ino]
            self.theirs.send(msg, fds=[r, w])
            os.close(r)
            os.close(w)
        self.theirs.send(protocol.WorkerPooled(pid=self.proc.pid, timings_ms={"root": 1.0}))
        self.client = ForkServerClient.__new__(ForkServerClient)
        monkeypatch.setattr(self.client, "_spawn_with_channel",
                            lambda plan, fd, encoded=None: (self.worker, self.control), raising=False)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.worker.close()
        self.control.close()
        self.theirs.close()


def _plan(own: bool) -> SimpleNamespace:
    return SimpleNamespace(namespaces=SimpleNamespace(user=own, net=own))


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_the_namespaces_come_first_and_the_rest_after(monkeypatch: pytest.MonkeyPatch) -> None:
    said = Said(monkeypatch, [protocol.WorkerNamespaces(pid=1)])
    got: list[int] = []

    def early(worker: Worker, control: protocol.FrameSocket, msg: protocol.WorkerNamespaces) -> None:
        assert worker is said.worker and isinstance(msg, protocol.WorkerNamespaces)
        for _ in range(2):
            fd = control.take_fd()
            got.append(os.fstat(fd).st_ino)
            os.close(fd)

    try:
        worker, control, pooled = said.client.make_ahead(_plan(True), 5.0, early)  # type: ignore[arg-type]
        assert got == said.sent and isinstance(pooled, protocol.WorkerPooled) and pooled.timings_ms == {"root": 1.0}
        assert said.proc.poll() is None  # the twin of the test below: it lives on
    finally:
        said.close()


def test_a_failure_given_the_namespaces_kills_the_sandbox_and_leaks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    before = _open_fds()
    said = Said(monkeypatch, [protocol.WorkerNamespaces(pid=1)])

    def early(worker: Worker, control: protocol.FrameSocket, msg: protocol.WorkerNamespaces) -> None:
        raise OSError(24, "the stack could not start")  # its descriptors not taken

    try:
        with pytest.raises(OSError, match="the stack could not start"):
            said.client.make_ahead(_plan(True), 5.0, early)  # type: ignore[arg-type]
        assert said.proc.wait(5) == -9  # killed
        assert said.control.sock.fileno() == -1  # its channel closed
        said.theirs.close()
        said.worker.close()
        assert _open_fds() <= before | {str(said.worker.pidfd)}
    finally:
        if said.proc.poll() is None:
            said.proc.kill()
        said.proc.wait()


def test_without_namespaces_of_its_own_nothing_comes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    said = Said(monkeypatch, [])
    called: list[object] = []
    try:
        _, _, pooled = said.client.make_ahead(_plan(False), 5.0, lambda *a: called.append(a))  # type: ignore[arg-type]
        assert called == [] and isinstance(pooled, protocol.WorkerPooled)
    finally:
        said.close()
