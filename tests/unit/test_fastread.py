"""The tool server's fast lane for read_file (tools/_fastread.c).

What it must hold: a request the lane answers gets the reply the Python path
sends, byte for byte; every other request is handed back whole and answered
by the Python path, as if the lane were not there; and a file is reached
below the worktree's root fd only (the lane opens as read_beneath does).

Two real tool servers (``_Server``/``Channel``, threads of this process,
over socketpairs), one with the lane and one without, are sent the same
frames; the plan is a namespace of the fields they read (no sandbox: the
lane's confinement is the session's, tested by the escape suite).
"""

from __future__ import annotations

import gc
import os
import re
import random
import socket
import struct
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from dispatchd import protocol
from dispatchd.policy import Limits
from dispatchd.tools import native
from dispatchd.worker import tool_server
from tests.unit.mutate import mutated
from tests.unit.test_tool_files import _SWAP_LOOP, _until_swapping

pytestmark = pytest.mark.skipif(native.lines is None, reason="the C helper is not built (test_native_lines says so)")

M = 2**63 - 1
Sockets = tuple[socket.socket, socket.socket]


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def call(params: dict[str, Any], rid: int = 7, **fields: Any) -> bytes:
    """A call_tool frame as msgspec encodes it (the client's encoder)."""
    return frame(msgspec.msgpack.encode(protocol.CallTool(id=rid, tool=fields.pop("tool", "read_file"),
                                                          params=params, **fields)))


def plan(root: str, tools: list[str]) -> Any:
    """The fields of a SessionPlan a tool server reads, for ``root`` (its
    scratch directory made beside it)."""
    made = types.SimpleNamespace(paths=types.SimpleNamespace(worktree=root, scratch=root + "-scratch"),
                                 limits=Limits(), env={}, writable=True, tools=tools, checkpoint_writes=False,
                                 namespaces=types.SimpleNamespace(user=True, mount=True, pid=True),
                                 mounts=types.SimpleNamespace(root="minimal"))
    os.makedirs(made.paths.scratch, exist_ok=True)
    return made


class Counted:
    """serve_read, counting the calls it answered (when it takes the send
    lock, just before the reply goes: counted before the client can see
    it) and the times it returned."""

    def __init__(self) -> None:
        assert native.lines is not None
        self.real, self.answered, self.returned = native.lines.serve_read, 0, 0

    def __call__(self, sock_fd: int, root_fd: int, cap: int, sniff: int, max_frame: int,
                 acquire: Callable[[], object], release: Callable[[], object], server: object) -> float | bytes:
        def counted() -> object:
            self.answered += 1
            return acquire()

        took = self.real(sock_fd, root_fd, cap, sniff, max_frame, counted, release, server)
        self.returned += 1
        return took


class Server:
    """A real tool server on a socketpair; ``ask`` sends bytes and reads the
    replies that come within ``wait`` seconds (None: the channel closed)."""

    def __init__(self, root: str, lane: bool) -> None:
        self.server = tool_server._Server(plan(root, ["read_file", "list_files"]), None)  # type: ignore[arg-type]
        self.counted = Counted()
        assert self.server.fast_read is not None  # built, read_file offered, the root held: the lane is on
        self.server.fast_read = self.counted if lane else None
        self.sock: socket.socket | None = None
        self.connect()

    def connect(self) -> None:
        ours, theirs = socket.socketpair()
        self.server.add_channel(theirs)
        self.sock = ours

    def ask(self, data: bytes, replies: int = 1, wait: float = 5.0) -> list[bytes] | None:
        assert self.sock is not None
        self.sock.sendall(data)
        got: list[bytes] = []
        self.sock.settimeout(wait)
        try:
            while len(got) < replies:
                head = self._exactly(4)
                if head is None:
                    return None
                body = self._exactly(struct.unpack(">I", head)[0])
                if body is None:
                    return None
                got.append(body)
        except TimeoutError:
            pass
        return got

    def _exactly(self, n: int) -> bytes | None:
        assert self.sock is not None
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        os.close(self.server.ctx.root_fd)


