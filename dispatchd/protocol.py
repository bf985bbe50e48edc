"""The one wire protocol of dispatchd, shared by the client, the daemon and the workers.

Guarantees:
- Every message is a frozen msgspec ``Struct`` tagged by its class name (the
  ``op`` field) and decoded by one typed decoder per direction, so a typo or a
  foreign message is a decode error, never a half-understood request.
- A frame is a 4-byte big-endian length followed by a msgpack payload of at
  most ``MAX_FRAME`` bytes. A longer length prefix is refused before any
  payload is read (``FrameTooLarge``): a peer cannot make us allocate.
- Requests carry an ``id`` chosen by the sender; the reply to a request carries
  the same ``id``, so several calls can be in flight on one connection.
- Every bad request gets an ``ErrorReply``; only a broken frame (garbage, bad
  length) ends the connection, and only that connection.

Four conversations use it:
- client <-> daemon: ``Hello`` first, then the ``DaemonRequest`` union.
- client <-> worker: ``CallTool`` on a channel the daemon handed to the client
  (``Attach``); one hop per tool call.
- daemon <-> worker: ``WorkerReady``/``WorkerFailed`` once, then ``AddChannel``.
- daemon <-> fork server: ``SpawnWorker`` / ``Spawned``; ``NetRules`` / ``OkReply``.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any, Union

import msgspec

from dispatchd.netmodes import NetworkMode
from dispatchd.tools.spec import Risk

PROTOCOL_VERSION = 1
# Big enough for a file at the policy's size cap plus two capped output streams,
# small enough that a hostile length prefix cannot exhaust memory.
MAX_FRAME = 64 * 1024 * 1024
# What the daemon reads from a client: requests are a path, a policy name,
# ports and domain lists, never file contents, so a frame of a few hundred KiB
# is plenty and bounds what each connection can make the (shared, unconfined)
# daemon buffer. Before ``Hello`` only a greeting is expected: a few KiB.
MAX_REQUEST_FRAME = 256 * 1024
MAX_HELLO_FRAME = 4 * 1024
_HEADER = struct.Struct(">I")


class _Msg(msgspec.Struct, frozen=True, tag_field="op", forbid_unknown_fields=True):
    pass


# --- client -> daemon -------------------------------------------------------


class Hello(_Msg, tag="hello", frozen=True):
    id: int
    version: int
    client: str = ""


class OpenSession(_Msg, tag="open_session", frozen=True):
    id: int
    worktree: str
    policy: str = "default"
    network: NetworkMode | None = None  # None: the policy's default
    ports: list[int] | None = None  # under "ports": TCP ports to connect to (None: the policy's)
    bind_ports: list[int] | None = None  # under "ports": TCP ports to bind (None: the policy's)
    domains: list[str] | None = None  # under "domains": the hosts it may reach (None: the policy's)
    # Extra read-only paths for this session (toolchains outside the system
    # directories: ~/.cargo, ~/.rustup), beside the policy's extra_read_only.
    read_only: list[str] = []
    # Lifetime (daemon/lifetimes.py): a session ends once every connection that
    # opened or attached to it has gone for its grace, unless it is detached.
    detached: bool = False
    orphan_grace_s: float | None = None  # shorter than the policy's, never longer; None: the policy's


class CloseSession(_Msg, tag="close_session", frozen=True):
    id: int
    session: str


class ReleaseWriteLock(_Msg, tag="release_write_lock", frozen=True):
    """Give back the session's worktree write lock without closing it; the
    session asks again at its next mutating call. Answered by ``SessionReply``."""

    id: int
    session: str


class ListSessions(_Msg, tag="list_sessions", frozen=True):
    id: int


class SetNetwork(_Msg, tag="set_network", frozen=True):
    id: int
    session: str
    network: NetworkMode
    ports: list[int] | None = None
    bind_ports: list[int] | None = None
    domains: list[str] | None = None


class Status(_Msg, tag="status", frozen=True):
    id: int


class Attach(_Msg, tag="attach", frozen=True):
    """Ask for a direct channel to a session's worker (an fd passed back)."""

    id: int
    session: str


