"""The internal protocol: the daemon and the processes it starts.

Not for clients, and free to change with the daemon (both ends are always the
same installed version, and nothing outside the daemon's own processes ever
holds these sockets). Kept apart from the public protocol (``messages.py``)
so that changing one never touches the other by accident.

Guarantees:
- Same framing and tagging as the public protocol, one decoder per direction:
  ``to_worker_decoder`` / ``from_worker_decoder`` on a session's control
  channel, ``fork_server_request_decoder`` / ``fork_server_reply_decoder`` with the
  fork server.
- A session's plan travels as bytes (``SpawnWorker.plan``, encoded and
  decoded by ``dispatchd.confine.plan``): the protocol sits below the
  confinement code and imports none of it, so a client importing
  ``dispatchd.protocol`` never loads it.

Two conversations:
- daemon <-> worker (control channel): ``WorkerReady``/``WorkerFailed`` once
  (a sandbox made ahead: ``WorkerNamespaces`` when it has its own,
  ``WorkerPooled``, then ``AdoptSession`` first),
  then ``AddChannel``, write-lock requests and grants, call records, ``Drain``.
- daemon <-> fork server: ``SpawnWorker`` / ``Spawned``; ``NetRules`` / ``OkReply``;
  ``NetClosed`` / ``OkReply``; ``EndLeftBehind`` / ``OkReply``; ``DnsSockets`` / ``DnsDoor``.
"""

from __future__ import annotations

from typing import Union

import msgspec

from dispatchd.protocol.messages import ErrorReply, OkReply, _Msg
from dispatchd.protocol.reports import Protections

# --- daemon <-> worker: the session's control channel ---------------------------

# Exit codes of the tool server, passed up unchanged by the session init (the
# daemon reads them from the pidfd it holds: ``dispatchd.daemon.exits``).
EXIT_IDLE = 3  # the idle timeout passed with no call
EXIT_DRAINED = 0  # the daemon asked it to finish (stop, close)
EXIT_ASLEEP = 4  # it handed its channels to the daemon and went to sleep (``Sleep``)



class WorkerReady(_Msg, tag="worker_ready", frozen=True):
    pid: int
    protections: Protections
    timings_ms: dict[str, float] = {}  # per confinement step, for the debug log
    # Sent with one fd when true: the proxy's listening socket, made on the
    # loopback of the session's own network namespace (network "domains").
    proxy_listener: bool = False
    # Sent with two fds when true, before the listener: the session's user and
    # network namespaces, for the network stack and the nftables rules. The
    # daemon cannot open /proc/PID/ns of a worker that is not dumpable (it has
    # no CAP_SYS_PTRACE over the init namespace that owns the worker's memory).
    namespaces: bool = False
    # Sent with two fds when true, right after the namespaces: the DNS relay's
    # door (its UDP socket and TCP listener), made by the worker on its own
    # loopback (``SessionPlan.dns_door``).
    dns_door: bool = False
    # Sent with this many fds, after the listener: what waking the session
    # needs (``dispatchd.worker.wake``): its Landlock ruleset, complete, and
    # its user, mount, IPC (and network) namespaces. 0: it never sleeps.
    wake_kit: int = 0


class WorkerPooled(_Msg, tag="worker_pooled", frozen=True):
    """A sandbox made ahead (``SpawnWorker.pooled``) has applied what every
    session of its kind shares and waits for ``AdoptSession``. Sent with no
    fd: one with namespaces of its own sent them first (``WorkerNamespaces``),
    and its ``WorkerReady`` sends none either."""

    pid: int
    timings_ms: dict[str, float] = {}


class WorkerNamespaces(_Msg, tag="worker_namespaces", frozen=True):
    """A sandbox made ahead with namespaces of its own, as soon as they are
    made (before its root): sent with two fds, its user and network
    namespaces, and two more when ``dns_door`` (as ``WorkerReady``'s), so
    that the daemon starts its network stack while it goes on."""

    pid: int
    dns_door: bool = False


