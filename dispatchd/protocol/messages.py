"""The public protocol: what a client says to the daemon and to a session's worker.

Guarantees:
- Every message is a frozen msgspec ``Struct``, tagged by the ``op`` field,
  with unknown fields refused; one decoder per direction
  (``daemon_request_decoder``, ``daemon_reply_decoder``,
  ``channel_request_decoder``, ``channel_reply_decoder``), so a typo or a
  message sent the wrong way is a decode error, never a half-understood request.
- Requests carry an ``id`` chosen by the sender; the reply to a request carries
  the same ``id``, so several calls can be in flight on one connection.
- The tags and fields here are what clients in the field speak: change them
  only with ``PROTOCOL_VERSION``. ``OkReply`` and ``ErrorReply`` serve every
  conversation, the internal ones (``internal.py``) included.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from dispatchd.catalogue import Risk
from dispatchd.netmodes import NetworkMode
from dispatchd.protocol.reports import BeforeRestoreReport, DaemonReport, KernelFeatures, Protections

PROTOCOL_VERSION = 1  # sent in Hello; the daemon refuses any other


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
    # Variables for the session's commands (dispatchd.envnames checks them),
    # and secrets: variables too, whose values never leave the sandbox in a
    # reply (dispatchd/redact.py), nor reach a log or a file of the daemon.
    env: dict[str, str] = {}
    secrets: dict[str, str] = {}
    # Lifetime (daemon/lifetimes.py): a session ends once every connection that
    # opened or attached to it has gone for its grace, unless it is detached.
    detached: bool = False
    orphan_grace_s: float | None = None  # shorter than the policy's, never longer; None: the policy's
    # Answered by ``Attached`` (with the channel's fd) instead of ``SessionReply``:
    # opened and attached in one round trip.
    attach: bool = False


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


class TakeCheckpoint(_Msg, tag="checkpoint", frozen=True):
    """Keep the session's worktree as it is now (daemon/checkpoints/);
    answered by ``CheckpointReply``."""

    id: int
    session: str
    label: str = ""


class ListCheckpoints(_Msg, tag="list_checkpoints", frozen=True):
    """The session's checkpoints, oldest first; answered by ``CheckpointsReply``."""

    id: int
    session: str


class RestoreCheckpoint(_Msg, tag="restore", frozen=True):
    """Put the worktree's files and git metadata back as they were at
    ``checkpoint``; answered by ``RestoredReply``. ``force``: restore even
    when the worktree as it is cannot be kept first (it is then lost)."""

    id: int
    session: str
    checkpoint: str
    force: bool = False


DaemonRequest = Union[
    Hello, OpenSession, CloseSession, ListSessions, SetNetwork, Status, Attach, ListTools, ReleaseWriteLock,
    TakeCheckpoint, ListCheckpoints, RestoreCheckpoint,
]

# --- daemon -> client -------------------------------------------------------