@pytest.fixture
def worktree(tmp_path: Path) -> str:
    root = os.path.realpath(tmp_path / "wt")
    os.mkdir(root)
    files = {
        "f4k.txt": ("0123456789abcdef" * 4 + "\n").encode() * 63,
        "empty.txt": b"",
        "one.txt": b"no newline at the end",
        "crlf.txt": b"a\r\nb\r\n\r\n",
        "utf8.txt": "héllo wörld\n€ and 𝄞\n".encode(),
        "bad-utf8.txt": b"ok\n\xff\xfe half \xe2\x82\nend \xc3",
        "many.txt": b"".join(b"line %d\n" % i for i in range(1200)),
        "binary.bin": b"ELF\x00\x01\x02",
        "d/e/deep.txt": b"deep\n",
        "sp ace.txt": b"space\n",
        "long.txt": b"x" * 70000 + b"\n" + b"y" * 300,
    }
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        Path(root, name).write_bytes(data)
    os.symlink("f4k.txt", os.path.join(root, "link.txt"))
    os.mkdir(os.path.join(root, "adir"))
    Path(tmp_path, "outside.txt").write_text("secret\n")
    return root


@pytest.fixture
def pair(worktree: str) -> Iterator[tuple[Server, Server]]:
    lane, python = Server(worktree, lane=True), Server(worktree, lane=False)
    yield lane, python
    lane.close()
    python.close()


# metadata["usage"] (the CPU time of the call, the peak resident size): the
# one part of a reply that differs between two answers of the same call.
_USAGE = re.compile(rb"\xa5usage\x82\xa5cpu_s\xcb.{8}\xa8peak_mib\xcb.{8}", re.DOTALL)


def same_but_usage(replies: list[bytes] | None) -> list[bytes] | None:
    """The replies with their usage figures zeroed (each reply of a call
    carries them, in the same place, both ways)."""
    if replies is None:
        return None
    return [_USAGE.sub(lambda m: m.group(0)[:14] + bytes(8) + m.group(0)[22:32] + bytes(8), r) for r in replies]


def both(pair: tuple[Server, Server], data: bytes, replies: int = 1) -> list[bytes] | None:
    lane, python = pair
    got, want = lane.ask(data, replies), python.ask(data, replies)
    assert same_but_usage(got) == same_but_usage(want)
    if got:
        for reply in got:
            decoded = msgspec.msgpack.decode(reply)
            if decoded.get("op") == "tool_reply" and decoded.get("success"):
                assert set(decoded["metadata"]["usage"]) == {"cpu_s", "peak_mib"}
    return got


# The usual calls: the lane answers each, with the Python path's bytes.
USUAL = [
    {"path": "f4k.txt"},
    {"path": "f4k.txt", "start_line": 10, "end_line": 20},
    {"path": "f4k.txt", "start_line": 62},
    {"path": "f4k.txt", "end_line": 0},
    {"path": "f4k.txt", "start_line": 5, "end_line": 5},
    {"path": "f4k.txt", "start_line": 60, "end_line": 2**62 - 1},
    {"path": "empty.txt"},
    {"path": "one.txt"},
    {"path": "crlf.txt"},
    {"path": "utf8.txt"},
    {"path": "utf8.txt", "start_line": 1},
    {"path": "bad-utf8.txt", "start_line": 0, "end_line": 0},  # its valid first line
    {"path": "many.txt"},
    {"path": "many.txt", "start_line": 990, "end_line": 1100},
    {"path": "d/e/deep.txt"},
    {"path": "sp ace.txt"},
    {"path": "long.txt"},
    {"end_line": 3, "path": "f4k.txt", "start_line": 1},  # any order of keys
]
IDS = [0, 1, 31, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, M, -1, -32, -33, -128, -129, -32768,
       -32769, -(2**31), -(2**31) - 1, -(2**63)]


