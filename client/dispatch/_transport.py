"""The client's transport: a trusted socket to the daemon, and frames over it.

Guarantees:
- ``try_connect`` sends nothing to a socket whose directory is not the
  user's own (not a symlink, not writable by others) or whose serving process
  has another uid (``UntrustedSocket``), both checked by descriptor
  (``dispatchd.paths``); a full listen backlog is waited out up to the timeout;
- a ``Connection`` carries several requests at once, each matched to its
  reply by id, from many threads; a descriptor that rides on a reply
  (``Attached``: a session's channel) comes back with it, and one that rides
  on a reply nobody waits for any more is closed;
- every wait is bounded: a socket call blocks a tick at most, and a request
  gives up at its own deadline (``RequestTimeout``); a frame cut in the
  middle fails the connection, never the next request;
- a request lost before any byte of it was written (the peer had closed,
  or the connection was failed already) raises ``NotWritten``, a
  ``ConnectionLost`` the peer never saw: sending it again elsewhere cannot
  run it twice;
- frames are the protocol's own (``dispatchd.protocol``: its length prefix
  and size limit), written out here only to save Python calls.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from dispatch.errors import (
    ConnectionLost,
    DaemonUnavailable,
    NotSent,
    RequestFailed,
    RequestTimeout,
    UntrustedSocket,
)
from dispatchd import paths, protocol

__all__ = ["Connection", "NotWritten", "OutputCallback", "connect_within", "try_connect"]


class NotWritten(ConnectionLost):
    """The connection was lost before any byte of the request was written:
    the peer never saw it."""


class _Unwritten(OSError):
    """A send failed with nothing of the frame written (``_send``, ``request``)."""

_PENDING = object()
# protocol.encode's parts, for request's written-out copy.
_encode = msgspec.msgpack.Encoder().encode
_FRAME_HEADER = protocol.FRAME_HEADER
# The longest a socket operation blocks at once: waits loop on it up to their
# own deadline, so one connection serves callers with different deadlines.
_TICK_S = 0.2

OutputCallback = Callable[[str, str], None]
# How long a CancelCall may take to send before we give up on it.
_CANCEL_SEND_S = 1.0


class Connection:
    """Frames to one peer with several requests in flight.

    No background thread: whichever caller is waiting becomes the reader
    until its own reply arrives, handing replies for others to them. A lone
    caller therefore reads its reply itself, with no thread switch on the way.
    Each waiting caller sleeps on a condition of its own: a reply (or
    streamed output) wakes the one caller it is for, and a reader that is
    done wakes one other caller to read (waking them all on every reply made
    eight threads on one session spend their time in wake-ups: see
    docs/performance.md).
    """

    def __init__(self, sock: socket.socket, decoder: msgspec.msgpack.Decoder[Any], *, fds: bool = False) -> None:
        # A blocking socket whose recv and send give up after a tick (EAGAIN):
        # waits stay bounded, yet a reply that is there costs no extra poll()
        # (a Python socket timeout polls before every call: +12% on read_file).
        sock.settimeout(None)
        tick = struct.pack("@ll", 0, int(_TICK_S * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tick)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tick)
        self._frames = protocol.FrameSocket(sock, fds=fds)
        self._decoder = decoder
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._reading = False
        self._waiters: dict[int, threading.Condition] = {}  # callers asleep, by request id (share _cond's lock)
        self._replies: dict[int, Any] = {}
        self._outputs: dict[int, list[tuple[str, str]]] = {}  # streamed output waiting for its caller
        self._ids = itertools.count(1)
        self._broken: Exception | None = None

    def request(self, build: Callable[..., msgspec.Struct], timeout: float | None = None,
                on_output: OutputCallback | None = None,
                sent: Callable[[int], None] | None = None, fields: tuple[Any, ...] = ()) -> tuple[Any, int | None]:
        """Send ``build(rid, *fields)`` and wait for its reply, ``timeout`` seconds at most
        (``RequestTimeout``; a reply that comes later is dropped). Raises
        ``NotSent`` (the connection stays usable) when the request cannot be
        encoded or is over the frame limit, ``ConnectionLost`` when the peer is
        gone, ``RequestFailed`` when the peer refused the whole connection
        (busy, stopping, too many channels).

        ``on_output(stream, text)`` gets the ``ToolOutput`` frames of this
        request, in this thread; ``sent(rid)`` is called once it is on the wire.
        ``fields``: the message's other fields, positional after the id, so
        a tool call passes its class (``protocol.CallTool``) and its fields
        instead of a lambda, whose cells cost call_tool ~1,200 instructions."""
        deadline = None if timeout is None else time.monotonic() + timeout
        rid = next(self._ids)
        try:
            # protocol.encode written out (one Python call fewer, ~900 instructions a call).
            payload = _encode(build(rid, *fields))
            if len(payload) > protocol.MAX_FRAME:
                raise protocol.too_large(len(payload))
            frame = _FRAME_HEADER.pack(len(payload)) + payload
        except (protocol.FrameTooLarge, TypeError, ValueError, UnicodeError, OverflowError) as exc:
            raise NotSent(str(exc)) from exc
        # _cond's lock, without the Condition's Python-level __enter__; and
        # acquire/release, not ``with``: a lock's __enter__ and __exit__ cost
        # about 800 instructions more, twice a call (here and _read_until).
        lock = self._lock
        lock.acquire()
        try:
            if self._broken is not None:
                raise NotWritten(str(self._broken))
            # Nobody reads (a lone caller, the usual case): this caller is the
            # reader from here, and reads its reply as soon as it is sent,
            # without a second trip through the lock in _wait. Nobody can
            # have read its reply or queued its output meanwhile, nor will
            # while it reads: only a caller that waits (_wait) has its entries
            # in _replies and _outputs, which a reader fills for it; the
            # reader's own come straight to it in _read_until (a dict set and
            # pop fewer, ~900 instructions a call).
            reader = not self._reading
            if reader:
                self._reading = True
            else:
                self._replies[rid] = _PENDING
                if on_output is not None:
                    self._outputs[rid] = []
        finally:
            lock.release()
        try:
            # _send's usual case written out (one Python call fewer): the
            # send lock free, and one send takes the whole request.
            send_lock = self._send_lock
            if send_lock.acquire(False):
                try:
                    done = self._frames.sock.send(frame)
                except (BlockingIOError, TimeoutError):  # nothing was sent in this tick
                    done = 0
                except OSError as exc:  # EPIPE: the peer had closed, and never saw a byte of it
                    send_lock.release()
                    raise _Unwritten(exc.errno, exc.strerror) from exc
                except BaseException:
                    send_lock.release()
                    raise
                if done == len(frame):
                    send_lock.release()
                else:
                    self._send(frame, deadline, done)  # the rest, the lock held (_send releases it)
            else:
                self._send(frame, deadline)
        except OSError as exc:
            self._forget(rid)
            refusal = self._refusal()  # a peer that refused the connection closed it after saying why
            self._fail(refusal or exc)
            if refusal is not None:
                raise refusal from exc
            raise (NotWritten if isinstance(exc, _Unwritten) else ConnectionLost)(str(exc)) from exc
        except BaseException:  # RequestTimeout, or an interrupt
            self._forget(rid)
            if reader:
                self._hand_over()
            raise
        try:
            if sent is not None:
                try:
                    sent(rid)
                except BaseException:
                    if reader:
                        self._hand_over()
                    raise
            if reader:
                return self._read_until(rid, deadline, timeout, on_output)
            return self._wait(rid, on_output, deadline, timeout)
        except BaseException:
            self._forget(rid)  # its reply, when it comes, is dropped
            raise

    def _hand_over(self) -> None:
        """Stop reading and wake a waiting caller to read instead."""
        with self._cond:
            self._reading = False
            self._wake_a_reader()

    def _forget(self, rid: int) -> None:
        with self._cond:
            self._replies.pop(rid, None)
            self._outputs.pop(rid, None)

    def send(self, msg: msgspec.Struct) -> None:
        """A message that has no reply (``CancelCall``); best effort, bounded."""
        try:
            self._send(protocol.encode(msg), time.monotonic() + _CANCEL_SEND_S)
        except (OSError, protocol.ProtocolError, RequestTimeout):
            pass

    def _wait(self, rid: int, on_output: OutputCallback | None, deadline: float | None,
              timeout: float | None) -> tuple[Any, int | None]:
        while True:
            chunks: list[tuple[str, str]] = []
            with self._lock:
                mine: threading.Condition | None = None
                try:
                    while True:
                        queued = self._outputs.get(rid)
                        if queued:
                            chunks, self._outputs[rid] = queued, []
                            break
                        if self._replies[rid] is not _PENDING:
                            self._outputs.pop(rid, None)
                            return self._replies.pop(rid)  # type: ignore[no-any-return]
                        if self._broken is not None:
                            if isinstance(self._broken, RequestFailed):
                                raise RequestFailed(self._broken.code, self._broken.message)
                            raise ConnectionLost(str(self._broken))
                        if not self._reading:
                            self._reading = True
                            break
                        if deadline is not None and time.monotonic() >= deadline:
                            raise RequestTimeout(f"no reply within {timeout:g} s")
                        if mine is None:  # made only by a caller that has to wait
                            mine = threading.Condition(self._lock)
                            self._waiters[rid] = mine
                        mine.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                finally:
                    if mine is not None:
                        del self._waiters[rid]
                        if not self._reading:
                            self._wake_a_reader()  # we may have been the one woken to read; pass it on
            if chunks:
                assert on_output is not None
                for stream, text in chunks:
                    on_output(stream, text)
                continue
            return self._read_until(rid, deadline, timeout, on_output)

    def _wake_a_reader(self) -> None:
        """Wake one waiting caller to take over reading (``_cond`` held)."""
        for cond in self._waiters.values():
            cond.notify()
            return

    def _wake(self, rid: int) -> None:
        """Wake the caller of ``rid``, if it sleeps (``_cond`` held)."""
        cond = self._waiters.get(rid)
        if cond is not None:
            cond.notify()

    def _refusal(self) -> RequestFailed | None:
        """The id-0 ``ErrorReply`` a peer left before closing on us, if any."""
        try:
            reply = self._frames.recv(self._decoder)
        except (OSError, protocol.ProtocolError):
            return None
        if isinstance(reply, protocol.ErrorReply) and reply.id == 0:
            return RequestFailed(reply.code, reply.message)
        return None

    def _send(self, frame: bytes, deadline: float | None, done: int = -1) -> None:
        """The whole frame, or ``RequestTimeout`` at the deadline (a frame cut
        in the middle leaves the stream unusable: the connection is failed).
        ``done`` >= 0: the send lock is held already and that much of the
        frame was sent (request's first try)."""
        lock = self._send_lock
        # Free, the usual case: taken without reading the clock.
        if done < 0 and not lock.acquire(False) and not lock.acquire(
                timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
            raise RequestTimeout("could not send within the wait (another request is stuck sending)")
        sent, view = max(done, 0), None
        try:
            sock = self._frames.sock
            if done < 0:
                try:
                    sent = sock.send(frame)  # a request is small: one send takes it whole
                except (BlockingIOError, TimeoutError):  # nothing was sent in this tick
                    sent = 0
            if sent == 0 and deadline is not None and time.monotonic() >= deadline:
                raise RequestTimeout("the peer takes nothing (stopped?)") from None
            view = memoryview(frame)[sent:] if sent < len(frame) else None
            while view:
                try:
                    view = view[sock.send(view):]
                except (BlockingIOError, TimeoutError):  # nothing was sent in this tick
                    if deadline is not None and time.monotonic() >= deadline:
                        if len(view) < len(frame):
                            self._fail(ConnectionLost("a request was cut in the middle by its timeout"))
                        raise RequestTimeout("the peer takes nothing (stopped?)") from None
        except OSError as exc:
            if sent == 0 and (view is None or len(view) == len(frame)):  # not a byte of it written
                raise _Unwritten(exc.errno, exc.strerror) from exc
            raise
        finally:
            self._send_lock.release()

    def _read_until(self, rid: int, deadline: float | None, timeout: float | None,
                    on_output: OutputCallback | None = None) -> tuple[Any, int | None]:
        frames, decode = self._frames, self._decoder.decode
        try:
            while True:
                try:
                    payload = frames.recv_payload()
                except (BlockingIOError, TimeoutError):  # nothing in this tick; a partial frame stays buffered
                    if deadline is not None and time.monotonic() >= deadline:
                        with self._cond:  # hand the reading over to another waiter, if any
                            self._reading = False
                            self._replies.pop(rid, None)
                            self._wake_a_reader()
                        raise RequestTimeout(f"no reply within {timeout:g} s") from None
                    continue
                if payload is None:
                    raise ConnectionLost("the peer closed the connection")
                try:
                    reply = decode(payload)  # protocol.decode written out: one Python call fewer a reply
                except protocol.DECODE_ERRORS as exc:
                    raise protocol.undecodable(exc) from exc
                # msgspec decodes to the exact types: no isinstance (each twice the cost) on the way
                kind = type(reply)
                if kind is protocol.ToolOutput:
                    if reply.id == rid and on_output is not None:
                        on_output(reply.stream, reply.text)  # the reader is its caller: no queue
                        continue
                    with self._cond:
                        queue = self._outputs.get(reply.id)
                        if queue is not None:
                            queue.append((reply.stream, reply.text))
                            self._wake(reply.id)
                    continue
                fd = frames.take_fd() if kind is protocol.Attached else None
                lock = self._lock
                lock.acquire()  # not ``with``: see request
                try:
                    if reply.id == rid:  # ours, the usual case: straight back to the caller
                        if self._replies:  # empty for a lone caller (see request): no pop to call
                            self._replies.pop(rid, None)
                        if on_output is not None:
                            self._outputs.pop(rid, None)
                        self._reading = False
                        if self._waiters:
                            self._wake_a_reader()
                        return reply, fd
                    if reply.id in self._replies:
                        self._replies[reply.id] = (reply, fd)
                    elif isinstance(reply, protocol.ErrorReply) and reply.id == 0:
                        # Id 0 answers the connection, not a request: busy,
                        # stopping, too many channels, forbidden.
                        raise RequestFailed(reply.code, reply.message)
                    elif fd is not None:
                        os.close(fd)  # the late reply of a request that timed out
                    self._wake(reply.id)
                finally:
                    lock.release()
        except (OSError, protocol.ProtocolError, ConnectionLost, RequestFailed) as exc:
            self._fail(exc)
            with self._cond:
                self._replies.pop(rid, None)
            raise exc if isinstance(exc, (ConnectionLost, RequestFailed)) else ConnectionLost(str(exc)) from exc
        except BaseException:
            # Interrupted (KeyboardInterrupt, or on_output raised): hand the
            # reading over to another waiter, keep the connection.
            with self._cond:
                self._reading = False
                self._wake_a_reader()
            raise

    def _fail(self, exc: Exception) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = exc
            self._reading = False
            for cond in self._waiters.values():
                cond.notify()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def close(self) -> None:
        self._fail(ConnectionLost("closed"))
        try:
            self._frames.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._frames.close()


def try_connect(path: str, timeout: float) -> socket.socket | None:
    """A connection to the daemon at ``path``, or None when nothing listens.
    Nothing is sent here; the directory and the peer are checked first."""
    directory, name = os.path.split(path)
    try:
        dirfd = paths.open_socket_dir(directory or ".")
    except FileNotFoundError:
        return None
    except paths.UnsafeDirectory as exc:
        raise UntrustedSocket(f"{exc} (refused before anything was sent)") from exc
    except PermissionError as exc:  # a directory on its way made unsearchable: which, and what to do
        raise DaemonUnavailable(f"cannot connect to dispatchd at {path}: {exc.strerror}: "
                                f"{paths.unsearchable(path) or paths.what_to_do()}") from exc
    except OSError as exc:
        raise DaemonUnavailable(f"cannot connect to dispatchd at {path}: {exc.strerror}; "
                                f"{paths.what_to_do()}") from exc
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        connect_within(sock, paths.via_fd(dirfd, name), timeout)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    except TimeoutError as exc:
        sock.close()
        raise RequestTimeout(f"dispatchd at {path} did not take the connection within {timeout:g} s "
                             "(stopped, or its backlog is full)") from exc
    except OSError as exc:
        sock.close()
        raise DaemonUnavailable(f"cannot connect to dispatchd at {path}: {exc.strerror}; "
                                f"{paths.what_to_do()}") from exc
    finally:
        os.close(dirfd)
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    problem = paths.peer_problem(uid, pid, os.getuid())
    if problem is not None:
        sock.close()
        raise UntrustedSocket(f"refusing the socket {path}: {problem}, so it is not your dispatchd and nothing "
                              "was sent to it; remove it if you can, or use a socket of your own (--socket, "
                              "$DISPATCH_SOCKET, or set XDG_RUNTIME_DIR)")
    return sock


def connect_within(sock: socket.socket, address: str, timeout: float) -> None:
    """``sock.connect(address)``, waiting up to ``timeout`` seconds for room in
    the daemon's listen backlog. A Unix socket does not wait there: with a
    timeout set its connect fails at once with EAGAIN while the backlog is
    full (a burst of clients the daemon is still accepting), so try again
    until the deadline; then ``TimeoutError``, as a full wait would give."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the listen backlog stayed full") from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.05)
