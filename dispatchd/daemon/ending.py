"""How a session ends: closed by its client, ended by the daemon (orphaned,
over its memory, idle asleep, its network stack or fork server gone), or
by the daemon's stop.

Guarantees:
- every end goes through ``_finish`` (or, for a network switch that failed
  half way, the same steps under the switch's lock): the state moves to
  ``closing`` under the session's lock, its processes are ended, what they
  left in git is moved aside and the temporary files of cut writes removed,
  then its remains go and it is ``closed``; a second end finds it closing or
  closed and does nothing (``lifecycle.decide``);
- ``_wind_down`` is the one way a sandbox of the session ends (its end, a
  network switch that replaces it): its processes gone before git is
  checked, and before the write lock passes on;
- ``_discard`` is the one way a session's remains go (cgroup, table entry,
  write lock, scratch directory, channels held asleep, wake kit, worktree
  descriptor), whether it ended or never finished opening; the scratch
  directory goes after the reply (``afterwards``), nothing else of it.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

from dispatchd import protocol, treewalk
from dispatchd.confine import cgroups
from dispatchd.daemon import afterwards, gitguard, leftovers
from dispatchd.daemon.lifecycle import Action, Event, Op, State, decide, ending_event, is_live
from dispatchd.daemon.session import READY_TIMEOUT_S, Session, has_pid_namespace
from dispatchd.daemon.sessionnet import stop_network
from dispatchd.daemon.spawn import SpawnError
from dispatchd.daemon.table import SessionTable
from dispatchd.protocol import FrameSocket
from dispatchd.tempfiles import no_temp_files, sweep_temp_files

log = logging.getLogger("dispatchd.sessions")
STOP_TIMEOUT_S = 2.0
_SWEPT = treewalk.Listings(no_temp_files)  # the writers' ends' sweeps (``_sweep_temp_files``)


class Ending(SessionTable):
    def close(self, sid: str) -> list[gitguard.Protected]:
        """Close ``sid``; returns what the checks at its end moved aside or put back."""
        session = self.get(sid)
        self._finish(session)
        self.pool.idle()  # its calls are over: a refill waits no more
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
            closing = [s for s in self._sessions.values() if not is_live(s.state)]
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
            self._finish(session, "dispatchd stopped", Event.DAEMON_STOP)
        # The stacks' exits, the records' removals and the scratch directories,
        # before the daemon's exit (each removal may wait for a namespace's
        # teardown: the more sessions, the longer).
        afterwards.drain(10.0 + 0.05 * len(sessions))

    def end(self, sid: str, word: str, why: str) -> None:
        """End a session for a reason of the daemon's own (orphaned, over its
        memory): logged with ``reason=word``; its client is told ``why``. Ends
        it on a thread of its own: stopping a worker may take seconds, and the
        caller (the watchdog, the orphan timer) serves every other session;
        on the caller's, should no thread be had: an end recorded is an end
        made (the record stops every later ``end`` of it)."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or not is_live(session.state) or self._ended.get(sid):
            return  # gone, or being ended already (its why recorded below)
        log.warning("event=session_ended session=%s reason=%s", sid, word)
        self._ended.record(sid, why)  # before the end: a client asking meanwhile hears why
        try:
            threading.Thread(target=self._finish, args=(session, why, ending_event(word)), daemon=True,
                             name=f"end-{sid}").start()
        except RuntimeError as exc:  # can't start new thread: ended here, never recorded and left running
            log.warning("event=end_inline session=%s why=%r", sid, str(exc))
            self._finish(session, why, ending_event(word))

    def _end_orphan(self, sid: str) -> None:
        with self._lock:
            session = self._sessions.get(sid)
        grace = session.lifetime.orphan_grace_s if session and session.lifetime else 0
        self.end(sid, "orphaned", f"every connection that held it had gone for {grace} s (its client exited or "
                                  "was killed; open it detached to keep it)")

    def _end_over_memory(self, sid: str, used: int, limit: int) -> None:
        self.end(sid, "memory", f"its processes used {used / 2**20:.0f} MiB of memory, over its limit of "
                                f"{limit / 2**20:.0f} MiB (limits.session_memory_bytes); the daemon's memory "
                                "watchdog ended it")

    def _watched(self) -> list[tuple[str, int, int, int]]:
        """Sessions whose memory only the watchdog bounds: (id, session init
        pid, limit, bytes its IPC namespace holds in System V memory)."""
        out = []
        for s in self.sessions():
            worker = s.worker
            if worker is not None and s.lifetime is not None and s.lifetime.memory.mechanism == "watchdog":
                pid, held = s.ipc_held
                out.append((s.id, worker.pid, s.policy.limits.session_memory_bytes, held if pid == worker.pid else 0))
        return out

    def _finish(self, session: Session, why: str = "it was closed", event: Event = Event.CLOSE,
                control: FrameSocket | None = None) -> None:
        """End the session for ``event`` (``why`` for its clients), once: an
        end that finds it closing (it waits for that end: the session's lock)
        or closed does nothing. With ``control``: only while that is still
        its worker's channel (a watch whose worker was replaced meanwhile
        ends nothing)."""
        with session.lock:
            self._finish_locked(session, why, event, control)

    def _finish_locked(self, session: Session, why: str, event: Event, control: FrameSocket | None = None) -> None:
        if decide(session.state, Op.CLOSE).action is not Action.GO:
            return  # closed already (under the lock, closing is never seen)
        if control is not None and session.control is not control:
            return
        self._ended.record(session.id, why)
        session.move(event)
        try:
            self._wind_down(session)
        finally:
            # Whatever the checks found, the session is over.
            self._discard(session)
            session.move(Event.DISCARDED)

    def _wind_down(self, session: Session) -> None:
        """The one way a sandbox of the session ends (its close, its end, a
        network switch that replaces it, one that failed half way): its
        processes gone, then what they left in git moved aside and the
        temporary files of cut writes removed, before anyone else may write."""
        steps: dict[str, float] = {}
        started = time.perf_counter()
        gone = self._stop_worker(session, steps)
        stopped = time.perf_counter()
        try:
            self._check_git(session)
        finally:
            # Whatever the check raised: no temporary file of a cut write is
            # left for the next writer, and the watch is not left open.
            checked = time.perf_counter()
            self._sweep_temp_files(session, gone)
            # Its tool server is gone: the watch it made is ours alone, closed after
            # the reply; queued after the check's own work there (the baseline
            # record's removal), which its teardown's wait would hold up.
            session.drop_watch()
        # Where an end's time goes (the bench's --steps reads it), as the open's event=open_steps.
        steps.update(git=(checked - stopped) * 1e3, sweep=(time.perf_counter() - checked) * 1e3,
                     all=(time.perf_counter() - started) * 1e3)
        log.debug("event=close_steps session=%s steps_ms=%s", session.id,
                  ",".join(f"{k}:{v:.3f}" for k, v in steps.items()))

    def _stop_worker(self, session: Session, steps: dict[str, float] | None = None) -> bool:
        """End the session's processes: False when that could not be seen done
        (its tool server's end did not come in time, or its cgroup kept some)."""
        # Asleep: its channels closed (its clients see the end), nothing to stop.
        session.end_nap(self.sleepers.forget)
        # The kit wakes this sandbox only: a replacement brings its own, and
        # a kit kept would hold this sandbox's namespaces (its mounts, its /tmp).
        session.drop_kit()
        worker, control = session.worker, session.control
        started = time.perf_counter()
        # The way out goes first: from here no byte of the session leaves
        # (the stack is killed now; its exit is waited for after the reply).
        had_stack = session.stack is not None
        stop_network(session, reap=afterwards.reap)
        if had_stack:
            # After the stack's exit (the job before): what it forked, however
            # deep, is the fork server's now, ended there off the reply's path.
            afterwards.later(self._end_left_behind)
        network = time.perf_counter()
        session.worker = session.control = None
        if session.proxy is not None:
            session.proxy.stop()  # nothing relayed for the old sandbox from here on
        if worker is None:
            return True
        # Pid 1 of the session's namespace has no SIGTERM handler, and the
        # kernel keeps from an init every signal it does not handle but SIGKILL
        # (which ends everything in its namespace). Without a pid namespace the
        # session init's SIGTERM handler kills its Landlock domain.
        # The tool server holds the other end of the control channel: its EOF
        # (session.ended) means the session's processes are gone (pid 1 of
        # their namespace has exited, or the session init has killed its
        # Landlock domain).
        sig = signal.SIGKILL if has_pid_namespace(session) else signal.SIGTERM
        gone = worker.stop(sig, session.ended, STOP_TIMEOUT_S)
        if steps is not None:
            steps.update(network=(network - started) * 1e3, exit=(time.perf_counter() - network) * 1e3)
        if not gone:
            log.warning("event=worker_stop_timeout session=%s seconds=%g", session.id, STOP_TIMEOUT_S)
        if session.cgroup and not cgroups.kill(session.cgroup):
            gone = False
            log.error("event=cgroup_not_empty session=%s cgroup=%s", session.id, session.cgroup)
        if control is not None:
            try:
                control.sock.shutdown(socket.SHUT_RDWR)  # wakes the watcher if it still waits
            except OSError:
                pass  # the watcher has closed it already
        return gone

    def _end_left_behind(self) -> None:
        try:
            self.fork_server.end_left_behind()
        except SpawnError as exc:  # gone: its parent-death signal and last sweep ended them
            log.debug("event=left_behind_not_ended error=%s", exc)

    def _check_git(self, session: Session) -> None:
        """Once the session's processes are gone: check its worktree's domain
        against the trusted baseline (gitguard/baselines.py) and move aside what
        differs; at its end, leave the domain (the last one out restores the
        repository's history). What cannot be moved or checked refuses the
        worktree until a later check passes (gitguard/taints.py)."""
        ending = session.state is State.CLOSING  # else a switch replaces its sandbox
        found = self.baselines.leave(session.id) if ending else self.baselines.check(session.id)
        session.found_at_end += found

    def _sweep_temp_files(self, session: Session, gone: bool) -> None:
        """The writer's processes are gone, and it still holds the write lock
        (nobody else writes meanwhile): a write its end cut short leaves no
        temporary file behind. A sweep that left none it would remove, its
        processes seen gone (``gone``), marks the worktree swept: the next
        writer's grant says so, and its tool server does not sweep again
        (daemon/writelock.py)."""
        if not self.write_locks.holds(session.id):
            return
        started = time.perf_counter()
        budget = treewalk.Budget()
        # The daemon writes none: none in flight. Its listings are kept from
        # one writer's end to the next (an unchanged directory is not listed).
        kept: list[str] = []
        removed = sweep_temp_files(session.worktree, budget=budget, listings=_SWEPT, kept=kept)
        if gone and not budget.skipped and not kept:
            self.write_locks.mark_swept(session.id, session.worktree)
        if budget.skipped:
            log.warning("event=temp_files_sweep_cut session=%s left=%r", session.id, budget.describe())
        if removed:
            log.info("event=temp_files_removed session=%s count=%d ms=%.1f", session.id, len(removed),
                     (time.perf_counter() - started) * 1e3)

    def _discard(self, session: Session) -> None:
        """The one way a session's remains go, whether it ended or never
        finished opening: its cgroup, its table entry and write lock, its
        scratch directory (and the lock that marks it ours), its worktree
        descriptor. Its processes are gone before this (``_stop_worker``)."""
        self.baselines.leave(session.id)  # an open that failed half way (a no-op after _check_git)
        self._remove_cgroup(session)
        self._forget(session)
        self.checkpoints.drop(session.id)  # daemon/checkpoints/: a session's go with it
        self._remove_scratch(session)
        session.end_nap(self.sleepers.forget)
        session.drop_kit()
        session.drop_first_channel()
        session.drop_watch()  # a sandbox that never started to end (an open that failed half way)
        session.worktree_dir.close()
        session.held.end()  # after its last check: what that logged was redacted

    def _remove_scratch(self, session: Session) -> None:
        """The scratch directory goes after the reply (``afterwards``): its
        processes are gone, so nothing writes it any more, and its removal
        waits in the kernel for the sandbox's mount namespace to be torn down
        (1.5-57 ms on a loaded machine; docs/performance.md). Its lock is
        released once it is gone: a daemon that dies meanwhile leaves both,
        and the next start removes it (``leftovers.remove_stale``)."""
        scratch, sid = session.scratch, session.id
        if not scratch:
            self._scratch_locks.release(sid)
            return

        def remove() -> None:
            try:
                leftovers.remove_tree(scratch)
            finally:
                self._scratch_locks.release(sid)
        afterwards.later(remove)

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