@pytest.mark.parametrize("params", USUAL, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_the_lane_answers_the_usual_call_with_the_python_paths_bytes(pair: tuple[Server, Server],
                                                                      params: dict[str, Any]) -> None:
    for rid in IDS:
        got = both(pair, call(params, rid))
        assert got is not None and len(got) == 1
        reply = msgspec.msgpack.decode(got[0])
        assert reply["op"] == "tool_reply" and reply["id"] == rid and reply["success"] is True
    assert pair[0].counted.answered == len(IDS)  # the lane, not the Python path, answered every one
    assert pair[1].counted.answered == 0


def test_a_streamed_call_and_other_encodings_are_the_usual_call(pair: tuple[Server, Server]) -> None:
    both(pair, call({"path": "f4k.txt"}, stream=True))
    # A map16 header for the same five pairs: another encoding of the same request.
    body = msgspec.msgpack.encode(protocol.CallTool(id=3, tool="read_file", params={"path": "one.txt"}))
    assert body[0] == 0x85
    both(pair, frame(b"\xde\x00\x05" + body[1:]))
    # A str8 header for a short string, and an id as an int64: the same again.
    both(pair, _raw_request([("op", b"\xd9\x09call_tool"), ("id", b"\xd3" + (5).to_bytes(8, "big")),
                             ("tool", _E("read_file")), ("params", _E({"path": "one.txt"}))]))
    assert pair[0].counted.answered == 3


def _raw_request(pairs: list[tuple[str, bytes]]) -> bytes:
    """A request map from already-encoded values (duplicate keys allowed)."""
    enc = msgspec.msgpack.encode
    return frame(bytes([0x80 | len(pairs)]) + b"".join(enc(k) + v for k, v in pairs))


_E = msgspec.msgpack.encode
# Each is handed back, and the Python path's answer (a failure, a refusal, a
# bad_request, or a reply the lane does not write) is what the client gets.
HANDED_BACK: dict[str, bytes] = {
    "a missing file": call({"path": "missing.txt"}),
    "a binary file": call({"path": "binary.bin"}),
    # Bytes that are not UTF-8 in the lines shown: read_file's last line says so.
    "bytes that are not UTF-8": call({"path": "bad-utf8.txt"}),
    "a line of bytes that are not UTF-8": call({"path": "bad-utf8.txt", "start_line": 1, "end_line": 1}),
    "a directory": call({"path": "adir"}),
    "a symlink inside the worktree": call({"path": "link.txt"}),
    "a path through ..": call({"path": "d/../f4k.txt"}),
    "a path out through ..": call({"path": "../outside.txt"}),
    "an absolute path": call({"path": "/etc/hostname"}),
    "a path with ./": call({"path": "./f4k.txt"}),
    "a path with //": call({"path": "d//e/deep.txt"}),
    "a trailing slash": call({"path": "d/e/deep.txt/"}),
    "an empty path": call({"path": ""}),
    "a non-ASCII name": call({"path": "fïle.txt"}),
    "a control character": call({"path": "f4k.txt\n"}),
    "a NUL": call({"path": "f4k\x00.txt"}),
    "start past the end": call({"path": "f4k.txt", "start_line": 63}),
    "start past an empty file": call({"path": "empty.txt", "start_line": 1}),
    "a negative start": call({"path": "f4k.txt", "start_line": -1}),
    "an end under -1": call({"path": "f4k.txt", "end_line": -2}),
    "start after end": call({"path": "f4k.txt", "start_line": 5, "end_line": 4}),
    "a start of 2**62": call({"path": "f4k.txt", "start_line": 2**62}),
    "an end of 2**62": call({"path": "f4k.txt", "end_line": 2**62}),
    "a start of 2**63 - 1": call({"path": "f4k.txt", "start_line": M}),
    "an unknown parameter": call({"path": "f4k.txt", "start": 1}),
    "a request over the lane's page": call({"path": "f4k.txt", "pad": "a" * 10000}),
    "a float line": call({"path": "f4k.txt", "start_line": 1.0}),
    "a bool line": call({"path": "f4k.txt", "start_line": True}),
    "a path that is not a string": call({"path": 7}),
    "no path": call({"start_line": 1}),
    "an id over int64": call({"path": "f4k.txt"}, 2**64 - 1),
    "another tool": call({"path": "d"}, tool="list_files"),
    "an unknown tool": call({"path": "f4k.txt"}, tool="read_files"),
    "a cancel": frame(_E(protocol.CancelCall(id=4))) + call({"path": "one.txt"}),
    "a duplicate key": _raw_request([("op", _E("call_tool")), ("id", _E(1)), ("tool", _E("read_file")),
                                     ("params", _E({"path": "f4k.txt"})), ("id", _E(2))]),
    "a duplicate path": _raw_request([("op", _E("call_tool")), ("id", _E(1)), ("tool", _E("read_file")),
                                      ("params", b"\x82" + _E("path") + _E("one.txt") + _E("path") + _E("f4k.txt"))]),
    "no op": _raw_request([("id", _E(1)), ("tool", _E("read_file")), ("params", _E({"path": "f4k.txt"}))]),
    "an unknown field": _raw_request([("op", _E("call_tool")), ("id", _E(1)), ("tool", _E("read_file")),
                                      ("params", _E({"path": "f4k.txt"})), ("extra", _E(1))]),
    "a trailing byte": frame(_E(protocol.CallTool(id=1, tool="read_file", params={"path": "f4k.txt"})) + b"\xc0"),
    "an empty frame": frame(b""),
    "garbage": frame(b"\xc1\xc1\xc1"),
    "a stream that is not a bool": _raw_request([("op", _E("call_tool")), ("id", _E(1)), ("tool", _E("read_file")),
                                                 ("params", _E({"path": "one.txt"})), ("stream", _E(1))]),
}


@pytest.mark.parametrize("name", list(HANDED_BACK))
def test_anything_else_is_handed_back_and_answered_by_the_python_path(pair: tuple[Server, Server],
                                                                      name: str) -> None:
    # One reply each (a cancel has none; the read sent with it does).
    got = both(pair, HANDED_BACK[name])
    assert got is not None and len(got) == 1, got
    # The lane answered none of these (the read after the cancel came in the
    # same recv: two frames, handed back whole).
    assert pair[0].counted.answered == 0
    # And the channel serves on, the lane again (after a bad_request the
    # Python path reads one more request itself: recv_request reads on until
    # one decodes).
    both(pair, call({"path": "one.txt"}))
    both(pair, call({"path": "one.txt"}))
    assert pair[0].counted.answered in (1, 2)


PIPELINED = {
    # what one recv brings: the answers the lane gives (in order), the rest the Python path's
    "two usual calls": ([call({"path": "one.txt"}, 1), call({"path": "crlf.txt"}, 2)], 2),
    "three, the middle one a missing file": (
        [call({"path": "one.txt"}, 1), call({"path": "missing.txt"}, 2), call({"path": "crlf.txt"}, 3)], 1),
    "three, the middle one another tool": (
        [call({"path": "one.txt"}, 1), call({"path": "d"}, 2, tool="list_files"), call({"path": "crlf.txt"}, 3)], 1),
    "a bad request first": ([frame(b"\xc1"), call({"path": "one.txt"}, 2)], 0),
    "a cancel first": ([frame(_E(protocol.CancelCall(id=9))), call({"path": "one.txt"}, 2)], 0),
    "eight usual calls": ([call({"path": "f4k.txt", "start_line": i}, i) for i in range(8)], 8),
}


@pytest.mark.parametrize("name", list(PIPELINED))
def test_several_frames_in_one_recv_the_usual_calls_at_the_front_answered(pair: tuple[Server, Server],
                                                                         name: str) -> None:
    """Threads sharing a session send several requests before a reply: the
    lane answers the usual calls at the front of what one recv brought, in
    order, and hands back the rest from the first it does not answer; the
    replies are the Python path's, in the same order."""
    frames, answered = PIPELINED[name]
    replies = sum(1 for f in frames if b"cancel_call" not in f)
    lane, python = pair
    # Both servers' readers get the whole batch in one recv: it is sent
    # before they read (their threads are held in the GIL-free recv of an
    # empty socket until then, and one send is one message).
    data = b"".join(frames)
    got = both(pair, data, replies)
    assert got is not None and len(got) == replies
    assert lane.counted.answered == answered


def test_a_frame_in_two_recvs_and_a_frame_cut_after_an_answered_one(pair: tuple[Server, Server]) -> None:
    """A frame whose first part comes alone is handed back, and the Python
    path reads the rest; so is the start of a frame after one answered."""
    lane, python = pair
    whole = call({"path": "f4k.txt"}, 3)
    for data, rest, answered in ((whole[:9], whole[9:], 0), (call({"path": "one.txt"}, 1) + whole[:9], whole[9:], 1)):
        before, returned = lane.counted.answered, lane.counted.returned
        for server in pair:
            assert server.sock is not None
            server.sock.sendall(data)
        deadline = time.monotonic() + 10
        while lane.counted.returned == returned:  # the lane read the first part on its own, and handed it back
            assert time.monotonic() < deadline, "the lane never read the first part"
            time.sleep(0.001)
        assert both(pair, rest, replies=1 + answered) is not None
        assert lane.counted.answered - before == answered
    both(pair, whole)  # the twin: whole, it is the lane's
    assert lane.counted.answered == 2


def test_a_length_over_the_frame_limit_ends_the_channel_as_before(pair: tuple[Server, Server]) -> None:
    # The Python path reads the header, refuses it, and drops the channel.
    assert both(pair, struct.pack(">I", protocol.MAX_FRAME + 1) + b"\x80") is None
    assert pair[0].counted.answered == 0


def test_random_requests_get_the_same_answers_both_ways(pair: tuple[Server, Server]) -> None:
    """Requests cut, grown and flipped from the usual call (lengths kept
    right, so that each is one frame): both servers answer alike, close
    alike, and the lane answers those still the usual call."""
    rng = random.Random(5)
    bases = [call(p, rid) for p in USUAL[:8] for rid in (1, 300, -40)]
    for _ in range(600):
        body = mutated(rng, rng.choice(bases)[4:], rng.randint(1, 3), most=6)
        got = both(pair, frame(body), replies=1)
        if got is None:  # closed alike (both() compared): new channels
            for server in pair:
                assert server.sock is not None
                server.sock.close()
                server.connect()
        both(pair, rng.choice(bases))  # and the usual call after it, twice, alike
        both(pair, rng.choice(bases))
    # The lane answered the usual calls but those read by the Python path
    # after a bad_request (recv_request reads on until a request decodes):
    # at least every second one.
    assert pair[0].counted.answered >= 600


def test_a_call_the_lane_answers_is_recorded(pair: tuple[Server, Server]) -> None:
    lane = pair[0]
    lane.server.activity.records.clear()
    before = lane.server.activity.last
    assert lane.ask(call({"path": "one.txt"})) is not None
    records = lane.server.activity.records
    deadline = time.monotonic() + 5
    while not records and time.monotonic() < deadline:  # recorded just after the reply went
        time.sleep(0.001)
    assert len(records) == 1 and records[0][0] == "read_file" and records[0][2] is True
    assert 0 < records[0][1] < 5 and lane.server.activity.last > before


def test_a_draining_server_refuses_in_the_python_paths_words(pair: tuple[Server, Server]) -> None:
    for server in pair:
        server.server.draining = True
    got = both(pair, call({"path": "f4k.txt"}))
    assert got is not None and b"dispatchd is stopping and takes no new calls" in got[0]
    assert pair[0].counted.answered == 0
    for server in pair:  # the twin: the same call, not draining, is the lane's
        server.server.draining = False
    both(pair, call({"path": "f4k.txt"}))
    assert pair[0].counted.answered == 1


# -- serve_read itself -------------------------------------------------------------


class _Flag:
    draining = False


def _serve(sock: socket.socket, root_fd: int, lock: threading.Lock | None = None,
           max_frame: int = protocol.MAX_FRAME, server: object = None) -> float | bytes:
    assert native.lines is not None
    lock = lock or threading.Lock()
    return native.lines.serve_read(sock.fileno(), root_fd, 1 << 24, 8192, max_frame, lock.acquire,
                                   lock.release, server or _Flag())


@pytest.fixture
def sockets() -> Iterator[Sockets]:
    """The client's end and the lane's."""
    ours, lane = socket.socketpair()
    yield ours, lane
    ours.close()
    lane.close()


@pytest.fixture
def root_fd(worktree: str) -> Iterator[int]:
    fd = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def test_serve_read_hands_back_exactly_the_bytes_that_came(root_fd: int, sockets: Sockets) -> None:
    ours, lane = sockets
    data = call({"path": "missing.txt"})
    ours.sendall(data)
    assert _serve(lane, root_fd) == data
    ours.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing was sent
        ours.recv(1)
    # The twin: the usual call is answered, a float of seconds.
    ours.setblocking(True)
    ours.sendall(call({"path": "one.txt"}))
    took = _serve(lane, root_fd)
    assert isinstance(took, float) and 0 <= took < 5
    reply = msgspec.msgpack.decode(ours.recv(1 << 16)[4:])
    assert reply["output"] == "0: no newline at the end"


def test_serve_read_says_nothing_came_when_the_peer_closed_and_raises_on_a_timeout(root_fd: int,
                                                                                   sockets: Sockets) -> None:
    ours, lane = sockets
    lane.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
    with pytest.raises(BlockingIOError) as caught:
        _serve(lane, root_fd)
    assert caught.value.errno == 11  # EAGAIN: as socket.recv raises it, which the channel's loop expects
    ours.close()
    assert _serve(lane, root_fd) == b""


def test_serve_read_answers_the_calls_at_the_front_and_hands_back_the_rest(root_fd: int,
                                                                          sockets: Sockets) -> None:
    ours, lane = sockets
    first, second = call({"path": "one.txt"}, 1), call({"path": "crlf.txt"}, 2)
    rest = call({"path": "missing.txt"}, 3) + call({"path": "one.txt"}, 4)[:7]
    ours.sendall(first + second + rest)
    took = _serve(lane, root_fd)
    assert isinstance(took, tuple)
    seconds, back = took
    assert len(seconds) == 2 and all(0 <= s < 5 for s in seconds) and back == rest
    replies = ours.recv(1 << 16)
    ids = []
    while replies:
        (n,) = struct.unpack(">I", replies[:4])
        ids.append(msgspec.msgpack.decode(replies[4:4 + n])["id"])
        replies = replies[4 + n:]
    assert ids == [1, 2]
    # All of it answered: the seconds of each, nothing back.
    ours.sendall(first + second)
    took = _serve(lane, root_fd)
    assert isinstance(took, tuple) and len(took[0]) == 2 and took[1] == b""


def test_serve_read_hands_back_a_reply_over_the_frame_limit(root_fd: int, sockets: Sockets) -> None:
    ours, lane = sockets
    data = call({"path": "f4k.txt"})
    ours.sendall(data)
    assert _serve(lane, root_fd, max_frame=4000) == data  # the numbered text is over 4,400 bytes
    ours.sendall(data)
    assert isinstance(_serve(lane, root_fd, max_frame=5000), float)


def test_serve_read_sends_only_while_it_holds_the_channels_send_lock(root_fd: int, sockets: Sockets) -> None:
    """A slow call's output may be on its way on the same channel: the reply
    waits for the send lock, so frames never interleave."""
    ours, lane = sockets
    lock = threading.Lock()
    ours.sendall(call({"path": "one.txt"}))
    lock.acquire()
    done: list[float | bytes] = []
    thread = threading.Thread(target=lambda: done.append(_serve(lane, root_fd, lock)))
    thread.start()
    ours.settimeout(0.3)
    with pytest.raises(TimeoutError):  # nothing while the lock is held
        ours.recv(1)
    lock.release()
    ours.settimeout(5)
    assert msgspec.msgpack.decode(ours.recv(1 << 16)[4:])["success"] is True
    thread.join(5)
    assert isinstance(done[0], float) and not lock.locked()


def test_serve_read_refuses_bad_arguments(root_fd: int) -> None:
    assert native.lines is not None
    lock = threading.Lock()
    with pytest.raises(ValueError, match="must be >= 0"):
        native.lines.serve_read(0, root_fd, -1, 0, 0, lock.acquire, lock.release, _Flag())
    with pytest.raises(TypeError):  # a descriptor that is not an int
        native.lines.serve_read("0", root_fd, 1, 0, 0, lock.acquire, lock.release, _Flag())


@pytest.mark.process
def test_a_directory_swapped_for_a_link_outside_is_never_read_through_the_lane(
        tmp_path: Path, sockets: Sockets) -> None:
    """The lane opens as read_beneath does (openat2 below the root fd, no
    symlinks): another process swapping a directory of the path for a
    symlink to outside, again and again, never gets the outside file read.
    A refusal there is handed back (the Python path would word it)."""
    root = os.path.realpath(tmp_path / "race")
    os.makedirs(os.path.join(root, "d"))
    Path(root, "d", "f.txt").write_text("inside\n")
    away = tmp_path / "away"
    away.mkdir()
    (away / "f.txt").write_text("secret\n")
    ours, lane = sockets
    data = call({"path": "d/f.txt"})
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        # The twin: without the swap, the inside file through the lane.
        ours.sendall(data)
        assert isinstance(_serve(lane, root_fd), float)
        assert msgspec.msgpack.decode(ours.recv(1 << 16)[4:])["output"] == "0: inside"
        swapper = subprocess.Popen([sys.executable, "-c", _SWAP_LOOP, root, str(away)])
        _until_swapping(root)
        answered = handed = 0
        # 3,000 reads, and on until one has met the link: on a loaded machine
        # the swapper may not have run beside the first 3,000.
        deadline = time.monotonic() + 120
        try:
            while answered + handed < 3000 or (handed == 0 and time.monotonic() < deadline):
                ours.sendall(data)
                took = _serve(lane, root_fd)
                if isinstance(took, float):
                    answered += 1
                    assert msgspec.msgpack.decode(ours.recv(1 << 16)[4:])["output"] == "0: inside"
                else:
                    handed += 1
                    assert took == data
            assert swapper.poll() is None  # the swap ran all along
        finally:
            swapper.kill()
            swapper.wait()
    finally:
        os.close(root_fd)
    assert answered + handed >= 3000 and handed > 0  # the race was run: some opens met the link
    assert (away / "f.txt").read_text() == "secret\n"


@pytest.mark.parametrize("why", ["read_file not offered", "no C helper", "no root fd"])
def test_without_the_lane_every_call_takes_the_python_path(worktree: str, monkeypatch: pytest.MonkeyPatch,
                                                           why: str) -> None:
    """The lane is on only where the session offers read_file, the C helper
    is built and the worktree's root is held by descriptor; elsewhere a
    read_file call gets the Python path's answer ("unknown tool" where the
    policy leaves it out)."""
    tools = ["list_files"] if why == "read_file not offered" else ["read_file", "list_files"]
    if why == "no C helper":
        monkeypatch.setattr(native, "lines", None)
    if why == "no root fd":
        monkeypatch.setattr(tool_server, "_open_root", lambda worktree: -1)
    server = tool_server._Server(plan(worktree, tools), None)
    assert server.fast_read is None
    ours, theirs = socket.socketpair()
    server.add_channel(theirs)
    try:
        ours.sendall(call({"path": "one.txt"}))
        ours.settimeout(5)
        reply = msgspec.msgpack.decode(ours.recv(1 << 16)[4:])
    finally:
        ours.close()
        if server.ctx.root_fd >= 0:
            os.close(server.ctx.root_fd)
    if why == "read_file not offered":
        assert reply["success"] is False and reply["error"].startswith("unknown tool: 'read_file'")
    else:
        assert reply["success"] is True and reply["output"] == "0: no newline at the end"


def _until_answering() -> None:
    """Wait (10 s at most) until the lane is inside a call: its request
    read, its reply not yet all sent."""
    assert native.lines is not None
    deadline = time.monotonic() + 10
    while native.lines.lane_calls() != 1:
        assert time.monotonic() < deadline, "the lane never began the call"
        time.sleep(0.001)


class _Exited(Exception):
    pass


def _exit(code: int) -> None:
    """os._exit for these tests: the stop and the idle check end the process."""
    raise _Exited(code)


def test_a_stop_waits_for_the_lanes_calls_in_flight(worktree: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop (``_Server.drain``) waits for a call the lane is answering, as
    it waits for the Python path's calls in flight: here a reply larger
    than the socket's buffer, whose client reads it only after 0.5 s. The
    twin: with nothing in flight the stop does not wait."""
    assert native.lines is not None
    Path(worktree, "big.txt").write_bytes((b"0123456789abcdef" * 4 + b"\n") * 40000)  # 2.6 MB
    monkeypatch.setattr(tool_server.os, "_exit", _exit)
    lane = Server(worktree, lane=True)
    lane.server.flush_records = lambda: None  # type: ignore[method-assign]  # no daemon to send them to
    try:
        # The twin first: nothing in flight, the stop goes on at once.
        started = time.monotonic()
        with pytest.raises(_Exited):
            lane.server.drain(10.0)
        assert time.monotonic() - started < 0.3
        lane.server.draining = False
        assert lane.sock is not None
        lane.sock.sendall(call({"path": "big.txt"}))
        _until_answering()  # the reply is on its way, its send blocked

        def read_later() -> None:
            time.sleep(0.5)
            lane.sock.settimeout(10)  # type: ignore[union-attr]
            head = lane._exactly(4)
            assert head is not None and lane._exactly(struct.unpack(">I", head)[0]) is not None

        reader = threading.Thread(target=read_later)
        reader.start()
        started = time.monotonic()
        with pytest.raises(_Exited):
            lane.server.drain(10.0)
        waited = time.monotonic() - started
        reader.join(10)
        assert 0.4 < waited < 9 and native.lines.lane_calls() == 0
    finally:
        lane.close()


def test_the_idle_timeout_does_not_end_a_session_while_the_lane_answers(worktree: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The idle check (``housekeeping``) counts the lane's call in flight as
    a call: a reply still on its way (a client reading slowly) holds the
    session open past its idle timeout. The twin: once the reply is read,
    the same check ends it."""
    assert native.lines is not None
    Path(worktree, "big.txt").write_bytes((b"0123456789abcdef" * 4 + b"\n") * 40000)  # 2.6 MB
    monkeypatch.setattr(tool_server.os, "_exit", _exit)
    lane = Server(worktree, lane=True)
    server = lane.server
    server.flush_records = lambda: None  # type: ignore[method-assign]  # no daemon to send them to
    server.sleep_after = 0.0  # the idle check alone
    try:
        assert lane.sock is not None
        lane.sock.sendall(call({"path": "big.txt"}))
        _until_answering()  # the reply is on its way, its send blocked
        server.activity.last = time.monotonic() - 2 * server.plan.limits.idle_timeout_s  # idle, by the record
        server.next_check = 0.0
        server.housekeeping(False)  # no exit: the lane is answering
        lane.sock.settimeout(10)
        head = lane._exactly(4)
        assert head is not None and lane._exactly(struct.unpack(">I", head)[0]) is not None
        deadline = time.monotonic() + 10
        while native.lines.lane_calls():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        server.activity.last = time.monotonic() - 2 * server.plan.limits.idle_timeout_s
        server.next_check = 0.0
        with pytest.raises(_Exited):
            server.housekeeping(False)
    finally:
        lane.close()


def test_the_warm_up_takes_the_lane_and_keeps_no_descriptor(worktree: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sandbox made ahead warms up with its session's usual first call
    (``warm_up``: read_file of /etc/hostname): through the lane, as that
    call will go, and with every descriptor it opened closed again (the
    session's root its server opened, /etc's, the pair, the eventfd)."""
    assert Path("/etc/hostname").is_file()  # what the warm-up reads
    counted = Counted()
    monkeypatch.setattr(native.lines, "serve_read", counted)
    made = plan(worktree, ["read_file"])
    # The descriptor table is the whole test process's: a socket another test
    # leaked may be closed by the collector meanwhile, another test's thread
    # may open one. Three warm-ups: a leak shows three times over, such
    # noise once at most.
    gc.collect()
    before = set(os.listdir("/proc/self/fd"))
    for _ in range(3):
        tool_server.warm_up(made)
    new = set(os.listdir("/proc/self/fd")) - before

    def target(fd: str) -> str:
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return "closed"
    assert len(new) < 3, {fd: target(fd) for fd in new}
    assert counted.answered == 3


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "python"])
def test_a_reader_waiting_for_a_request_costs_no_more_memory_with_the_lane(worktree: str, lane: bool) -> None:
    """Each channel's reader waits in the lane's recv between requests: what
    it reads into must not be resident memory while nothing comes (a zeroed
    64 KiB bytearray a channel was: 84 KiB a waiting reader, against 20 for
    the Python path's recv). The lane's buffer is a page on
    the stack."""

    def rss_kib() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)

    server = Server(worktree, lane)
    clients: list[socket.socket] = []
    try:
        assert server.ask(call({"path": "one.txt"})) is not None  # the first reader warmed up
        before, n = rss_kib(), 100
        for _ in range(n):
            ours, theirs = socket.socketpair()
            clients.append(ours)
            server.server.add_channel(theirs)
        for ours in clients:  # every reader has read a request (so it has been in the lane's recv) and waits again
            ours.sendall(call({"path": "one.txt"}))
        for ours in clients:
            ours.settimeout(10)
            assert ours.recv(1 << 16)
        per_reader = (rss_kib() - before) / n
        assert per_reader < 48, f"{per_reader:.1f} KiB a waiting reader"
    finally:
        for sock in clients:
            sock.close()
        server.close()


def test_a_stop_waits_for_a_lane_reply_waiting_for_the_send_lock(worktree: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane read its request and waits for the channel's send lock (a
    slow call's output on its way) when a stop comes: the stop waits for it,
    and the reply goes out whole once the lock is free."""
    assert native.lines is not None
    monkeypatch.setattr(tool_server.os, "_exit", _exit)
    lane = Server(worktree, lane=True)
    lane.server.flush_records = lambda: None  # type: ignore[method-assign]  # no daemon to send them to
    try:
        assert lane.sock is not None
        (channel,) = lane.server.live
        channel.send_lock.acquire()
        lane.sock.sendall(call({"path": "one.txt"}))
        _until_answering()  # read, checked, its reply made: it waits for the lock
        threading.Timer(0.5, channel.send_lock.release).start()
        started = time.monotonic()
        with pytest.raises(_Exited):
            lane.server.drain(10.0)
        assert 0.4 < time.monotonic() - started < 9
        got = lane.ask(b"", wait=10)
        assert got is not None and len(got) == 1
        assert msgspec.msgpack.decode(got[0])["output"] == "0: no newline at the end"
    finally:
        lane.close()
