"""Parked connections (daemon/parking.py): given back once each time they
become readable or end, never before; one that cannot get a thread stays
parked and is tried again. Real sockets; the ``resume`` is the test's."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest

from dispatchd.daemon import parking
from tests.conftest import wait_until


class Resumes:
    def __init__(self, fail: int = 0) -> None:
        self.got: list[str] = []
        self.fail = fail  # how many first calls raise, as a thread that cannot start does
        self.lock = threading.Lock()

    def __call__(self, item: str) -> None:
        with self.lock:
            if self.fail:
                self.fail -= 1
                raise RuntimeError("can't start new thread")
            self.got.append(item)


def test_a_parked_connection_is_given_back_once_when_a_byte_comes_and_not_before() -> None:
    resumes = Resumes()
    park = parking.Parking(resumes)
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    try:
        park.park("a", a.fileno())
        park.park("c", c.fileno())
        assert wait_until(lambda: park.count() == 2)
        time.sleep(0.1)
        assert resumes.got == []  # nothing came: both wait
        b.send(b"x")
        assert wait_until(lambda: resumes.got == ["a"])
        time.sleep(0.1)
        assert resumes.got == ["a"] and park.count() == 1  # once: out of the poll set before it is given back
        d.close()  # the peer's end is given back too (the server reads it and lets its sessions go)
        assert wait_until(lambda: resumes.got == ["a", "c"])
        assert park.count() == 0
        assert a.recv(1) == b"x"  # nothing read while parked
    finally:
        for s in (a, b, c):
            s.close()


def test_a_connection_that_cannot_get_a_thread_stays_parked_and_is_tried_again(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(parking, "RETRY_S", 0.05)
    resumes = Resumes(fail=2)
    park = parking.Parking(resumes)
    a, b = socket.socketpair()
    try:
        with caplog.at_level(logging.WARNING, logger="dispatchd.server"):
            park.park("a", a.fileno())
            b.send(b"x")
            assert wait_until(lambda: resumes.got == ["a"])
        assert resumes.fail == 0  # refused twice, then given back
        assert caplog.text.count("event=connection_waits reason=threads") == 1  # said once, not at every try
        assert park.count() == 0
    finally:
        a.close()
        b.close()