class ListTools(_Msg, tag="list_tools", frozen=True):
    id: int
    policy: str = "default"


DaemonRequest = Union[
    Hello, OpenSession, CloseSession, ListSessions, SetNetwork, Status, Attach, ListTools, ReleaseWriteLock
]

# --- daemon -> client -------------------------------------------------------


class ToolSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    parameters: dict[str, Any]
    risk: Risk = "execute"  # from tools/spec.py; a tool that does not say is treated as the riskiest
    slow: bool = False  # runs on a thread of its own in the worker: its calls can be cancelled


class DeniedHost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A host a ``domains`` session asked the proxy for and was refused."""

    host: str
    port: int
    count: int
    last: float  # time.time() of the last refusal


class SessionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    worktree: str
    policy: str
    network: NetworkMode
    created: float
    protections: dict[str, Any] = {}
    limits: dict[str, Any] = {}  # the policy's limits (timeouts, caps, model output budget)
    note: str = ""
    domains: list[str] = []  # under "domains": the hosts the proxy lets it reach
    denied: list[DeniedHost] = []  # under "domains": the last hosts refused, most recent first
    writes: bool = False  # holds its worktree's write lock (one writer per worktree)


class HelloOk(_Msg, tag="hello_ok", frozen=True):
    id: int
    version: int
    daemon_version: str


class SessionReply(_Msg, tag="session", frozen=True):
    id: int
    session: SessionInfo


class SessionsReply(_Msg, tag="sessions", frozen=True):
    id: int
    sessions: list[SessionInfo]


class StatusReply(_Msg, tag="status_reply", frozen=True):
    id: int
    daemon_version: str
    pid: int
    socket: str
    kernel: dict[str, Any]
    sessions: list[SessionInfo]
    daemon: dict[str, Any] = {}  # its own budgets: descriptors, connections (daemon/capacity.py)


class Attached(_Msg, tag="attached", frozen=True):
    """Sent with exactly one fd (SCM_RIGHTS): a stream socket to the worker."""

    id: int
    session: SessionInfo
    tools: list[ToolSchema]


class ToolsReply(_Msg, tag="tools", frozen=True):
    id: int
    tools: list[ToolSchema]


class OkReply(_Msg, tag="ok", frozen=True):
    id: int


class ErrorReply(_Msg, tag="error", frozen=True):
    """``code`` is stable and machine-readable; ``message`` is for people."""

    id: int
    code: str
    message: str


DaemonReply = Union[
    HelloOk, SessionReply, SessionsReply, StatusReply, Attached, ToolsReply, OkReply, ErrorReply
]

# --- client <-> worker ------------------------------------------------------


class CallTool(_Msg, tag="call_tool", frozen=True):
    id: int
    tool: str
    params: dict[str, Any]
    stream: bool = False  # send ToolOutput frames as output comes, before the ToolReply


class CancelCall(_Msg, tag="cancel_call", frozen=True):
    """Client -> worker: end the call ``id`` now (its processes killed); its
    ``ToolReply`` still comes, a failure with ``metadata["cancelled"]``. No
    reply of its own; an unknown or finished id is ignored."""

    id: int


class ToolOutput(_Msg, tag="tool_output", frozen=True):
    """Worker -> client, for a ``CallTool`` with ``stream``: output of call
    ``id`` as it came, ``stream`` "stdout" or "stderr", before its reply."""

    id: int
    stream: str
    text: str


class ToolReply(_Msg, tag="tool_reply", frozen=True):
    id: int
    success: bool
    output: str | None = None
    error: str | None = None
    metadata: dict[str, Any] = {}


# --- daemon <-> worker ------------------------------------------------------


class WorkerReady(_Msg, tag="worker_ready", frozen=True):
    pid: int
    protections: dict[str, Any]
    timings_ms: dict[str, float] = {}  # per confinement step, for the debug log
    # Sent with one fd when true: the proxy's listening socket, made on the
    # loopback of the session's own network namespace (network "domains").
    proxy_listener: bool = False
    # Sent with two fds when true, before the listener: the session's user and
    # network namespaces, for the network stack and the nftables rules. The
    # daemon cannot open /proc/PID/ns of a worker that is not dumpable (it has
    # no CAP_SYS_PTRACE over the init namespace that owns the worker's memory).
    namespaces: bool = False


class WorkerFailed(_Msg, tag="worker_failed", frozen=True):
    """A confinement step could not be applied: the worker has exited."""

    step: str
    errno: int
    path: str
    message: str


class AddChannel(_Msg, tag="add_channel", frozen=True):
    """Sent with one fd: a new client channel for the worker to serve."""

    id: int


# --- daemon <-> fork server ----------------------------------------------


class SpawnWorker(_Msg, tag="spawn_worker", frozen=True):
    """Sent with two fds: the worker's end of its control channel, and the
    worktree the daemon checked (O_PATH). ``plan`` is a msgpack-encoded ``SessionPlan``."""

    id: int
    plan: bytes


class Spawned(_Msg, tag="spawned", frozen=True):
    """Sent with one fd: a pidfd of the new session's first process."""

    id: int
    pid: int


