"""The wire protocol against a real daemon, over raw sockets.

What a well-behaved client does (Hello, then requests) beside what a broken or
hostile peer does (wrong version, undecodable payloads, garbage, oversized
length prefixes, half frames): each bad case gets the exact error the
protocol promises, or a closed connection where it promises that, and the
daemon keeps serving the good request that stands beside it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

import dispatchd
from dispatchd import protocol
from tests.conftest import Daemon, wait_for_pool

HEADER = struct.Struct(">I")
REPLIES = protocol.daemon_reply_decoder


def connect_unix(sock: socket.socket, path: str, within: float = 10.0) -> None:
    """``sock.connect(path)``, again while the listen backlog is full: a Unix
    socket with a timeout says EAGAIN then, rather than waiting, while the
    daemon is still accepting a burst of connections before this one."""
    deadline = time.monotonic() + within
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


@contextlib.contextmanager
def raw(daemon: Daemon, *, fds: bool = False) -> Iterator[protocol.FrameSocket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    frames = protocol.FrameSocket(sock, fds=fds)
    try:
        connect_unix(sock, daemon.socket)
        yield frames
    finally:
        frames.close()


@contextlib.contextmanager
def greeted(daemon: Daemon, *, fds: bool = False) -> Iterator[protocol.FrameSocket]:
    with raw(daemon, fds=fds) as frames:
        frames.send(protocol.Hello(id=1, version=protocol.PROTOCOL_VERSION, client="test"))
        assert isinstance(frames.recv(REPLIES), protocol.HelloOk)
        yield frames


def frame(payload: bytes) -> bytes:
    return HEADER.pack(len(payload)) + payload


def closed(frames: protocol.FrameSocket) -> bool:
    """Whether the daemon has closed this connection (EOF, or a reset)."""
    try:
        return frames.recv_payload() is None
    except ConnectionResetError:
        return True


def refused_then_closed(frames: protocol.FrameSocket, code: str) -> protocol.ErrorReply:
    """The daemon answered the connection (id 0, ``code``), then closed it."""
    try:
        reply = frames.recv(REPLIES)
    except ConnectionResetError:  # we were still sending: the reset may overtake the reply
        raise AssertionError("reset before the error reply arrived") from None
    assert isinstance(reply, protocol.ErrorReply) and (reply.id, reply.code) == (0, code), reply
    assert closed(frames)
    return reply


def assert_serving(daemon: Daemon, *, within: float = 1.0) -> None:
    """The allowed twin: a fresh client is greeted and served at once."""
    started = time.monotonic()
    with greeted(daemon) as frames:
        frames.send(protocol.ListSessions(id=2))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.SessionsReply) and reply.id == 2
    assert time.monotonic() - started < within


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ----------------------------------------------------------------- greeting


def test_hello_gets_hello_ok(daemon: Daemon) -> None:
    with raw(daemon) as frames:
        frames.send(protocol.Hello(id=41, version=protocol.PROTOCOL_VERSION, client="test"))
        assert frames.recv(REPLIES) == protocol.HelloOk(
            id=41, version=protocol.PROTOCOL_VERSION, daemon_version=dispatchd.__version__
        )
        frames.send(protocol.Status(id=42))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.StatusReply)
        assert reply.id == 42 and reply.pid == daemon.proc.pid and reply.socket == daemon.socket


@pytest.mark.parametrize(("first", "got"), [
    (protocol.Hello(id=3, version=protocol.PROTOCOL_VERSION + 98), "version 99"),  # a wrong version
    (protocol.Status(id=3), "Status"),  # a request before the hello
], ids=["wrong_version", "request_before_hello"])
def test_a_first_message_other_than_hello_is_refused_then_closed(daemon: Daemon, first: msgspec.Struct,
                                                                   got: str) -> None:
    with raw(daemon) as frames:
        frames.send(first)
        assert frames.recv(REPLIES) == protocol.ErrorReply(
            id=3, code="bad_version", message=f"expected hello with protocol version 1, got {got}"
        )
        assert closed(frames)
    assert_serving(daemon)


def test_hello_again_after_the_greeting_is_answered(daemon: Daemon) -> None:
    with greeted(daemon) as frames:
        frames.send(protocol.Hello(id=2, version=protocol.PROTOCOL_VERSION))
        assert isinstance(frames.recv(REPLIES), protocol.HelloOk)


# ----------------------------------------------------------------- undecodable requests


@pytest.mark.parametrize(
    ("message", "rid", "error"),
    [
        ({"op": "nope", "id": 7}, 7, "undecodable message: Invalid value 'nope' - at `$.op`"),
        ({"op": "status", "id": 8, "extra": 1}, 8, "undecodable message: Object contains unknown field `extra`"),
        ({"op": "close_session", "id": 9}, 9, "undecodable message: Object missing required field `session`"),
        ({"op": "hello_ok", "id": 10, "version": 1, "daemon_version": "x"}, 10,
         "undecodable message: Invalid value 'hello_ok' - at `$.op`"),
        ({"id": 11}, 11, "undecodable message: Object missing required field `op`"),
        ([1, 2, 3], 0, "undecodable message: Expected `object`, got `array`"),
    ],
    ids=["unknown-op", "unknown-field", "missing-field", "a-reply", "no-op", "not-an-object"],
)
def test_undecodable_request_gets_bad_request_and_the_connection_stays(
    daemon: Daemon, message: object, rid: int, error: str
) -> None:
    with greeted(daemon) as frames:
        frames.sock.sendall(frame(msgspec.msgpack.encode(message)))
        assert frames.recv(REPLIES) == protocol.ErrorReply(id=rid, code="bad_request", message=error)
        # The same connection still serves a good request.
        frames.send(protocol.Status(id=100))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.StatusReply) and reply.id == 100


def test_undecodable_request_before_hello_is_bad_request_not_a_close(daemon: Daemon) -> None:
    with raw(daemon) as frames:
        frames.sock.sendall(frame(msgspec.msgpack.encode({"op": "nope", "id": 7})))
        reply = frames.recv(REPLIES)
        assert reply == protocol.ErrorReply(id=7, code="bad_request",
                                            message="undecodable message: Invalid value 'nope' - at `$.op`")
        frames.send(protocol.Hello(id=8, version=protocol.PROTOCOL_VERSION))
        assert isinstance(frames.recv(REPLIES), protocol.HelloOk)


def test_well_framed_garbage_payload_is_bad_request(daemon: Daemon) -> None:
    with greeted(daemon) as frames:
        frames.sock.sendall(frame(b"\xc1\xc1\xc1\xc1"))  # 0xc1 is never valid msgpack
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.ErrorReply)
        assert reply.id == 0 and reply.code == "bad_request"
        assert reply.message.startswith("undecodable message: ")
        frames.sock.sendall(frame(b""))  # an empty payload, likewise
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "bad_request" and reply.id == 0
        frames.send(protocol.ListSessions(id=5))
        assert isinstance(frames.recv(REPLIES), protocol.SessionsReply)


def test_error_reply_id_is_always_an_integer(daemon: Daemon) -> None:
    """An undecodable request whose id is not an int (true, a string) gets id 0:
    the reply must itself decode as the protocol's ErrorReply."""
    with greeted(daemon) as frames:
        for bad_id in (True, "7", 1.5):
            frames.sock.sendall(frame(msgspec.msgpack.encode({"op": "nope", "id": bad_id})))
            reply = frames.recv(REPLIES)
            assert reply == protocol.ErrorReply(
                id=0, code="bad_request", message="undecodable message: Invalid value 'nope' - at `$.op`"
            ), bad_id
        frames.send(protocol.Status(id=6))
        assert isinstance(frames.recv(REPLIES), protocol.StatusReply)


