"""The table of sessions, and what every part of the manager shares.

``SessionManager`` (``sessions.py``) is built in layers, each a module with
one job, each using only the layers below it (no import goes back up):

    sessions.SessionManager    its constructor: the daemon's parts wired together
    switching.Switching        set_network: in place, or the sandbox replaced
    opening.Opening            open, a worker's start, sandboxes made ahead
    napping.Napping            a worker's control channel: watch, sleep, wake, attach
    ending.Ending              close, end, close_all: the one way a session ends
    table.SessionTable         this: the table, lookups, the write lock, the environment

Guarantees:
- ``get`` and ``sessions`` give only sessions neither closing nor closed;
- a request refused by the session's state (``lifecycle.decide``) raises a
  ``SessionError`` that says so; one on a session that has ended names why,
  as ``get`` does;
- one writer per worktree: a grant is decided and sent under the session's
  ``send_lock``, so a release (sent under the same lock) never overtakes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec

from dispatchd import protocol
from dispatchd.confine import cgroups
from dispatchd.daemon import claims, exits, gitguard, leftovers, lifetimes, watchdog
from dispatchd.daemon.checkpoints import Store as CheckpointStore
from dispatchd.daemon.dnsrelay import DnsRelay
from dispatchd.daemon.lifecycle import Action, Op, State, Verdict, decide, is_live
from dispatchd.daemon.planahead import PlanInputs
from dispatchd.daemon.pool import Kind, SandboxPool
from dispatchd.daemon.session import READY_TIMEOUT_S, Session
from dispatchd.daemon.sessionnet import SessionNetworks
from dispatchd.daemon.sleepers import Sleepers
from dispatchd.daemon.spawn import ForkServerClient
from dispatchd.daemon.inuse import InUse
from dispatchd.daemon.writelock import WriteLocks
from dispatchd.secretbook import said
from dispatchd.errors import SessionError
from dispatchd.kernel import KernelFeatures
from dispatchd.policy import Policy

log = logging.getLogger("dispatchd.sessions")


class SessionTable:
    """The sessions by id, and the daemon's parts every layer uses (set by
    ``SessionManager.__init__``)."""

    fork_server: ForkServerClient
    networks: SessionNetworks  # nft, pasta, the DNS relay, the proxies' resolver
    dns: DnsRelay | None
    dns_resolv: str  # the relay's resolv.conf, which sessions bind; "": the host's
    host_tree: bool  # plan_session's: the host's root held by descriptor (mounts._hold_host)
    kernel: KernelFeatures
    load_policy: Callable[[str], Policy]
    sessions_dir: str
    protected: list[str]
    private: list[str]
    runtime_dirs: list[str]
    code_paths: list[str]
    base_env: dict[str, str]
    delegation: cgroups.Delegation
    uid: int
    gid: int
    home: str
    accepting: bool  # False once the daemon stops: no open, no sleep
    write_locks: WriteLocks
    in_use: InUse | None  # the worktrees its sessions use, for the user's other daemons (claims.py)
    state_dir: str
    restores_at_start: list[gitguard.Protected]  # and those a dead daemon left, finished at a related open
    baselines: gitguard.Baselines
    checkpoints: CheckpointStore
    holders: lifetimes.Holders
    watchdog: watchdog.MemoryWatchdog
    pool: SandboxPool
    sleepers: Sleepers
    _sessions: dict[str, Session]
    _lock: threading.Lock  # the table, and the count of opens in flight
    _opening: int
    _opens_done: threading.Condition
    _last_inputs: dict[Kind, PlanInputs]  # the last open's plan inputs, per kind (planahead.py)
    _ended: leftovers.EndedSessions  # why recent sessions ended, for their clients
    _scratch_locks: leftovers.ScratchLocks

    # --- lookups -------------------------------------------------------------

    def get(self, sid: str) -> Session:
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or not is_live(session.state):
            raise self._gone(sid)
        return session

    def _gone(self, sid: str) -> SessionError:
        why = self._ended.get(sid)
        return SessionError(f"no such session: {sid!r} (it has ended: {why})" if why else
                            f"no such session: {sid!r}", sid)

    def _admit(self, session: Session, op: Op) -> Verdict:
        """``op``'s verdict in the session's state now; a refusal raised: one
        on a session that has ended as ``get`` says it, one on a session
        closing (seen before its lock is taken) naming what was asked."""
        verdict = decide(session.state, op)
        if verdict.action is Action.REFUSE:
            if session.state is State.CLOSED:
                raise self._gone(session.id)
            raise SessionError(f"session {session.id} cannot {op.value}: {verdict.reason}", session.id)
        return verdict

    def sessions(self) -> list[Session]:
        with self._lock:
            return [s for s in self._sessions.values() if is_live(s.state)]

    def _ended_error(self, session: Session) -> SessionError:
        """The session's worker is gone: wait (briefly) for its watcher to say why."""
        session.ended.wait(exits.REASON_WAIT_S)
        deadline = time.monotonic() + exits.STATUS_WAIT_S + 1.0  # the watcher's wait for the status, and its report
        while is_live(session.state) and time.monotonic() < deadline:
            time.sleep(0.01)
        why = self._ended.get(session.id) or "its worker has gone"
        return SessionError(f"session {session.id} has ended: {why}", session.id)

    def _forget(self, session: Session) -> None:
        self.holders.forget(session.id)
        with self._lock:
            self._sessions.pop(session.id, None)
        # Its processes are gone (stopped before this): the next may write,
        # and another daemon's sessions may use its worktree (claims.py).
        self.write_locks.release(session.id)
        claims.release(self.in_use, self.baselines, session, self.baselines.later)
        session.writes = False

    def send_command_env(self, session: Session, set_env: dict[str, str], unset: list[str]) -> None:
        """Commands the session starts once this returns get ``set_env`` and lose
        ``unset`` (e.g. ``domains.proxy_env()`` when a switch keeps the sandbox)."""
        with session.send_lock:
            for key in unset:
                session.env_set.pop(key, None)
                session.env_unset.add(key)
            for key, value in set_env.items():
                session.env_set[key] = value
                session.env_unset.discard(key)
            if session.nap is not None:
                return  # told when it wakes (_wake), before any call can start a command
            asked = _ask(session, lambda rid: protocol.SetCommandEnv(set=set_env, unset=unset, id=rid,
                                                                      secrets=session.secret_names))
            if asked is None:
                raise SessionError(f"session {session.id} has ended", session.id)
        if not _answered(session, asked):
            raise SessionError(f"session {session.id}: its worker did not confirm the new environment", session.id)

    def _grant_write_lock(self, session: Session, rid: int) -> protocol.OkReply | protocol.ErrorReply:
        """One writer per worktree (a worktree inside another's counts as the
        same), and only once the worktree's baseline is on disk
        (gitguard.baselines). A grant says whether the worktree is known swept
        of temporary files (daemon/writelock.py): the worker then skips its own
        sweep."""
        not_durable = self.baselines.durable(session.id)  # a few ms at most, once, right after an open
        if not_durable is not None:
            return protocol.ErrorReply(id=rid, code="baseline_not_durable", message=said(
                f"the worktree {session.worktree}: {not_durable}; this session may only read it"))
        holder, swept = self.write_locks.grant(session.id, session.worktree)
        if holder is not None:
            with self._lock:
                other = self._sessions.get(holder)
            since = time.strftime("%H:%M:%S", time.localtime(other.created)) if other else "?"
            return protocol.ErrorReply(id=rid, code="write_locked", message=said(
                f"the worktree {session.worktree} is being written by session {holder} (opened {since}); "
                "only one session at a time may write a worktree: close that session, or use this one to read"))
        with self._lock:
            # Out of the table, and not for being still opened (its watch
            # serves its first calls before the open puts it there): its end
            # has taken it out, and released its locks or is about to.
            gone = self._sessions.get(session.id) is not session and session.state is not State.OPENING
        if gone:
            # Granted after that release (a checkpoint's grant runs on a
            # thread of its own): given back here. In either order no lock
            # outlives its session; one its end may still need (its sweep,
            # under it) is never taken from it, as it is still in the table.
            self.write_locks.release(session.id)
            return protocol.ErrorReply(id=rid, code="session_ended", message=said(
                f"the worktree {session.worktree}: session {session.id} has ended"))
        session.writes = True
        self.baselines.writing(session.id)
        log.info("event=write_lock session=%s worktree=%s", session.id, session.worktree)
        return protocol.WriteLockGranted(id=rid, swept=swept)

    def release_write_lock(self, sid: str) -> Session:
        """Give back ``sid``'s write lock (a no-op when it holds none). The
        worker is told first, under the lock its grants are sent under, and
        this returns once it has answered: its next mutating call asks again.
        Cooperative: a call already running, or a process left in the
        background, may still write."""
        session = self.get(sid)
        with session.send_lock:
            # None: the worker is gone (or asleep): nothing holds the lock for it.
            asked = _ask(session, lambda rid: protocol.ForgetWriteLock(id=rid))
            self.write_locks.give_back(sid)  # its processes live on: no sweep vouches for it until its end
            session.writes = False
        # Answered once the worker has forgotten it (outside the lock: the
        # watch that reads the answer may be sending a grant under it): a
        # mutating call made after this returns asks again, and is refused
        # while another session writes.
        if asked is not None and not _answered(session, asked):
            log.warning("event=write_lock_release_unconfirmed session=%s", sid)
        log.info("event=write_lock_released session=%s", sid)
        return session


def _ask(session: Session, make: Callable[[int], msgspec.Struct]) -> tuple[int, threading.Event] | None:
    """Under ``session.send_lock``: send its worker ``make(id)``, a message it
    answers with ``OkReply(id)`` (read by the session's watch); None when
    there is no worker to send it to."""
    if session.control is None:
        return None
    session.ack_ids += 1
    rid = session.ack_ids
    done = session.acks[rid] = threading.Event()
    try:
        session.control.send(make(rid))
    except OSError:
        session.acks.pop(rid, None)
        return None
    return rid, done


def _answered(session: Session, asked: tuple[int, threading.Event]) -> bool:
    """Outside the send lock: whether ``_ask``'s message was answered in time."""
    rid, done = asked
    if done.wait(READY_TIMEOUT_S):
        return True
    session.acks.pop(rid, None)
    return False
