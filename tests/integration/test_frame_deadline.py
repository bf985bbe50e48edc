"""A connection stopped inside a request frame is bounded (daemon/server.py,
``FRAME_TIMEOUT_S``): a real daemon, raw frames. Connections that send
``Hello`` and then most of a 256 KiB request, and stall, or trickle it in a
byte at a time, are answered ``frame_stalled`` and closed once the frame is
10 s old, logged, and the daemon's threads come back to what they were; a
request sent slowly, in pieces, within the bound is served, each frame with
a clock of its own."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from dispatchd import protocol
from dispatchd.daemon.server import FRAME_TIMEOUT_S
from tests.conftest import wait_until
from tests.integration.test_daemon_attacks import started
from tests.integration.test_protocol import REPLIES, assert_serving, closed, greeted

STALLED = 40
WANT = 4 + protocol.MAX_REQUEST_FRAME  # a whole request frame of the largest size, header included
SENT = 4 + 200 * 1024  # what each stalled connection sends of it


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _refused(frames: protocol.FrameSocket) -> tuple[protocol.ErrorReply, float]:
    """The daemon's answer to a stalled connection, and when it came (it is closed after)."""
    reply = frames.recv(REPLIES)
    at = time.monotonic()
    assert isinstance(reply, protocol.ErrorReply) and (reply.id, reply.code) == (0, "frame_stalled"), reply
    assert closed(frames)
    return reply, at


def test_stalled_and_trickling_frames_are_closed_after_the_bound_and_threads_come_back(tmp_path: Path) -> None:
    assert FRAME_TIMEOUT_S == 10.0
    with started(tmp_path) as d:
        assert_serving(d)
        before = _threads(d.proc.pid)
        with contextlib.ExitStack() as held:
            stalled = [held.enter_context(greeted(d)) for _ in range(STALLED)]
            trickling = held.enter_context(greeted(d))
            for frames in stalled:
                frames.sock.settimeout(FRAME_TIMEOUT_S + 20)
                frames.sock.sendall(protocol.FRAME_HEADER.pack(protocol.MAX_REQUEST_FRAME) + b"\x91" * (SENT - 4))
            first_byte = time.monotonic()
            # One more that never stops: a byte every half second (never a
            # read's timeout without one), which the bound ends all the same.
            trickling.sock.settimeout(FRAME_TIMEOUT_S + 20)
            trickling.sock.sendall(protocol.FRAME_HEADER.pack(protocol.MAX_REQUEST_FRAME))
            trickled_from = time.monotonic()
            stop = threading.Event()

            def trickle() -> None:
                while not stop.wait(0.5):
                    try:
                        trickling.sock.send(b"\x91")
                    except OSError:
                        return  # closed by the daemon

            dripper = threading.Thread(target=trickle, daemon=True)
            dripper.start()
            held.callback(dripper.join)
            held.callback(stop.set)
            # Each held by a thread while it waits (a loaded machine may start the last ones a little later;
            # ``before`` may have counted one short-lived thread of the daemon's own, gone since).
            assert wait_until(lambda: _threads(d.proc.pid) >= before - 1 + STALLED, timeout=5), _threads(d.proc.pid)
            assert_serving(d)  # others are served meanwhile
            for frames in stalled:
                reply, at = _refused(frames)
                assert reply.message == (f"frame not whole 10 s after its first byte ({SENT} bytes of {WANT} "
                                         "came): the connection is closed")
                assert FRAME_TIMEOUT_S - 0.1 <= at - first_byte < FRAME_TIMEOUT_S + 6
            reply, at = _refused(trickling)
            assert reply.message.startswith("frame not whole 10 s after its first byte (")
            assert reply.message.endswith(f" bytes of {WANT} came): the connection is closed")
            assert FRAME_TIMEOUT_S - 0.1 <= at - trickled_from < FRAME_TIMEOUT_S + 6
        # Their threads (and buffers) are let go: the daemon is back to what it was.
        assert wait_until(lambda: _threads(d.proc.pid) <= before + 1, timeout=15), (before, _threads(d.proc.pid))
        log = d.log()
        assert log.count("event=frame_stalled conn=") == STALLED + 1, log[-3000:]
        assert f"greeted=True after_s=10 got={SENT} want={WANT}" in log
        assert "Traceback" not in log
        assert_serving(d)


def test_requests_sent_slowly_in_pieces_within_the_bound_are_served(tmp_path: Path) -> None:
    """The twin: on one connection, a Status sent over 6 s and then a
    200 KiB request at ~40 KiB/s (5 s): 11 s in all, more than the bound,
    each frame within it; both answered, nothing logged as stalled."""
    with started(tmp_path) as d, greeted(d) as frames:
        frames.sock.settimeout(30)
        status = protocol.encode(protocol.Status(id=2))
        for i in range(len(status)):
            frames.sock.sendall(status[i:i + 1])
            time.sleep(6 / len(status))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.StatusReply) and reply.id == 2, reply
        big = protocol.encode(protocol.ListTools(id=3, policy="p" * (200 * 1024)))
        for i in range(0, len(big), 8 * 1024):
            frames.sock.sendall(big[i:i + 8 * 1024])
            time.sleep(0.2)
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.ErrorReply) and (reply.id, reply.code) == (3, "bad_policy"), reply
        assert reply.message.endswith("is not a policy name (letters, digits, '.', '_', '-')")
        assert "event=frame_stalled" not in d.log()