class NetRules(_Msg, tag="net_rules", frozen=True):
    """Sent with two fds, a session's user and network namespaces: commit
    ``rules`` (nftables) in there. Answered by ``OkReply`` or ``ErrorReply``."""

    id: int
    rules: str


WorkerRequest = Union[CallTool, ToolReply, ErrorReply, CancelCall, ToolOutput]
ZygoteRequest = Union[SpawnWorker, NetRules]
ZygoteReply = Union[Spawned, OkReply, ErrorReply]
class AcquireWriteLock(_Msg, tag="acquire_write_lock", frozen=True):
    """Worker -> daemon, before the session's first mutating tool call: only
    one session at a time may write a worktree. Answered by ``OkReply`` or by
    ``ErrorReply`` (code ``write_locked``) naming the session that holds it."""

    id: int


class CallRecord(msgspec.Struct, frozen=True, array_like=True):
    """One finished tool call, for the daemon's log line (never arguments,
    output or file contents)."""

    tool: str
    duration_ms: float
    success: bool


class ToolCallsDone(_Msg, tag="tool_calls_done", frozen=True):
    """Worker -> daemon, the calls finished since the last one, sent at most
    every half second: a message per call would wake the daemon between a
    reply and the next request, which measured as half the round trip."""

    calls: list[CallRecord]


class Drain(_Msg, tag="drain", frozen=True):
    """Daemon -> worker when the daemon stops: take no new call, let calls in
    flight finish for up to ``deadline_s``, then end the session."""

    deadline_s: float


class ForgetWriteLock(_Msg, tag="forget_write_lock", frozen=True):
    """Daemon -> worker: the write lock was given back; ask again before the
    next mutating call. Sent under the same lock as the grants, so a grant
    and a release reach the worker in the order the daemon decided them."""


class SetCommandEnv(_Msg, tag="set_command_env", frozen=True):
    """Daemon -> worker: commands started from now on run with ``set`` added
    to their environment and ``unset`` removed (the proxy variables when a
    session's network changes in place). Commands already running keep theirs."""

    set: dict[str, str] = {}
    unset: list[str] = []
    id: int = 0  # not 0: the worker answers ``OkReply(id)`` once later commands get it


WorkerControl = Union[WorkerReady, WorkerFailed, AddChannel, AcquireWriteLock, ToolCallsDone, Drain, OkReply,
                      ErrorReply, SetCommandEnv, ForgetWriteLock]

