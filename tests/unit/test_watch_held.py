"""The worktree watch a tool server hands the daemon (``WatchHeld``): held
while the sandbox that made it runs, closed after the reply once it is gone,
and never anything but an inotify instance (daemon/session.py, napping.py)."""

from __future__ import annotations

import ctypes
import os
import socket
from collections.abc import Iterator

import pytest

from dispatchd import protocol
from dispatchd.daemon import afterwards
from dispatchd.daemon.napping import Napping
from dispatchd.daemon.session import Session
from dispatchd.daemon.worktree import Worktree
from dispatchd.policy import Policy
from tests.unit.test_afterwards import _is_open

_libc = ctypes.CDLL(None, use_errno=True)


def _inotify() -> int:
    fd = _libc.inotify_init1(os.O_CLOEXEC)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    return fd


def _what(fd: int) -> str:
    return os.readlink(f"/proc/self/fd/{fd}")


@pytest.fixture
def session(tmp_path: object) -> Iterator[Session]:
    s = Session("s1", Worktree("/nowhere", -1), Policy(), "")
    yield s
    s.drop_watch()
    assert afterwards.drain()


@pytest.fixture
def channel() -> Iterator[tuple[protocol.FrameSocket, socket.socket]]:
    """A control channel as the daemon holds it, and the worker's end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frames = protocol.FrameSocket(ours, fds=True)
    yield frames, theirs
    frames.close()
    theirs.close()


def test_the_watch_of_the_current_tool_server_is_held_until_dropped(session: Session, channel) -> None:
    control, _ = channel
    session.control = control
    fd = _inotify()
    session.keep_watch(control, fd)
    assert session.watch == fd and afterwards.drain() and _is_open(fd) and _what(fd) == "anon_inode:inotify"
    session.drop_watch()
    assert session.watch == -1 and afterwards.drain() and not _is_open(fd)


def test_a_watch_from_a_tool_server_let_go_or_a_second_one_is_closed(session: Session, channel) -> None:
    control, _ = channel
    first, late, second = _inotify(), _inotify(), _inotify()
    session.keep_watch(control, late)  # control is not (or no longer) the session's
    assert session.watch == -1 and afterwards.drain() and not _is_open(late)
    session.control = control
    session.keep_watch(control, first)
    session.keep_watch(control, second)  # a tool server makes one: a second is not kept
    assert session.watch == first and afterwards.drain() and _is_open(first) and not _is_open(second)


def test_only_an_inotify_instance_is_held(session: Session, channel) -> None:
    control, worker = channel
    session.control = control
    r, w = os.pipe()
    try:
        socket.send_fds(worker, [protocol.encode(protocol.WatchHeld())], [r])
        assert isinstance(control.recv(protocol.from_worker_decoder), protocol.WatchHeld)
        Napping._keep_watch(session, control)
        assert session.watch == -1
        os.close(r)  # the worker's copy: the daemon's was closed, so the pipe has no reader
        with pytest.raises(BrokenPipeError):
            os.write(w, b"x")
        # The allowed twin: an inotify instance the same way is held.
        fd = _inotify()
        socket.send_fds(worker, [protocol.encode(protocol.WatchHeld())], [fd])
        assert isinstance(control.recv(protocol.from_worker_decoder), protocol.WatchHeld)
        Napping._keep_watch(session, control)
        assert session.watch >= 0 and _what(session.watch) == "anon_inode:inotify"
        os.close(fd)
    finally:
        os.close(w)
