"""The daemon's watch over sleeping sessions' channels (daemon/sleepers.py),
on real socket pairs: a byte wakes (and is left in the socket), an end of
stream does not, a deadline expires, a forgotten session is left alone."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dispatchd.daemon.sleepers import Sleepers


class Calls:
    def __init__(self) -> None:
        self.q: queue.Queue[tuple[str, ...]] = queue.Queue()
        self.sleepers = Sleepers(lambda sid, nap: self.q.put(("wake", sid, str(nap))),
                                 lambda sid, nap, fd: self.q.put(("hung_up", sid, str(nap), str(fd))),
                                 lambda sid, nap: self.q.put(("expire", sid, str(nap))))

    def next(self, timeout: float = 5.0) -> tuple[str, ...]:
        return self.q.get(timeout=timeout)

    def none(self, within: float = 0.3) -> None:
        with pytest.raises(queue.Empty):
            self.q.get(timeout=within)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    client, held = socket.socketpair()
    yield client, held
    client.close()
    held.close()


@pytest.fixture
def calls(pair: tuple[socket.socket, socket.socket]) -> Iterator[Calls]:
    """Its watch forgets every session before the test's sockets close
    (set up after ``pair``, torn down before it): a watch left running
    polls descriptor numbers that the next test's sockets take again, and
    peeked at those (one run in about twenty-five failed so)."""
    made = Calls()
    yield made
    for sid in list(made.sleepers._deadlines):
        made.sleepers.forget(sid)


def test_a_request_wakes_its_session_once_and_is_left_unread(calls: Calls, pair: tuple[socket.socket, socket.socket]) -> None:
    client, held = pair
    calls.sleepers.add("s1", 7, [held.fileno()], time.monotonic() + 60)
    calls.none()
    client.sendall(b"request")
    assert calls.next() == ("wake", "s1", "7")
    assert held.recv(100, socket.MSG_DONTWAIT) == b"request"  # every byte still there for the tool server
    client.sendall(b"more")
    calls.none()  # no longer watched: one wake only
    assert calls.sleepers.count() == 0


def test_an_out_of_band_byte_wakes_once_and_the_watch_goes_quiet(calls: Calls,
                                                                pair: tuple[socket.socket, socket.socket]) -> None:
    """poll says readable, a peek finds nothing (it skips an OOB byte): left
    watched, the thread spun on it; the woken tool server's read drops it."""
    client, held = pair
    calls.sleepers.add("s1", 3, [held.fileno()], time.monotonic() + 60)
    client.send(b"!", socket.MSG_OOB)
    assert calls.next() == ("wake", "s1", "3")
    calls.none()
    assert calls.sleepers.count() == 0


def test_a_stale_readiness_wakes_nothing(calls: Calls, pair: tuple[socket.socket, socket.socket]) -> None:
    """A readiness polled for a descriptor this number had before (closed and
    reused meanwhile), on a channel with nothing in it: no wake."""
    client, held = pair
    calls.sleepers.add("s1", 4, [held.fileno()], time.monotonic() + 60)
    calls.sleepers._ready(held.fileno())
    calls.none()
    assert calls.sleepers.count() == 1


def test_a_client_gone_does_not_wake_its_session(calls: Calls, pair: tuple[socket.socket, socket.socket]) -> None:
    client, held = pair
    other_client, other_held = socket.socketpair()
    try:
        calls.sleepers.add("s1", 3, [held.fileno(), other_held.fileno()], time.monotonic() + 60)
        client.close()
        assert calls.next() == ("hung_up", "s1", "3", str(held.fileno()))
        calls.none()
        # Its twin: the session's other channel still wakes it.
        other_client.sendall(b"x")
        assert calls.next() == ("wake", "s1", "3")
    finally:
        other_client.close()
        other_held.close()


def test_a_session_asleep_at_its_deadline_expires(calls: Calls, pair: tuple[socket.socket, socket.socket]) -> None:
    _, held = pair
    calls.sleepers.add("s1", 1, [held.fileno()], time.monotonic() + 0.2)
    calls.sleepers.add("s2", 2, [], time.monotonic() + 60)
    assert calls.next() == ("expire", "s1", "1")
    calls.none()  # s2's deadline is far
    assert calls.sleepers.count() == 1


def test_a_forgotten_session_is_left_alone(calls: Calls, pair: tuple[socket.socket, socket.socket]) -> None:
    client, held = pair
    calls.sleepers.add("s1", 1, [held.fileno()], time.monotonic() + 0.3)
    calls.sleepers.forget("s1")
    client.sendall(b"x")
    calls.none(0.6)  # neither a wake nor the expiry


def test_a_channel_attached_while_asleep_wakes_it_too(calls: Calls, pair: tuple[socket.socket, socket.socket]) -> None:
    client, held = pair
    calls.sleepers.add("s1", 5, [], time.monotonic() + 60)
    calls.sleepers.add_channel("s1", held.fileno())
    client.sendall(b"x")
    assert calls.next() == ("wake", "s1", "5")
    # Not for a session that is not asleep: nothing is watched for it.
    late_client, late_held = socket.socketpair()
    try:
        calls.sleepers.add_channel("s9", late_held.fileno())
        late_client.sendall(b"x")
        calls.none()
    finally:
        late_client.close()
        late_held.close()


def test_a_watch_that_cannot_start_lets_no_session_sleep_and_is_tried_again(
        calls: Calls, pair: tuple[socket.socket, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon out of threads at the first sleep: ``ensure`` says no (the
    session stays awake), and the next ask starts it (before, the failed
    start was kept as the thread and never tried again: every later sleeper
    went unwatched)."""
    real = threading.Thread

    class Refused(real):  # type: ignore[valid-type,misc]
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading, "Thread", Refused)
    assert calls.sleepers.ensure() is False
    assert calls.sleepers._runner.thread is None
    monkeypatch.setattr(threading, "Thread", real)
    assert calls.sleepers.ensure() is True  # the twin: a thread to be had
    client, held = pair
    calls.sleepers.add("s1", 9, [held.fileno()], time.monotonic() + 60)
    client.sendall(b"request")
    assert calls.next() == ("wake", "s1", "9")
