"""Frames: how every message of dispatchd travels, and how a server reads them.

Guarantees:
- A frame is a 4-byte big-endian length followed by a msgpack payload of at
  most ``MAX_FRAME`` bytes. A longer length prefix is refused before any
  payload is read (``FrameTooLarge``): a peer cannot make us allocate.
- A payload that does not decode is a ``BadMessage``; ``recv_request`` answers
  it with an ``ErrorReply`` (``bad_request``, the request's ``id`` when it can
  be read) and reads on: only a broken frame (garbage, bad length) ends a
  connection, and only that connection. Both servers, the daemon's and the
  worker's, read their requests through it.
- File descriptors ride on a frame's first byte (SCM_RIGHTS) and are queued
  until taken; a descriptor the kernel had to drop is an error, not a silence.
  When the receiver is out of descriptors (the kernel cuts them: MSG_CTRUNC),
  the bytes that came are kept, the frame is read whole and ``recv_payload``
  raises ``DescriptorsLost`` for that one frame (its payload with it, for a
  reply that names its request); the descriptors of it that did arrive are
  closed, and the next frame reads as if nothing had happened: a stream is
  never misparsed for want of a descriptor.
- A read that gives up (a socket timeout) inside a frame loses nothing: the
  next ``recv`` goes on from where it stopped, large frames included.
- With ``frame_timeout_s`` set (the daemon's side), a frame must be whole
  that long after its first byte came: the first read past it raises
  ``FrameStalled`` instead of waiting on, however slowly bytes still trickle
  in. ``close`` lets go of what a frame had buffered.
"""

from __future__ import annotations

import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from dispatchd.protocol.messages import ErrorReply

# Big enough for a file at the policy's size cap plus two capped output streams,
# small enough that a hostile length prefix cannot exhaust memory.
MAX_FRAME = 64 * 1024 * 1024
# What the daemon reads from a client: requests are a path, a policy name,
# ports and domain lists, never file contents, so a frame of a few hundred KiB
# is plenty and bounds what each connection can make the (shared, unconfined)
# daemon buffer. Before ``Hello`` only a greeting is expected: a few KiB.
MAX_REQUEST_FRAME = 256 * 1024
MAX_HELLO_FRAME = 4 * 1024
# The length prefix of every frame (the client writes its requests out with it too).
FRAME_HEADER = struct.Struct(">I")
# The most descriptors one message may carry (the kernel's SCM_MAX_FD): a
# sleeping session's channels travel in messages of at most this many.
SCM_MAX_FD = 253


# --- codec ------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_encode = _encoder.encode


class ProtocolError(Exception):
    """The peer broke framing or sent something undecodable; drop the connection."""


class FrameTooLarge(ProtocolError):
    pass


class FrameStalled(ProtocolError):
    """A frame not whole ``after_s`` seconds after its first byte: ``got``
    bytes of ``want`` (header included; 0 while the header itself is short)."""

    def __init__(self, after_s: float, got: int, want: int) -> None:
        of = f"of {want} " if want else ""
        super().__init__(f"frame not whole {after_s:g} s after its first byte ({got} bytes {of}came)")
        self.after_s, self.got, self.want = after_s, got, want


class Unencodable(ProtocolError):
    """A message this side made that the codec cannot encode: text holding a
    lone surrogate (a file or ref name that is not UTF-8, as Python reads
    it), or a value of no wire type. Raised by ``FrameSocket.send`` before
    any byte of it is written: the stream is whole, and the sender can
    answer otherwise (the daemon sends an ``ErrorReply``). ``text``: the
    string that could not be encoded, if that was the cause, else ""."""

    def __init__(self, message: str, text: str = "") -> None:
        super().__init__(message)
        self.text = text


def encode(msg: msgspec.Struct) -> bytes:
    """One whole frame: length prefix and payload."""
    # The size check written out here and in send (no shared helper): every
    # request and reply is encoded, and a Python call costs about 1,200 instructions.
    payload = _encode(msg)
    if len(payload) > MAX_FRAME:
        raise too_large(len(payload))
    return FRAME_HEADER.pack(len(payload)) + payload


