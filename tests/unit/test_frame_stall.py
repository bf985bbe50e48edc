"""A frame must be whole ``frame_timeout_s`` after its first byte (the
daemon's bound on a connection stopped inside a request), over a real
``socket.socketpair``: stalled and trickling frames raise ``FrameStalled``
with what came; frames in pieces within the bound, and the next frame's
clock started afresh, are read whole."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator

import pytest

from dispatchd import protocol as p
from dispatchd.protocol import FrameSocket, FrameStalled, ProtocolError

BOUND = 0.5


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, FrameSocket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(0.1)  # as the daemon's SO_RCVTIMEO: a read gives up, the caller reads again
    frames = FrameSocket(b)
    frames.frame_timeout_s = BOUND
    yield a, frames
    a.close()
    frames.close()


def _read(frames: FrameSocket, within: float = 5.0) -> bytes | bytearray | None:
    """Read as the daemon does: a read that times out is tried again."""
    deadline = time.monotonic() + within
    while True:
        try:
            return frames.recv_payload()
        except TimeoutError:
            assert time.monotonic() < deadline, "never raised nor returned"


def test_a_stalled_frame_raises_after_the_bound_with_what_came(pair: tuple[socket.socket, FrameSocket]) -> None:
    a, frames = pair
    a.sendall(struct.pack(">I", 1000) + b"x" * 10)
    started = time.monotonic()
    with pytest.raises(FrameStalled) as info:
        _read(frames)
    assert BOUND <= time.monotonic() - started < BOUND + 1
    assert str(info.value) == "frame not whole 0.5 s after its first byte (14 bytes of 1004 came)"
    assert (info.value.got, info.value.want, info.value.after_s) == (14, 1004, 0.5)
    assert isinstance(info.value, ProtocolError)  # a broken frame: the connection ends
    frames.close()
    assert not frames.buffered()  # what it held is let go


def test_a_short_header_stalls_too(pair: tuple[socket.socket, FrameSocket]) -> None:
    a, frames = pair
    a.sendall(b"\x00\x00")
    with pytest.raises(FrameStalled) as info:
        _read(frames)
    assert str(info.value) == "frame not whole 0.5 s after its first byte (2 bytes came)"


def test_a_frame_trickling_in_past_the_bound_raises_at_its_next_read(pair: tuple[socket.socket, FrameSocket]) -> None:
    a, frames = pair
    a.sendall(struct.pack(">I", 1000))
    frames.sock.settimeout(0.05)
    started = time.monotonic()
    with pytest.raises(FrameStalled) as info:
        while True:  # a byte before every read: the frame grows, and only the bound ends it
            a.send(b"y")
            try:
                frames.recv_payload()
            except TimeoutError:
                pass
    assert BOUND <= time.monotonic() - started < BOUND + 1
    assert str(info.value).startswith("frame not whole 0.5 s after its first byte (")


def test_frames_in_pieces_within_the_bound_are_read_each_with_its_own_clock(
    pair: tuple[socket.socket, FrameSocket]
) -> None:
    """The twin: two frames, each sent in pieces over 0.3 s (0.6 s in all,
    more than the bound), and a third behind the second in the same write."""
    a, frames = pair
    status, listing = p.encode(p.Status(id=2)), p.encode(p.ListSessions(id=3))
    for data in (status, listing + status):
        for i in range(0, len(data), 3):
            a.sendall(data[i:i + 3])
            time.sleep(0.3 / (len(data) / 3))
        got = _read(frames)
        assert got == data[4:len(status) if data is status else len(listing)]
    time.sleep(BOUND + 0.1)  # the third came with the second's last bytes, long ago: whole, so read
    assert _read(frames) == status[4:]


def test_without_a_bound_a_frame_waits_as_long_as_it_takes() -> None:
    """Clients and tool servers set none: a partial frame is waited on."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(0.1)
        frames = FrameSocket(b)
        data = p.encode(p.Status(id=2))
        a.sendall(data[:3])
        started = time.monotonic()
        while time.monotonic() - started < BOUND * 2:
            with pytest.raises(TimeoutError):
                frames.recv_payload()
        a.sendall(data[3:])
        assert frames.recv_payload() == data[4:]
