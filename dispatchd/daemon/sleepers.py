"""The daemon's watch over sessions that sleep (``dispatchd.worker.wake``).

A sleeping session has no process: the daemon holds its client channels.
One thread polls all of them, with no thread or timer per session.

Guarantees:
- no session sleeps unwatched: the thread is started before the first
  session is let sleep (``ensure``), and a session whose sleep would need it
  while it cannot start stays awake;
- the first byte a client writes on a channel of a sleeping session calls
  ``wake(sid, nap)`` once (on a thread of its own: a wake forks and waits for
  the new tool server); its channels are no longer watched from then on,
  and no byte is read here (``MSG_PEEK``), so the woken tool server reads
  the whole request (a byte sent out of band wakes it too: its read drops
  the byte, as when awake);
- a channel whose client has gone (end of stream, or an error) is passed to
  ``hung_up(sid, nap, fd)`` and never wakes the session;
- a session still asleep at its deadline (the policy's idle timeout after
  its last call) is passed to ``expire(sid, nap)``;
- ``forget(sid)`` stops watching a session before its channels are handed
  over or closed: the descriptors of a session forgotten are never
  touched again here.

``nap`` numbers each time a session falls asleep: a callback for a nap that
is over (the session woken meanwhile, maybe asleep again with other
descriptors of the same numbers) is for the receiver to ignore.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from dispatchd import threads

log = logging.getLogger("dispatchd.sleepers")


class Sleepers:
    def __init__(self, wake: Callable[[str, int], None], hung_up: Callable[[str, int, int], None],
                 expire: Callable[[str, int], None]) -> None:
        self._wake, self._hung_up, self._expire = wake, hung_up, expire
        self._lock = threading.Lock()
        self._fds: dict[int, str] = {}  # watched channel -> its session
        self._deadlines: dict[str, float] = {}  # session -> when it ends asleep (monotonic)
        self._naps: dict[str, int] = {}  # session -> its nap
        self._changed = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._runner = threads.Once(self._run, "sleepers")

    def count(self) -> int:
        with self._lock:
            return len(self._deadlines)

    def add(self, sid: str, nap: int, fds: list[int], deadline: float) -> None:
        """Watch a session that fell asleep, its channels and its deadline."""
        with self._lock:
            for fd in fds:
                self._fds[fd] = sid
            self._deadlines[sid] = deadline
            self._naps[sid] = nap
        self.ensure()  # started before the session was let sleep (``ensure``): at most a retry
        self._poke()

    def ensure(self) -> bool:
        """The watch thread runs, started at the first sleep, before that
        session's tool server is told to sleep. False where the daemon cannot
        start a thread (its processes and threads at the user's limit): the
        session is told to stay awake and asks again at its next idle time,
        and the next ask tries again. No session sleeps unwatched."""
        try:
            self._runner.start()
        except RuntimeError as exc:  # can't start new thread
            log.warning("event=sleepers_not_started error=%s", exc)
            return False
        return True

    def add_channel(self, sid: str, fd: int) -> None:
        """A channel attached to a session while it sleeps."""
        with self._lock:
            if sid in self._deadlines:
                self._fds[fd] = sid
        self._poke()

    def forget(self, sid: str) -> None:
        with self._lock:
            self._deadlines.pop(sid, None)
            self._naps.pop(sid, None)
            for fd in [fd for fd, owner in self._fds.items() if owner == sid]:
                del self._fds[fd]
        self._poke()

    def _poke(self) -> None:
        try:
            os.eventfd_write(self._changed, 1)
        except BlockingIOError:
            pass  # woken already

    def _run(self) -> None:
        # The one watch of every sleeping session: a callback that fails
        # (a bug, the daemon out of threads) must not end it for all.
        while True:
            try:
                self._once()
            except Exception:  # noqa: BLE001
                log.exception("event=sleepers_error")
                time.sleep(0.1)  # not a spin, should it fail again at once

    def _once(self) -> None:
        """One poll of every watched channel, and the deadlines due."""
        with self._lock:
            watched = dict(self._fds)
            due = min(self._deadlines.values(), default=None)
        poller = select.poll()
        poller.register(self._changed, select.POLLIN)
        for fd in watched:
            poller.register(fd, select.POLLIN)
        wait_ms = None if due is None else max(0.0, (due - time.monotonic()) * 1e3)
        ready = poller.poll(wait_ms)
        for fd, _ in ready:
            if fd == self._changed:
                try:
                    os.eventfd_read(self._changed)
                except BlockingIOError:
                    pass
                continue
            self._ready(fd)
        self._expire_due()

    def _ready(self, fd: int) -> None:
        """A watched channel polled readable: a request (wake), or its end."""
        with self._lock:
            sid = self._fds.get(fd)
            if sid is None:
                return  # forgotten meanwhile
            nap = self._naps.get(sid, -1)
            try:
                peeked = socket.socket(fileno=fd)
                try:
                    data = peeked.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if not _readable(fd):
                        raise  # a stale event (of a descriptor this number had before)
                    # Readable with nothing to peek: a byte sent out of band
                    # (MSG_OOB), which a peek skips and poll reports until a
                    # read drops it (left watched, this loop spun). Not read
                    # here (a request's first byte may come meanwhile): the
                    # woken tool server's read drops it, as when awake.
                    data = b"\0"
                finally:
                    peeked.detach()  # the session's descriptor: not ours to close
            except BlockingIOError:
                return  # nothing after all
            except OSError:
                data = b""  # broken: as gone
            if not data:
                del self._fds[fd]
            else:
                self._deadlines.pop(sid, None)
                self._naps.pop(sid, None)
                for other in [f for f, owner in self._fds.items() if owner == sid]:
                    del self._fds[other]
        if not data:
            self._hung_up(sid, nap, fd)
        else:
            try:
                threads.Thread(target=self._wake, args=(sid, nap), daemon=True, name=f"wake-{sid}").start()
            except RuntimeError:  # can't start new thread: the daemon at its process limit
                self._wake(sid, nap)  # here, then: the watch waits for this one wake

    def _expire_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [(sid, self._naps.pop(sid, -1)) for sid, at in self._deadlines.items() if at <= now]
            for sid, _ in due:
                del self._deadlines[sid]
                for fd in [f for f, owner in self._fds.items() if owner == sid]:
                    del self._fds[fd]
        for sid, nap in due:
            self._expire(sid, nap)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return any(events & select.POLLIN for _, events in poller.poll(0))