class ToolSchema(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    description: str
    parameters: dict[str, Any]
    risk: Risk = "execute"  # from dispatchd/catalogue.py; a tool that does not say is treated as the riskiest
    slow: bool = False  # runs on a thread of its own in the worker: its calls can be cancelled


class DeniedHost(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A host a ``domains`` session asked the proxy for and was refused."""

    host: str
    port: int
    count: int
    last: float  # time.time() of the last refusal


class ProtectedItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Something the checks at a session's end moved aside or put back: a
    file the user's git or other tools would have run, a ref, object files."""

    path: str
    why: str
    time: float = 0.0


class SessionUsage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a session's tool calls used, summed as the tool server reports
    them (in batches, about every half second): the calls counted, their
    CPU time, and the largest ``peak_mib`` of any of them."""

    calls: int = 0
    cpu_s: float = 0.0
    peak_mib: float = 0.0


# Why a session's sandbox was last replaced (``SessionInfo.replaced``): a
# phrase a client shows as it is, one it does not know included. A wake from
# sleep replaces no sandbox here: its tool server hands every channel, whole,
# to the next, and sleeps only with no call in flight.
REPLACED_NETWORK = "its network was switched"  # a switch that could not be made in place (switching.py)


class SessionInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    worktree: str
    policy: str
    network: NetworkMode
    created: float
    protections: Protections
    limits: dict[str, Any] = {}  # the policy's limits (timeouts, caps, model output budget)
    note: str = ""
    domains: list[str] = []  # under "domains": the hosts the proxy lets it reach
    denied: list[DeniedHost] = []  # under "domains": the last hosts refused, most recent first
    writes: bool = False  # holds its worktree's write lock (one writer per worktree)
    asleep: bool = False  # no process runs: its next call wakes it (the policy's sleep_after_s)
    protected: list[ProtectedItem] = []  # what checks of its worktree moved aside or put back since it opened
    # What does not work as the mode promises, e.g. "DNS does not answer: ..."
    # (network on/ports, daemon/dnsrelay.py); empty when all is well.
    warnings: list[str] = []
    usage: SessionUsage = SessionUsage()  # what its tool calls used so far
    # Which of its sandboxes serves it: 1 at its open, one more each time the
    # daemon replaces it, ending its processes and closing its channels (the
    # calls in flight on them are lost); 0 from a daemon that does not say.
    # A channel attached to one sandbox is served by that one only.
    sandbox: int = 0
    replaced: str = ""  # why the last replacement happened (REPLACED_*); "" while it has its first


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
    kernel: KernelFeatures
    sessions: list[SessionInfo]
    daemon: DaemonReport | None = None  # its own budgets: descriptors, connections (daemon/capacity.py)
    protected: list[ProtectedItem] = []  # what the checks a dead daemon left did at this daemon's start


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


class ClosedReply(_Msg, tag="closed", frozen=True):
    """A session closed; what the checks at its end moved aside or put back."""

    id: int
    protected: list[ProtectedItem] = []


class CheckpointInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A checkpoint: its id, when it was taken (``time.time()``), its label,
    and what it holds (entries: files, directories and links; bytes copied,
    not cloned or linked; git object files it keeps)."""

    id: str
    created: float
    label: str = ""
    entries: int = 0
    copied_bytes: int = 0
    objects: int = 0


class CheckpointReply(_Msg, tag="checkpoint_taken", frozen=True):
    id: int
    checkpoint: CheckpointInfo


class CheckpointsReply(_Msg, tag="checkpoints", frozen=True):
    id: int
    checkpoints: list[CheckpointInfo]


class RestoredReply(_Msg, tag="restored", frozen=True):
    """What a restore changed: paths removed, written (files, links) and
    made (directories), git object files put back; ``before``: the
    checkpoint of the worktree as it was just before (restore it to undo);
    ``kept``: the directory where the same files are kept past the session
    (docs/checkpoints.md); ``displaced``: the refs under
    ``refs/dispatchd/displaced/`` that keep the values it moved;
    ``kept_total``: with ``kept``, all that restores keep there, and its budget;
    ``not_restored``: the refs it left as they are, each with why (a branch
    checked out in another worktree, a lock the user's git held)."""

    id: int
    checkpoint: str
    before: str = ""
    removed: int = 0
    written: int = 0
    made: int = 0
    objects: int = 0
    kept: str = ""
    displaced: list[str] = []
    kept_total: BeforeRestoreReport | None = None
    not_restored: list[str] = []


class ErrorReply(_Msg, tag="error", frozen=True):
    """``code`` is stable and machine-readable; ``message`` is for people."""

    id: int
    code: str
    message: str


DaemonReply = Union[
    HelloOk, SessionReply, SessionsReply, StatusReply, Attached, ToolsReply, OkReply, ClosedReply, ErrorReply,
    CheckpointReply, CheckpointsReply, RestoredReply,
]

# --- client <-> worker: a channel the daemon handed over (Attach), one hop per call ---


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


ChannelRequest = Union[CallTool, CancelCall]
ChannelReply = Union[ToolReply, ToolOutput, ErrorReply]

# --- decoders, one per direction ------------------------------------------------

daemon_request_decoder = msgspec.msgpack.Decoder(DaemonRequest)  # client -> daemon
daemon_reply_decoder = msgspec.msgpack.Decoder(DaemonReply)  # daemon -> client
channel_request_decoder = msgspec.msgpack.Decoder(ChannelRequest)  # client -> worker
channel_reply_decoder = msgspec.msgpack.Decoder(ChannelReply)  # worker -> client