def too_large(size: int) -> FrameTooLarge:
    return FrameTooLarge(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte limit")


class DescriptorsLost(ProtocolError):
    """A whole frame arrived but the kernel cut the descriptors sent with it
    (this process is out of them): refuse that frame, keep the connection.
    ``payload`` is the frame's, read and consumed."""

    def __init__(self, payload: bytes) -> None:
        super().__init__(descriptors_lost_message())
        self.payload = payload


def descriptors_lost_message() -> str:
    """What ``DescriptorsLost`` says, with this process's limit."""
    try:
        limit = f"RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    except (OSError, ValueError):
        limit = "RLIMIT_NOFILE"
    return (f"the file descriptors sent with this message were cut: the receiving process (pid {os.getpid()}) "
            f"is out of file descriptors ({limit})")


class BadMessage(ProtocolError):
    """A whole frame arrived but does not decode: answer it, keep the connection."""


T = TypeVar("T")

# What a decoder raises for a payload that does not decode. UnicodeDecodeError:
# invalid UTF-8 in a string field, which msgspec reports as such rather than
# as a DecodeError.
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError)


def decode(decoder: msgspec.msgpack.Decoder[T], payload: bytes | bytearray) -> T:
    try:
        return decoder.decode(payload)
    except DECODE_ERRORS as exc:
        raise undecodable(exc) from exc


def undecodable(exc: Exception) -> BadMessage:
    """The ``BadMessage`` for a ``DECODE_ERRORS`` exception (``decode``'s,
    for a caller that calls the decoder itself, without ``decode``'s frame).
    Invalid UTF-8 is said in words of our own: msgspec up to 0.22 raises
    ``UnicodeDecodeError`` for it, 0.23 a ``DecodeError``, each worded its way."""
    if isinstance(exc, UnicodeDecodeError) or str(exc).startswith("Invalid UTF-8"):
        return BadMessage(INVALID_UTF8)
    return BadMessage(f"undecodable message: {exc}")


INVALID_UTF8 = "undecodable message: a string is not valid UTF-8"


class _IdOnly(msgspec.Struct):
    """The one field read from a request that did not decode. Typed: every
    other key is skipped without building anything, so a hostile payload
    (megabytes of nested empty arrays) costs no memory here."""

    id: int = 0


_id_decoder = msgspec.msgpack.Decoder(_IdOnly)


def request_id_of(payload: bytes | bytearray) -> int:
    """Best effort: the ``id`` of a request we could not decode, so the error reply
    can still be matched by the sender. 0 when even that is unreadable."""
    try:
        rid = _id_decoder.decode(payload).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return 0
    # One our own reply can carry (msgspec already refused bools and floats).
    return rid if -(2**63) <= rid < 2**64 else 0


_LARGE = 1 << 18  # past this much still to read, a frame is read by _recv_large


