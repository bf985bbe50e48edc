"""The pipes of ``dispatch mcp``: JSON-RPC lines in on fd 0, out on fd 1,
with waits that a stop ends at once.

The MCP SDK's ``stdio_server`` reads stdin with a blocking ``readline`` on a
worker thread that a cancel cannot abandon: a stop signal then waited for
the client's next line, or for it to close the pipe, with the session, its
write lock and its jobs left up. Here every wait on a pipe is a ``poll``
that also watches a wake pipe, so ``stop()`` ends the read and the write in
flight, and every later one, whatever the client does.

Guarantees:
- while claimed, fd 0 reads the null device and fd 1 writes to stderr, so
  nothing a library or a child process reads or prints touches the
  protocol (as the SDK's own transport does); ``close()`` puts them back;
- ``read_line`` returns one line, its ``\\n`` kept (the last one without, at
  EOF), ``b""`` at EOF, or raises ``Stopped``; a line longer than
  ``max_line`` raises ``LineTooLong`` (its size, first and last bytes) once it has
  been read to its end, and is never held whole: past ``max_line`` the rest
  is counted and dropped as it comes; ``write`` writes all its bytes,
  or raises ``Stopped`` or ``OSError`` (the client closed the pipe);
- a write never blocks a stop: it waits for room with ``poll`` and writes at
  most ``PIPE_BUF`` bytes at a time, which a pipe with room takes whole;
- ``stop()`` is final, one ``os.write``, callable from any thread;
- no descriptor is closed while a thread may still wait on it: ``close()``
  waits briefly for them, and leaves the private copies open if one is
  still inside (a number closed under a thread could be reused).

One reader and one writer at a time (``mcp.py`` has one task of each).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import sys
import threading
from collections.abc import Iterator

from dispatchd.protocol.frames import MAX_FRAME

__all__ = ["MAX_LINE", "LineTooLong", "StdioPipes", "Stopped"]

_CHUNK = 1 << 16
# A little over the largest frame dispatchd takes: a longer line could carry
# nothing the daemon would accept, and must not cost its size in memory.
MAX_LINE = MAX_FRAME + (1 << 20)
_HEAD = 1 << 12  # what a LineTooLong keeps of each end of its line: where an id is found
_CLOSE_WAIT_S = 1.0  # for a thread still inside read_line or write at close()


class Stopped(Exception):
    """``stop()`` was called: no more reading or writing."""


class LineTooLong(Exception):
    """A line over ``max_line``, read to its end and dropped: ``size`` bytes
    (its newline not counted), ``head`` and ``tail`` its first and last."""

    def __init__(self, size: int, head: bytes, tail: bytes) -> None:
        super().__init__(f"a line of {size} bytes")
        self.size, self.head, self.tail = size, head, tail


class StdioPipes:
    """fd 0 and fd 1 claimed for the protocol (see the module's guarantees)."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._max_line = max_line
        sys.stdout.flush()  # what was printed before goes where it was going
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._in = _claim(0, os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))
        try:
            self._out = _claim(1, fcntl.fcntl(2, fcntl.F_DUPFD_CLOEXEC, 3))
        except OSError:
            os.dup2(self._in, 0)
            raise
        self._buffer = bytearray()
        self._scanned = 0  # how much of _buffer holds no newline
        self._stopped = False
        self._inside = 0  # threads in read_line or write
        self._idle = threading.Condition()

    def read_line(self) -> bytes:
        """The next line (blocking; from a worker thread)."""
        with self._entered():
            while True:
                end = self._buffer.find(b"\n", self._scanned)
                if end >= 0:
                    line = bytes(self._buffer[:end + 1])
                    del self._buffer[:end + 1]
                    self._scanned = 0
                    return line
                self._scanned = len(self._buffer)
                if self._scanned > self._max_line:
                    self._drop_line()
                chunk = self._read()
                if not chunk:  # EOF: the last line, if it had no newline
                    line = bytes(self._buffer)
                    self._buffer.clear()
                    self._scanned = 0
                    return line
                self._buffer += chunk

    def _read(self) -> bytes:
        self._wait(self._in, select.POLLIN)
        return os.read(self._in, _CHUNK)

    def _drop_line(self) -> None:
        """Read the rest of the line in ``_buffer`` (no newline yet), keeping
        none of it; keep what follows it; raise ``LineTooLong``."""
        head, tail, size = bytes(self._buffer[:_HEAD]), bytes(self._buffer[-_HEAD:]), len(self._buffer)
        self._buffer.clear()
        self._scanned = 0
        while True:
            chunk = self._read()
            end = chunk.find(b"\n")
            if end >= 0:
                self._buffer += chunk[end + 1:]
                chunk = chunk[:end]
            size += len(chunk)
            tail = (tail + chunk)[-_HEAD:]
            if end >= 0 or not chunk:  # its end, or EOF
                raise LineTooLong(size, head, tail)

    def write(self, data: bytes) -> None:
        """All of ``data`` (blocking; from a worker thread)."""
        with self._entered():
            view = memoryview(data)
            while view:
                self._wait(self._out, select.POLLOUT)
                view = view[os.write(self._out, view[:select.PIPE_BUF]):]

    def stop(self) -> None:
        """End every wait, now and later (``Stopped``)."""
        if not self._stopped:
            self._stopped = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"\0")

    def close(self) -> None:
        """Stop, and give fd 0 and fd 1 back their own files."""
        self.stop()
        with self._idle:
            self._idle.wait_for(lambda: self._inside == 0, _CLOSE_WAIT_S)
            leave_open = self._inside > 0
        sys.stdout.flush()  # written to stderr while claimed: there, not onto the protocol's file
        for fd, private in ((0, self._in), (1, self._out)):
            os.dup2(private, fd)
            if not leave_open:
                os.close(private)
        if not leave_open:
            os.close(self._wake_r)
        os.close(self._wake_w)

    @contextlib.contextmanager
    def _entered(self) -> Iterator[None]:
        with self._idle:
            self._inside += 1
        try:
            yield
        finally:
            with self._idle:
                self._inside -= 1
                self._idle.notify_all()

    def _wait(self, fd: int, event: int) -> None:
        """Until ``fd`` is ready for ``event`` (or hung up, or in error: the
        read or write that follows says which); ``Stopped`` first."""
        poller = select.poll()
        poller.register(fd, event)
        poller.register(self._wake_r, select.POLLIN)
        ready = poller.poll()  # retried on EINTR by Python itself (PEP 475)
        if self._stopped or any(f == self._wake_r for f, _ in ready):
            raise Stopped()


def _claim(fd: int, diversion: int) -> int:
    """A private copy of ``fd`` (close-on-exec, above the standard three);
    ``fd`` itself then points at ``diversion`` (which is closed)."""
    try:
        private = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
        os.dup2(diversion, fd)
    finally:
        os.close(diversion)
    return private