def test_deeply_nested_payload_gets_bad_request(daemon: Daemon) -> None:
    """Well framed, small (100 KB), but nested 100 000 levels deep: still just a
    bad request, answered, and the connection stays."""
    payload = b"\x91" * 100_000 + b"\xc0"  # [[[[...nil...]]]]
    with greeted(daemon) as frames:
        frames.sock.sendall(frame(payload))
        try:
            answer = frames.recv_payload()
        except ConnectionResetError:
            answer = None
        assert answer is not None, "the daemon closed the connection instead of replying"
        assert protocol.decode(REPLIES, answer) == protocol.ErrorReply(
            id=0, code="bad_request", message="undecodable message: Expected `object`, got `array`")
        frames.send(protocol.Status(id=6))
        assert isinstance(frames.recv(REPLIES), protocol.StatusReply)
    assert_serving(daemon)


# ----------------------------------------------------------------- broken framing


def test_garbage_bytes_close_the_connection_only(daemon: Daemon) -> None:
    with greeted(daemon) as frames, greeted(daemon) as bystander:
        frames.sock.sendall(b"\xff" * 8)
        refused_then_closed(frames, "frame_too_large")
        # The other connection, open all along, is still served.
        bystander.send(protocol.Status(id=9))
        assert isinstance(bystander.recv(REPLIES), protocol.StatusReply)
    assert_serving(daemon)


