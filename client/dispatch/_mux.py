"""Many byte streams over one: what ``dispatch bridge`` and ``--host`` speak.

The daemon hands each session's channel over as a descriptor (SCM_RIGHTS),
which no network stream carries. Over a bridge, the daemon connection is
stream 0 and every channel the daemon hands over becomes a stream of its
own, all carried by one byte stream (ssh's stdio, or any command's).

Guarantees:
- Link frames are ``dispatch._linkwire``'s. A length over
  ``MAX_LINK_FRAME`` or a kind not known ends the link with a ``LinkError``
  (never an allocation a peer chose).
- Bounded buffers, with back-pressure per stream: a side sends at most
  ``WINDOW`` bytes of one stream that the other has not written out yet
  (credit). So a receiver holds at most ``WINDOW`` bytes a stream, a slow
  reader of one stream stops that stream's source being read (and no
  other), and a peer that sends past its credit ends the link. Sources are
  not read either while more than ``OUT_BOUND`` bytes wait to go out on the
  link itself (a slow link).
- Descriptors: on the bridge, a daemon frame whose message is ``Attached``
  carries a channel; it travels as an ``ATTACH`` frame naming a new stream,
  and on the client a socket pair stands in for it: one end rides on that
  frame's first byte to the client (as the daemon's own descriptor would),
  the other is that stream. Every other byte is carried as it came.
- A stream ends with ``CLOSE`` (its sender neither sends nor reads it any
  more); stream ids are never reused. The link ends when its byte stream
  does (the far side went away): every stream's local end is closed, after
  ``reason`` is set, so whoever sees a stream end can say why.
"""

from __future__ import annotations

import fcntl
import os
import select
import socket
import threading
from collections import deque
from collections.abc import Callable
from typing import Final

from dispatch._linkwire import (
    ATTACH,
    CHUNK,
    CLOSE,
    CREDIT,
    DATA,
    ERROR,
    HANDSHAKE,
    LINK_HEADER,
    MAX_LINK_FRAME,
    OUT_BOUND,
    U32,
    WINDOW,
    DaemonFrames,
    LinkError,
    frame,
)

__all__ = ["HANDSHAKE", "Link", "LinkError"]

_F_SETPIPE_SZ: Final = 1031  # fcntl.F_SETPIPE_SZ, named there from Python 3.10 on Linux only


def _widen_pipe(fd: int) -> None:
    """A pipe of 1 MiB instead of 64 KiB, when ``fd`` is a pipe and the
    system lets us (best effort): a large reply then crosses in a few
    writes, not dozens of wake-ups."""
    try:
        fcntl.fcntl(fd, _F_SETPIPE_SZ, 1 << 20)
    except OSError:
        pass


class _Stream:
    __slots__ = ("sid", "sock", "out", "out_bytes", "credit", "written", "eof", "peer_closed", "fds", "tracker")

    def __init__(self, sid: int, sock: socket.socket, *, fds: bool = False) -> None:
        self.sid = sid
        self.sock = sock
        sock.setblocking(False)
        self.out: deque[tuple[memoryview, list[int]]] = deque()  # to write to sock, descriptors on the first byte
        self.out_bytes = 0
        self.credit = WINDOW  # what we may still send the far side of this stream
        self.written = 0  # bytes from the far side written to sock and not yet acknowledged
        self.eof = False  # sock said it is done: we read it no more
        self.peer_closed = False  # the far side said CLOSE: close sock once out is written
        self.fds = fds  # read with recv_fds (the bridge's daemon connection)
        self.tracker: DaemonFrames | None = None


