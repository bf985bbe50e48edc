"""The daemon's table of sessions: open, close, switch network, attach.

Guarantees:
- a session is in the table only once its worker has reported that every
  step of its confinement is in force (``WorkerReady``); a step that fails
  refuses the open with the worker's own step, errno and path;
- closing a session, switching its network, or the daemon stopping ends every
  process the session started (see ``dispatchd.worker.session_init``), and the
  session's scratch directory is removed afterwards;
- a session whose worker ends on its own (idle timeout, crash) leaves the table;
- a session that sleeps (``sleep_after_s``, ``dispatchd.worker.wake``) has no
  process: the daemon holds its channels (``sleepers``) and its wake kit,
  and wakes it, confined as at its start, at the first byte a client
  writes; a channel attached meanwhile waits with the others; it still
  ends at its idle timeout, and closes like any other;
- one writer per worktree: the first session to run a mutating tool on a
  worktree holds its write lock until it ends; others get a failure naming it;
- the daemon opens the worktree itself once, by descriptor
  (``open_worktree``: no symlink of the user's followed), checks that
  descriptor, holds it for the session's life and hands it to every worker
  of the session, which binds and grants exactly it;
- extra read-only paths (the policy's and the call's) are resolved and
  checked against the credential deny-list at each open;
- the daemon runs nothing in a worktree (not even ``git``) and opens there
  only git's metadata, as hostile content (``gitfs``: ``O_NOFOLLOW``,
  regular files only, bounded reads): at open ``gitlayout`` walks ``.git``
  by name, each step ``lstat``-checked, and ``gitsnapshot`` walks every git
  directory and what an index names by ``O_PATH | O_NOFOLLOW`` descriptors
  from the worktree; an index is opened by its path;
- the one thing it creates there is an empty ``hooks`` in a git directory
  that has none (``gitlayout``, at open: so that it can be held read-only);
- once a session's processes are gone (close, network switch, end) it
  renames aside, within its own directory, what the session changed there
  that the user's own git would run (``gitredirects``, ``gitsnapshot``),
  making a directory the session made read-only writable for its owner
  first, or refuses the worktree until restart if it cannot;
- the daemon removes in a worktree only the temporary files of writes a
  session's end cut short (``tempfiles.py``: our exact names, regular
  files, by descriptor, no symlink followed), once the session that held the
  write lock has no process left and before the lock passes on.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable

import msgspec

from dispatchd import envnames, protocol, threads, treewalk
from dispatchd.confine import cgroups, domains, netstack
from dispatchd.confine.netstack import NetworkPorts
from dispatchd.confine.plan import GitLayout, SessionPaths, SessionPlan, plan_session, pool_key
from dispatchd.daemon import (
    baselines, exits, gitidentity, gitlayout, gitredirects, gitsnapshot, leftovers, lifetimes, watchdog)
from dispatchd.daemon.sleepers import Sleepers
from dispatchd.daemon import afterwards  # what a close leaves for after its reply
from dispatchd.daemon.beside import Beside  # the baseline taken while the sandbox starts
from dispatchd.daemon.planahead import PlanInputs, make_plan, plan_ahead, plan_for
from dispatchd.daemon.pool import Kind, Made, SandboxPool
from dispatchd.daemon.dnsrelay import DnsRelay, session_resolv_binds
from dispatchd.daemon.proxy import Resolver, SessionProxy, system_resolver
from dispatchd.daemon.spawn import ForkServerClient, SpawnError, Worker, adopt
from dispatchd.daemon.worktree import Worktree, check_read_only_path, credential_dirs, open_worktree
from dispatchd.daemon.writelock import WriteLocks
from dispatchd.errors import ConfinementError, DispatchdError, SessionError, Stopping, WorktreeError
from dispatchd.inside import is_below, is_within, overlap
from dispatchd.kernel import KernelFeatures
from dispatchd.netmodes import NETWORK_MODES, NetworkMode
from dispatchd.policy import Policy, max_channels, too_many_channels
from dispatchd.tempfiles import sweep_temp_files
from dispatchd.tools.spec import schemas_for

log = logging.getLogger("dispatchd.sessions")
READY_TIMEOUT_S = 10.0
# The most channels a tool server going to sleep may hand over (it serves
# 256 at most): a worker that sends more is ended, not believed.
MAX_HANDED_OVER = 1024
MAX_KEPT_JOBS = 64  # the ended jobs a tool server keeps (tools/jobs.py MAX_KEPT)
STOP_TIMEOUT_S = 2.0


class Session:
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
        self.git_before = gitsnapshot.GitSnapshot()  # what git reads for configuration, by content
        # What the checks of its worktree's baseline did (baselines.py): since
        # it opened (for status), and at its end (for the close reply).
        self.reports: Callable[[], list[baselines.Protected]] = list
        self.found_at_end: list[baselines.Protected] = []
        self.protections: protocol.Protections | None = None  # from the worker, once it is ready
        self.cgroup = ""  # its cgroup, made at the first start, removed at the end
        self.worker: Worker | None = None
        self.net: netstack.NetworkPlan | None = None  # how its network is held now
        self.stack: netstack.Stack | None = None  # its user-mode stack, while one runs
        self.ns_fds: tuple[int, int] | None = None  # its user and network namespaces, sent by its worker
        self.control: protocol.FrameSocket | None = None
        self.lock = threading.Lock()  # one attach or switch at a time
        self.send_lock = threading.Lock()  # one message at a time on the control channel
        self.generation = 0
        self.closed = False
        self.ended = threading.Event()  # set when the current worker's control channel closes
        self.writes = False  # holds its worktree's write lock (kept by the manager's write_locks)
        self.acks: dict[int, threading.Event] = {}  # SetCommandEnv requests waiting for the worker
        self.ack_ids = 0
        # How long it outlives its last connection, and what holds its memory (status shows both).
        self.lifetime: protocol.LifetimeReport | None = None
        self.poolable = False  # its plan is one sandboxes can be made ahead for (pool_key)
        self.plan: SessionPlan | None = None  # its sandbox's, as started: what a wake applies again
        self.kit: list[int] = []  # what waking it needs (worker/wake.py), from its worker; empty: it never sleeps
        self.asleep: _Nap | None = None  # asleep: its channels, held here (no process of it runs)
        self.wakes = 0  # how often it was woken (the policy's max_wakes)
        # What SetCommandEnv changed since its start, over and above the plan's
        # environment: a woken tool server is told again.
        self.env_set: dict[str, str] = {}
        self.env_unset: set[str] = set()
        # The caller's env and secrets (OpenSession), given to every tool server
        # it has (after a switch that replaces it too); kept in memory only.
        self.user_env: dict[str, str] = {}
        self.secret_names: list[str] = []
        self.usage: tuple[int, float, float] = (0, 0.0, 0.0)  # calls, CPU seconds, largest peak (MiB)

    def info(self) -> protocol.SessionInfo:
        # Sessions are listed only once their worker is ready: protections are known.
        assert self.protections is not None, f"session {self.id} has no worker yet"
        protections = msgspec.structs.replace(self.protections, lifetime=self.lifetime)
        denied = [protocol.DeniedHost(host=h, port=p, count=c, last=t) for h, p, c, t in self.proxy.denied()
                  ] if self.proxy else []
        warning = self.stack.warning() if self.stack is not None else ""
        return protocol.SessionInfo(id=self.id, worktree=self.worktree, policy=self.policy.name,
                                    network=self.network, created=self.created, protections=protections,
                                    limits=msgspec.to_builtins(self.policy.limits), note=self.note,
                                    domains=domains.describe(self.domains) if self.network == "domains" else [],
                                    denied=denied, writes=self.writes, asleep=self.asleep is not None,
                                    protected=[protocol.ProtectedItem(path=p.path, why=p.why, time=p.time)
                                               for p in self.reports()],
                                    warnings=[warning] if warning else [],
                                    usage=protocol.SessionUsage(*self.usage))


class _Nap:
    """A session asleep: the channels its tool server handed over (ours now),
    when it went, and which nap this is (``sleepers``)."""

    naps = 0

    def __init__(self, channels: list[int], jobs: tuple[protocol.KeptJobs, list[int]] | None = None) -> None:
        _Nap.naps += 1
        self.number = _Nap.naps
        self.channels = channels
        self.jobs = jobs  # its ended background jobs, and their logs by descriptor
        self.since = time.monotonic()

    def close(self) -> None:
        for fd in self.channels + (self.jobs[1] if self.jobs else []):
            os.close(fd)
        self.channels, self.jobs = [], None


@functools.lru_cache(maxsize=32)
def _tool_schemas(names: tuple[str, ...]) -> list[protocol.ToolSchema]:
    """What an attach sends of a policy's tools, made once per list of names
    (only ever encoded, never changed)."""
    return [msgspec.convert(s, protocol.ToolSchema) for s in schemas_for(names)]


def _has_user_namespace(session: Session) -> bool:
    """Whether the session's worker runs in a user namespace of its own."""
    return session.protections is not None and session.protections.namespaces.user