def test_oversized_length_prefix_is_refused_without_allocating(daemon: Daemon) -> None:
    before = rss_kib(daemon.proc.pid)
    for length in (protocol.MAX_REQUEST_FRAME + 1, protocol.MAX_FRAME + 1, 0xFFFFFFFF):
        with greeted(daemon) as frames:
            frames.sock.sendall(HEADER.pack(length) + b"\x00" * 1024)
            reply = refused_then_closed(frames, "frame_too_large")
            assert reply.message == (f"frame of {length} bytes exceeds the {protocol.MAX_REQUEST_FRAME}-byte limit: "
                                     "the connection is closed")
        assert_serving(daemon, within=0.5)
    # Nothing near the announced 64 MiB or 4 GiB was allocated.
    assert rss_kib(daemon.proc.pid) - before < 16 * 1024
    assert "frame of 67108865 bytes exceeds the 262144-byte limit" in daemon.log()


def test_a_frame_of_exactly_the_request_limit_is_not_refused_up_front(daemon: Daemon) -> None:
    """The allowed twin of the oversized prefix: at the limit the daemon waits for the payload."""
    with greeted(daemon) as frames:
        frames.sock.sendall(HEADER.pack(protocol.MAX_REQUEST_FRAME) + b"\x00" * 16)
        frames.sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            frames.sock.recv(1)  # neither a reply nor a close: still reading
    assert_serving(daemon)


def test_before_hello_only_a_greeting_sized_frame_is_read(daemon: Daemon) -> None:
    with raw(daemon) as frames:
        frames.sock.sendall(HEADER.pack(protocol.MAX_HELLO_FRAME + 1) + b"\x00" * 16)
        reply = refused_then_closed(frames, "frame_too_large")
        assert reply.message == (f"frame of {protocol.MAX_HELLO_FRAME + 1} bytes exceeds the "
                                 f"{protocol.MAX_HELLO_FRAME}-byte limit before hello: the connection is closed")
    with raw(daemon) as frames:  # the twin: a frame of that size is read (and is not a hello)
        frames.sock.sendall(frame(msgspec.msgpack.encode({"op": "hello", "id": 3, "version": 1,
                                                          "client": "x" * (protocol.MAX_HELLO_FRAME - 40)})))
        assert isinstance(frames.recv(REPLIES), protocol.HelloOk)
    assert_serving(daemon)


@pytest.mark.parametrize("sent", [b"\x00\x00", HEADER.pack(100) + b"\x81\xa2op"], ids=["half-header", "half-payload"])
def test_half_a_frame_then_disconnect(daemon: Daemon, sent: bytes) -> None:
    with raw(daemon) as frames:
        frames.sock.sendall(sent)
    assert_serving(daemon)
    deadline = time.monotonic() + 2
    want = "connection closed inside a frame"
    while want not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert want in daemon.log()


def test_a_client_that_connects_and_says_nothing_does_not_block_others(daemon: Daemon) -> None:
    with raw(daemon), raw(daemon), raw(daemon):
        assert_serving(daemon)


# ----------------------------------------------------------------- many clients, pipelining


def test_twenty_clients_in_parallel(daemon: Daemon) -> None:
    barrier = threading.Barrier(20)
    replies: list[object] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        try:
            with raw(daemon) as frames:
                barrier.wait(10)
                frames.send(protocol.Hello(id=n, version=protocol.PROTOCOL_VERSION, client=f"c{n}"))
                hello = frames.recv(REPLIES)
                frames.send(protocol.ListSessions(id=1000 + n))
                listed = frames.recv(REPLIES)
            with lock:
                replies.append((n, hello, listed))
        except BaseException as exc:  # collected, re-raised below in the test's thread
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len(replies) == 20
    for n, hello, listed in replies:
        assert isinstance(hello, protocol.HelloOk) and hello.id == n
        assert isinstance(listed, protocol.SessionsReply) and listed.id == 1000 + n


