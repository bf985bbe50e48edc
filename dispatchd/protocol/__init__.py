"""The one wire protocol of dispatchd, shared by the client, the daemon and the workers.

Four modules, one job each, all re-exported here (``protocol.Hello``,
``protocol.FrameSocket``, ...):

- ``messages``: the public protocol, what clients in the field speak.
  client <-> daemon: ``Hello`` first, then the ``DaemonRequest`` union,
  answered by the ``DaemonReply`` union. client <-> worker: ``CallTool`` on a
  channel the daemon handed to the client (``Attach``); one hop per tool call.
- ``reports``: what ``status`` and a session's open report (``Protections``,
  ``KernelFeatures``), typed, encoded exactly as the dicts they replaced.
- ``internal``: the daemon and its own processes. daemon <-> worker:
  ``WorkerReady``/``WorkerFailed`` once, then ``AddChannel`` and the rest;
  daemon <-> fork server: ``SpawnWorker`` / ``Spawned``; ``NetRules`` / ``OkReply``;
  ``NetClosed`` / ``OkReply``; ``EndLeftBehind`` / ``OkReply``; ``StartStack`` / ``Spawned``; ``DnsSockets`` / ``DnsDoor``.
- ``frames``: length-prefixed frames with a maximum size, the codec, fd
  passing, and ``FrameSocket.recv_request``, through which both servers read.

Guarantees (each module's docstring says more):
- Every message is a frozen msgspec ``Struct`` tagged by its class name (the
  ``op`` field) and decoded by one typed decoder per direction, so a typo or a
  foreign message is a decode error, never a half-understood request.
- Every bad request gets an ``ErrorReply``; only a broken frame (garbage, bad
  length) ends the connection, and only that connection.
- Importing it is cheap: no daemon code comes with it (the client imports it).
"""

from dispatchd.protocol.frames import (
    DECODE_ERRORS,
    FRAME_HEADER,
    MAX_FRAME,
    MAX_HELLO_FRAME,
    MAX_REQUEST_FRAME,
    BadMessage,
    DescriptorsLost,
    FrameSocket,
    FrameStalled,
    FrameTooLarge,
    INVALID_UTF8,
    ProtocolError,
    Unencodable,
    decode,
    encode,
    request_id_of,
    too_large,
    undecodable,
)
from dispatchd.protocol.internal import (
    AcquireWriteLock,
    AddChannel,
    AdoptSession,
    Asleep,
    JobRecord,
    KeptJobs,
    MaySleep,
    Sleep,
    StayAwake,
    WakeWorker,
    CallRecord,
    Drain,
    ForgetWriteLock,
    WriteLockGranted,
    FromWorker,
    NetRules,
    NetClosed,
    EndLeftBehind,
    DnsSockets,
    DnsDoor,
    SetCommandEnv,
    NetworkDenied,
    Spawned,
    StartStack,
    SpawnWorker,
    ToolCallsDone,
    ToWorker,
    WatchHeld,
    IpcHeld,
    WorkerFailed,
    WorkerNamespaces,
    WorkerPooled,
    WorkerReady,
    Pause,
    Paused,
    Resume,
    ForkServerReply,
    ForkServerRequest,
    from_worker_decoder,
    to_worker_decoder,
    fork_server_reply_decoder,
    fork_server_request_decoder,
)
from dispatchd.protocol.messages import (
    PROTOCOL_VERSION,
    REPLACED_NETWORK,
    Attach,
    Attached,
    CallTool,
    CheckpointInfo,
    CheckpointReply,
    CheckpointsReply,
    ListCheckpoints,
    RestoreCheckpoint,
    RestoredReply,
    TakeCheckpoint,
    CancelCall,
    ChannelReply,
    ChannelRequest,
    CloseSession,
    ClosedReply,
    DaemonReply,
    DaemonRequest,
    DeniedHost,
    ErrorReply,
    Hello,
    HelloOk,
    ListSessions,
    ListTools,
    OkReply,
    OpenSession,
    ProtectedItem,
    ReleaseWriteLock,
    SessionInfo,
    SessionUsage,
    SessionReply,
    SessionsReply,
    SetNetwork,
    Status,
    StatusReply,
    ToolOutput,
    ToolReply,
    ToolSchema,
    ToolsReply,
    _Msg,
    channel_reply_decoder,
    channel_request_decoder,
    daemon_reply_decoder,
    daemon_request_decoder,
)
from dispatchd.protocol.reports import (
    BeforeRestoreReport,
    DaemonReport,
    GitReport,
    KernelFeatures,
    LandlockReport,
    LifetimeReport,
    LimitsReport,
    MemoryHold,
    NamespacesReport,
    NetworkReport,
    Protections,
    RootEntry,
)

__all__ = [
    # frames
    "FRAME_HEADER", "MAX_FRAME", "MAX_HELLO_FRAME", "MAX_REQUEST_FRAME", "BadMessage", "FrameSocket", "FrameStalled", "FrameTooLarge",
    "DECODE_ERRORS", "DescriptorsLost", "INVALID_UTF8", "ProtocolError", "Unencodable", "decode", "encode", "request_id_of", "too_large", "undecodable",
    # the public protocol: client <-> daemon, client <-> worker
    "PROTOCOL_VERSION", "REPLACED_NETWORK", "Attach", "Attached", "CallTool", "CancelCall", "ChannelReply", "ChannelRequest",
    "CloseSession", "ClosedReply", "ProtectedItem", "DaemonReply", "DaemonRequest", "DeniedHost", "ErrorReply", "Hello", "HelloOk",
    "ListSessions", "ListTools", "OkReply", "OpenSession", "ReleaseWriteLock", "SessionInfo", "SessionReply", "SessionUsage",
    "SessionsReply", "SetNetwork", "Status", "StatusReply", "ToolOutput", "ToolReply", "ToolSchema",
    "ToolsReply", "_Msg", "channel_reply_decoder", "channel_request_decoder", "daemon_reply_decoder",
    "daemon_request_decoder",
    "CheckpointInfo", "CheckpointReply", "CheckpointsReply", "ListCheckpoints", "RestoreCheckpoint", "RestoredReply",
    "TakeCheckpoint",
    # reports
    "BeforeRestoreReport", "DaemonReport", "GitReport", "KernelFeatures", "LandlockReport", "LifetimeReport", "LimitsReport", "MemoryHold",
    "NamespacesReport", "NetworkReport", "Protections", "RootEntry",
    # internal: daemon <-> worker, daemon <-> fork server
    "AcquireWriteLock", "AddChannel", "AdoptSession", "CallRecord", "Drain", "ForgetWriteLock", "FromWorker", "NetRules",
    "NetClosed", "EndLeftBehind",
    "WriteLockGranted",
    "SetCommandEnv", "NetworkDenied", "Spawned", "SpawnWorker", "StartStack", "ToolCallsDone", "ToWorker", "WorkerFailed",
    "WatchHeld",
    "IpcHeld",
    "WorkerNamespaces", "WorkerPooled", "WorkerReady", "DnsSockets", "DnsDoor", "Asleep", "JobRecord", "KeptJobs", "MaySleep", "Sleep",
    "StayAwake", "WakeWorker", "Pause", "Paused", "Resume",
    "ForkServerReply", "ForkServerRequest", "from_worker_decoder", "to_worker_decoder",
    "fork_server_reply_decoder", "fork_server_request_decoder",
]