def _has_pid_namespace(session: Session) -> bool:
    """Whether the session's worker is pid 1 of a pid namespace of its own."""
    return session.protections is not None and session.protections.namespaces.pid


def _check_network(network: NetworkMode, ports: list[int] | None, bind_ports: list[int] | None,
                   domain_list: list[str] | None = None) -> tuple[domains.Rule, ...] | None:
    """Refuse a bad request before anything changes; the parsed domains, if given."""
    if network not in NETWORK_MODES:
        raise DispatchdError(f"network must be one of {', '.join(NETWORK_MODES)}, not {network!r}")
    for port in (ports or []) + (bind_ports or []):
        if not 1 <= port <= 65535:
            raise DispatchdError(f"{port} is not a TCP port (1-65535)")
    if network != "ports" and (ports or bind_ports):
        raise DispatchdError(f"ports are only for network 'ports', not {network!r}")
    if domain_list is None:
        return None
    if network != "domains":
        raise DispatchdError(f"domains are only for network 'domains', not {network!r}")
    try:
        return domains.parse_domains(domain_list)
    except domains.BadHost as exc:
        raise DispatchdError(f"domains: {exc}") from None


def _ports_for(session: Session, ports: list[int] | None, bind_ports: list[int] | None) -> NetworkPorts:
    return _ports_of(session.policy, ports, bind_ports)


def _ports_of(policy: Policy, ports: list[int] | None = None, bind_ports: list[int] | None = None) -> NetworkPorts:
    """The call's ports, or else the policy's: sorted, each once (what the
    rules and a sandbox made ahead name: the same list, the same pool_key)."""
    net = policy.network
    return NetworkPorts(connect=sorted(set(net.connect_ports if ports is None else ports)),
                        bind=sorted(set(net.bind_ports if bind_ports is None else bind_ports)))


def _domains_for(session: Session, rules: tuple[domains.Rule, ...] | None) -> tuple[domains.Rule, ...]:
    """The caller's list, or else the policy's (as ports do)."""
    return domains.parse_domains(session.policy.network.domains) if rules is None else rules


def _count_session_processes(session: Session) -> int:
    """Processes the session's commands started: what a network switch ends.
    Below the worker the daemon holds are the commands (full mode: it is the
    tool server), or the tool server and then the commands (degraded mode:
    it is the session init)."""
    if session.worker is None:
        return 0
    import psutil

    own = 0 if _has_pid_namespace(session) else 1
    try:
        return max(0, len(psutil.Process(session.worker.pid).children(recursive=True)) - own)
    except psutil.Error:
        return 0