def test_pipelined_requests_get_replies_with_matching_ids(daemon: Daemon) -> None:
    with raw(daemon) as frames:
        batch = b"".join(protocol.encode(m) for m in (
            protocol.Hello(id=1, version=protocol.PROTOCOL_VERSION),
            protocol.Status(id=10),
            protocol.ListSessions(id=11),
            protocol.ListTools(id=12),
        ))
        frames.sock.sendall(batch)  # all four before reading any reply
        replies = [frames.recv(REPLIES) for _ in range(4)]
    assert [r.id for r in replies] == [1, 10, 11, 12]
    assert [type(r) for r in replies] == [protocol.HelloOk, protocol.StatusReply, protocol.SessionsReply, protocol.ToolsReply]
    assert [t.name for t in replies[3].tools] == [
        "read_file", "write_file", "edit_file", "create_file", "list_files", "search_files", "shell_exec",
        "job_output", "job_stop", "job_list"]


def test_pipelined_bad_request_in_the_middle(daemon: Daemon) -> None:
    with greeted(daemon) as frames:
        frames.sock.sendall(
            protocol.encode(protocol.Status(id=20))
            + frame(msgspec.msgpack.encode({"op": "nope", "id": 21}))
            + protocol.encode(protocol.ListSessions(id=22))
        )
        replies = [frames.recv(REPLIES) for _ in range(3)]
    assert [r.id for r in replies] == [20, 21, 22]
    assert isinstance(replies[1], protocol.ErrorReply) and replies[1].code == "bad_request"


# ----------------------------------------------------------------- refused requests


def test_refused_requests_get_their_codes(daemon: Daemon, tmp_path: Path) -> None:
    with greeted(daemon) as frames:
        frames.send(protocol.CloseSession(id=2, session="000000000000"))
        assert frames.recv(REPLIES) == protocol.ErrorReply(
            id=2, code="unknown_session", message="no such session: '000000000000'")
        frames.send(protocol.ListTools(id=3, policy="nope"))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.ErrorReply) and reply.id == 3 and reply.code == "bad_policy"
        assert "no policy named 'nope'" in reply.message
        frames.send(protocol.OpenSession(id=4, worktree=str(tmp_path / "missing")))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.ErrorReply) and reply.id == 4 and reply.code == "bad_worktree"
        assert "worktree does not exist" in reply.message
        # The allowed twins on the same connection.
        frames.send(protocol.ListTools(id=5, policy="read-only"))
        reply = frames.recv(REPLIES)
        assert isinstance(reply, protocol.ToolsReply) and [t.name for t in reply.tools] == [
            "read_file", "list_files", "search_files"]


# ----------------------------------------------------------------- the worker channel


@contextlib.contextmanager
def worker_channel(daemon: Daemon, worktree: Path) -> Iterator[protocol.FrameSocket]:
    """Open a session over the raw protocol, attach, and yield the worker channel."""
    with greeted(daemon, fds=True) as frames:
        frames.send(protocol.OpenSession(id=2, worktree=str(worktree)))
        opened = frames.recv(REPLIES)
        assert isinstance(opened, protocol.SessionReply), opened
        sid = opened.session.id
        try:
            frames.send(protocol.Attach(id=3, session=sid))
            attached = frames.recv(REPLIES)
            assert isinstance(attached, protocol.Attached) and attached.id == 3
            assert attached.session.id == sid
            channel = protocol.FrameSocket(socket.socket(fileno=frames.take_fd()))
            channel.sock.settimeout(10)
            try:
                yield channel
            finally:
                channel.close()
        finally:
            frames.send(protocol.CloseSession(id=4, session=sid))
            assert frames.recv(REPLIES) == protocol.ClosedReply(id=4, protected=[])


def test_attach_hands_over_a_worker_channel(daemon: Daemon, worktree: Path) -> None:
    with worker_channel(daemon, worktree) as channel:
        worker_channel_cases(channel)


