"""dispatchd.protocol: messages, the codec, frames and fd passing over a socketpair.

The wire tags and the header are pinned byte for byte: changing them breaks
every client in the field. Frame tests run over a real ``socket.socketpair``
with a timeout, so a reader that waits for bytes it should not need fails
instead of hanging.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from dispatchd import protocol as p
from dispatchd.protocol import frames
from dispatchd.protocol import DescriptorsLost, FrameSocket, FrameTooLarge, ProtocolError
from tests.conftest import made_each

PROTECTIONS = p.Protections(
    mode="full", landlock=p.LandlockReport(abi=6, filesystem="enforced", scopes=["signal"], tcp="denied"),
    seccomp="enforced", namespaces=p.NamespacesReport(user=True, mount=True, pid=True, net=True),
    network=p.NetworkReport(mode="off", mechanism="its own network namespace, no interface but lo"),
    worktree="read-write", root=[p.RootEntry(path="/usr", how="read-only")], unix_sockets="allowed",
    git=p.GitReport(kind="none", read_only=[], granted=[]), hygiene=["no_new_privs"], leaves_open=[],
    limits=p.LimitsReport(mechanism="rlimits", cgroup="", cgroups="no: off", max_processes=256, memory="1 GiB",
                          cpu_weight="not enforced (no cpu controller)", max_data_bytes_per_process=1 << 30,
                          max_file_bytes=1 << 30, max_open_files_per_process=1024, kernel_budgets="shared",
                          leaves_open=["epoll watches"]),
    absent_paths=[])
KERNEL = p.KernelFeatures(release="6.8.0", landlock_abi=7, user_namespaces=True, user_namespaces_note="ok",
                          seccomp=True, seccomp_actions=["kill", "errno"], cgroup2="/sys/fs/cgroup")
INFO = p.SessionInfo(id="a1b2c3", worktree="/home/u/wt", policy="default", network="off", created=1700000000.5,
                     protections=PROTECTIONS, limits={"command_timeout_s": 120.0}, note="n")
SCHEMA = p.ToolSchema(name="read_file", description="Read a file.",
                      parameters={"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]})

# One instance of every message, with every optional field set, and the
# decoders that must accept it (its direction's union).
SAMPLES: dict[type, tuple[msgspec.Struct, set[str]]] = {
    p.Hello: (p.Hello(id=1, version=1, client="dispatch 0.1"), {"daemon_request"}),
    p.OpenSession: (p.OpenSession(id=2, worktree="/home/u/wt", policy="read-only", network="ports",
                                  ports=[443], bind_ports=[8080]), {"daemon_request"}),
    p.CloseSession: (p.CloseSession(id=3, session="a1b2c3"), {"daemon_request"}),
    p.ListSessions: (p.ListSessions(id=4), {"daemon_request"}),
    p.SetNetwork: (p.SetNetwork(id=5, session="a1b2c3", network="ports", ports=[80], bind_ports=[]), {"daemon_request"}),
    p.Status: (p.Status(id=6), {"daemon_request"}),
    p.Attach: (p.Attach(id=7, session="a1b2c3"), {"daemon_request"}),
    p.ListTools: (p.ListTools(id=8, policy="read-only"), {"daemon_request"}),
    p.HelloOk: (p.HelloOk(id=1, version=1, daemon_version="0.1.0"), {"daemon_reply"}),
    p.SessionReply: (p.SessionReply(id=2, session=INFO), {"daemon_reply"}),
    p.SessionsReply: (p.SessionsReply(id=4, sessions=[INFO, INFO]), {"daemon_reply"}),
    p.StatusReply: (p.StatusReply(id=6, daemon_version="0.1.0", pid=1234, socket="/run/user/1000/dispatchd/dispatchd.sock",
                                  kernel=KERNEL, sessions=[INFO],
                                  daemon=p.DaemonReport(open_files=4096, open_files_note="raised from 1024",
                                                        connections=1, max_connections=2048,
                                                        before_restore=p.BeforeRestoreReport(
                                                            path="/state/before-restore", count=2, bytes=4096,
                                                            budget=8 << 30, budget_why="dispatchd's fixed bound"))),
                    {"daemon_reply"}),
    p.Attached: (p.Attached(id=7, session=INFO, tools=[SCHEMA]), {"daemon_reply"}),
    p.ToolsReply: (p.ToolsReply(id=8, tools=[SCHEMA]), {"daemon_reply"}),
    p.OkReply: (p.OkReply(id=9), {"daemon_reply", "to_worker", "from_worker", "fork_server_reply"}),
    p.ClosedReply: (p.ClosedReply(id=9, protected=[p.ProtectedItem(path="/wt/.git/config.quarantined-by-dispatchd-1-a",
                                                                  why="git configuration changed", time=1.5)]),
                    {"daemon_reply"}),
    p.ErrorReply: (p.ErrorReply(id=10, code="bad_policy", message="no policy named 'x'"),
                   {"daemon_reply", "channel_reply", "to_worker", "fork_server_reply"}),
    p.CallTool: (p.CallTool(id=11, tool="shell_exec", params={"command": "ls -l", "timeout": 1.5, "cwd": None,
                                                               "nested": {"a": [1, True]}}, stream=True), {"channel_request"}),
    p.CancelCall: (p.CancelCall(id=11), {"channel_request"}),
    p.ToolOutput: (p.ToolOutput(id=11, stream="stderr", text="warning: é\n"), {"channel_reply"}),
    p.ToolReply: (p.ToolReply(id=11, success=False, output="out", error="exit 1",
                              metadata={"exit_code": 1, "stdout": "", "truncated": False}), {"channel_reply"}),
    p.WorkerReady: (p.WorkerReady(pid=4321, protections=PROTECTIONS, timings_ms={"landlock": 0.25}),
                    {"from_worker"}),
    p.WorkerPooled: (p.WorkerPooled(pid=4322, timings_ms={"root": 1.25}), {"from_worker"}),
    p.WorkerNamespaces: (p.WorkerNamespaces(pid=4322, dns_door=True), {"from_worker"}),
    p.AdoptSession: (p.AdoptSession(plan=b"\x00\x01\xff msgpack"), {"to_worker"}),
    p.WorkerFailed: (p.WorkerFailed(step="landlock: add path rule", errno=13, path="/opt",
                                    message="cannot apply landlock: add path rule (/opt): EACCES"), {"from_worker"}),
    p.AddChannel: (p.AddChannel(id=12), {"to_worker"}),
    p.AcquireWriteLock: (p.AcquireWriteLock(id=13, checkpoint=True, tool="write_file"), {"from_worker"}),
    p.ToolCallsDone: (p.ToolCallsDone(calls=[p.CallRecord("read_file", 1.5, True)]), {"from_worker"}),
    p.Drain: (p.Drain(deadline_s=30.0), {"to_worker"}),
    p.ReleaseWriteLock: (p.ReleaseWriteLock(id=4, session="a1b2c3"), {"daemon_request"}),
    p.ForgetWriteLock: (p.ForgetWriteLock(id=17), {"to_worker"}),
    p.SetCommandEnv: (p.SetCommandEnv(set={"HTTP_PROXY": "http://127.0.0.1:3128"}, unset=["http_proxy"]), {"to_worker"}),
    p.NetworkDenied: (p.NetworkDenied(host="notallowed.invalid", port=443,
                                      allow="dispatch network s1 domains --domains notallowed.invalid"), {"to_worker"}),
    p.SpawnWorker: (p.SpawnWorker(id=14, plan=b"\x00\x01\xff msgpack"), {"fork_server_request"}),
    p.Spawned: (p.Spawned(id=14, pid=999), {"fork_server_reply"}),
    p.NetRules: (p.NetRules(id=15, rules="add table inet dispatchd"), {"fork_server_request"}),
    p.NetClosed: (p.NetClosed(id=19), {"fork_server_request"}),
    p.EndLeftBehind: (p.EndLeftBehind(id=20), {"fork_server_request"}),
    p.StartStack: (p.StartStack(id=16), {"fork_server_request"}),
    p.DnsSockets: (p.DnsSockets(id=18), {"fork_server_request"}),
    p.DnsDoor: (p.DnsDoor(id=18), {"fork_server_reply"}),
    p.WakeWorker: (p.WakeWorker(id=17, plan=b"\x00 msgpack", kit=6), {"fork_server_request"}),
    p.MaySleep: (p.MaySleep(), {"from_worker"}),
    p.Asleep: (p.Asleep(count=253, last=False), {"from_worker"}),
    p.Sleep: (p.Sleep(), {"to_worker"}),
    p.StayAwake: (p.StayAwake(for_good=True), {"to_worker"}),
    p.KeptJobs: (p.KeptJobs(jobs=[p.JobRecord(id="job_1", command="make", token="t0k", cap=1024, written=10,
                                              truncated=False, exit_code=0, ended_by="")], next=2),
                 {"to_worker", "from_worker"}),
    p.TakeCheckpoint: (p.TakeCheckpoint(id=20, session="a1b2c3", label="before the refactor"), {"daemon_request"}),
    p.ListCheckpoints: (p.ListCheckpoints(id=21, session="a1b2c3"), {"daemon_request"}),
    p.RestoreCheckpoint: (p.RestoreCheckpoint(id=22, session="a1b2c3", checkpoint="c0001-ab12cd34"),
                          {"daemon_request"}),
    p.CheckpointReply: (p.CheckpointReply(id=20, checkpoint=p.CheckpointInfo(
        id="c0001-ab12cd34", created=1.5, label="x", entries=3, copied_bytes=10, objects=2)), {"daemon_reply"}),
    p.CheckpointsReply: (p.CheckpointsReply(id=21, checkpoints=[p.CheckpointInfo(id="c0001-ab12cd34", created=1.5)]),
                         {"daemon_reply"}),
    p.RestoredReply: (p.RestoredReply(id=22, checkpoint="c0001-ab12cd34", removed=1, written=2, made=3, objects=4,
                                      kept="/state/before-restore/x", displaced=["refs/dispatchd/displaced/t/HEAD"],
                                      kept_total=p.BeforeRestoreReport(path="/state/before-restore", count=1, bytes=8192,
                                                                       budget=1 << 20, budget_why="as set by a test")),
                      {"daemon_reply"}),
    p.Pause: (p.Pause(id=23), {"to_worker"}),
    p.Paused: (p.Paused(id=23, busy="1 tool call in flight"), {"from_worker"}),
    p.WatchHeld: (p.WatchHeld(), {"from_worker"}),
    p.IpcHeld: (p.IpcHeld(bytes=16 << 20), {"from_worker"}),
    p.Resume: (p.Resume(), {"to_worker"}),
}
DECODERS = {
    "daemon_request": p.daemon_request_decoder,
    "daemon_reply": p.daemon_reply_decoder,
    "channel_request": p.channel_request_decoder,
    "channel_reply": p.channel_reply_decoder,
    "to_worker": p.to_worker_decoder,
    "from_worker": p.from_worker_decoder,
    "fork_server_request": p.fork_server_request_decoder,
    "fork_server_reply": p.fork_server_reply_decoder,
}
TAGS = {
    "Hello": "hello", "OpenSession": "open_session", "CloseSession": "close_session",
    "ListSessions": "list_sessions", "SetNetwork": "set_network", "Status": "status", "Attach": "attach",
    "ListTools": "list_tools", "HelloOk": "hello_ok", "SessionReply": "session", "SessionsReply": "sessions",
    "StatusReply": "status_reply", "Attached": "attached", "ToolsReply": "tools", "OkReply": "ok", "ClosedReply": "closed",
    "ErrorReply": "error", "CallTool": "call_tool", "ToolReply": "tool_reply", "WorkerReady": "worker_ready",
    "WorkerFailed": "worker_failed", "AddChannel": "add_channel", "SpawnWorker": "spawn_worker",
    "Spawned": "spawned", "NetRules": "net_rules", "NetClosed": "net_closed", "EndLeftBehind": "end_left_behind", "StartStack": "start_stack", "AcquireWriteLock": "acquire_write_lock",
    "ToolCallsDone": "tool_calls_done", "Drain": "drain", "CancelCall": "cancel_call", "ToolOutput": "tool_output",
    "SetCommandEnv": "set_command_env", "NetworkDenied": "network_denied", "WorkerPooled": "worker_pooled", "WorkerNamespaces": "worker_namespaces", "AdoptSession": "adopt_session",
    "ReleaseWriteLock": "release_write_lock", "ForgetWriteLock": "forget_write_lock",
    "WakeWorker": "wake_worker", "MaySleep": "may_sleep", "Asleep": "asleep", "Sleep": "sleep", "StayAwake": "stay_awake",
    "KeptJobs": "kept_jobs", "DnsSockets": "dns_sockets", "DnsDoor": "dns_door",
    "TakeCheckpoint": "checkpoint", "ListCheckpoints": "list_checkpoints", "RestoreCheckpoint": "restore",
    "CheckpointReply": "checkpoint_taken", "CheckpointsReply": "checkpoints", "RestoredReply": "restored",
    "Pause": "pause", "Paused": "paused", "Resume": "resume", "WatchHeld": "watch_held", "IpcHeld": "ipc_held",
}


def payload_of(msg: msgspec.Struct) -> bytes:
    return p.encode(msg)[4:]


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    yield a, b
    a.close()
    b.close()


# -- messages -----------------------------------------------------------------


def test_constants():
    assert p.PROTOCOL_VERSION == 1
    assert p.MAX_FRAME == 64 * 1024 * 1024
    assert p.MAX_REQUEST_FRAME == 256 * 1024
    assert p.MAX_HELLO_FRAME == 4 * 1024


def test_every_message_type_has_a_sample():
    assert {cls.__name__ for cls in p._Msg.__subclasses__()} == {cls.__name__ for cls in SAMPLES}


def test_wire_tags_are_pinned():
    assert {cls.__name__: cls.__struct_config__.tag for cls in p._Msg.__subclasses__()} == TAGS
    assert all(cls.__struct_config__.tag_field == "op" for cls in p._Msg.__subclasses__())


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_round_trip_through_each_accepting_decoder(cls: type):
    msg, accepted = SAMPLES[cls]
    for name in accepted:
        back = p.decode(DECODERS[name], payload_of(msg))
        assert type(back) is cls
        assert back == msg


@pytest.mark.parametrize("cls", list(SAMPLES), ids=lambda c: c.__name__)
def test_other_directions_refuse_the_message(cls: type):
    msg, accepted = SAMPLES[cls]
    for name in set(DECODERS) - accepted:
        with pytest.raises(ProtocolError) as info:
            p.decode(DECODERS[name], payload_of(msg))
        assert info.value.args[0] == f"undecodable message: Invalid value '{TAGS[cls.__name__]}' - at `$.op`"


def test_messages_are_frozen():
    msg = p.Hello(id=1, version=1)
    with pytest.raises(AttributeError):
        msg.id = 2  # type: ignore[misc]


def test_the_tag_is_on_the_wire():
    assert msgspec.msgpack.decode(payload_of(p.Attach(id=3, session="s"))) == {"op": "attach", "id": 3, "session": "s"}


def test_defaults_fill_omitted_fields():
    raw = msgspec.msgpack.encode({"op": "open_session", "id": 1, "worktree": "/w"})
    assert p.decode(p.daemon_request_decoder, raw) == p.OpenSession(
        id=1, worktree="/w", policy="default", network=None, ports=None, bind_ports=None)


def test_an_info_from_a_daemon_that_does_not_number_its_sandboxes_reads_as_sandbox_0():
    info = msgspec.to_builtins(msgspec.structs.replace(INFO, sandbox=3, replaced=p.REPLACED_NETWORK))
    assert (info["sandbox"], info["replaced"]) == (3, "its network was switched")
    del info["sandbox"], info["replaced"]  # what a daemon older than the numbers sends
    got = p.decode(p.daemon_reply_decoder, msgspec.msgpack.encode({"op": "attached", "id": 1, "session": info,
                                                                    "tools": []}))
    assert isinstance(got, p.Attached) and (got.session.sandbox, got.session.replaced) == (0, "")
    assert got.session == INFO


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"op": "hello", "id": 1, "version": 1, "extra": 2}, "Object contains unknown field `extra`"),
        ({"op": "open_session", "id": 1, "worktree": "/w", "polcy": "x"}, "Object contains unknown field `polcy`"),
        ({"op": "hello", "id": "1", "version": 1}, "Expected `int`, got `str` - at `$.id`"),
        ({"op": "hello", "version": 1}, "Object missing required field `id`"),
        ({"id": 1, "version": 1}, "Object missing required field `op`"),
        ({"op": "shutdown", "id": 1}, "Invalid value 'shutdown' - at `$.op`"),
    ],
)
def test_bad_requests_are_protocol_errors(raw: dict[str, Any], message: str):
    with pytest.raises(ProtocolError) as info:
        p.decode(p.daemon_request_decoder, msgspec.msgpack.encode(raw))
    assert type(info.value) is p.BadMessage  # answered with an ErrorReply; the connection stays
    assert info.value.args[0] == f"undecodable message: {message}"
    assert isinstance(info.value.__cause__, msgspec.ValidationError)


def test_unknown_fields_are_refused_in_nested_structs():
    info = msgspec.to_builtins(INFO)
    info["secret"] = 1
    raw = msgspec.msgpack.encode({"op": "session", "id": 1, "session": info})
    with pytest.raises(ProtocolError) as err:
        p.decode(p.daemon_reply_decoder, raw)
    assert err.value.args[0] == "undecodable message: Object contains unknown field `secret` - at `$.session`"


def test_every_message_forbids_unknown_fields():
    assert all(cls.__struct_config__.forbid_unknown_fields for cls in p._Msg.__subclasses__())
    assert p.SessionInfo.__struct_config__.forbid_unknown_fields
    assert p.ToolSchema.__struct_config__.forbid_unknown_fields


def test_garbage_is_a_protocol_error():
    with pytest.raises(ProtocolError) as info:
        p.decode(p.daemon_request_decoder, b"\xc1")
    assert type(info.value) is p.BadMessage
    assert info.value.args[0] == "undecodable message: MessagePack data is malformed: invalid opcode '\\xc1' (byte 0)"
    assert isinstance(info.value.__cause__, msgspec.DecodeError)


def test_absurd_nesting_is_a_bad_message_not_a_crash():
    head = msgspec.msgpack.encode({"op": "call_tool", "id": 1, "tool": "x"})
    payload = b"\x84" + head[1:] + b"\xa6params" + b"\x81\xa1a" + b"\x91" * 200000 + b"\x00"
    with pytest.raises(p.BadMessage) as info:
        p.decode(p.channel_request_decoder, payload)
    assert info.value.args[0] == "undecodable message: maximum recursion depth exceeded while deserializing an object"
    assert p.request_id_of(payload) == 0


def test_invalid_utf8_in_a_string_field_is_a_bad_message():
    """msgspec raises UnicodeDecodeError for it up to 0.22, a DecodeError from
    0.23: a BadMessage either way, in the same words."""
    good = msgspec.msgpack.encode({"op": "close_session", "id": 5, "session": "ab"})
    bad = good.replace(b"\xa2ab", b"\xa2\xff\xfe")
    assert p.decode(p.daemon_request_decoder, good) == p.CloseSession(id=5, session="ab")
    with pytest.raises(p.BadMessage) as info:
        p.decode(p.daemon_request_decoder, bad)
    assert info.value.args[0] == "undecodable message: a string is not valid UTF-8"
    assert p.request_id_of(bad) == 5
    call = msgspec.msgpack.encode({"op": "call_tool", "id": 6, "tool": "read_file", "params": {"path": "ab"}})
    with pytest.raises(p.BadMessage):
        p.decode(p.channel_request_decoder, call.replace(b"\xa2ab", b"\xa2\xff\xfe"))


def test_request_id_of_builds_nothing_from_a_hostile_payload():
    """24 MiB of nested empty arrays beside the id: the untyped decode this
    replaced built ~1.7 GB of lists; the typed one skips them."""
    import tracemalloc

    payload = b"\x82\xa2id\x07\xa1x\xdd" + (12 * 1024 * 1024).to_bytes(4, "big") + b"\x90" * (12 * 1024 * 1024)
    tracemalloc.start()
    try:
        assert p.request_id_of(payload) == 7
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024, peak


def test_a_frame_socket_with_a_lower_limit(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(p.encode(p.Status(id=1)) + struct.pack(">I", 4097))
    reader = FrameSocket(b, max_frame=4096)
    assert reader.recv(p.daemon_request_decoder) == p.Status(id=1)
    with pytest.raises(FrameTooLarge) as info:
        reader.recv_payload()
    assert info.value.args[0] == "frame of 4097 bytes exceeds the 4096-byte limit"


# -- the frame header -------------------------------------------------------------


def test_frame_header_is_a_big_endian_length():
    assert p.encode(p.OkReply(id=7)) == b"\x00\x00\x00\x0b" + b"\x82\xa2op\xa2ok\xa2id\x07"


def test_frame_header_of_a_larger_frame():
    frame = p.encode(p.SpawnWorker(id=1, plan=b"x" * 70000))
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert frame[:4] == (len(frame) - 4).to_bytes(4, "big")
    assert length > 70000


def test_encode_refuses_a_frame_over_the_limit(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(frames, "MAX_FRAME", 10)
    with pytest.raises(FrameTooLarge) as info:
        p.encode(p.OkReply(id=7))
    assert info.value.args[0] == "frame of 11 bytes exceeds the 10-byte limit"
    monkeypatch.setattr(frames, "MAX_FRAME", 11)
    assert p.encode(p.OkReply(id=7)) == b"\x00\x00\x00\x0b\x82\xa2op\xa2ok\xa2id\x07"


def test_error_classes():
    assert issubclass(FrameTooLarge, ProtocolError)
    assert issubclass(p.BadMessage, ProtocolError)
    assert not issubclass(FrameTooLarge, p.BadMessage)


# -- request_id_of ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        (b"\xc1", 0),
        (b"", 0),
        (b"\x82\xa2op", 0),  # truncated
        (msgspec.msgpack.encode([1, 2, 3]), 0),
        (msgspec.msgpack.encode(42), 0),
        (msgspec.msgpack.encode({"op": "nope"}), 0),
        (msgspec.msgpack.encode({"id": "17"}), 0),
        (msgspec.msgpack.encode({"id": True}), 0),
        (msgspec.msgpack.encode({"id": 1.5}), 0),
        (msgspec.msgpack.encode({"id": None}), 0),
        (b"\x91" * 200000 + b"\x00", 0),  # absurdly nested arrays
        (b"\x81\xa2id" * 200000 + b"\x00", 0),  # absurdly nested maps
        (msgspec.msgpack.encode({"id": 17}), 17),
        (msgspec.msgpack.encode({"id": -3}), -3),
        (msgspec.msgpack.encode({"id": 2**64 - 1}), 2**64 - 1),
        (msgspec.msgpack.encode({"op": "shutdown", "id": 99, "junk": [1]}), 99),
    ],
)
def test_request_id_of(payload: bytes, expected: int):
    assert p.request_id_of(payload) == expected


def test_request_id_of_a_valid_request():
    assert p.request_id_of(payload_of(p.Attach(id=123456, session="s"))) == 123456


# -- FrameSocket --------------------------------------------------------------------


def test_several_frames_in_one_recv(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    msgs = [p.Status(id=1), p.Attach(id=2, session="s"), p.ListTools(id=3)]
    a.sendall(b"".join(p.encode(m) for m in msgs))
    a.close()
    reader = FrameSocket(b)
    assert [reader.recv(p.daemon_request_decoder) for _ in msgs] == msgs
    assert reader.recv(p.daemon_request_decoder) is None


def test_send_and_recv_through_frame_sockets(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    writer, reader = FrameSocket(a), FrameSocket(b)
    # Written beside the reads: every sample at once is more than a socket
    # pair buffers.
    sending = threading.Thread(target=lambda: [writer.send(msg) for msg, _ in SAMPLES.values()])
    sending.start()
    got = [reader.recv_payload() for _ in SAMPLES]
    sending.join()
    assert got == [payload_of(msg) for msg, _ in SAMPLES.values()]


class _Trickle:
    """A socket whose reads return at most one byte: every frame arrives split."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reads = 0

    def recv(self, n: int) -> bytes:
        self.reads += 1
        return self.sock.recv(min(n, 1))