class FrameSocket:
    """Frames over a connected stream socket, with optional fd passing.

    Reads are buffered so a small reply costs one ``recv``; fds that arrive
    with the data are queued and taken by ``take_fd``. Not thread-safe by
    itself: callers serialise reads and writes (the client does; the daemon
    and worker give each connection one reader).
    """

    def __init__(self, sock: socket.socket, *, fds: bool = False, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self._fds = fds
        self.max_frame = max_frame  # the largest payload accepted; the daemon lowers it per phase
        self._buf = bytearray()
        self._large: tuple[bytearray, int] | None = None  # a large frame's payload being read, and how much came
        # Descriptors received and not taken, each with where (in bytes read
        # out of the buffer, ``_consumed``) the frame it came with begins.
        self._fd_queue: list[tuple[int, int]] = []
        # Descriptor streams only: how many bytes were read out of the
        # buffer so far, and where (at that count) each frame begins whose
        # descriptors the kernel cut.
        self._consumed = 0
        self._cut: set[int] = set()
        # How long a frame may take once its first byte came (None: as long
        # as it takes), and when the first byte of the one now buffered came.
        self.frame_timeout_s: float | None = None
        self._began = 0.0

    def fileno(self) -> int:
        return self.sock.fileno()

    def buffered(self) -> bool:
        """Whether bytes already read wait to be returned (the socket may not
        be readable while a whole frame sits here)."""
        return bool(self._buf) or self._large is not None

    def feed(self, data: bytes | bytearray) -> None:
        """Bytes received from this socket by someone else (the tool server's
        fast lane, which reads a request itself and hands back what it does
        not answer): read next, as if ``recv`` had read them."""
        if not self._buf:
            self._began = time.monotonic()
        self._buf += data

    def send(self, msg: msgspec.Struct, fds: list[int] | None = None) -> None:
        try:
            payload = _encode(msg)  # as encode's, without a helper's call
        except UnicodeEncodeError as exc:
            raise Unencodable(f"{type(msg).__name__}: text that is not UTF-8 ({exc.reason})",
                              exc.object if isinstance(exc.object, str) else "") from exc
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            raise Unencodable(f"{type(msg).__name__}: {exc}") from exc
        if len(payload) > MAX_FRAME:
            raise too_large(len(payload))
        header = FRAME_HEADER.pack(len(payload))
        if fds:
            # The fds ride on the first byte of the frame; the rest follows.
            frame = header + payload
            sent = socket.send_fds(self.sock, [frame], fds)
            if sent < len(frame):
                self.sock.sendall(memoryview(frame)[sent:])
        elif len(payload) > _LARGE:
            # A search's every match, a big file: header and payload go in
            # one sendmsg, without a copy of the payload to join them.
            sent = self.sock.sendmsg([header, payload])
            if sent < len(header):
                self.sock.sendall(header[sent:])
                sent = len(header)
            if sent - len(header) < len(payload):
                self.sock.sendall(memoryview(payload)[sent - len(header):])
        else:
            self.sock.sendall(header + payload)

    def _fill(self) -> bool:
        if self._buf:
            self._check_stall(len(self._buf))
        if self._fds:
            # Close-on-exec from the start: a descriptor received here is never
            # meant for a program this process might exec (the fork server's
            # stack child marks its own inheritable).
            data, fds, flags, _addr = socket.recv_fds(self.sock, 1 << 16, SCM_MAX_FD, socket.MSG_CMSG_CLOEXEC)
            if flags & socket.MSG_CTRUNC:
                # The kernel dropped descriptors it could not install here
                # (EMFILE). A read stops just after the one message that
                # carried descriptors, so those that did come are all that
                # message's, an incomplete set: closed. Its frame is the one
                # this read ends in; it is refused when read, whole.
                for fd in fds:
                    os.close(fd)
                if data:
                    self._cut.add(self._consumed + self._frame_at(len(self._buf) + len(data) - 1, data))
            elif fds:
                # They came with the frame this read ends in (as the cut ones above).
                at = self._consumed + self._frame_at(len(self._buf) + len(data) - 1, data)
                self._fd_queue.extend((at, fd) for fd in fds)
        else:
            data = self.sock.recv(1 << 16)
        if not data:
            return False
        if not self._buf:
            self._began = time.monotonic()
        self._buf += data
        return True

    def _check_stall(self, got: int) -> None:
        """Raise ``FrameStalled`` when the frame begun at ``_began`` (``got``
        bytes of it here) is past ``frame_timeout_s``."""
        if self.frame_timeout_s is None or time.monotonic() - self._began <= self.frame_timeout_s:
            return
        want = 4 + FRAME_HEADER.unpack_from(self._buf)[0] if len(self._buf) >= 4 else 0
        if self._large is not None:
            want = 4 + len(self._large[0])
        raise FrameStalled(self.frame_timeout_s, got, want)

    def _frame_at(self, index: int, more: bytes) -> int:
        """Where, in the buffer with ``more`` appended, the frame holding byte
        ``index`` begins (the buffer always begins with a frame)."""
        buf = self._buf + more
        start = 0
        while start + 4 <= len(buf):
            (length,) = FRAME_HEADER.unpack_from(buf, start)
            if start + 4 + length > index:
                break
            start += 4 + length
        return start

    def recv_payload(self) -> bytes | bytearray | None:
        """The next payload, or None on a clean end of stream between frames."""
        if self._large is not None:  # the rest of a large frame a read gave up inside
            return self._recv_large()
        if not self._buf and not self._fds:
            # The usual case, a request or its reply: nothing buffered, and
            # one recv brings exactly one whole frame. Its payload is one
            # slice of what came, without the buffer's appends, copies and
            # deletion (the general loop below does the rest, the checks the same).
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            if len(data) > 4:
                (length,) = FRAME_HEADER.unpack_from(data)
                if length > self.max_frame:
                    raise FrameTooLarge(f"frame of {length} bytes exceeds the {self.max_frame}-byte limit")
                if len(data) == 4 + length:
                    return data[4:]
            self._began = time.monotonic()  # only a frame that came in pieces pays for the clock
            self._buf += data
        while len(self._buf) < 4:
            if not self._fill():
                if self._buf:
                    raise ProtocolError("connection closed inside a frame header")
                return None
        (length,) = FRAME_HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the {self.max_frame}-byte limit")
        if not self._fds and 4 + length - len(self._buf) > _LARGE:
            # Far larger than one read (a search's every match, a big file):
            # read into one buffer of its size, each read as large as the
            # socket has, instead of 64 KiB at a time appended.
            large = bytearray(length)
            have = len(self._buf) - 4  # all of it belongs to this frame (checked above)
            large[:have] = self._buf[4:]
            self._buf = bytearray()
            self._large = (large, have)
            return self._recv_large()
        while len(self._buf) < 4 + length:
            if not self._fill():
                raise ProtocolError("connection closed inside a frame")
        payload = bytes(self._buf[4 : 4 + length])
        del self._buf[: 4 + length]
        if self._buf:
            self._began = time.monotonic()  # the next frame's first bytes came with this one's last
        if self._fds:
            start = self._consumed
            self._consumed += 4 + length
            if self._cut:
                try:
                    self._cut.remove(start)
                except KeyError:
                    pass
                else:
                    raise DescriptorsLost(payload)
        return payload

    def _recv_large(self) -> bytearray:
        """The rest of the large frame begun in ``_large``. A read that gives
        up (a client's socket times out after a tick) leaves what came in
        ``_large``, and the next call goes on from there. The buffer itself is
        the payload (the decoder takes it as it is: no copy)."""
        assert self._large is not None
        payload, have = self._large
        view = memoryview(payload)
        try:
            while have < len(payload):
                self._check_stall(4 + have)
                n = self.sock.recv_into(view[have:], len(payload) - have)
                if n == 0:
                    raise ProtocolError("connection closed inside a frame")
                have += n
        finally:
            view.release()
            self._large = (payload, have)
        self._large = None
        return payload

    def recv(self, decoder: msgspec.msgpack.Decoder[T]) -> T | None:
        payload = self.recv_payload()
        if payload is None:
            return None
        return decode(decoder, payload)

    def recv_request(self, decoder: msgspec.msgpack.Decoder[T], refuse: Callable[[ErrorReply], None]) -> T | None:
        """The next request that decodes, or None on a clean end of stream.

        A request that does not decode is answered through ``refuse`` (an
        ``ErrorReply``, code ``bad_request``, with its ``id`` when readable)
        and the next one is read: the connection stays. Broken framing raises
        ``ProtocolError`` (``FrameTooLarge`` for a length over ``max_frame``,
        before its payload is read) and ``OSError`` comes through: the caller
        ends that connection, and may answer a ``FrameTooLarge`` first."""
        while True:
            payload = self.recv_payload()
            if payload is None:
                return None
            try:
                return decoder.decode(payload)  # decode() written out: a server's every request comes here
            except DECODE_ERRORS as exc:
                error = ErrorReply(id=request_id_of(payload), code="bad_request", message=str(undecodable(exc)))
            del payload  # a refused frame is not kept while we wait for the next
            refuse(error)

    def take_fd(self) -> int:
        if not self._fd_queue:
            raise ProtocolError("expected a file descriptor with this message, none came")
        return self._fd_queue.pop(0)[1]

    def drop_fds(self) -> None:
        """Close every descriptor queued and not taken that came with a frame
        read already: a peer that sends descriptors no message of its asks
        for cannot make them pile up. Those of a frame still in the buffer
        (one read can bring a frame and, behind it, the next with its
        descriptors) stay for it."""
        self._drop(lambda at: at < self._consumed)

    def _drop(self, which: Callable[[int], bool]) -> None:
        kept = []
        for at, fd in self._fd_queue:
            if not which(at):
                kept.append((at, fd))
                continue
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd_queue = kept

    def close(self) -> None:
        self._drop(lambda _: True)
        self._buf, self._large = bytearray(), None  # a frame's bytes go now, whoever still holds this object
        self.sock.close()