class AdoptSession(_Msg, tag="adopt_session", frozen=True):
    """Daemon -> a sandbox made ahead, sent with one fd (the worktree the
    daemon checked, O_PATH): become this session (``plan``, an encoded
    ``SessionPlan`` whose ``pool_key`` must equal the one it was made for).
    With ``channel``, a second fd: the opener's client channel, served from
    the tool server's start as an ``AddChannel``'s (it counts as one).
    Answered by ``WorkerReady`` or ``WorkerFailed``, as a fresh worker."""

    plan: bytes
    channel: bool = False


class WorkerFailed(_Msg, tag="worker_failed", frozen=True):
    """A confinement step could not be applied: the worker has exited."""

    step: str
    errno: int
    path: str
    message: str


class AddChannel(_Msg, tag="add_channel", frozen=True):
    """Sent with one fd: a new client channel for the worker to serve."""

    id: int


class AcquireWriteLock(_Msg, tag="acquire_write_lock", frozen=True):
    """Worker -> daemon, before the session's first mutating tool call: only
    one session at a time may write a worktree. Answered by ``WriteLockGranted``
    (an ``OkReply``) or by ``ErrorReply`` (code ``write_locked``) naming the
    session that holds it."""

    id: int
    # Policy [checkpoints] before_writes: asked before every writing call, and
    # granted only once a checkpoint is taken (daemon/checkpoints/), labelled
    # with the tool; a checkpoint refused is an ``ErrorReply`` and the call fails.
    checkpoint: bool = False
    tool: str = ""


class WriteLockGranted(OkReply, tag="write_lock_granted", frozen=True):
    """Daemon -> worker: ``AcquireWriteLock`` granted. ``swept``: the daemon
    knows the worktree holds no temporary file of a cut write
    (``daemon/writelock.py``), so the worker need not sweep it at this grant."""

    swept: bool = False


class CallRecord(msgspec.Struct, frozen=True, array_like=True):
    """One finished tool call, for the daemon's log line (never arguments,
    output or file contents)."""

    tool: str
    duration_ms: float
    success: bool
    cpu_s: float = 0.0  # metadata["usage"] of the call (0: not measured)
    peak_mib: float = 0.0


class ToolCallsDone(_Msg, tag="tool_calls_done", frozen=True):
    """Worker -> daemon, the calls finished since the last one, sent at most
    every half second: a message per call would wake the daemon between a
    reply and the next request, which measured as half the round trip."""

    calls: list[CallRecord]


class WatchHeld(_Msg, tag="watch_held", frozen=True):
    """Worker -> daemon, with one fd: the inotify instance of the worktree's
    watch (``tools/changes.py``), made at the session's first writing call.
    The daemon holds it until the sandbox that made it is gone, then closes
    it after the reply: the last close of an instance waits for the kernel to
    tear its marks down (grace periods: 2-20 ms measured), which the sandbox's
    exit, and so a close's reply, waited for when the tool server held the
    only reference."""


class IpcHeld(_Msg, tag="ipc_held", frozen=True):
    """Worker -> daemon: the bytes the session's IPC namespace holds in System
    V shared memory and message queues (``worker/ipcwatch.py``), sent when
    it changed; the memory watchdog adds them to the session's sum."""

    bytes: int


class Drain(_Msg, tag="drain", frozen=True):
    """Daemon -> worker when the daemon stops: take no new call, let calls in
    flight finish for up to ``deadline_s``, then end the session."""

    deadline_s: float


class ForgetWriteLock(_Msg, tag="forget_write_lock", frozen=True):
    """Daemon -> worker: the write lock was given back; ask again before the
    next mutating call. Sent under the same lock as the grants, so a grant
    and a release reach the worker in the order the daemon decided them.
    ``id``: answered with ``OkReply(id)`` once forgotten; the release returns
    only then, so a call made after it asks again (0: no answer)."""

    id: int = 0