# --- codec ------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
daemon_request_decoder = msgspec.msgpack.Decoder(DaemonRequest)
daemon_reply_decoder = msgspec.msgpack.Decoder(DaemonReply)
worker_decoder = msgspec.msgpack.Decoder(WorkerRequest)
control_decoder = msgspec.msgpack.Decoder(WorkerControl)
zygote_request_decoder = msgspec.msgpack.Decoder(ZygoteRequest)
zygote_reply_decoder = msgspec.msgpack.Decoder(ZygoteReply)


class ProtocolError(Exception):
    """The peer broke framing or sent something undecodable; drop the connection."""


class FrameTooLarge(ProtocolError):
    pass


def encode(msg: msgspec.Struct) -> bytes:
    """One whole frame: length prefix and payload."""
    payload = _encoder.encode(msg)
    if len(payload) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(payload)} bytes exceeds the {MAX_FRAME}-byte limit")
    return _HEADER.pack(len(payload)) + payload


class BadMessage(ProtocolError):
    """A whole frame arrived but does not decode: answer it, keep the connection."""


def decode(decoder: msgspec.msgpack.Decoder[Any], payload: bytes) -> Any:
    try:
        return decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError) as exc:
        # UnicodeDecodeError: invalid UTF-8 in a string field, which msgspec
        # reports as such rather than as a DecodeError.
        raise BadMessage(f"undecodable message: {exc}") from exc


class _IdOnly(msgspec.Struct):
    """The one field read from a request that did not decode. Typed: every
    other key is skipped without building anything, so a hostile payload
    (megabytes of nested empty arrays) costs no memory here."""

    id: int = 0


_id_decoder = msgspec.msgpack.Decoder(_IdOnly)


def request_id_of(payload: bytes) -> int:
    """Best effort: the ``id`` of a request we could not decode, so the error reply
    can still be matched by the sender. 0 when even that is unreadable."""
    try:
        rid = _id_decoder.decode(payload).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError):
        return 0
    # One our own reply can carry (msgspec already refused bools and floats).
    return rid if -(2**63) <= rid < 2**64 else 0


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
        self._fd_queue: list[int] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, msg: msgspec.Struct, fds: list[int] | None = None) -> None:
        frame = encode(msg)
        if fds:
            # The fds ride on the first byte of the frame; the rest follows.
            sent = socket.send_fds(self.sock, [frame], fds)
            if sent < len(frame):
                self.sock.sendall(memoryview(frame)[sent:])
        else:
            self.sock.sendall(frame)

    def _fill(self) -> bool:
        if self._fds:
            data, fds, flags, _addr = socket.recv_fds(self.sock, 1 << 16, 4)
            self._fd_queue.extend(fds)
            if flags & socket.MSG_CTRUNC:
                # The kernel dropped a descriptor it could not install here
                # (EMFILE): say so, rather than "none came" later.
                raise ProtocolError("a file descriptor sent to this process was lost: "
                                    "it is out of descriptors (RLIMIT_NOFILE)")
        else:
            data = self.sock.recv(1 << 16)
        if not data:
            return False
        self._buf += data
        return True

    def recv_payload(self) -> bytes | None:
        """The next payload, or None on a clean end of stream between frames."""
        while len(self._buf) < 4:
            if not self._fill():
                if self._buf:
                    raise ProtocolError("connection closed inside a frame header")
                return None
        (length,) = _HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise FrameTooLarge(f"frame of {length} bytes exceeds the {self.max_frame}-byte limit")
        while len(self._buf) < 4 + length:
            if not self._fill():
                raise ProtocolError("connection closed inside a frame")
        payload = bytes(self._buf[4 : 4 + length])
        del self._buf[: 4 + length]
        return payload

    def recv(self, decoder: msgspec.msgpack.Decoder[Any]) -> Any:
        payload = self.recv_payload()
        if payload is None:
            return None
        return decode(decoder, payload)

    def take_fd(self) -> int:
        if not self._fd_queue:
            raise ProtocolError("expected a file descriptor with this message, none came")
        return self._fd_queue.pop(0)

    def close(self) -> None:
        for fd in self._fd_queue:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fd_queue.clear()
        self.sock.close()