class SessionManager:
    def __init__(
        self,
        *,
        fork_server: ForkServerClient,
        kernel: KernelFeatures,
        load_policy: Callable[[str], Policy],
        state_dir: str,
        protected: list[str],
        private: list[str],
        runtime_dirs: list[str],
        code_paths: list[str],
        base_env: dict[str, str],
        delegation: cgroups.Delegation = cgroups.Delegation(note="not looked for"),
        resolver: Resolver | None = None,
        pool_size: int = 0,
        host_tree: bool = False,
        dns: DnsRelay | None = None,
    ) -> None:
        self.fork_server = fork_server
        self.dns = dns  # network on/ports: the DNS relay, and the resolv.conf sessions read (daemon/dnsrelay.py)
        self.dns_resolv = ""  # the relay's resolv.conf, which sessions bind; "": the host's
        if dns is not None and not kernel.network_stack_missing:
            try:
                self.dns_resolv = dns.session_file(state_dir)
            except OSError as exc:  # sessions read the host's: names resolve as before the relay, or not
                log.warning("event=dns_resolv_conf_failed error=%s", exc)
        self.host_tree = host_tree  # plan_session's: the host's root held by descriptor (mounts._hold_host)
        self._last_inputs: dict[Kind, PlanInputs] = {}  # the last open's plan inputs, per kind (planahead.py)
        self.kernel = kernel
        self.load_policy = load_policy
        self.sessions_dir = os.path.join(state_dir, "sessions")
        self.protected = protected
        self.private = private
        self.runtime_dirs = runtime_dirs
        self.code_paths = code_paths
        self.base_env = base_env
        self.delegation = delegation
        self.resolver = resolver or system_resolver()  # for the proxies of "domains" sessions
        self.uid, self.gid = os.getuid(), os.getgid()
        self.home = os.path.expanduser("~")
        self._sessions: dict[str, Session] = {}
        self.write_locks = WriteLocks()  # one writer per worktree
        # One trusted baseline per worktree, on disk (baselines.py); the
        # checks a daemon that died left are finished before anything opens.
        self.baselines = baselines.Baselines(state_dir, self.home)
        self.baselines.sync_dir = afterwards.fsync_dir  # a record's removal made durable after the reply
        for found in self.baselines.recover():
            log.warning("event=recovered path=%s why=%r", found.path, found.why)
        self._lock = threading.Lock()
        self.accepting = True
        # Opens in flight: close_all waits for them (a session they register
        # while the daemon stops is ended by close_all or by its own open).
        self._opening = 0
        self._opens_done = threading.Condition(self._lock)
        # Sessions whose every connection has gone end after their grace (lifetimes.py).
        self.holders = lifetimes.Holders(self._end_orphan)
        self._ended = leftovers.EndedSessions()  # why recent sessions ended, for their clients
        self._scratch_locks = leftovers.ScratchLocks(self.sessions_dir)
        self.watchdog = watchdog.MemoryWatchdog(self._watched, self._end_over_memory)
        # Sandboxes made ahead, per kind of session (pool.py); started by start_pool.
        self.pool = SandboxPool(size=pool_size, make=self._make_ahead, let_go=self._let_go)
        # Sessions asleep: their channels watched by one thread (sleepers.py).
        self.sleepers = Sleepers(self._wake, self._channel_gone, self._expire_asleep)

    # --- lookups -------------------------------------------------------------

    def get(self, sid: str) -> Session:
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or session.closed:
            why = self._ended.get(sid)
            raise SessionError(f"no such session: {sid!r} (it has ended: {why})" if why else
                               f"no such session: {sid!r}", sid)
        return session

    def sessions(self) -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.closed]

    # --- open / close ----------------------------------------------------------

    def open(self, worktree: str, policy_name: str, network: NetworkMode | None,
             ports: list[int] | None = None, bind_ports: list[int] | None = None, *,
             detached: bool = False, orphan_grace_s: float | None = None, holder: int | None = None,
             domain_list: list[str] | None = None, read_only: list[str] | None = None,
             env: dict[str, str] | None = None, secrets: dict[str, str] | None = None) -> Session:
        try:
            user_env = envnames.check_env(env)
            hidden = envnames.check_secrets(secrets, user_env)
        except envnames.EnvError as exc:
            raise DispatchdError(str(exc)) from None
        with self._lock:
            if not self.accepting:
                raise Stopping("the daemon is stopping and opens no new sessions")
            self._opening += 1
        try:
            return self._open(worktree, policy_name, network, ports, bind_ports, detached=detached,
                              orphan_grace_s=orphan_grace_s, holder=holder, domain_list=domain_list,
                              read_only=read_only, user_env={**user_env, **hidden}, secret_names=sorted(hidden))
        finally:
            with self._lock:
                self._opening -= 1
                self._opens_done.notify_all()

    def _open(self, worktree: str, policy_name: str, network: NetworkMode | None, ports: list[int] | None,
              bind_ports: list[int] | None, *, detached: bool, orphan_grace_s: float | None, holder: int | None,
              domain_list: list[str] | None, read_only: list[str] | None,
              user_env: dict[str, str], secret_names: list[str]) -> Session:
        t0 = time.perf_counter()
        policy = self.load_policy(policy_name)  # re-read: a broken edit refuses the open
        network = network or policy.network.default
        rules = _check_network(network, ports, bind_ports, domain_list)
        extra = self._read_only_paths(policy, read_only or [])
        t1 = time.perf_counter()
        held = open_worktree(worktree, uid=self.uid, home=self.home, protected=self.protected, private=self.private)
        # Milliseconds per step of the open, for the debug log (bench/openprofile.py reads them).
        steps = {"policy": (t1 - t0) * 1e3, "worktree": (time.perf_counter() - t1) * 1e3}
        try:
            return self._open_held(held, policy, network, ports, bind_ports, extra, rules, detached=detached,
                                   orphan_grace_s=orphan_grace_s, holder=holder, steps=steps,
                                   user_env=user_env, secret_names=secret_names)
        except BaseException:
            held.close()
            raise


    def _read_only_paths(self, policy: Policy, asked: list[str]) -> list[str]:
        """The policy's and the call's extra read-only paths, resolved; one that
        is or holds credentials, the home directory or our own files refuses the open."""
        found: list[str] = []
        for where, paths in (("filesystem.extra_read_only", policy.filesystem.extra_read_only),
                             ("read_only", asked)):
            for path in paths:
                resolved = check_read_only_path(os.path.expanduser(path), home=self.home,
                                                protected=self.protected + self.private, where=where)
                if resolved not in found:
                    found.append(resolved)
        return found

    def _open_held(self, held: Worktree, policy: Policy, network: NetworkMode, ports: list[int] | None,
                   bind_ports: list[int] | None, extra: list[str], rules: tuple[domains.Rule, ...] | None, *,
                   detached: bool, orphan_grace_s: float | None,
                   holder: int | None, steps: dict[str, float],
                   user_env: dict[str, str] | None = None, secret_names: list[str] | None = None) -> Session:
        resolved = held.path
        tainted = self.baselines.tainted.get(resolved)
        if tainted:
            raise WorktreeError(f"{resolved}: a session left files here that dispatchd could not move aside "
                                f"({tainted}); look at them (your own tools would run them), then restart "
                                "dispatchd", resolved)
        session = Session("", held, policy, "")  # its id once its sandbox is chosen, below
        session.read_only = extra
        session.user_env, session.secret_names = user_env or {}, secret_names or []
        session.ports = _ports_for(session, ports, bind_ports)
        session.domains = _domains_for(session, rules)
        t = time.perf_counter()
        try:
            self._inspect_git(session)
        except BaseException as exc:
            if isinstance(exc, WorktreeError) or not isinstance(exc, Exception):
                raise
            # Hostile content we did not foresee: refuse, loudly.
            raise WorktreeError(f"{resolved}: its git metadata cannot be inspected "
                                f"({type(exc).__name__}: {exc}); no session opened", resolved) from exc
        steps["git"] = (time.perf_counter() - t) * 1e3
        # A sandbox made ahead for this kind of session, if one is ready: the
        # session takes the id it was made for (its cgroup's name). Taken only
        # now: an open refused above costs none, and the host's mounts are
        # looked at (pool.take) as close to the adoption as can be.
        made = self.pool.take((policy.name, network))
        session.id = made.sid if made is not None else secrets.token_hex(6)
        session.scratch = scratch = os.path.join(self.sessions_dir, session.id)
        sid = session.id
        t = time.perf_counter()
        if made is None:  # one made ahead comes with its scratch directory
            self._make_scratch(sid, scratch)
        try:
            steps["scratch"] = (time.perf_counter() - t) * 1e3
            t = time.perf_counter()
            # The worktree's trusted baseline, on disk before the session's
            # first call can reach its sandbox (taken now if no session of its
            # domain runs), taken while the sandbox is given its session (beside.py).
            joining = Beside(functools.partial(
                self.baselines.join, sid, resolved, session.git, session.git_before, session.redirects_before,
                tuple(policy.protect.paths)))
            try:
                self._start_worker(session, network, made)
            except BaseException:
                joining.wait()  # whatever it recorded, before _discard undoes it
                raise
            steps["worker"] = (time.perf_counter() - t) * 1e3
            self._joined(session, joining)
            steps["baseline"], steps["both"] = joining.ms, (time.perf_counter() - t) * 1e3
            session.reports = functools.partial(self.baselines.reports_for, sid)
        except BaseException:
            self._discard(session)  # closes the worktree's descriptor too (and open()'s close is then a no-op)
            raise
        finally:
            if session.poolable:
                self.pool.want((policy.name, network))  # refilled now that this open is done
        grace = lifetimes.effective_grace(policy.limits.orphan_grace_s, orphan_grace_s)
        cgroup_memory = bool(session.cgroup) and "memory" in self.delegation.controllers
        session.lifetime = protocol.LifetimeReport(
            detached=detached, orphan_grace_s=grace,
            memory=watchdog.mechanism(cgroup_memory, policy.limits.session_memory_bytes))
        with self._lock:
            self._sessions[sid] = session
        if not self.accepting:
            # The daemon began to stop while this open ran: close_all may have
            # looked at the table already; end it here (once: _finish is idempotent).
            self._finish(session, "dispatchd stopped")
            raise Stopping("the daemon is stopping and opens no new sessions")
        self.holders.track(sid, detached=detached, grace_s=grace, holder=holder)
        if not cgroup_memory:
            self.watchdog.ensure_running()
        log.info("event=session_open session=%s policy=%s network=%s mode=%s made_ahead=%d worktree=%s",
                 sid, policy.name, network, session.protections.mode if session.protections else None,
                 bool(session.protections and session.protections.made_ahead), resolved)
        log.debug("event=open_steps session=%s steps_ms=%s", sid, ",".join(f"{k}:{v:.3f}" for k, v in steps.items()))
        return session

    def _joined(self, session: Session, joining: Beside) -> None:
        """The baseline taken beside the sandbox's start: refused, its sandbox
        stops (it ran no call) and the open fails with why."""
        try:
            joining.result()
        except BaseException:
            with session.lock:
                session.generation += 1  # its watcher ends quietly
            self._stop_worker(session)
            raise

    def _make_scratch(self, sid: str, scratch: str) -> None:
        self._scratch_locks.take(sid)  # before the directory: a later start knows it is ours
        try:
            os.makedirs(scratch + "/tmp", mode=0o700)
            os.makedirs(scratch + "/home", mode=0o700)
        except BaseException:
            leftovers.remove_tree(scratch)
            self._scratch_locks.release(sid)
            raise

    def _inspect_git(self, session: Session) -> None:
        resolved = session.worktree
        session.git = gitlayout.inspect_git(resolved, uid=self.uid)
        if session.git.kind == "linked" and not self._points_back(session.git, resolved):
            # The worktree's path was swapped for a symlink to another
            # repository's linked worktree while git was inspected (the
            # descriptor the daemon holds is the checked directory, the
            # inspection went by name): its common directory is not granted.
            session.git = GitLayout("refused", read_only=[p for p in session.git.read_only
                                                                  if is_below(p, resolved)],
                                            note=f"the linked worktree's git directory does not point back at "
                                                 f"{resolved}/.git; not granted")
        for granted in session.git.readable + session.git.writable:
            home_inside = is_within(self.home, granted)
            mine = self.protected + credential_dirs(self.home)
            if home_inside or any(overlap(granted, p) for p in mine):
                # A common directory that holds the daemon's files, the user's
                # credentials, or the whole home directory, is no repository a session needs.
                session.git = GitLayout("refused", read_only=[p for p in session.git.read_only
                                                                      if is_below(p, resolved)],
                                                note=f"{granted} holds the daemon's files, credentials or the "
                                                     "whole home directory; not granted")
                break
        session.git_before = gitsnapshot.take(resolved, session.git, self.home)
        if not session.git_before.complete:
            raise WorktreeError(f"{resolved}: more git directories than dispatchd checks "
                                f"({gitsnapshot.MAX_GITDIRS}); no session opened", resolved)
        # Git directories only the recursive walk finds (submodules of
        # submodules kept in place) are held read-only too.
        session.git = gitlayout.with_gitdirs(session.git, resolved,
                                           gitsnapshot.gitdir_paths(resolved, session.git_before))
        session.redirects_before = gitredirects.redirects_present(session.git, resolved)

    @staticmethod
    def _points_back(git: GitLayout, worktree: str) -> bool:
        """Whether the linked worktree's git directory names, literally, the
        ``.git`` of the path the daemon walked and checked."""
        try:
            fd = os.open(os.path.join(git.gitdirs[0], "gitdir"), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, IndexError):
            return False
        try:
            back = os.read(fd, 4096).decode("utf-8", "replace").strip()
        except OSError:
            return False
        finally:
            os.close(fd)
        return os.path.normpath(back) == worktree + "/.git"

    def _plan_inputs(self, session: Session, network: NetworkMode) -> PlanInputs:
        paths = SessionPaths(worktree=session.worktree, scratch=session.scratch,
                             runtime_dirs=self.runtime_dirs, code=self.code_paths, git=session.git,
                             read_only=session.read_only, resolv=session_resolv_binds(self.dns_resolv))
        # Read at each worker start (open, network switch): a few µs, no git run.
        identity = gitidentity.identity_env(gitidentity.read_identity(self.home, self.base_env))
        return PlanInputs(session=session.id, policy=session.policy, network=network, paths=paths,
                          ports=session.ports, git_identity=identity, kernel=self.kernel, uid=self.uid,
                          gid=self.gid, base_env=self.base_env, delegation=self.delegation,
                          host_tree=self.host_tree)

    def _plan(self, session: Session, network: NetworkMode) -> SessionPlan:
        return make_plan(self._plan_inputs(session, network))

    def _plan_and_key(self, session: Session, network: NetworkMode,
                      made: Made | None) -> tuple[SessionPlan, bytes | None]:
        """The session's plan and its pool key at a worker's start: the one made
        ahead with ``made`` when made of equal inputs (planahead.py), else made now."""
        inputs = self._plan_inputs(session, network)
        # What the pool's next sandbox of this kind plans for (the next open is most often alike).
        self._last_inputs[(session.policy.name, network)] = inputs
        return plan_for(inputs, made.planned if made is not None else None)

    def _start_worker(self, session: Session, network: NetworkMode, made: Made | None = None) -> None:
        """The session's sandbox, confined and ready: ``made`` (one made ahead,
        taken from the pool) when its plan is the one it was made for, or a
        new one."""
        started = time.perf_counter()
        try:
            plan, key = self._plan_and_key(session, network, made)
        except BaseException:
            if made is not None:
                made.scratch = ""  # the session's: it goes with the session
                self._let_go(made)
            raise
        session.poolable = key is not None
        ready = self._adopt(session, plan, key, made) if made is not None else None
        if made is not None and ready is not None:
            worker, control, msg = made.worker, made.control, ready
            ns_fds, stack, net = made.ns_fds, made.stack, made.net
        else:
            if plan.cgroup is not None and not session.cgroup:
                cgroups.create(plan.cgroup)  # limits in force before the first process joins
                session.cgroup = plan.cgroup.path
            worker, control, msg = self.fork_server.start_worker(plan, session.worktree_dir.fd, session.worktree,
                                                                 READY_TIMEOUT_S)
            stack, net = None, None
            try:
                ns_fds = self._take_namespaces(plan, msg, control)
            except BaseException:
                worker.kill()
                control.close()
                raise
        kit: list[int] = []
        try:
            self._start_proxy(session, plan, msg, control)
            kit = self._take_kit(msg, control)
        except BaseException:  # whatever failed, the worker and what it sent go
            for fd in [*(ns_fds or ()), *kit]:
                os.close(fd)
            if stack is not None:
                stack.stop()
            worker.kill()
            control.close()
            raise
        log.debug("event=worker_ready session=%s pid=%s made_ahead=%d steps_ms=%s", session.id, worker.pid,
                  ready is not None, ",".join(f"{k}:{v}" for k, v in msg.timings_ms.items()))
        session.worker = worker
        session.ns_fds, session.stack, session.net = ns_fds, stack, net
        try:
            self._apply_network(session, plan.net)  # nothing left to do for one made ahead
            self._check_dns(session)
        except BaseException:
            self._stop_network(session)
            session.worker = None
            worker.kill()
            control.close()
            raise
        session.control = control
        session.network = network
        session.protections = msg.protections
        session.plan, session.kit = plan, kit
        session.env_set, session.env_unset = {}, set()
        session.generation += 1
        session.ended = threading.Event()
        log.debug("event=worker_started session=%s total_ms=%.2f planned_ahead=%d", session.id,
                  (time.perf_counter() - started) * 1e3, made is not None and made.planned is not None
                  and plan is made.planned.plan)
        # Not waited for (threads.py): nothing of the open needs it running
        # yet; what the worker sends meanwhile waits in the channel.
        threads.Thread(target=self._watch, args=(session, session.generation, control, session.ended),
                       daemon=True, name=f"watch-{session.id}").start()
        if session.user_env:  # before any call can reach this tool server: attach comes after
            self.send_command_env(session, session.user_env, [])

    # --- sandboxes made ahead (pool.py) ----------------------------------------

    def start_pool(self) -> None:
        """Start making sandboxes ahead, first for the default policy's default
        network (when it loads: a broken policy only fails its own opens)."""
        try:
            policy = self.load_policy("default")
            first: Kind | None = ("default", policy.network.default)
        except Exception:
            first = None
        self.pool.start(first)

    def _make_ahead(self, kind: Kind) -> Made | None:
        """One sandbox of ``kind`` made ahead (on the pool's thread): its shared
        part applied, its cgroup made, its network set up. None when sessions
        of that kind are never made ahead (no ``pool_key``)."""
        if not self.accepting:
            raise Stopping("the daemon is stopping")
        policy_name, network = kind
        policy = self.load_policy(policy_name)
        sid = secrets.token_hex(6)
        # A plan of the kind: its shared part (pool_key) depends on the policy,
        # the network and this machine only; the session's own parts are
        # placeholders, replaced by the session's plan at adoption.
        paths = SessionPaths(worktree=os.path.join(self.sessions_dir, sid, "worktree"),
                             scratch=os.path.join(self.sessions_dir, sid), runtime_dirs=self.runtime_dirs,
                             code=self.code_paths, resolv=session_resolv_binds(self.dns_resolv))
        ports = _ports_of(policy)  # as a session's: sorted, each once
        plan = plan_session(policy, self.kernel, session=sid, paths=paths, network=network, uid=self.uid,
                            gid=self.gid, base_env=self.base_env, ports=ports, delegation=self.delegation,
                            host_tree=self.host_tree)
        key = pool_key(plan)
        if key is None:
            return None
        self._make_scratch(sid, paths.scratch)  # the session's, made ahead with it
        cgroup = ""
        try:
            if plan.cgroup is not None:
                cgroups.create(plan.cgroup)
                cgroup = plan.cgroup.path
            worker, control, msg = self.fork_server.make_ahead(plan, READY_TIMEOUT_S)
        except BaseException:
            self._remove_cgroup_path(cgroup, sid)
            leftovers.remove_tree(paths.scratch)
            self._scratch_locks.release(sid)
            raise
        made = Made(kind=kind, sid=sid, key=key, worker=worker, control=control, cgroup=cgroup,
                    scratch=paths.scratch)
        try:
            made.ns_fds = self._take_namespaces(plan, msg, control)
            self._apply_network(made, plan.net)
        except BaseException:
            self._let_go(made)
            raise
        last = self._last_inputs.get(kind)
        if last is not None:
            try:
                made.planned = plan_ahead(last, session=sid, scratch=paths.scratch, policy=policy)
                # Not yet in the pool: nothing else writes to its channel now.
                control.send(protocol.ExpectSession(plan=made.planned.encoded))
            except Exception as exc:  # noqa: BLE001 - then planned at open, where the same error refuses that open
                log.debug("event=plan_ahead_failed session=%s error=%s", sid, exc)
        log.debug("event=pool_made kind=%s/%s session=%s pid=%s steps_ms=%s", policy_name, network, sid, worker.pid,
                  ",".join(f"{k}:{v}" for k, v in msg.timings_ms.items()))
        return made

    def _adopt(self, session: Session, plan: SessionPlan, key: bytes | None,
               made: Made) -> protocol.WorkerReady | None:
        """Give ``made`` its session (its report), or let it go and return None (the caller
        makes a sandbox at open instead): a plan it was not made for (the
        policy was edited since), or a failure on the way (logged; a fresh
        sandbox repeats every check and fails for itself if it must)."""
        made.scratch = ""  # the session's from here: it goes with the session (_discard)
        if key != made.key:
            log.info("event=pool_mismatch session=%s", session.id)
            self._let_go(made)
            return None
        try:
            ready = adopt(made.worker, made.control, plan, session.worktree_dir.fd, session.worktree,
                          READY_TIMEOUT_S, made.planned.encoded if made.planned and plan is made.planned.plan else None)
        except DispatchdError as exc:
            log.warning("event=pool_adopt_failed session=%s error=%s", session.id, exc)
            self._let_go(made)
            return None
        session.cgroup = made.cgroup
        self.pool.served_one()
        return ready

    def _let_go(self, made: Made) -> None:
        """A sandbox made ahead that serves no session: killed, and what the
        daemon holds for it freed (its stack, namespaces, cgroup)."""
        made.worker.kill()
        made.control.close()
        if made.stack is not None:
            made.stack.stop()
            made.stack = None
        for fd in made.ns_fds or ():
            os.close(fd)
        made.ns_fds = None
        self._remove_cgroup_path(made.cgroup, made.sid)
        made.cgroup = ""
        if made.scratch:  # never given to a session
            leftovers.remove_tree(made.scratch)
            self._scratch_locks.release(made.sid)
            made.scratch = ""

    # --- the session's network (confine/netstack.py) ------------------------------

    @staticmethod
    def _take_namespaces(plan: SessionPlan, msg: protocol.WorkerReady | protocol.WorkerPooled,
                         control: protocol.FrameSocket) -> tuple[int, int] | None:
        """The session's user and network namespaces, as the worker sent them
        with ``WorkerReady`` (first of its fds), when it has its own."""
        if not (plan.namespaces.user and plan.namespaces.net):
            return None
        if not msg.namespaces:
            raise ConfinementError("network: namespaces", detail="the worker handed over no namespace descriptors")
        try:
            userns = control.take_fd()
            try:
                return userns, control.take_fd()
            except protocol.ProtocolError:
                os.close(userns)
                raise
        except protocol.ProtocolError as exc:
            raise ConfinementError("network: namespaces", detail=str(exc)) from exc

    @staticmethod
    def _take_kit(msg: protocol.WorkerReady, control: protocol.FrameSocket) -> list[int]:
        """The wake kit the worker sent with ``WorkerReady`` (last of its fds)."""
        kit: list[int] = []
        try:
            for _ in range(msg.wake_kit):
                kit.append(control.take_fd())
        except protocol.ProtocolError as exc:
            for fd in kit:
                os.close(fd)
            raise ConfinementError("sleep: wake kit", detail=str(exc)) from exc
        return kit

    def _namespaces(self, session: Session | Made) -> tuple[int, int]:
        if session.ns_fds is None:
            raise ConfinementError("network: namespaces", detail="the session has no network namespace of its own")
        return session.ns_fds

    def _apply_network(self, session: Session | Made, new: netstack.NetworkPlan | None) -> None:
        """Bring the session's namespace to ``new``, keeping its processes: the
        stack ended first when the new mode has none (killed and reaped before
        this returns), the rules committed before a stack starts."""
        old, session.net = session.net, new
        if new is None or not new.namespace:
            return
        if not new.stack and session.stack is not None:
            session.stack.stop()
            session.stack = None
        if new.rules != (old.rules if old is not None else ""):
            try:
                # No rules of the new mode's own: the old mode's table goes.
                self.fork_server.net_rules(new.rules or netstack.reset_rules(), *self._namespaces(session))
            except SpawnError as exc:
                raise ConfinementError("network: nftables", detail=str(exc)) from exc
        if new.stack and session.stack is None:
            # The DNS relay's door is made while pasta starts (daemon/dnsrelay.py).
            door = self.dns.door_ahead(session.id, self._namespaces(session), self.fork_server.dns_sockets) \
                if self.dns else None
            try:
                session.stack = netstack.start_stack(*self._namespaces(session), launch=self.fork_server.start_stack)
            except BaseException:
                if door is not None:
                    door.discard()
                raise
            log.debug("event=stack_started session=%s pid=%s", session.id, session.stack.pid)
            if door is not None:
                door.open_with(session.stack)

    def _check_dns(self, session: Session) -> None:
        """An open or a switch with the relay: ask the host's resolvers now, so
        that the reply's ``warnings`` say whether names will resolve."""
        if self.dns is not None and session.stack is not None and session.stack.with_it:
            self.dns.check(session.id)

    def _stop_network(self, session: Session, reap: Callable[[int, float], None] | None = None) -> None:
        """``reap``: a session's end, whose processes are killed next (netstack.Stack.stop)."""
        if session.stack is not None:
            session.stack.stop(reap)
            session.stack = None
        if session.ns_fds is not None:
            for fd in session.ns_fds:
                os.close(fd)
            session.ns_fds = None
        session.net = None

    def _switch_in_place(self, session: Session, network: NetworkMode) -> str | None:
        """Switch without replacing the sandbox when the old and the new mode
        are both held in the session's own namespace; the reply's note, or None
        when the sandbox must be replaced (see ``netstack.switch_in_place``)."""
        old = session.net
        plan = self._plan(session, network)
        if old is None or plan.net is None or not netstack.switch_in_place(old, plan.net) \
                or (session.worker is None and session.asleep is None):
            return None
        self._apply_network(session, plan.net)
        self._check_dns(session)
        if session.proxy is not None:
            session.proxy.configure(network, session.domains)  # refuses all outside "domains"
        absent = session.protections.absent_paths if session.protections else None
        made_ahead = bool(session.protections and session.protections.made_ahead)
        session.protections = msgspec.structs.replace(plan.protections, absent_paths=absent or [], made_ahead=made_ahead)
        session.network = network
        kept = _count_session_processes(session)
        if network == "off":
            cut = (f"its way out ({netstack.STACK}) was stopped: every connection outside the session is cut; "
                   "servers inside still serve the session's own clients")
        elif network == "ports":
            cut = ("nftables in its namespace now lets out only TCP, MPTCP and UDP to ports "
                   f"{', '.join(map(str, session.ports.connect)) or 'none'}: connections to any other are cut")
        else:
            cut = f"out through {netstack.STACK}, any port"
        return f"network {network}: switched in place, {kept} process(es) of the session kept; {cut}"

    def _start_proxy(self, session: Session, plan: SessionPlan, msg: protocol.WorkerReady,
                     control: protocol.FrameSocket) -> None:
        """Serve the listener a "domains" worker made in its namespace; in any
        other mode the session's proxy (if it had one) refuses everything."""
        if plan.proxy_port and not msg.proxy_listener:
            raise ConfinementError("network: proxy listener", detail="the worker handed over no listener")
        if msg.proxy_listener:
            try:
                listener = socket.socket(fileno=control.take_fd())
            except protocol.ProtocolError as exc:
                raise ConfinementError("network: proxy listener", detail=str(exc)) from exc
            if session.proxy is None:
                session.proxy = SessionProxy(session.id, self.resolver)
                session.proxy.on_deny = functools.partial(self._tell_denied, session)
            session.proxy.configure(plan.network, session.domains)
            session.proxy.serve(listener)
        elif session.proxy is not None:
            session.proxy.configure(plan.network, session.domains)

    @staticmethod
    def _tell_denied(session: Session, host: str, port: int, allow: str) -> None:
        """The proxy refused ``host:port``: tell the tool server, whose calls in
        flight carry it (an asleep one has none)."""
        with session.send_lock:
            if session.control is not None and session.asleep is None:
                try:
                    session.control.send(protocol.NetworkDenied(host=host, port=port, allow=allow))
                except OSError:
                    pass  # the sandbox is going: no call to tell

    def send_command_env(self, session: Session, set_env: dict[str, str], unset: list[str]) -> None:
        """Commands the session starts once this returns get ``set_env`` and lose
        ``unset`` (e.g. ``domains.proxy_env()`` when a switch keeps the sandbox)."""
        done = threading.Event()
        with session.send_lock:
            for key in unset:
                session.env_set.pop(key, None)
                session.env_unset.add(key)
            for key, value in set_env.items():
                session.env_set[key] = value
                session.env_unset.discard(key)
            if session.asleep is not None:
                return  # told when it wakes (_wake), before any call can start a command
            if session.control is None:
                raise SessionError(f"session {session.id} has ended", session.id)
            session.ack_ids += 1
            rid = session.ack_ids
            session.acks[rid] = done
            try:
                session.control.send(protocol.SetCommandEnv(set=set_env, unset=unset, id=rid,
                                                            secrets=session.secret_names))
            except OSError as exc:
                session.acks.pop(rid, None)
                raise SessionError(f"session {session.id} has ended", session.id) from exc
        if not done.wait(READY_TIMEOUT_S):
            session.acks.pop(rid, None)
            raise SessionError(f"session {session.id}: its worker did not confirm the new environment", session.id)

    def _watch(self, session: Session, generation: int, control: protocol.FrameSocket, ended: threading.Event) -> None:
        """The only reader of a worker's control channel: its EOF means the tool
        server is gone, on purpose (close, switch) or on its own (idle, crash)."""
        try:
            while (msg := control.recv(protocol.from_worker_decoder)) is not None:
                # None of the messages read here carries a descriptor (those
                # that do are read before, WorkerReady, or in _sleep): a
                # worker that sends some anyway does not pile them up here.
                control.drop_fds()
                if isinstance(msg, protocol.ToolCallsDone):
                    calls, cpu, peak = session.usage
                    for call in msg.calls:  # debug only: a line per call grew the log without bound
                        log.debug("event=tool_call session=%s tool=%s duration_ms=%.1f outcome=%s",
                                 session.id, call.tool, call.duration_ms, "ok" if call.success else "failed")
                        calls, cpu, peak = calls + 1, cpu + call.cpu_s, max(peak, call.peak_mib)
                    session.usage = (calls, round(cpu, 4), peak)  # one assignment: info() reads it whole
                elif isinstance(msg, protocol.OkReply):
                    waiting = session.acks.pop(msg.id, None)
                    if waiting is not None:
                        waiting.set()
                elif isinstance(msg, protocol.AcquireWriteLock):
                    # Decided and sent under send_lock: a release in between
                    # would otherwise reach the worker before this grant.
                    with session.send_lock:
                        control.send(self._grant_write_lock(session, msg.id))
                elif isinstance(msg, protocol.MaySleep):
                    if self._sleep(session, generation, control):
                        return  # asleep, or ended: this watch is over
        except (OSError, protocol.ProtocolError):
            pass
        ended.set()
        control.close()
        with session.lock:
            if session.generation != generation or session.closed:
                return  # replaced by a network switch, or closed on purpose
            # Our own descriptor: a close meanwhile closes the worker's.
            pidfd = os.dup(session.worker.pidfd) if session.worker is not None and session.worker.pidfd >= 0 else -1
        try:
            status = exits.exit_status(pidfd) if pidfd >= 0 else None
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        word, sentence = exits.describe_exit(status, idle_timeout_s=session.policy.limits.idle_timeout_s,
                                             tool_server_is_init=_has_pid_namespace(session))
        died = self.fork_server.death(0.1 if status is None or os.WIFSIGNALED(status) else 0.0)
        if died:  # its parent's end took the worker: that is the cause (daemon/helpers.py)
            word, sentence = "fork_server_died", f"{died}; dispatchd exits so that a new one is started: " \
                                                 "open the session again"
        elif not self.accepting and word == "worker_exited code=0":
            word, sentence = "daemon_stopping", "dispatchd stopped (calls in flight were let finish first)"
        log.info("event=session_ended session=%s reason=%s", session.id, word)
        self._finish(session, sentence)

    def _stop_worker(self, session: Session) -> None:
        self._end_nap(session)  # asleep: its channels closed (its clients see the end), nothing to stop
        # The kit wakes this sandbox only: a replacement brings its own, and
        # a kit kept would hold this sandbox's namespaces (its mounts, its /tmp).
        # Closed here, not after the reply: the mount namespace's teardown,
        # moved after it, ran into the next open and slowed it by about what
        # the close gained (docs/performance.md).
        self._drop_kit(session)
        worker, control = session.worker, session.control
        # The way out goes first: from here no byte of the session leaves.
        self._stop_network(session, reap=afterwards.reap)
        session.worker = session.control = None
        if session.proxy is not None:
            session.proxy.stop()  # nothing relayed for the old sandbox from here on
        if worker is None:
            return
        # Pid 1 of the session's namespace has no SIGTERM handler, and the
        # kernel keeps from an init every signal it does not handle but SIGKILL
        # (which ends everything in its namespace). Without a pid namespace the
        # session init's SIGTERM handler kills its Landlock domain.
        # The tool server holds the other end of the control channel: its EOF
        # (session.ended) means the session's processes are gone (pid 1 of
        # their namespace has exited, or the session init has killed its
        # Landlock domain).
        sig = signal.SIGKILL if _has_pid_namespace(session) else signal.SIGTERM
        if not worker.stop(sig, session.ended, STOP_TIMEOUT_S):
            log.warning("event=worker_stop_timeout session=%s seconds=%g", session.id, STOP_TIMEOUT_S)
        if session.cgroup and not cgroups.kill(session.cgroup):
            log.error("event=cgroup_not_empty session=%s cgroup=%s", session.id, session.cgroup)
        if control is not None:
            try:
                control.sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher if it still waits
            except OSError:
                pass  # the watcher has closed it already

    def _finish(self, session: Session, why: str = "it was closed") -> None:
        with session.lock:
            if session.closed:
                return
            self._ended.record(session.id, why)
            session.closed = True
            session.generation += 1
            try:
                self._wind_down(session)
            finally:
                # Whatever the checks found, the session is over.
                self._discard(session)

    def _wind_down(self, session: Session) -> None:
        """The one way a sandbox of the session ends (its close, its end, a
        network switch that replaces it, one that failed half way): its
        processes gone, then what they left in git moved aside and the
        temporary files of cut writes removed, before anyone else may write."""
        self._stop_worker(session)
        self._check_git(session)
        self._sweep_temp_files(session)

    def _discard(self, session: Session) -> None:
        """The one way a session's remains go, whether it ended or never
        finished opening: its cgroup, its table entry and write lock, its
        scratch directory (and the lock that marks it ours), its worktree
        descriptor. Its processes are gone before this (``_stop_worker``)."""
        self.baselines.leave(session.id)  # an open that failed half way (a no-op after _check_git)
        self._remove_cgroup(session)
        self._forget(session)
        self._remove_scratch(session)
        self._end_nap(session)
        self._drop_kit(session)
        session.worktree_dir.close()

    @staticmethod
    def _drop_kit(session: Session) -> None:
        for fd in session.kit:
            os.close(fd)
        session.kit = []

    def _sweep_temp_files(self, session: Session) -> None:
        """The writer's processes are gone, and it still holds the write lock
        (nobody else writes meanwhile): a write its end cut short leaves no
        temporary file behind."""
        if not self.write_locks.holds(session.id):
            return
        started = time.perf_counter()
        budget = treewalk.Budget()
        removed = sweep_temp_files(session.worktree, budget=budget)  # the daemon writes none: none in flight
        if budget.skipped:
            log.warning("event=temp_files_sweep_cut session=%s left=%r", session.id, budget.describe())
        if removed:
            log.info("event=temp_files_removed session=%s count=%d ms=%.1f", session.id, len(removed),
                     (time.perf_counter() - started) * 1e3)

    def end(self, sid: str, word: str, why: str) -> None:
        """End a session for a reason of the daemon's own (orphaned, over its
        memory): logged with ``reason=word``; its client is told ``why``. Ends
        it on a thread of its own: stopping a worker may take seconds, and the
        caller (the watchdog, the orphan timer) serves every other session."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or session.closed or self._ended.get(sid):
            return  # gone, or being ended already
        log.warning("event=session_ended session=%s reason=%s", sid, word)
        self._ended.record(sid, why)  # before the end: a client asking meanwhile hears why
        threading.Thread(target=self._finish, args=(session, why), daemon=True, name=f"end-{sid}").start()

    def _end_orphan(self, sid: str) -> None:
        with self._lock:
            session = self._sessions.get(sid)
        grace = session.lifetime.orphan_grace_s if session and session.lifetime else 0
        self.end(sid, "orphaned", f"every connection that held it had gone for {grace} s (its client exited or "
                                  "was killed; open it detached to keep it)")

    def _watched(self) -> list[tuple[str, int, int]]:
        """Sessions whose memory only the watchdog bounds: (id, session init pid, limit)."""
        out = []
        for s in self.sessions():
            worker = s.worker
            if worker is not None and s.lifetime is not None and s.lifetime.memory.mechanism == "watchdog":
                out.append((s.id, worker.pid, s.policy.limits.session_memory_bytes))
        return out

    def _end_over_memory(self, sid: str, used: int, limit: int) -> None:
        self.end(sid, "memory", f"its processes used {used / 2**20:.0f} MiB of memory, over its limit of "
                                f"{limit / 2**20:.0f} MiB (limits.session_memory_bytes); the daemon's memory "
                                "watchdog ended it")

    def _remove_scratch(self, session: Session) -> None:
        leftovers.remove_tree(session.scratch)
        self._scratch_locks.release(session.id)

    def _check_git(self, session: Session) -> None:
        """Once the session's processes are gone: check its worktree's domain
        against the trusted baseline (baselines.py) and move aside what
        differs; at its end, leave the domain (the last one out restores the
        repository's history). What cannot be moved or checked refuses the
        worktree until a restart's check passes."""
        found = self.baselines.leave(session.id) if session.closed else self.baselines.check(session.id)
        session.found_at_end += found

    def _remove_cgroup(self, session: Session) -> None:
        self._remove_cgroup_path(session.cgroup, session.id)
        session.cgroup = ""

    @staticmethod
    def _remove_cgroup_path(path: str, sid: str) -> None:
        if not path:
            return
        try:
            cgroups.remove(path)
        except OSError as exc:
            log.error("event=cgroup_not_removed session=%s cgroup=%s error=%r", sid, path, exc.strerror)

    def _forget(self, session: Session) -> None:
        self.holders.forget(session.id)
        with self._lock:
            self._sessions.pop(session.id, None)
        # Its processes are gone (stopped before this): the next may write.
        self.write_locks.release(session.id)
        session.writes = False

    def _grant_write_lock(self, session: Session, rid: int) -> protocol.OkReply | protocol.ErrorReply:
        """One writer per worktree (a worktree inside another's counts as the same)."""
        holder = self.write_locks.acquire(session.id, session.worktree)
        if holder is not None:
            with self._lock:
                other = self._sessions.get(holder)
            since = time.strftime("%H:%M:%S", time.localtime(other.created)) if other else "?"
            return protocol.ErrorReply(id=rid, code="write_locked", message=(
                f"the worktree {session.worktree} is being written by session {holder} (opened {since}); "
                "only one session at a time may write a worktree: close that session, or use this one to read"))
        session.writes = True
        log.info("event=write_lock session=%s worktree=%s", session.id, session.worktree)
        return protocol.OkReply(id=rid)

    def release_write_lock(self, sid: str) -> Session:
        """Give back ``sid``'s write lock (a no-op when it holds none). The
        worker is told first, under the lock its grants are sent under, so it
        asks again before its next mutating call. Cooperative: a call already
        running, or a process left in the background, may still write."""
        session = self.get(sid)
        with session.send_lock:
            if session.control is not None:
                try:
                    session.control.send(protocol.ForgetWriteLock())
                except OSError:
                    pass  # the worker is gone: nothing holds the lock for it
            self.write_locks.release(sid)
            session.writes = False
        log.info("event=write_lock_released session=%s", sid)
        return session

    def close(self, sid: str) -> list[baselines.Protected]:
        """Close ``sid``; returns what the checks at its end moved aside or put back."""
        session = self.get(sid)
        self._finish(session)
        log.info("event=session_close session=%s", sid)
        return session.found_at_end

    def close_all(self, drain_s: float = 0.0) -> None:
        """End every session; with ``drain_s``, first let calls in flight finish
        for up to that long (new calls are refused meanwhile)."""
        self.pool.stop()  # before the sessions: nothing made ahead outlives the daemon's stop
        with self._lock:
            # Opens in flight finish first (new ones are refused): what they
            # register is in the table below, or ended by the open itself.
            self._opens_done.wait_for(lambda: self._opening == 0, timeout=drain_s + READY_TIMEOUT_S + 5)
            # Sessions being closed by another thread too: _finish waits for
            # that close (their lock), so none is abandoned half way (its git
            # check, its scratch directory) when the daemon exits.
            closing = [s for s in self._sessions.values() if s.closed]
        sessions = self.sessions()
        if drain_s > 0:
            for session in sessions:
                try:
                    with session.send_lock:
                        if session.control is not None:
                            session.control.send(protocol.Drain(deadline_s=drain_s))
                except OSError:
                    pass
            deadline = time.monotonic() + drain_s + 1.0
            for session in sessions:
                session.ended.wait(max(0.0, deadline - time.monotonic()))
        for session in sessions + closing:
            self._finish(session, "dispatchd stopped")
        afterwards.drain()  # the stacks' exits and the namespaces' ends, before the daemon's

    # --- network, attach -----------------------------------------------------

    def set_network(self, sid: str, network: NetworkMode, ports: list[int] | None = None,
                    bind_ports: list[int] | None = None, domain_list: list[str] | None = None) -> Session:
        """Between off, on and ports in the session's own namespace: in place,
        its processes kept (``_switch_in_place``). Otherwise by replacing the
        sandbox: every process of the session is ended, so nothing started under
        the old setting keeps its connections. From "domains" to "domains" (a
        new list) the sandbox stays: the proxy closes the connections the new
        list does not allow before this returns."""
        rules = _check_network(network, ports, bind_ports, domain_list)
        session = self.get(sid)
        with session.lock:
            if session.closed:
                raise SessionError(f"no such session: {sid!r}", sid)
            if network == "domains" and session.network == "domains" and session.proxy is not None:
                session.domains = _domains_for(session, rules)
                cut = session.proxy.configure("domains", session.domains)
                session.note = (f"network domains: the list was changed in place (no process ended); {cut} "
                                "connection(s) to hosts no longer listed were closed")
                log.info("event=session_network session=%s network=domains in_place=1 cut=%s", sid, cut)
                return session
            old_ports, old_domains = session.ports, session.domains
            session.ports = _ports_for(session, ports, bind_ports)
            session.domains = _domains_for(session, rules)
            try:
                self._plan(session, network)  # what cannot be enforced is refused before anything ends
            except ConfinementError:
                session.ports, session.domains = old_ports, old_domains
                raise
            try:
                note = self._switch_in_place(session, network)
            except BaseException:
                # Half switched (a stack that did not start, rules nft refused):
                # end the session rather than leave it in a state nobody asked for.
                session.closed = True
                session.generation += 1
                self._ended.record(session.id, f"its network could not be switched to {network}")
                try:
                    self._wind_down(session)  # what it planted in git is moved aside, as at every end
                finally:
                    self._discard(session)
                raise
            if note is not None:
                session.note = note
                log.info("event=session_network session=%s network=%s in_place=1", sid, network)
                return session
            ended = _count_session_processes(session)
            session.generation += 1
            self._wind_down(session)
            try:
                self._start_worker(session, network)
                session.note = (f"network {network}: the sandbox was replaced ({self._why_replaced(session)}); "
                                f"{ended} process(es) the session had started were ended")
            except BaseException as exc:
                # The new setting cannot be enforced (or starting failed):
                # stay closed rather than leave the session running under a
                # setting nobody asked for.
                if isinstance(exc, ConfinementError):
                    session.ports, session.domains = old_ports, old_domains
                session.closed = True
                self._ended.record(session.id, f"its network could not be switched to {network}")
                self._discard(session)
                raise
        log.info("event=session_network session=%s network=%s ended=%s", sid, network, ended)
        return session

    def _why_replaced(self, session: Session) -> str:
        if not _has_user_namespace(session):
            return "no user namespaces: the network is held by seccomp and Landlock, fixed at the start"
        # In full mode every network is held in the session's own namespace:
        # only "domains" is set up at the worker's start.
        return "to or from 'domains': its proxy's listener and variables are set up when the sandbox starts"

    def _ended_error(self, session: Session) -> SessionError:
        """The session's worker is gone: wait (briefly) for its watcher to say why."""
        session.ended.wait(exits.REASON_WAIT_S)
        deadline = time.monotonic() + exits.REASON_WAIT_S
        while not session.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        why = self._ended.get(session.id) or "its worker has gone"
        return SessionError(f"session {session.id} has ended: {why}", session.id)

    def attach(self, sid: str, holder: int | None = None) -> tuple[Session, socket.socket, list[protocol.ToolSchema]]:
        """A new stream socket to the session's tool server (the client's end)."""
        session = self.get(sid)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with session.lock:
            sent = False
            if session.asleep is not None and not session.closed:
                limit = max_channels(session.policy.limits.max_processes, session.policy.limits.max_open_files)
                if len(session.asleep.channels) >= limit:
                    # Refused as its tool server would: the client reads why on the channel.
                    try:
                        protocol.FrameSocket(theirs).send(protocol.ErrorReply(
                            id=0, code="too_many_channels", message=too_many_channels(limit)))
                    except OSError:
                        pass
                    theirs.close()
                    if holder is not None:
                        self.holders.hold(sid, holder)  # as an attach the tool server refuses
                    return session, ours, _tool_schemas(tuple(session.policy.tools))
                # Held with the others: its first request wakes the session.
                fd = theirs.detach()
                session.asleep.channels.append(fd)
                self.sleepers.add_channel(session.id, fd)
                if holder is not None:
                    self.holders.hold(sid, holder)
                return session, ours, _tool_schemas(tuple(session.policy.tools))
            if session.control is not None and not session.ended.is_set():
                try:
                    with session.send_lock:
                        session.control.send(protocol.AddChannel(id=0), fds=[theirs.fileno()])
                    sent = True
                except OSError:
                    pass  # the worker is gone: say why below
            theirs.close()
            if sent:
                if holder is not None:
                    self.holders.hold(sid, holder)
                return session, ours, _tool_schemas(tuple(session.policy.tools))
            ours.close()
        # Outside the session's lock: its watcher takes it to finish the session.
        raise self._ended_error(session)

    # --- sessions that sleep (worker/wake.py, sleepers.py) ------------------------

    def _sleep(self, session: Session, generation: int, control: protocol.FrameSocket) -> bool:
        """The worker asks to sleep (``MaySleep``): let it (``Sleep``), take
        its channels and see it gone; True when the session is asleep, or was
        ended because that failed (this watch is then over). Refused
        (``StayAwake``) when the session is closing, replaced, or the daemon
        stops, or when the session's lock is busy (a close waits under it
        for this very watch to see the worker end: asked again later)."""
        failed = ""
        if not session.lock.acquire(blocking=False):
            try:
                with session.send_lock:
                    control.send(protocol.StayAwake())
            except OSError:
                pass
            return False
        try:
            with session.send_lock:
                if session.closed or session.generation != generation or not self.accepting \
                        or not session.kit or session.worker is None or session.plan is None \
                        or session.wakes >= session.policy.limits.max_wakes:
                    # Each wake adds a rule to its kept ruleset (its fresh
                    # /proc's root), which the kernel cannot take back: past
                    # max_wakes (~130 KiB at the default 1,000; 8 hours of
                    # naps at 30 s) it stays awake, its kernel share bounded.
                    for_good = session.wakes >= session.policy.limits.max_wakes
                    if for_good:
                        log.info("event=sleep_no_more session=%s wakes=%d", session.id, session.wakes)
                    try:
                        control.send(protocol.StayAwake(for_good=for_good))
                    except OSError:
                        pass
                    return False
                control.send(protocol.Sleep())
                session.control = None  # nothing more is sent to it: it hands over and exits
            worker, session.worker = session.worker, None
            channels: list[int] = []
            jobs: tuple[protocol.KeptJobs, list[int]] | None = None
            started = time.monotonic()
            try:
                control.sock.settimeout(READY_TIMEOUT_S)
                while True:
                    msg = control.recv(protocol.from_worker_decoder)
                    if msg is None:
                        raise protocol.ProtocolError("its tool server ended before it handed over its channels")
                    if isinstance(msg, protocol.OkReply):  # a SetCommandEnv sent before Sleep, applied
                        waiting = session.acks.pop(msg.id, None)
                        if waiting is not None:
                            waiting.set()
                    elif isinstance(msg, protocol.KeptJobs) and jobs is None and len(msg.jobs) <= MAX_KEPT_JOBS:
                        jobs = (msg, [control.take_fd() for _ in msg.jobs])
                    elif isinstance(msg, protocol.Asleep):
                        channels += [control.take_fd() for _ in range(msg.count)]
                        if msg.last:
                            break
                        if len(channels) > MAX_HANDED_OVER:
                            raise protocol.ProtocolError(f"it handed over more than {MAX_HANDED_OVER} channels")
            except (OSError, protocol.ProtocolError) as exc:
                failed = str(exc) or type(exc).__name__
                for fd in channels + (jobs[1] if jobs else []):
                    os.close(fd)
            worker.kill()  # gone by itself, or now: its pid namespace with it
            control.close()
            session.ended.set()
            session.generation += 1  # this watch's generation is over
            if not failed:
                session.asleep = nap = _Nap(channels, jobs)
                deadline = started + session.policy.limits.idle_timeout_s - session.policy.limits.sleep_after_s
                self.sleepers.add(session.id, nap.number, channels, deadline)
                log.info("event=session_asleep session=%s channels=%d", session.id, len(channels))
        finally:
            session.lock.release()
        if failed:
            log.warning("event=sleep_failed session=%s error=%s", session.id, failed)
            self._finish(session, f"its tool server failed going to sleep ({failed})")
        return True

    def _wake(self, sid: str, nap: int) -> None:
        """A sleeping session's first request came: its tool server again,
        confined as at its start (``ForkServerClient.wake_worker``), given the
        environment changes and every channel held. On failure the session
        ends, saying why: it never runs less confined."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            return
        failed = ""
        with session.lock:
            asleep = session.asleep
            if asleep is None or asleep.number != nap or session.closed or session.plan is None:
                return
            self.sleepers.forget(sid)
            started = time.perf_counter()
            try:
                worker, control, msg = self.fork_server.wake_worker(session.plan, session.kit, READY_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 (any: left asleep, nobody would watch or wake it)
                failed = str(exc) or type(exc).__name__
            else:
                session.asleep = None
                session.wakes += 1
                session.worker, session.control = worker, control
                session.generation += 1
                session.ended = threading.Event()
                try:
                    with session.send_lock:
                        if session.env_set or session.env_unset:
                            control.send(protocol.SetCommandEnv(set=session.env_set, unset=sorted(session.env_unset),
                                                                secrets=session.secret_names))
                        if asleep.jobs is not None:
                            control.send(asleep.jobs[0], fds=asleep.jobs[1])
                        for fd in asleep.channels:
                            control.send(protocol.AddChannel(id=0), fds=[fd])
                except OSError as exc:
                    failed = f"its woken tool server went away ({exc})"
                held = len(asleep.channels)
                asleep.close()
                log.debug("event=worker_ready session=%s pid=%s woken=1 steps_ms=%s", sid, worker.pid,
                          ",".join(f"{k}:{v}" for k, v in msg.timings_ms.items()))
                log.info("event=session_woken session=%s ms=%.1f channels=%d", sid,
                         (time.perf_counter() - started) * 1e3, held)
                try:
                    threads.Thread(target=self._watch, args=(session, session.generation, control, session.ended),
                                   daemon=True, name=f"watch-{sid}").start()
                except RuntimeError as exc:  # can't start new thread: unwatched, its MaySleep would hang it
                    failed = failed or f"no thread to watch it ({exc})"
        if failed:
            log.warning("event=wake_failed session=%s error=%s", sid, failed)
            self._finish(session, f"it could not be woken ({failed})")

    def _channel_gone(self, sid: str, nap: int, fd: int) -> None:
        """A client closed its channel to a sleeping session: let it go, unwoken."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            return
        with session.lock:
            if session.asleep is not None and session.asleep.number == nap and fd in session.asleep.channels:
                session.asleep.channels.remove(fd)
                os.close(fd)

    def _expire_asleep(self, sid: str, nap: int) -> None:
        """Its idle timeout passed while it slept: it ends as an idle one does."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or session.asleep is None or session.asleep.number != nap:
            return
        self.end(sid, "idle", f"it ended idle (no call for {session.policy.limits.idle_timeout_s:g} s, "
                              "the policy's idle_timeout_s)")

    def _end_nap(self, session: Session) -> None:
        """No longer asleep (closed, replaced): its channels closed, unwatched."""
        if session.asleep is not None:
            self.sleepers.forget(session.id)
            session.asleep.close()
            session.asleep = None
