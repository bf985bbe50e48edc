"""The bridge's link (dispatch._mux, dispatch._linkwire) and ssh:// parsing, on real sockets and pipes, no daemon."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from dispatch import _linkwire, _mux
from dispatch._remote import ssh_command
from dispatchd import protocol

_FAKE_ATTACHED = msgspec.msgpack.encode({"op": "attached", "id": 7, "pad": "y" * 100})


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def test_attached_is_recognised_by_its_first_bytes_and_nothing_else_is() -> None:
    info = protocol.ErrorReply(id=3, code="x", message="attached")
    assert _linkwire.attached_prefix(_FAKE_ATTACHED)
    assert _linkwire.attached_prefix(_FAKE_ATTACHED[:_linkwire.PROBE])
    assert not _linkwire.attached_prefix(protocol.encode(info)[4:])
    assert not _linkwire.attached_prefix(protocol.encode(protocol.OkReply(id=1))[4:])
    assert not _linkwire.attached_prefix(b"")
    # msgspec writes the tag first, whatever the struct's size (map16 too).
    big = msgspec.msgpack.encode({"op": "attached", **{f"k{i}": i for i in range(20)}})
    assert big[0] == 0xDE and _linkwire.attached_prefix(big)


@pytest.mark.parametrize("cut", [1, 3, 5, 17, 4096])
def test_daemon_frames_are_cut_where_an_attached_frame_begins(cut: int) -> None:
    other = _frame(protocol.encode(protocol.OkReply(id=1))[4:])
    large = _frame(b"\x81\xa2op\xa5error" + b"z" * 70_000)
    stream = other + _frame(_FAKE_ATTACHED) + large + other + _frame(_FAKE_ATTACHED) + other
    tracker = _linkwire.DaemonFrames()
    tracker.fds.extend([101, 102])
    parts: list[tuple[bytes, int | None]] = []
    for i in range(0, len(stream), cut):
        parts += tracker.split(stream[i:i + cut])
    assert b"".join(p for p, _ in parts) == stream
    starts = [sum(len(p) for p, _ in parts[:n]) for n, (_, fd) in enumerate(parts) if fd is not None]
    assert [fd for _, fd in parts if fd is not None] == [101, 102]
    first = len(other)
    second = first + len(_frame(_FAKE_ATTACHED)) + len(large) + len(other)
    assert starts == [first, second]


def test_an_attached_frame_without_its_descriptor_ends_the_link() -> None:
    with pytest.raises(_mux.LinkError, match="came without its channel"):
        _linkwire.DaemonFrames().split(_frame(_FAKE_ATTACHED))


class Pair:
    """A bridge's link and a client's, joined by two pipes; the bridge's
    stream 0 is ``daemon`` (the daemon's end), the client's is ``client``."""

    def __init__(self) -> None:
        a_in, b_out = os.pipe()
        b_in, a_out = os.pipe()
        self.daemon, bridge_end = socket.socketpair()
        client_pump_end, self.client = socket.socketpair()
        self.ended: list[str | None] = []
        self.channels: list[socket.socket] = []  # those _channel made: closed with the pair, however a test ends
        self.bridge = _mux.Link(a_in, a_out, bridge_end, bridge=True)
        self.far = _mux.Link(b_in, b_out, client_pump_end, bridge=False, on_end=self.ended.append)
        self.fds = [a_in, a_out, b_in, b_out]
        self.threads = [threading.Thread(target=link.run, daemon=True) for link in (self.bridge, self.far)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.bridge.stop("test over")
        self.far.stop("test over")
        for t in self.threads:
            t.join(5)
        for fd in self.fds:
            os.close(fd)
        self.daemon.close()
        self.client.close()
        for sock in self.channels:
            sock.close()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, "closed early"
        got += chunk
    return got


def _channel(pair: Pair, size: int) -> tuple[socket.socket, socket.socket]:
    """A channel the daemon's side hands over (read by the client ``size``
    bytes at a time): the worker's end and the client's."""
    worker, channel = socket.socketpair()
    pair.channels.append(worker)
    try:
        socket.send_fds(pair.daemon, [_frame(_FAKE_ATTACHED)], [channel.fileno()])
    finally:
        channel.close()
    pair.client.settimeout(5)
    data, fds, _flags, _addr = socket.recv_fds(pair.client, size, 4)
    pair.channels += [socket.socket(fileno=fd) for fd in fds]  # each, mine included, a socket that closes
    assert fds and data == _frame(_FAKE_ATTACHED)[:len(data)]
    mine = pair.channels[-len(fds)]
    mine.settimeout(5)
    worker.settimeout(5)
    return worker, mine


def _both_ways(worker: socket.socket, mine: socket.socket, ask: bytes, answer: bytes) -> None:
    mine.sendall(ask)
    assert _recv_exactly(worker, len(ask)) == ask
    worker.sendall(answer)
    assert _recv_exactly(mine, len(answer)) == answer


def _settled(read: Callable[[], int], quiet: float = 0.5, timeout: float = 30) -> int:
    """``read()`` once it has not changed for ``quiet`` seconds (polled, up
    to ``timeout``: a loaded machine only makes it slower)."""
    deadline = time.monotonic() + timeout
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, f"still changing after {timeout} s: {read()}"
        time.sleep(0.05)
        if read() != value:
            value, since = read(), time.monotonic()
    return value


def test_a_channel_arrives_as_a_descriptor_and_carries_both_ways(pair: Pair) -> None:
    worker, mine = _channel(pair, 1 << 16)
    _both_ways(worker, mine, b"request", b"reply!")
    # Closed on one side: closed on the other.
    mine.close()
    assert worker.recv(10) == b""
    worker.close()


def test_a_slow_reader_holds_back_its_stream_only_and_nothing_buffers_without_bound(pair: Pair) -> None:
    worker, mine = _channel(pair, len(_frame(_FAKE_ATTACHED)))
    # The daemon floods stream 0; the client does not read it.
    written = 0
    stop = threading.Event()

    def flood() -> None:
        nonlocal written
        pair.daemon.settimeout(0.2)
        chunk = b"\x00" * 65536
        while not stop.is_set():
            try:
                written += pair.daemon.send(chunk)
            except TimeoutError:
                continue
            except OSError:
                return

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while written == 0 and time.monotonic() < deadline:  # the flood has begun
        time.sleep(0.02)
    stalled_at = _settled(lambda: written)  # ...and stalled: the source is no longer read
    # The window, the link's bound, and the kernel's socket and pipe buffers.
    kernel = 4 * 1024 * 1024
    assert written < _linkwire.WINDOW + _linkwire.OUT_BOUND + kernel, written
    # The channel goes on meanwhile.
    _both_ways(worker, mine, b"ping", b"pong")
    # Reading stream 0 lets the flood go on.
    pair.client.settimeout(1)
    drained = 0
    while drained < stalled_at:
        drained += len(pair.client.recv(1 << 20))
    deadline = time.monotonic() + 30
    while written <= stalled_at and time.monotonic() < deadline:
        time.sleep(0.02)
    assert written > stalled_at
    stop.set()
    t.join(5)
    mine.close()
    worker.close()


def test_the_far_side_going_away_ends_every_stream_and_says_so() -> None:
    p = Pair()
    try:
        p.bridge.stop("killed")  # the bridge ends: its side of the pipes goes quiet, then closes
        p.threads[0].join(5)
        os.close(p.fds[1])  # the bridge's output: the client reads the end of the link
        p.fds.remove(p.fds[1])
        p.threads[1].join(5)
        assert not p.threads[1].is_alive()
        assert p.ended and p.ended[0] is not None
        assert "killed" in p.ended[0] or "closed the link" in p.ended[0]
        p.client.settimeout(5)
        assert p.client.recv(10) == b""
    finally:
        p.close()


def test_a_link_frame_over_the_limit_ends_the_link() -> None:
    a_in, b_out = os.pipe()
    b_in, a_out = os.pipe()
    ours, theirs = socket.socketpair()
    ended: list[str | None] = []
    link = _mux.Link(a_in, a_out, ours, bridge=False, on_end=ended.append)
    os.write(b_out, struct.pack(">IIB", 1 << 30, 0, 0))
    t = threading.Thread(target=link.run, daemon=True)
    t.start()
    t.join(5)
    assert ended == [f"the far side sent a link frame of {1 << 30} bytes: not a dispatch bridge, or a broken one"]
    for fd in (a_in, a_out, b_in, b_out):
        os.close(fd)
    theirs.close()


@pytest.mark.parametrize("url, expected", [
    ("ssh://example.org", ["--", "example.org"]),
    ("ssh://me@example.org:2222", ["-p", "2222", "--", "me@example.org"]),
    ("ssh://me@[::1]:22", ["-p", "22", "--", "me@::1"]),
    ("ssh://10.0.0.1/", ["--", "10.0.0.1"]),
])
def test_ssh_urls_become_an_ssh_command(url: str, expected: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISPATCH_SSH_COMMAND", raising=False)
    argv = ssh_command(url)
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"]
    assert argv[4:-1] == expected
    assert argv[-1] == "dispatch bridge"


def test_the_socket_path_is_quoted_for_the_far_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPATCH_SSH_COMMAND", "ssh -F '/tmp/my config'")
    argv = ssh_command("ssh://h", "/run/a b;rm -rf x/s.sock", autostart=False)
    assert argv[:3] == ["ssh", "-F", "/tmp/my config"]
    assert argv[-1] == "dispatch --no-autostart bridge --socket '/run/a b;rm -rf x/s.sock'"


@pytest.mark.parametrize("url, why", [
    ("ssh://-oProxyCommand=sh", "the host in"),
    ("ssh://host;reboot", "the host in"),
    ("ssh://a b", "the host in"),
    ("ssh://-l@host", "the user in"),
    ("ssh://me@host:0", "the port in"),
    ("ssh://me@host:ssh", "the port in"),
    ("http://host", "a host is ssh://"),
    ("ssh://", "the host in"),
])
def test_malformed_ssh_urls_are_refused_before_anything_runs(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        ssh_command(url)
