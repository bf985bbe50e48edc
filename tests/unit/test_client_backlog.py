"""A client connecting while the daemon's listen backlog is full (a burst of
clients it is still accepting) waits for room up to its timeout, as it would
for a slow accept, instead of failing at once with EAGAIN (what a Unix
socket with a timeout says then). A real listening socket of our own, never
accepting until the test says so."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatch._transport import try_connect
from dispatch.errors import RequestTimeout


@pytest.fixture
def full_backlog(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A listener whose backlog is full: ``(its path, the listener)``."""
    home = tmp_path / "run"
    home.mkdir(mode=0o700)
    path = str(home / "d.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(0)
    queued = []
    for _ in range(64):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            break
        queued.append(s)
    else:
        pytest.fail("the backlog never filled")
    yield path, listener
    for s in queued:
        s.close()
    listener.close()


def test_a_full_backlog_is_waited_on_then_timed_out(full_backlog: tuple[str, socket.socket]) -> None:
    path, _ = full_backlog
    started = time.monotonic()
    with pytest.raises(RequestTimeout, match=r"did not take the connection within 0.3 s \(stopped, or its "
                                             r"backlog is full\)"):
        try_connect(path, 0.3)
    assert 0.25 < time.monotonic() - started < 3


def test_room_made_in_the_backlog_lets_the_waiting_client_in(full_backlog: tuple[str, socket.socket]) -> None:
    """The twin: the listener accepts one connection 0.2 s later; the client,
    which found the backlog full, gets in (its peer checked: ourselves)."""
    path, listener = full_backlog
    accepted: list[socket.socket] = []
    timer = threading.Timer(0.2, lambda: accepted.append(listener.accept()[0]))
    timer.start()
    try:
        sock = try_connect(path, 5.0)
        assert sock is not None
        assert sock.getpeername() == path
        sock.close()
    finally:
        timer.join()
        for s in accepted:
            s.close()
    assert len(accepted) == 1
