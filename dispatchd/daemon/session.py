"""A session as the daemon holds it: what it was opened with, what runs for
it now, and where it is in its life (``lifecycle.State``).

Guarantees:
- a session's state changes only through ``Session.move``, which follows
  ``lifecycle.TRANSITIONS`` (an illegal change raises and changes nothing);
  the manager calls it under ``Session.lock``;
- ``Session.nap`` (the channels its tool server handed over) is set exactly
  while it sleeps: set with ``slept``, cleared when it is woken, replaced, or
  ends (``end_nap``: its descriptors closed once);
- ``Session.watch`` (the inotify instance of its tool server's worktree
  watch, ``WatchHeld``) is held only while the sandbox that made it runs:
  ``drop_watch`` at that sandbox's end hands it to the thread that finishes
  after the reply (``afterwards``), where its teardown waits for the kernel.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from dispatchd import protocol
from dispatchd import domains
from dispatchd.confine import netstack
from dispatchd.confine.netstack import NetworkPorts
from dispatchd.confine.plan import GitLayout, SessionPlan
from dispatchd.daemon import afterwards, gitguard, lifecycle
from dispatchd.daemon.lifecycle import Event, State
from dispatchd.daemon.proxy import SessionProxy
from dispatchd.daemon.spawn import Worker
from dispatchd.daemon.worktree import Worktree
from dispatchd.netmodes import NetworkMode
from dispatchd.policy import Policy
from dispatchd.secretbook import Secrets
from dispatchd.catalogue import schemas_for

READY_TIMEOUT_S = 10.0


class Session:
    """One session. Its fields other than ``state`` are data; where it is in
    its life is ``state`` alone (no flag beside it says so)."""

    def __init__(self, sid: str, worktree: Worktree, policy: Policy, scratch: str) -> None:
        self.id = sid
        self.worktree = worktree.path
        self.worktree_dir = worktree  # the checked descriptor: every worker binds this
        self.read_only: list[str] = []
        self.policy = policy
        self.scratch = scratch
        self.created = time.time()
        self.network: NetworkMode = policy.network.default
        self.ports = NetworkPorts(connect=list(policy.network.connect_ports), bind=list(policy.network.bind_ports))
        self.domains = domains.parse_domains(policy.network.domains)  # checked with the policy
        self.proxy: SessionProxy | None = None  # network "domains": made at the first such start
        self.note = ""
        self.git = GitLayout("none")
        self.redirects_before: list[str] = []
        self.git_before = gitguard.GitSnapshot()  # what git reads for configuration, by content
        # What the checks of its worktree's baseline did (gitguard/baselines.py): since
        # it opened (for status), and at its end (for the close reply).
        self.reports: Callable[[], list[gitguard.Protected]] = list
        self.found_at_end: list[gitguard.Protected] = []
        self.protections: protocol.Protections | None = None  # from the worker, once it is ready
        self.cgroup = ""  # its cgroup, made at the first start, removed at the end
        self.worker: Worker | None = None
        self.net: netstack.NetworkPlan | None = None  # how its network is held now
        self.stack: netstack.Stack | None = None  # its user-mode stack, while one runs
        self.ns_fds: tuple[int, int] | None = None  # its user and network namespaces, sent by its worker
        self.door: tuple[socket.socket, socket.socket] | None = None  # the DNS relay's door it made, until its stack starts
        self._control: protocol.FrameSocket | None = None
        self.added = 0  # AddChannel messages sent to its current tool server (MaySleep.added), under send_lock
        # Its opener's channel, sent to a sandbox made ahead with the session
        # (AdoptSession.channel) and handed to the opener by its attach: the
        # client's end, and the control channel of the tool server holding
        # the other (a channel to a sandbox since replaced is no channel).
        self.first_channel: tuple[protocol.FrameSocket, socket.socket] | None = None
        self.lock = threading.Lock()  # one change of state, and the action it stands for, at a time
        self.send_lock = threading.Lock()  # one message at a time on the control channel
        self.state = State.OPENING
        self.ended = threading.Event()  # set when the current worker's control channel closes
        self.writes = False  # holds its worktree's write lock (kept by the manager's write_locks)
        self.acks: dict[int, threading.Event] = {}  # SetCommandEnv requests waiting for the worker
        self.ack_ids = 0
        # How long it outlives its last connection, and what holds its memory (status shows both).
        self.lifetime: protocol.LifetimeReport | None = None
        self.poolable = False  # its plan is one sandboxes can be made ahead for (pool_key)
        self.plan: SessionPlan | None = None  # its sandbox's, as started: what a wake applies again
        self.kit: list[int] = []  # what waking it needs (worker/wake.py), from its worker; empty: it never sleeps
        self.watch = -1  # its tool server's worktree watch, held too (WatchHeld); -1: none
        self._watch_lock = threading.Lock()
        self.nap: Nap | None = None  # asleep: its channels, held here (no process of it runs)
        self.wakes = 0  # how often it was woken (the policy's max_wakes)
        # Which of its sandboxes serves it (1: the first), and why the last
        # replacement happened (protocol.REPLACED_*): one tuple, read whole
        # without the lock. Changed under the lock by what replaces it
        # (switching.py); a wake is no replacement (its channels carry over).
        self.sandbox: tuple[int, str] = (1, "")
        # What SetCommandEnv changed since its start, over and above the plan's
        # environment: a woken tool server is told again.
        self.env_set: dict[str, str] = {}
        self.env_unset: set[str] = set()
        # The caller's env and secrets (OpenSession), given to every tool server
        # it has (after a switch that replaces it too); kept in memory only.
        self.user_env: dict[str, str] = {}
        self.secret_names: list[str] = []
        # Its secrets, held from its open to its end (``_discard``): what the
        # daemon says of it (refused hosts, labels) and its log lines are
        # redacted by them (dispatchd/secretbook.py).
        self.held = Secrets()
        self.usage: tuple[int, float, float] = (0, 0.0, 0.0)  # calls, CPU seconds, largest peak (MiB)
        # (worker pid, bytes): what that worker's IPC namespace holds in System V
        # memory (IpcHeld, worker/ipcwatch.py), for the memory watchdog.
        self.ipc_held: tuple[int, int] = (0, 0)

    @property
    def control(self) -> protocol.FrameSocket | None:
        """The control channel of its current tool server, if one serves it."""
        return self._control

    @control.setter
    def control(self, control: protocol.FrameSocket | None) -> None:
        # A new tool server (started, woken, switched) has taken no channel yet.
        self._control, self.added = control, 0

    def info(self, sandbox: tuple[int, str] | None = None) -> protocol.SessionInfo:
        """What a client is told of it; ``sandbox``: the one a channel was
        attached to, as seen under the lock (default: the one now)."""
        # Sessions are listed only once their worker is ready: protections are known.
        assert self.protections is not None, f"session {self.id} has no worker yet"
        protections = msgspec.structs.replace(self.protections, lifetime=self.lifetime)
        denied = [protocol.DeniedHost(host=self.held.text(h), port=p, count=c, last=t)
                  for h, p, c, t in self.proxy.denied()] if self.proxy else []
        warning = self.stack.warning() if self.stack is not None else ""
        number, why = sandbox or self.sandbox
        return protocol.SessionInfo(id=self.id, worktree=self.worktree, policy=self.policy.name,
                                    network=self.network, created=self.created, protections=protections,
                                    limits=msgspec.to_builtins(self.policy.limits), note=self.note,
                                    domains=domains.describe(self.domains) if self.network == "domains" else [],
                                    denied=denied, writes=self.writes, asleep=self.nap is not None,
                                    protected=[protocol.ProtectedItem(path=p.path, why=p.why, time=p.time)
                                               for p in self.reports()],
                                    warnings=[warning] if warning else [],
                                    usage=protocol.SessionUsage(*self.usage), sandbox=number, replaced=why)

    def move(self, event: Event) -> None:
        """Its state after ``event`` (``lifecycle.move``: raises ``IllegalTransition``)."""
        self.state = lifecycle.move(self.state, event)

    def end_nap(self, forget: Callable[[str], None]) -> None:
        """No longer asleep (woken, replaced, closed): its channels unwatched
        (``forget``, ``Sleepers.forget``), then closed."""
        if self.nap is not None:
            forget(self.id)
            self.nap.close()
            self.nap = None

    def keep_watch(self, control: protocol.FrameSocket, fd: int) -> None:
        """Hold ``fd``, the watch the tool server behind ``control`` made; one
        from a tool server already let go (``control`` is no longer this
        session's) goes at once, as does one held before (a worker never
        makes two: a second is not kept)."""
        with self._watch_lock:  # against drop_watch, on the thread that ends the sandbox
            if control is self._control and self.watch < 0:
                fd, self.watch = -1, fd
        if fd >= 0:
            afterwards.later(functools.partial(os.close, fd))

    def drop_watch(self) -> None:
        """Its sandbox is gone (or going to sleep, or replaced): the watch is
        closed after the reply, by ``afterwards``."""
        with self._watch_lock:
            fd, self.watch = self.watch, -1
        if fd >= 0:
            afterwards.later(functools.partial(os.close, fd))

    def take_first_channel(self) -> socket.socket | None:
        """Under ``lock``: the opener's channel, if one was sent ahead to the
        tool server that serves it now; one sent to another goes."""
        first, self.first_channel = self.first_channel, None
        if first is None:
            return None
        control, ours = first
        if control is self._control and not self.ended.is_set() and self.nap is None:
            return ours
        ours.close()
        return None

    def drop_first_channel(self) -> None:
        """The opener's channel, never attached (an open that failed after its
        sandbox took the session), goes."""
        first, self.first_channel = self.first_channel, None
        if first is not None:
            first[1].close()

    def drop_kit(self) -> None:
        """The wake kit goes: it wakes this sandbox only."""
        for fd in self.kit:
            os.close(fd)
        self.kit = []

class Nap:
    """A session asleep: the channels its tool server handed over (ours now),
    when it went, and which nap this is (``sleepers``)."""

    naps = 0

    def __init__(self, channels: list[int], jobs: tuple[protocol.KeptJobs, list[int]] | None = None) -> None:
        Nap.naps += 1
        self.number = Nap.naps
        self.channels = channels
        self.jobs = jobs  # its ended background jobs, and their logs by descriptor
        self.since = time.monotonic()

    def close(self) -> None:
        for fd in self.channels + (self.jobs[1] if self.jobs else []):
            os.close(fd)
        self.channels, self.jobs = [], None

@functools.lru_cache(maxsize=32)
def tool_schemas(names: tuple[str, ...]) -> list[protocol.ToolSchema]:
    """What an attach sends of a policy's tools, made once per list of names
    (only ever encoded, never changed)."""
    return [msgspec.convert(s, protocol.ToolSchema) for s in schemas_for(names)]

def has_user_namespace(session: Session) -> bool:
    """Whether the session's worker runs in a user namespace of its own."""
    return session.protections is not None and session.protections.namespaces.user

def has_pid_namespace(session: Session) -> bool:
    """Whether the session's worker is pid 1 of a pid namespace of its own."""
    return session.protections is not None and session.protections.namespaces.pid

def count_session_processes(session: Session) -> int:
    """Processes the session's commands started: what a network switch ends.
    Below the worker the daemon holds are the commands (full mode: it is the
    tool server), or the tool server and then the commands (degraded mode:
    it is the session init)."""
    if session.worker is None:
        return 0
    import psutil

    own = 0 if has_pid_namespace(session) else 1
    try:
        return max(0, len(psutil.Process(session.worker.pid).children(recursive=True)) - own)
    except psutil.Error:
        return 0