class SetCommandEnv(_Msg, tag="set_command_env", frozen=True):
    """Daemon -> worker: commands started from now on run with ``set`` added
    to their environment and ``unset`` removed (the proxy variables when a
    session's network changes in place). Commands already running keep theirs."""

    set: dict[str, str] = {}
    unset: list[str] = []
    id: int = 0  # not 0: the worker answers ``OkReply(id)`` once later commands get it
    # Names in ``set`` that are secrets: their values are redacted from every
    # reply from now on (dispatchd/redact.py), for as long as the worker lives.
    secrets: list[str] = []


class NetworkDenied(_Msg, tag="network_denied", frozen=True):
    """Daemon -> worker: the session's proxy refused ``host:port`` (network
    "domains"). Sent before the refusal's answer goes to the process that
    asked, so the call it belongs to learns of it before it can end; the
    worker adds it to the calls in flight (``metadata["network_denied"]``).
    ``allow``: the command that would allow it."""

    host: str
    port: int
    allow: str


class Pause(_Msg, tag="pause", frozen=True):
    """Daemon -> worker, before a checkpoint or a restore (daemon/checkpoints/):
    start no tool call until ``Resume`` (they wait, none is refused), and say
    whether one is in flight. Answered by ``Paused`` with the same ``id``."""

    id: int


class Paused(_Msg, tag="paused", frozen=True):
    """Worker -> daemon: ``busy`` empty: paused, nothing in flight; otherwise
    what is in flight (then it is not paused: no ``Resume`` is needed)."""

    id: int
    busy: str = ""


class Resume(_Msg, tag="resume", frozen=True):
    """Daemon -> worker: the calls that waited since ``Pause`` start."""


class MaySleep(_Msg, tag="may_sleep", frozen=True):
    """Worker -> daemon: idle for the policy's ``sleep_after_s``, with no call,
    job, other process or unread byte; it reads no channel until answered,
    ``Sleep`` or ``StayAwake``. ``added``: the ``AddChannel`` messages it had
    taken when it looked; the daemon lets it sleep only if that is every one
    it sent (one sent after the look carries a request nobody has read)."""

    added: int = 0


class Sleep(_Msg, tag="sleep", frozen=True):
    """Daemon -> worker, the answer to ``MaySleep``: hand the channels over
    (``Asleep``) and exit with ``EXIT_ASLEEP``. The daemon sends nothing after it."""


class StayAwake(_Msg, tag="stay_awake", frozen=True):
    """Daemon -> worker, the other answer to ``MaySleep``: read on; with
    ``for_good``, and never ask again (the session has slept its most)."""

    for_good: bool = False


class Asleep(_Msg, tag="asleep", frozen=True):
    """Worker -> daemon after ``Sleep``: sent with ``count`` fds, client
    channels (at most 253 a message, the kernel's SCM_RIGHTS limit); the
    last has ``last``. Then the worker exits."""

    count: int
    last: bool


class JobRecord(msgspec.Struct, frozen=True, array_like=True):
    """A background job that has ended, as ``job_output``/``job_list`` still
    show it; its log travels as a descriptor beside it."""

    id: str
    command: str
    token: str
    cap: int
    written: int
    truncated: bool
    exit_code: int
    ended_by: str


class KeptJobs(_Msg, tag="kept_jobs", frozen=True):
    """Worker -> daemon after ``Sleep``, before ``Asleep``, and daemon ->
    worker after a wake, before the channels: the session's ended jobs (the
    only ones a session that sleeps has), each with its log's descriptor, and
    the next job's number."""

    jobs: list[JobRecord]
    next: int


# Worker -> daemon: its start, then requests and records while it serves.
FromWorker = Union[WorkerReady, WorkerPooled, WorkerNamespaces, WorkerFailed, AcquireWriteLock, ToolCallsDone, OkReply, MaySleep,
                   Asleep, KeptJobs, Paused, WatchHeld, IpcHeld]
# Daemon -> worker: channels to serve, answers to its requests, commands.
ToWorker = Union[AddChannel, Drain, OkReply, WriteLockGranted, ErrorReply, SetCommandEnv, ForgetWriteLock,
                 AdoptSession, Sleep, StayAwake, KeptJobs, NetworkDenied, Pause, Resume]