def test_a_frame_split_into_single_bytes(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    msg = p.CallTool(id=5, tool="read_file", params={"path": "src/main.py"})
    frame = p.encode(msg)
    for i in range(len(frame)):
        a.send(frame[i : i + 1])
    trickle = _Trickle(b)
    reader = FrameSocket(trickle)  # type: ignore[arg-type]
    assert reader.recv(p.channel_request_decoder) == msg
    assert trickle.reads == len(frame)


def test_a_frame_split_across_sends_over_time(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    msg = p.ToolReply(id=9, success=True, output="x" * 5000)
    frame = p.encode(msg)
    chunks = [frame[:2], frame[2:4], frame[4:10], frame[10:3000], frame[3000:]]

    def send_slowly() -> None:
        for chunk in chunks:
            time.sleep(0.01)
            a.sendall(chunk)

    sender = threading.Thread(target=send_slowly)
    sender.start()
    try:
        assert FrameSocket(b).recv(p.channel_reply_decoder) == msg
    finally:
        sender.join()


def test_a_large_frame_then_a_small_one_in_the_same_stream(pair: tuple[socket.socket, socket.socket]):
    """A 3 MiB reply is read into one buffer of its size (_recv_large), the
    frame after it as usual; sent in odd chunks so that a read may end anywhere."""
    a, b = pair
    big = p.ToolReply(id=1, success=True, output="".join(chr(0x41 + i % 50) for i in range(3 << 20)))
    small = p.OkReply(id=2)
    stream = p.encode(big) + p.encode(small)

    def send_in_chunks() -> None:
        for i in range(0, len(stream), 99_991):
            a.sendall(stream[i : i + 99_991])

    sender = threading.Thread(target=send_in_chunks)
    sender.start()
    try:
        reader = FrameSocket(b)
        assert reader.recv(p.channel_reply_decoder) == big
        assert reader.recv(p.to_worker_decoder) == small
    finally:
        sender.join()


def test_a_large_frame_read_across_timed_out_reads(pair: tuple[socket.socket, socket.socket]):
    """The client's socket gives up a read after a tick (SO_RCVTIMEO) and
    reads again: a large frame whose sender stalls longer than that goes on
    from where it was, not from a lost buffer (which read the middle of the
    frame as a length prefix)."""
    a, b = pair
    b.settimeout(None)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("@ll", 0, 20_000))
    big = p.ToolReply(id=1, success=True, output="".join(chr(0x41 + i % 50) for i in range(3 << 20)))
    small = p.OkReply(id=2)
    stream = p.encode(big) + p.encode(small)

    def send_with_stalls() -> None:
        for i in range(0, len(stream), 1 << 20):
            a.sendall(stream[i : i + (1 << 20)])
            time.sleep(0.1)

    sender = threading.Thread(target=send_with_stalls)
    sender.start()
    reader = FrameSocket(b)
    got: list[object] = []
    gave_up = 0
    try:
        while len(got) < 2:
            try:
                got.append(reader.recv(p.channel_reply_decoder if not got else p.to_worker_decoder))
            except (BlockingIOError, TimeoutError):
                gave_up += 1
    finally:
        sender.join()
    assert got == [big, small]
    assert gave_up > 0  # the stalls did reach the reader


def test_a_large_frame_is_sent_whole_and_in_order(pair: tuple[socket.socket, socket.socket]):
    """FrameSocket.send puts a large payload behind its header without a
    copy (one sendmsg, then the rest): the bytes are the encoded frame's."""
    a, b = pair
    big = p.ToolReply(id=1, success=True, output="\u00e9x" * (1 << 20))
    received = bytearray()

    def read_all() -> None:
        while len(received) < len(p.encode(big)) + len(p.encode(p.OkReply(id=2))):
            received.extend(b.recv(1 << 16))

    reader = threading.Thread(target=read_all)
    reader.start()
    try:
        sender = FrameSocket(a)
        sender.send(big)
        sender.send(p.OkReply(id=2))
    finally:
        reader.join()
    assert bytes(received) == p.encode(big) + p.encode(p.OkReply(id=2))


def test_eof_inside_a_large_frame_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    frame = p.encode(p.ToolReply(id=1, success=True, output="y" * (1 << 20)))

    def send_half() -> None:
        a.sendall(frame[: len(frame) // 2])
        a.shutdown(socket.SHUT_WR)

    sender = threading.Thread(target=send_half)
    sender.start()
    try:
        with pytest.raises(ProtocolError, match="connection closed inside a frame"):
            FrameSocket(b).recv_payload()
    finally:
        sender.join()


def test_eof_between_frames_is_none(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(p.encode(p.OkReply(id=1)))
    a.shutdown(socket.SHUT_WR)
    reader = FrameSocket(b)
    assert reader.recv(p.to_worker_decoder) == p.OkReply(id=1)
    assert reader.recv(p.to_worker_decoder) is None
    assert reader.recv_payload() is None


def test_eof_before_anything_is_none(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    assert FrameSocket(b).recv_payload() is None


def test_eof_inside_the_header_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(b"\x00\x00")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError) as info:
        FrameSocket(b).recv_payload()
    assert info.value.args[0] == "connection closed inside a frame header"


def test_eof_inside_the_payload_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(p.encode(p.OkReply(id=1))[:-1])
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError) as info:
        FrameSocket(b).recv_payload()
    assert type(info.value) is ProtocolError
    assert info.value.args[0] == "connection closed inside a frame"


def test_oversized_length_is_refused_without_reading_the_payload(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    # Only the header is sent and the peer stays open: a reader that waited for
    # the payload would block until the 5 s timeout and raise TimeoutError.
    a.sendall(struct.pack(">I", p.MAX_FRAME + 1))
    started = time.monotonic()
    with pytest.raises(FrameTooLarge) as info:
        FrameSocket(b).recv_payload()
    assert time.monotonic() - started < 2
    assert info.value.args[0] == f"frame of {p.MAX_FRAME + 1} bytes exceeds the {p.MAX_FRAME}-byte limit"


def test_the_largest_length_prefix_is_not_too_large(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(struct.pack(">I", p.MAX_FRAME) + b"abc")
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError) as info:
        FrameSocket(b).recv_payload()
    assert type(info.value) is ProtocolError  # waited for the payload, not FrameTooLarge
    assert info.value.args[0] == "connection closed inside a frame"


def test_garbage_payload_through_recv(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(b"\x00\x00\x00\x01\xc1" + p.encode(p.Status(id=2)))
    reader = FrameSocket(b)
    with pytest.raises(p.BadMessage):
        reader.recv(p.daemon_request_decoder)
    # The frame boundary is kept: the next frame still decodes.
    assert reader.recv(p.daemon_request_decoder) == p.Status(id=2)


def test_fileno(pair: tuple[socket.socket, socket.socket]):
    a, _ = pair
    assert FrameSocket(a).fileno() == a.fileno()


# -- fd passing ---------------------------------------------------------------------


class Pipe:
    def __init__(self) -> None:
        self.r, self.w = os.pipe()

    def close_write(self) -> None:
        os.close(self.w)
        self.w = -1

    def close(self) -> None:
        for fd in (self.r, self.w):
            if fd >= 0:
                os.close(fd)
        self.r = self.w = -1


@pytest.fixture
def pipes() -> Iterator[Callable[[], Pipe]]:
    yield from made_each(Pipe, Pipe.close)


def fd_pair(pair: tuple[socket.socket, socket.socket]) -> tuple[FrameSocket, FrameSocket]:
    return FrameSocket(pair[0], fds=True), FrameSocket(pair[1], fds=True)


def test_fd_passing_gives_a_working_fd(pair: tuple[socket.socket, socket.socket], pipes: Callable[[], Pipe]):
    pipe = pipes()
    writer, reader = fd_pair(pair)
    writer.send(p.AddChannel(id=1), fds=[pipe.w])
    assert reader.recv(p.to_worker_decoder) == p.AddChannel(id=1)
    fd = reader.take_fd()
    assert fd not in (pipe.r, pipe.w)
    assert os.write(fd, b"through the passed fd") == 21
    os.close(fd)
    assert os.read(pipe.r, 100) == b"through the passed fd"
    with pytest.raises(ProtocolError) as info:
        reader.take_fd()
    assert info.value.args[0] == "expected a file descriptor with this message, none came"


def test_descriptors_no_message_asked_for_are_dropped(pair: tuple[socket.socket, socket.socket],
                                                      pipes: Callable[[], Pipe]):
    """A peer that sends descriptors with messages that take none (a
    compromised tool server, to the daemon) cannot make them pile up: the
    reader drops them. Its twin: one taken before the drop is kept, and works."""
    pipe, other = pipes(), pipes()
    writer, reader = fd_pair(pair)
    writer.send(p.AddChannel(id=1), fds=[pipe.w])
    reader.recv(p.to_worker_decoder)
    kept = reader.take_fd()
    writer.send(p.MaySleep(), fds=[other.w, other.w])
    reader.recv(p.from_worker_decoder)
    queued = [fd for _, fd in reader._fd_queue]
    assert len(queued) == 2
    reader.drop_fds()
    for fd in queued:
        with pytest.raises(OSError) as info:
            os.fstat(fd)
        assert info.value.errno == errno.EBADF
    with pytest.raises(ProtocolError):
        reader.take_fd()
    assert os.write(kept, b"k") == 1 and os.read(pipe.r, 1) == b"k"
    os.close(kept)


def test_the_descriptors_of_a_frame_still_buffered_are_kept_for_it(pair: tuple[socket.socket, socket.socket],
                                                                    pipes: Callable[[], Pipe]):
    """One read can bring a frame that takes no descriptor and, behind it,
    the next one with its own (a worker's ToolCallsDone, then its WatchHeld):
    the drop after the first leaves the second's. Its twin: a descriptor
    that came with the first frame itself is dropped."""
    pipe, stray = pipes(), pipes()
    writer, reader = fd_pair(pair)
    writer.send(p.MaySleep(), fds=[stray.w])
    writer.send(p.ToolCallsDone(calls=[]))
    writer.send(p.WatchHeld(), fds=[pipe.w])  # all three in the socket before the first read
    stray.close_write()
    assert reader.recv(p.from_worker_decoder) == p.MaySleep()
    reader.drop_fds()
    assert os.read(stray.r, 1) == b""  # the first frame's: closed (its only write end was queued)
    assert reader.recv(p.from_worker_decoder) == p.ToolCallsDone(calls=[])
    reader.drop_fds()  # read with the frame above, not this one's: kept
    assert reader.recv(p.from_worker_decoder) == p.WatchHeld()
    fd = reader.take_fd()
    assert os.write(fd, b"w") == 1 and os.read(pipe.r, 1) == b"w"
    os.close(fd)


def test_fd_rides_with_a_large_frame(pair: tuple[socket.socket, socket.socket], pipes: Callable[[], Pipe]):
    pipe = pipes()
    msg = p.SpawnWorker(id=2, plan=b"p" * 200000)
    writer, reader = fd_pair(pair)
    sender = threading.Thread(target=writer.send, args=(msg,), kwargs={"fds": [pipe.r]})
    sender.start()
    try:
        assert reader.recv(p.fork_server_request_decoder) == msg
    finally:
        sender.join()
    fd = reader.take_fd()
    os.write(pipe.w, b"z")
    assert os.read(fd, 1) == b"z"
    os.close(fd)


def test_take_fd_without_any_is_a_protocol_error(pair: tuple[socket.socket, socket.socket]):
    writer, reader = fd_pair(pair)
    writer.send(p.AddChannel(id=1))
    assert reader.recv(p.to_worker_decoder) == p.AddChannel(id=1)
    with pytest.raises(ProtocolError) as info:
        reader.take_fd()
    assert info.value.args[0] == "expected a file descriptor with this message, none came"


def test_fds_are_taken_in_order(pair: tuple[socket.socket, socket.socket], pipes: Callable[[], Pipe]):
    first_pipe, second_pipe = pipes(), pipes()
    writer, reader = fd_pair(pair)
    writer.send(p.AddChannel(id=1), fds=[first_pipe.w])
    writer.send(p.AddChannel(id=2), fds=[second_pipe.w])
    assert reader.recv(p.to_worker_decoder) == p.AddChannel(id=1)
    first = reader.take_fd()
    assert reader.recv(p.to_worker_decoder) == p.AddChannel(id=2)
    second = reader.take_fd()
    os.write(first, b"1")
    os.write(second, b"2")
    os.close(first)
    os.close(second)
    assert (os.read(first_pipe.r, 9), os.read(second_pipe.r, 9)) == (b"1", b"2")


def test_close_closes_untaken_fds(pair: tuple[socket.socket, socket.socket], pipes: Callable[[], Pipe]):
    pipe = pipes()
    writer, reader = fd_pair(pair)
    writer.send(p.AddChannel(id=1), fds=[pipe.w])
    assert reader.recv(p.to_worker_decoder) == p.AddChannel(id=1)
    pipe.close_write()
    reader.close()
    # The only remaining write end was the queued fd: closing it is EOF.
    assert os.read(pipe.r, 1) == b""


def test_recv_request_answers_a_bad_request_and_reads_on(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    bad = msgspec.msgpack.encode({"op": "close_session", "id": 5})
    a.sendall(len(bad).to_bytes(4, "big") + bad + p.encode(p.Status(id=6)))
    refused: list[p.ErrorReply] = []
    reader = FrameSocket(b)
    assert reader.recv_request(p.daemon_request_decoder, refused.append) == p.Status(id=6)
    assert refused == [p.ErrorReply(id=5, code="bad_request",
                                    message="undecodable message: Object missing required field `session`")]
    a.close()
    assert reader.recv_request(p.daemon_request_decoder, refused.append) is None
    assert len(refused) == 1


def test_recv_request_raises_on_a_frame_over_the_limit(pair: tuple[socket.socket, socket.socket]):
    a, b = pair
    a.sendall(struct.pack(">I", p.MAX_HELLO_FRAME + 1))
    refused: list[p.ErrorReply] = []
    with pytest.raises(FrameTooLarge):
        FrameSocket(b, max_frame=p.MAX_HELLO_FRAME).recv_request(p.daemon_request_decoder, refused.append)
    assert refused == []  # the caller answers it, and closes


def _receive_under_one_free_descriptor(sock: socket.socket, frames: int) -> dict[str, Any]:
    """In a child whose descriptor limit leaves it one free slot: read
    ``frames`` frames from ``sock`` and say what each was (what the kernel
    installs is counted per process: this test process keeps its own)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            free = os.dup(0)
            os.close(free)
            resource.setrlimit(resource.RLIMIT_NOFILE, (free + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            reader = FrameSocket(sock, fds=True)
            seen: list[object] = []
            for _ in range(frames):
                try:
                    msg = reader.recv(p.fork_server_request_decoder)
                except DescriptorsLost as exc:
                    seen.append(["lost", p.request_id_of(exc.payload), str(exc), len(exc.payload)])
                    continue
                assert msg is not None
                fds = []
                while reader._fd_queue:
                    fd = reader.take_fd()
                    fds.append(os.fstat(fd).st_ino)
                    os.close(fd)
                seen.append(["ok", msg.id, fds])
            again = os.dup(0)  # the slot is free again: what came of a cut set was closed
            os.write(w, msgspec.json.encode({"pid": os.getpid(), "limit": free + 1, "seen": seen,
                                             "slot_free": again == free}))
        finally:
            os._exit(0)
    os.close(w)
    try:
        out = b"".join(iter(lambda: os.read(r, 65536), b""))
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    result: dict[str, Any] = msgspec.json.decode(out)
    return result


@pytest.mark.process  # a forked receiver with one free descriptor slot
@pytest.mark.parametrize("size", [10, 200_000], ids=["small", "large"])
def test_descriptors_cut_refuse_their_frame_and_the_stream_reads_on(
        pair: tuple[socket.socket, socket.socket], pipes: Callable[[], Pipe], size: int) -> None:
    """A receiver out of descriptors (MSG_CTRUNC): the frame whose descriptors
    were cut is read whole and refused with why, the one of its descriptors
    that did arrive is closed, and the frames around it read as sent. The
    allowed twin, on the same stream: one descriptor, which fits, arrives."""
    pipe = pipes()
    writer = FrameSocket(pair[0], fds=True)
    plan = b"p" * size
    sender = threading.Thread(target=lambda: (
        writer.send(p.SpawnWorker(id=1, plan=plan)),
        writer.send(p.SpawnWorker(id=2, plan=plan), fds=[pipe.r, pipe.w]),
        writer.send(p.SpawnWorker(id=3, plan=plan, pooled=True), fds=[pipe.w])))
    sender.start()
    try:
        got = _receive_under_one_free_descriptor(pair[1], 3)
    finally:
        sender.join()
    message = (f"the file descriptors sent with this message were cut: the receiving process (pid {got['pid']}) "
               f"is out of file descriptors (RLIMIT_NOFILE {got['limit']})")
    assert got["seen"] == [["ok", 1, []], ["lost", 2, message, len(p.encode(p.SpawnWorker(id=2, plan=plan))) - 4],
                           ["ok", 3, [os.fstat(pipe.w).st_ino]]]
    assert got["slot_free"] is True
