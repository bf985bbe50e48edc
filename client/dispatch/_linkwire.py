"""What crosses a bridge's link (``dispatch._mux``): its frames, their kinds and bounds.

Guarantees:
- A link frame is ``dispatchd.protocol.frames``'s: a 4-byte big-endian
  length, then that many bytes; here the bytes are a 4-byte stream id, a
  1-byte kind and the kind's data (``frame``). ``MAX_LINK_FRAME`` bounds
  what a reader accepts.
- ``DaemonFrames`` finds where the daemon's own frames begin in stream 0
  (their length prefix is the protocol's ``FRAME_HEADER``), so that an
  ``Attached`` reply, recognised by its first bytes alone
  (``attached_prefix``), travels with the descriptor that came with it; a
  reply of that kind without one is a ``LinkError``.
"""

from __future__ import annotations

import struct
from collections import deque
from typing import Final

import msgspec

from dispatchd.protocol.frames import FRAME_HEADER

__all__ = [
    "ATTACH", "CHUNK", "CLOSE", "CREDIT", "DATA", "ERROR", "HANDSHAKE", "LINK_HEADER", "MAX_LINK_FRAME",
    "OUT_BOUND", "PROBE", "U32", "WINDOW", "DaemonFrames", "LinkError", "attached_prefix", "frame",
]

HANDSHAKE: Final = b"dispatch-bridge 1\n"
"""The line a bridge writes first: what it speaks, so a command that prints
anything else (a shell's greeting) is reported as not a bridge."""

# Kinds of link frame.
DATA: Final = 0  # bytes of a stream
ATTACH: Final = 1  # 4-byte new stream id, then bytes of stream 0 whose first byte carries that stream (bridge -> client)
CLOSE: Final = 2  # the sender neither sends nor reads this stream any more
CREDIT: Final = 3  # 4-byte count: that many more bytes of this stream were written out
ERROR: Final = 4  # UTF-8 text: why the sender ends the link (bridge -> client)

WINDOW: Final = 2 * 1024 * 1024
"""Bytes of one stream a side may send and the other has not written out."""
OUT_BOUND: Final = 1024 * 1024
"""Past this much waiting to go out on the link, no source is read."""
CHUNK: Final = 256 * 1024
MAX_LINK_FRAME: Final = CHUNK + 16

LINK_HEADER = struct.Struct(">IIB")  # length, stream id, kind
U32 = struct.Struct(">I")  # a stream id (ATTACH), a count (CREDIT)
# The start of an ``Attached`` message: msgspec writes a struct as a map whose
# first entry is its tag, so after the map's header come these bytes.
_ATTACHED_MARK: Final = msgspec.msgpack.encode("op") + msgspec.msgpack.encode("attached")
PROBE: Final = 5 + len(_ATTACHED_MARK)  # the longest map header (map32) and the mark


class LinkError(Exception):
    """The far side broke the link's framing, or went away."""


def attached_prefix(payload: bytes | bytearray | memoryview) -> bool:
    """Whether a daemon frame's payload (its first bytes suffice) is an ``Attached`` reply."""
    if not payload:
        return False
    first = payload[0]
    skip = 1 if 0x80 <= first <= 0x8F else 3 if first == 0xDE else 5 if first == 0xDF else -1
    return skip > 0 and bytes(payload[skip:skip + len(_ATTACHED_MARK)]) == _ATTACHED_MARK


def frame(stream: int, kind: int, data: bytes = b"") -> bytes:
    return LINK_HEADER.pack(5 + len(data), stream, kind) + data


class DaemonFrames:
    """Where the daemon's frames begin on stream 0 (the bridge's side): so an
    ``Attached`` frame's first byte can be sent as an ``ATTACH``, with the
    descriptor that came with it."""

    def __init__(self) -> None:
        self.pending = bytearray()  # bytes at a frame's start held until it is known whether it is Attached
        self.left = 0  # bytes of the current frame still to pass on
        self.fds: deque[int] = deque()

    def split(self, data: bytes) -> list[tuple[bytes, int | None]]:
        """``data`` cut where ``Attached`` frames begin: (bytes, its descriptor or None)."""
        out: list[tuple[bytes, int | None]] = []
        buf = self.pending + data if self.pending else data
        self.pending = bytearray()
        pos = 0
        plain_from = 0
        while pos < len(buf):
            if self.left:
                step = min(self.left, len(buf) - pos)
                pos += step
                self.left -= step
                continue
            if len(buf) - pos < 4:
                break
            (length,) = FRAME_HEADER.unpack_from(buf, pos)
            probe = min(length, PROBE)
            if len(buf) - pos - 4 < probe:
                break
            if attached_prefix(memoryview(buf)[pos + 4:pos + 4 + probe]):
                if not self.fds:
                    raise LinkError("the daemon's Attached reply came without its channel")
                if pos > plain_from:
                    out.append((bytes(buf[plain_from:pos]), None))
                end = min(len(buf), pos + 4 + length)
                out.append((bytes(buf[pos:end]), self.fds.popleft()))
                self.left = pos + 4 + length - end
                pos = plain_from = end
                continue
            self.left = 4 + length
        if pos > plain_from:
            out.append((bytes(buf[plain_from:pos]), None))
        self.pending = bytearray(buf[pos:])
        return out
