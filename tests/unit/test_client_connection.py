"""The client's per-caller wake-ups (``dispatch._transport.Connection``), with real
threads and a real socket pair.

They exist for speed (docs/performance.md); these tests hold what must not change
with them: every caller sharing one connection gets its own reply, even out
of order and across a timeout, and a broken connection wakes every waiter.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dispatch._transport import Connection
from dispatch.errors import RequestTimeout
from dispatchd import protocol


class _OutOfOrderServer:
    """Answers CallTool requests in batches of ``batch``, last first."""

    def __init__(self, sock: socket.socket, batch: int, skip: set[int] | None = None) -> None:
        self.frames = protocol.FrameSocket(sock)
        self.batch = batch
        self.skip = skip or set()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self) -> None:
        pending = []
        while True:
            try:
                req = self.frames.recv(protocol.channel_request_decoder)
            except OSError:
                return
            if req is None:
                return
            pending.append(req)
            if len(pending) == self.batch:
                for r in reversed(pending):
                    if r.params["n"] not in self.skip:
                        self.frames.send(protocol.ToolReply(id=r.id, success=True, output=str(r.params["n"])))
                pending = []


def _call(conn: Connection, n: int, timeout: float = 10.0) -> str:
    reply, _ = conn.request(lambda rid: protocol.CallTool(id=rid, tool="t", params={"n": n}), timeout=timeout)
    return reply.output


def test_each_caller_gets_its_own_reply_when_replies_come_out_of_order() -> None:
    ours, theirs = socket.socketpair()
    server = _OutOfOrderServer(theirs, batch=8)
    conn = Connection(ours, protocol.channel_reply_decoder)
    results: dict[int, list[str]] = {i: [] for i in range(8)}

    def caller(i: int) -> None:
        for k in range(25):
            results[i].append(_call(conn, i * 100 + k))

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert results == {i: [str(i * 100 + k) for k in range(25)] for i in range(8)}
    conn.close()
    server.frames.close()


def test_a_caller_that_times_out_hands_the_reading_on() -> None:
    # Two callers; the server answers the pair only once both are in, and
    # never answers n=1: its caller times out, the other still gets its reply.
    ours, theirs = socket.socketpair()
    server = _OutOfOrderServer(theirs, batch=2, skip={1})
    conn = Connection(ours, protocol.channel_reply_decoder)
    out: dict[int, object] = {}

    def caller(n: int, timeout: float) -> None:
        try:
            out[n] = _call(conn, n, timeout)
        except RequestTimeout as exc:
            out[n] = exc

    first = threading.Thread(target=caller, args=(1, 0.5))
    first.start()
    time.sleep(0.1)  # the first caller is the reader by now
    second = threading.Thread(target=caller, args=(2, 10.0))
    second.start()
    first.join(10)
    second.join(10)
    assert isinstance(out[1], RequestTimeout)
    assert out[2] == "2"
    conn.close()
    server.frames.close()


@pytest.mark.parametrize("waiters", [1, 6])
def test_a_broken_connection_wakes_every_waiter(waiters: int) -> None:
    ours, theirs = socket.socketpair()
    conn = Connection(ours, protocol.channel_reply_decoder)
    errors: list[BaseException] = []

    def caller(n: int) -> None:
        try:
            _call(conn, n, timeout=30)
        except Exception as exc:  # noqa: BLE001 (any error is the answer here)
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(waiters)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    theirs.close()  # the peer goes away: the reader sees EOF and fails the connection
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads)
    assert len(errors) == waiters
    conn.close()
