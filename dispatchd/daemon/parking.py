"""Idle connections wait without a thread of their own.

The daemon serves a connection on a thread of its own while the connection
is in use (blocking I/O: the fastest for its request and reply). A greeted
connection that sends nothing for ``PARK_AFTER_S`` (its socket's receive
timeout says so: no ``poll`` on a request's path) is *parked*: its thread
ends, and one thread polls every parked connection; the first byte that
comes, or its end, gives it a thread again (``resume``). Every thread is a
task the kernel counts against the user's ``RLIMIT_NPROC``, which the
user's sessions and other programs share: a client holding a connection
(and its sessions) for hours now costs none, and a thousand idle clients
cost one thread, not a thousand.

Guarantees:
- a parked connection is given back exactly once per readiness: it leaves
  the poll set before ``resume`` is called, and nothing reads it while it is
  parked, so its requests are served in the order sent;
- ``resume`` that cannot start a thread (``RuntimeError``: the process
  limit) leaves the connection parked; it is tried again every ``RETRY_S``
  (the log says so, at most every ``TELL_EVERY_S``); nothing is closed or
  lost;
- the polling thread starts with the first connection parked (a daemon whose
  clients stay busy has none), and serves until the process exits; its
  wake-up pipe is made with the ``Parking``, so parking changes none of the
  daemon's descriptors but the parked connections' own.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from dispatchd import threads

log = logging.getLogger("dispatchd.server")

PARK_AFTER_S = 5.0  # a greeted connection idle this long gives its thread back
RETRY_S = 0.5  # a connection that could not get a thread is tried again after this
TELL_EVERY_S = 10.0  # how often the log says connections wait for a thread

T = TypeVar("T")

_READY = select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL


class Parking(Generic[T]):
    """Parked connections (``T``: the caller's state of one), each waiting
    for its descriptor to become readable; ``resume(item)`` then starts its
    thread (raising ``RuntimeError`` when it cannot)."""

    def __init__(self, resume: Callable[[T], None]) -> None:
        self._resume = resume
        self._lock = threading.Lock()
        self._new: list[tuple[int, T]] = []  # parked since the thread last looked
        self._waiting: dict[int, T] = {}  # fd -> item, in the poll set (the thread's own)
        self._later: list[tuple[float, int, T]] = []  # could not get a thread: when to try again
        # Made now, not with the thread: the daemon's descriptors stay what
        # they were at its start however its clients come and go.
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread: threading.Thread | None = None
        self._told = 0.0  # when the log last said a connection waits for a thread

    def park(self, item: T, fd: int) -> None:
        """``item`` waits, without a thread, until ``fd`` is readable."""
        with self._lock:
            if self._thread is None:
                # Raises RuntimeError without a thread to be had: the caller keeps serving.
                thread = threads.Thread(target=self._run, daemon=True, name="parked")
                thread.start()
                self._thread = thread
            self._new.append((fd, item))
        self._wake()

    def count(self) -> int:
        """How many connections are parked now."""
        with self._lock:
            return len(self._new) + len(self._waiting) + len(self._later)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full: the thread is awake already

    def _run(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        while True:
            with self._lock:
                new, self._new = self._new, []
                for fd, item in new:
                    self._waiting[fd] = item
                    poller.register(fd, select.POLLIN)
                now = time.monotonic()
                due = [(fd, item) for when, fd, item in self._later if when <= now]
                self._later = [entry for entry in self._later if entry[0] > now]
            for fd, item in due:
                self._hand_back(fd, item)  # refused again: back in the list, with a new time
            with self._lock:  # after the hand-backs: those refused again wait no longer than their retry
                now = time.monotonic()
                timeout = min((when - now for when, _, _ in self._later), default=None)
            events = poller.poll(None if timeout is None else max(1, int(timeout * 1000)))
            for fd, mask in events:
                if fd == self._wake_r:
                    try:
                        while os.read(self._wake_r, 64):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                if not mask & _READY:
                    continue
                poller.unregister(fd)
                with self._lock:
                    item = self._waiting.pop(fd)
                self._hand_back(fd, item)

    def _hand_back(self, fd: int, item: T) -> None:
        try:
            self._resume(item)
        except Exception as exc:  # noqa: BLE001 - RuntimeError: no thread to be had; it waits, parked, and is tried again
            now = time.monotonic()
            with self._lock:
                self._later.append((now + RETRY_S, fd, item))
                tell = now - self._told >= TELL_EVERY_S
                if tell:
                    self._told = now
            if tell:
                log.warning("event=connection_waits reason=threads error=%s retry_s=%s", exc, RETRY_S)