from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)

# --- daemon <-> fork server ----------------------------------------------------


class SpawnWorker(_Msg, tag="spawn_worker", frozen=True):
    """Sent with two fds: the worker's end of its control channel, and the
    worktree the daemon checked (O_PATH). ``plan`` is a msgpack-encoded ``SessionPlan``.
    ``pooled``: a sandbox made ahead, sent with the control channel only; it
    applies the plan's ``pool_key`` part and waits for ``AdoptSession``."""

    id: int
    plan: bytes
    pooled: bool = False


class Spawned(_Msg, tag="spawned", frozen=True):
    """Sent with one fd: a pidfd of the new session's first process."""

    id: int
    pid: int


class NetRules(_Msg, tag="net_rules", frozen=True):
    """Sent with two fds, a session's user and network namespaces: commit
    ``rules`` (nftables) in there. Answered by ``OkReply`` or ``ErrorReply``."""

    id: int
    rules: str


class NetClosed(_Msg, tag="net_closed", frozen=True):
    """Sent with two fds, a session's user and network namespaces, once its
    stack was stopped: end every process that stack left behind, then look
    in there (``netstack.links_up_in``). Answered by ``OkReply`` when only
    the loopback is up, else ``ErrorReply`` naming what is."""

    id: int

class EndLeftBehind(_Msg, tag="end_left_behind", frozen=True):
    """Once a closed session's stack has exited: end every process it left
    behind, however deep, as ``NetClosed`` does, without the look (the
    namespace goes with the session). Answered by ``OkReply``."""

    id: int


class StartStack(_Msg, tag="start_stack", frozen=True):
    """Sent with four fds, a session's user and network namespaces, the write
    end of the readiness pipe and the file for its stderr: start the network
    stack ``stack`` (the file ``executable``) attached to them, as a child of
    the fork server that dies with it, confined first by ``confinement`` (an encoded
    ``netstack.StackConfinement``; empty for pasta, which confines itself).
    Answered by ``Spawned`` (with a pidfd) or ``ErrorReply``."""

    id: int
    stack: str = "pasta"
    executable: str = ""  # the file to execute ("": found on PATH)
    confinement: bytes = b""
    cgroup: str = ""  # the session's cgroup, joined first ("": none; the fork server's)
    host_loopback: bool = True  # the gateway maps to the host's loopback (stacks.stack_argv)


class DnsSockets(_Msg, tag="dns_sockets", frozen=True):
    """Sent with two fds, a session's user and network namespaces: make the
    DNS relay's door in there (``netstack.open_dns_sockets_in``). Answered by
    ``DnsDoor`` with two fds (the UDP socket, the TCP listener) or ``ErrorReply``."""

    id: int


class DnsDoor(_Msg, tag="dns_door", frozen=True):
    """Sent with two fds: the UDP socket and TCP listener of ``DnsSockets``."""

    id: int


class WakeWorker(_Msg, tag="wake_worker", frozen=True):
    """Sent with the worker's end of a new control channel, then the session's
    wake kit (``WorkerReady.wake_kit``: ruleset, user, mount, IPC and, when
    it has one, network namespace): make the session's tool server again, in
    those namespaces, confined by that ruleset and the plan. Answered as
    ``SpawnWorker`` (``Spawned`` with a pidfd); the worker reports ``WorkerReady``."""

    id: int
    plan: bytes
    kit: int  # how many fds of the kit follow the control channel


ForkServerRequest = Union[SpawnWorker, NetRules, NetClosed, EndLeftBehind, StartStack, WakeWorker, DnsSockets]
ForkServerReply = Union[Spawned, OkReply, ErrorReply, DnsDoor]

fork_server_request_decoder = msgspec.msgpack.Decoder(ForkServerRequest)  # daemon -> fork server
fork_server_reply_decoder = msgspec.msgpack.Decoder(ForkServerReply)  # fork server -> daemon