def test_worker_channel_deeply_nested_payload_gets_bad_request(daemon: Daemon, worktree: Path) -> None:
    with worker_channel(daemon, worktree) as channel:
        channel.sock.sendall(frame(b"\x91" * 100_000 + b"\xc0"))
        try:
            answer = channel.recv_payload()
        except ConnectionResetError:
            answer = None
        assert answer is not None, "the worker closed the channel instead of replying"
        reply = protocol.decode(protocol.channel_reply_decoder, answer)
        assert isinstance(reply, protocol.ErrorReply) and reply.code == "bad_request" and reply.id == 0
        channel.send(protocol.CallTool(id=1, tool="read_file", params={"path": "README.md"}))
        assert channel.recv(protocol.channel_reply_decoder).output == "0: hello\n1: world"


def worker_channel_cases(channel: protocol.FrameSocket) -> None:
    replies = protocol.channel_reply_decoder
    channel.send(protocol.CallTool(id=1, tool="read_file", params={"path": "README.md"}))
    reply = channel.recv(replies)
    assert isinstance(reply, protocol.ToolReply) and set(reply.metadata.pop("usage")) == {"cpu_s", "peak_mib"}
    assert reply == protocol.ToolReply(
        id=1, success=True, output="0: hello\n1: world",
        metadata={"path": "README.md", "total_lines": 2, "start_line": 0, "end_line": 1})
    # Undecodable: an ErrorReply with the id, and the channel stays.
    channel.sock.sendall(frame(msgspec.msgpack.encode({"op": "call_tool", "id": 2, "tool": "read_file"})))
    assert channel.recv(replies) == protocol.ErrorReply(
        id=2, code="bad_request", message="undecodable message: Object missing required field `params`")
    # A message of the other direction: not a request a worker takes.
    channel.send(protocol.ToolReply(id=3, success=True, output="x"))
    assert channel.recv(replies) == protocol.ErrorReply(
        id=3, code="bad_request", message="undecodable message: Invalid value 'tool_reply' - at `$.op`")
    channel.send(protocol.CallTool(id=4, tool="nope", params={}))
    reply = channel.recv(replies)
    assert isinstance(reply, protocol.ToolReply) and reply.id == 4 and reply.success is False
    assert reply.error.startswith("unknown tool: 'nope' (this session has: read_file, ")
    # Pipelined slow calls come back as each finishes, matched by id.
    channel.sock.sendall(
        protocol.encode(protocol.CallTool(id=5, tool="shell_exec", params={"command": "sleep 0.4; echo five"}))
        + protocol.encode(protocol.CallTool(id=6, tool="shell_exec", params={"command": "echo six"}))
    )
    first, second = channel.recv(replies), channel.recv(replies)
    assert (first.id, first.output) == (6, "six\n")
    assert (second.id, second.output) == (5, "five\n")


def test_attach_to_an_unknown_session_is_refused_without_an_fd(daemon: Daemon) -> None:
    """Attach to an unknown session is refused with unknown_session, no fd passed."""
    with greeted(daemon, fds=True) as frames:
        frames.send(protocol.Attach(id=2, session="000000000000"))
        assert frames.recv(REPLIES) == protocol.ErrorReply(
            id=2, code="unknown_session", message="no such session: '000000000000'")
        with pytest.raises(protocol.ProtocolError):
            frames.take_fd()


def test_daemon_fds_do_not_accumulate(daemon: Daemon) -> None:
    """Broken connections are closed on the daemon's side, not leaked."""
    def count() -> int:
        return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))

    def settled() -> int:
        """The count once the pool of sandboxes made ahead (each holds a few
        of the daemon's descriptors) is not making or retiring one."""
        with daemon.connect() as client:
            wait_for_pool(client, n=2)
        last, deadline = count(), time.monotonic() + 10
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = count()
            if now == last:
                return now
            last = now
        return last

    assert_serving(daemon)
    before = settled()
    for _ in range(30):
        with raw(daemon) as frames:
            frames.sock.sendall(b"\xff" * 8)
            refused_then_closed(frames, "frame_too_large")
    assert_serving(daemon)
    assert settled() <= before + 2