class Link:
    """One pump: streams of local sockets to and from a link (two descriptors,
    in and out), run by ``run`` in one thread until every stream has ended or
    the link has.

    ``bridge=True``: the bridge's side; stream 0 is the daemon connection,
    read with its descriptors. Else the client's side: an ``ATTACH`` makes a
    socket pair. ``on_end(reason)`` is called before the local ends close
    when the link ended under us (None when every stream ended normally).
    """

    def __init__(self, link_in: int, link_out: int, stream0: socket.socket, *, bridge: bool,
                 on_end: Callable[[str | None], None] | None = None) -> None:
        self._in, self._out = link_in, link_out
        os.set_blocking(link_in, False)
        os.set_blocking(link_out, False)
        for fd in (link_in, link_out):
            _widen_pipe(fd)
        self._bridge = bridge
        self._on_end = on_end
        self._streams: dict[int, _Stream] = {}
        self._next_sid = 1
        self._outbuf = bytearray()
        self._inbuf = bytearray()
        self._in_eof = False
        self._poll = select.poll()
        self._masks: dict[int, int] = {}
        self._lock = threading.Lock()  # guards _stop_reason only: everything else is the pump's thread's
        self._stop_reason: str | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._wake_r, select.POLLIN)
        s0 = _Stream(0, stream0, fds=bridge)
        if bridge:
            s0.tracker = DaemonFrames()
        self._add(s0)

    # --- public -----------------------------------------------------------

    def stop(self, reason: str) -> None:
        """From any thread: end the link (every stream with it)."""
        with self._lock:
            if self._stop_reason is None:
                self._stop_reason = reason
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass

    def send_error(self, text: str) -> None:
        """Queue an ``ERROR`` for the far side (the bridge, before it ends the link)."""
        self._queue(frame(0, ERROR, text.encode("utf-8", "replace")[:CHUNK]))

    def run(self) -> str | None:
        """Pump until every stream has ended (None) or the link has (why)."""
        reason: str | None = None
        try:
            reason = self._loop()
        except LinkError as exc:
            reason = str(exc)
        except OSError as exc:
            reason = f"the link failed: {os.strerror(exc.errno) if exc.errno else exc}"
        if reason is not None and self._bridge:
            try:
                self.send_error(reason)
                self._flush_briefly()
            except (OSError, LinkError):
                pass  # the far side is gone: nobody to tell
        if self._on_end is not None:
            self._on_end(reason)
        for stream in list(self._streams.values()):
            self._drop(stream)
        os.close(self._wake_r)
        os.close(self._wake_w)
        return reason

    # --- the loop ----------------------------------------------------------

    def _loop(self) -> str | None:
        while True:
            with self._lock:
                if self._stop_reason is not None:
                    return self._stop_reason
            if not self._streams and not self._outbuf:
                return None
            if self._in_eof:
                return "the far side closed the link"
            self._set_masks()
            for fd, events in self._poll.poll():
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 64)
                    except BlockingIOError:
                        pass
                elif fd == self._in:
                    self._read_link()
                elif fd == self._out:
                    self._write_link()
                else:
                    stream = self._by_fd.get(fd)
                    if stream is None or self._streams.get(stream.sid) is not stream:
                        continue  # ended earlier in this round (its fd number may be a new stream's already)
                    if events & select.POLLOUT or (stream.out and events & (select.POLLERR | select.POLLHUP)):
                        self._write_stream(stream)
                    if stream.sid in self._streams and events & (select.POLLIN | select.POLLHUP | select.POLLERR) \
                            and not stream.eof and stream.credit > 0:
                        self._read_stream(stream)

    def _set_masks(self) -> None:
        want: dict[int, int] = {self._wake_r: select.POLLIN}
        if not self._in_eof:
            want[self._in] = select.POLLIN
        if self._outbuf:
            want[self._out] = select.POLLOUT
        room = len(self._outbuf) < OUT_BOUND
        self._by_fd: dict[int, _Stream] = {}
        for stream in self._streams.values():
            fd = stream.sock.fileno()
            self._by_fd[fd] = stream
            mask = 0
            if room and stream.credit > 0 and not stream.eof:
                mask |= select.POLLIN
            if stream.out:
                mask |= select.POLLOUT
            if mask:  # registered with none, poll would still report a hang-up, over and over
                want[fd] = mask
        for fd in list(self._masks):
            if fd not in want:
                try:
                    self._poll.unregister(fd)
                except (KeyError, ValueError):
                    pass
                del self._masks[fd]
        for fd, mask in want.items():
            old = self._masks.get(fd)
            if old == mask:
                continue
            if old is None:
                self._poll.register(fd, mask)
            else:
                self._poll.modify(fd, mask)
            self._masks[fd] = mask

    # --- the link ----------------------------------------------------------

    def _queue(self, data: bytes) -> None:
        """Append to the link's output, writing at once what it takes (no
        trip through poll for the usual small message)."""
        if not self._outbuf:
            try:
                n = os.write(self._out, data)
            except BlockingIOError:
                n = 0
            except BrokenPipeError:
                raise LinkError("the far side went away (its input is closed)") from None
            if n == len(data):
                return
            data = data[n:]
        self._outbuf += data

    def _write_link(self) -> None:
        try:
            n = os.write(self._out, self._outbuf[:1 << 20])
        except BlockingIOError:
            return
        except BrokenPipeError:
            raise LinkError("the far side went away (its input is closed)") from None
        del self._outbuf[:n]

    def _flush_briefly(self) -> None:
        """Best effort, a second at most: the last frames (an ERROR) out."""
        end = 10
        while self._outbuf and end:
            try:
                select.select([], [self._out], [], 0.1)
                self._write_link()
            except (OSError, LinkError):
                return
            end -= 1

    def _read_link(self) -> None:
        try:
            data = os.read(self._in, 1 << 20)
        except BlockingIOError:
            return
        except OSError as exc:
            raise LinkError(f"reading the link failed: {os.strerror(exc.errno or 0)}") from None
        if not data:
            self._in_eof = True
            return
        buf = self._inbuf
        buf += data
        pos = 0
        try:
            while len(buf) - pos >= LINK_HEADER.size:
                length, sid, kind = LINK_HEADER.unpack_from(buf, pos)
                if length < 5 or length > MAX_LINK_FRAME:
                    raise LinkError(f"the far side sent a link frame of {length} bytes: not a dispatch bridge, "
                                    "or a broken one")
                if len(buf) - pos < 4 + length:
                    break
                body = bytes(buf[pos + LINK_HEADER.size:pos + 4 + length])
                pos += 4 + length
                self._handle(sid, kind, body)
        finally:
            del buf[:pos]

    def _handle(self, sid: int, kind: int, body: bytes) -> None:
        stream = self._streams.get(sid)
        if kind == DATA:
            if stream is not None:
                self._deliver(stream, body, [])
        elif kind == ATTACH:
            if self._bridge or len(body) < 4:
                raise LinkError("an ATTACH frame where none may come")
            (new_sid,) = U32.unpack_from(body)
            if new_sid in self._streams or new_sid == 0:
                raise LinkError(f"an ATTACH frame for stream {new_sid}, which is in use")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self._add(_Stream(new_sid, ours))
            if stream is not None:
                self._deliver(stream, body[4:], [theirs.detach()])
            else:
                theirs.close()
        elif kind == CREDIT:
            if stream is not None and len(body) == 4:
                stream.credit += U32.unpack(body)[0]
                if stream.credit > WINDOW:
                    raise LinkError("the far side gave back more credit than it was sent")
        elif kind == CLOSE:
            if stream is not None:
                stream.peer_closed = True
                stream.eof = True
                if not stream.out:
                    self._drop(stream)
        elif kind == ERROR:
            raise LinkError(body.decode("utf-8", "replace"))
        else:
            raise LinkError(f"a link frame of unknown kind {kind}")

    # --- the streams ----------------------------------------------------------

    def _add(self, stream: _Stream) -> None:
        self._streams[stream.sid] = stream

    def _drop(self, stream: _Stream) -> None:
        self._streams.pop(stream.sid, None)
        for _data, fds in stream.out:
            for fd in fds:
                os.close(fd)
        stream.out.clear()
        if stream.tracker is not None:
            for fd in stream.tracker.fds:
                os.close(fd)
            stream.tracker.fds.clear()
        try:
            stream.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        stream.sock.close()

    def _end_stream(self, stream: _Stream) -> None:
        """Our side of ``stream`` is done: tell the far side, and forget it."""
        if stream.sid in self._streams:
            self._queue(frame(stream.sid, CLOSE))
            self._drop(stream)

    def _deliver(self, stream: _Stream, data: bytes, fds: list[int]) -> None:
        if stream.out_bytes + len(data) > WINDOW:
            for fd in fds:
                os.close(fd)
            raise LinkError(f"the far side sent stream {stream.sid} more than its credit")
        stream.out.append((memoryview(data), fds))
        stream.out_bytes += len(data)
        self._write_stream(stream)

    def _write_stream(self, stream: _Stream) -> None:
        sock = stream.sock
        done = 0
        try:
            while stream.out:
                data, fds = stream.out[0]
                if fds:
                    n = socket.send_fds(sock, [data], fds)
                    for fd in fds:
                        os.close(fd)  # the receiver has its own copy now
                    stream.out[0] = (data, [])
                else:
                    n = sock.send(data)
                done += n
                if n < len(data):
                    stream.out[0] = (data[n:], [])
                    break
                stream.out.popleft()
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            # The local end is gone (EPIPE, ECONNRESET): so is the stream.
            stream.out_bytes -= done
            self._end_stream(stream)
            return
        stream.out_bytes -= done
        stream.written += done
        if stream.peer_closed and not stream.out:
            self._drop(stream)
            return
        # Credit back in batches, a quarter window at a time: the sender
        # cannot stall on it (it stops only with a full window unacknowledged,
        # of which at most a quarter is written out here and unacknowledged,
        # the rest still to be written: whose writing crosses the quarter).
        if stream.written >= WINDOW // 4:
            self._queue(frame(stream.sid, CREDIT, U32.pack(stream.written)))
            stream.written = 0

    def _read_stream(self, stream: _Stream) -> None:
        want = min(stream.credit, CHUNK)
        if want <= 0:
            return
        try:
            if stream.fds:
                data, fds, flags, _addr = socket.recv_fds(stream.sock, want, 16, socket.MSG_CMSG_CLOEXEC)
                if fds:
                    assert stream.tracker is not None
                    stream.tracker.fds.extend(fds)
                if flags & socket.MSG_CTRUNC:
                    raise LinkError("a channel from the daemon was lost: the bridge is out of descriptors")
            else:
                data = stream.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            stream.eof = True
            if not stream.out:
                self._end_stream(stream)
            else:
                self._queue(frame(stream.sid, CLOSE))
                stream.peer_closed = True  # write out what is queued, then close
            return
        stream.credit -= len(data)
        if stream.tracker is None:
            self._queue(frame(stream.sid, DATA, data))
            return
        for part, fd in stream.tracker.split(data):
            if fd is None:
                self._queue(frame(0, DATA, part))
                continue
            sid = self._next_sid
            self._next_sid += 1
            self._add(_Stream(sid, socket.socket(fileno=fd)))
            self._queue(frame(0, ATTACH, U32.pack(sid) + part))
