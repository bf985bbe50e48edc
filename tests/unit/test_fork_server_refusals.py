"""The fork server answers a fork the kernel refuses (a process limit
reached) with ``no_process`` and words, not a traceback and no answer: the
daemon then keeps the session as it was (daemon/sessionnet.py)."""

from __future__ import annotations

import errno
import os
import socket

import pytest

from dispatchd import protocol
from dispatchd.worker import fork_server


class _Frames:
    """The fork server's side of its channel, as far as ``_dns_sockets`` uses it."""

    def __init__(self, fds: list[int]) -> None:
        self.fds, self.sent = fds, []  # type: ignore[var-annotated]

    def take_fd(self) -> int:
        return self.fds.pop(0)

    def send(self, msg: object, fds: list[int] | None = None) -> None:
        self.sent.append(msg)


def _namespace_fds() -> list[int]:
    a, b = socket.socketpair()  # any two descriptors: the fork never happens
    return [a.detach(), b.detach()]


def test_a_refused_fork_for_the_dns_door_is_answered_no_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> int:
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refused)
    fds = _namespace_fds()
    frames = _Frames(list(fds))
    fork_server._dns_sockets(protocol.DnsSockets(id=7), frames)  # type: ignore[arg-type]
    [reply] = frames.sent
    assert isinstance(reply, protocol.ErrorReply) and reply.id == 7 and reply.code == "no_process"
    assert reply.message.startswith("cannot fork to make the DNS relay's door: [Errno 11]"), reply.message
    assert "EAGAIN: the processes all sessions of this daemon may run together" in reply.message
    for fd in fds:  # the namespaces' descriptors are closed all the same
        with pytest.raises(OSError) as closed:
            os.fstat(fd)
        assert closed.value.errno == errno.EBADF


def test_another_fork_error_is_spawn_failed_without_the_limits_words() -> None:
    # The twin: only EAGAIN is a process limit.
    reply = fork_server._fork_refused(3, "enter the session's namespaces", OSError(errno.ENOMEM, "Cannot allocate"))
    assert reply.code == "spawn_failed"
    assert reply.message == "cannot fork to enter the session's namespaces: [Errno 12] Cannot allocate"
    eagain = fork_server._fork_refused(3, "enter the session's namespaces", OSError(errno.EAGAIN, "again"))
    assert eagain.code == "no_process" and "EAGAIN: the processes all sessions" in eagain.message
