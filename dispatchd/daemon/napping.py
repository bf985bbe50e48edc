"""A worker's control channel, and the naps its tool server asks for: the
watch that reads the channel, a session falling asleep, its wake, the
channels held meanwhile, and an attach (to a session awake or asleep).

Guarantees:
- one watch per worker is the only reader of its control channel; its end
  of stream ends the session (``worker_died``) only if that worker still
  serves it, awake: a worker replaced by a switch, or that handed over to
  sleep, ended on purpose;
- a session falls asleep (``slept``) only when ready, its lock free, the
  daemon not stopping, its wake kit held and its ``max_wakes`` not reached;
  otherwise its tool server is told to stay awake; a hand-over that fails
  ends the session (``sleep_failed``);
- a wake is for the nap it was asked for: one for a nap that is over, or a
  session closing or closed, does nothing (``lifecycle.decide``); a wake
  that fails ends the session (``wake_failed``): it never runs less confined;
- an attach to a sleeping session is held with its other channels and does
  not wake it; one to a session that has ended says why.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from dispatchd import protocol, threads
from dispatchd.daemon import checkpoints, exits
from dispatchd.daemon.ending import Ending
from dispatchd.daemon.lifecycle import Action, Event, Op, State, decide
from dispatchd.daemon.session import READY_TIMEOUT_S, Nap, Session, has_pid_namespace, tool_schemas
from dispatchd.daemon.spawn import NoProcess, Worker
from dispatchd.policy import max_channels, too_many_channels

log = logging.getLogger("dispatchd.sessions")
# The most channels a tool server going to sleep may hand over (it serves
# 256 at most): a worker that sends more is ended, not believed.
MAX_HANDED_OVER = 1024
MAX_KEPT_JOBS = 64  # the ended jobs a tool server keeps (tools/jobs.py MAX_KEPT)
# A wake refused for want of a process is tried again after these pauses, doubling.
WAKE_RETRY_FIRST_S = 0.1
WAKE_RETRY_MOST_S = 2.0


class Napping(Ending):
    def _watch(self, session: Session, control: protocol.FrameSocket, ended: threading.Event) -> None:
        """The only reader of a worker's control channel: its EOF means the tool
        server is gone, on purpose (close, switch) or on its own (idle, crash)."""
        try:
            while (msg := control.recv(protocol.from_worker_decoder)) is not None:
                if isinstance(msg, protocol.WatchHeld):
                    self._keep_watch(session, control)
                # No other message read here carries a descriptor (those that
                # do are read before, WorkerReady, or in _sleep): a worker
                # that sends some anyway does not pile them up here.
                control.drop_fds()
                if isinstance(msg, protocol.ToolCallsDone):
                    calls, cpu, peak = session.usage
                    for call in msg.calls:  # debug only: a line per call grew the log without bound
                        log.debug("event=tool_call session=%s tool=%s duration_ms=%.1f outcome=%s",
                                 session.id, call.tool, call.duration_ms, "ok" if call.success else "failed")
                        calls, cpu, peak = calls + 1, cpu + call.cpu_s, max(peak, call.peak_mib)
                    session.usage = (calls, round(cpu, 4), peak)  # one assignment: info() reads it whole
                elif isinstance(msg, protocol.IpcHeld):
                    worker = session.worker
                    if session.control is control and worker is not None:
                        session.ipc_held = (worker.pid, max(0, msg.bytes))  # one assignment: read whole
                elif isinstance(msg, protocol.OkReply):
                    waiting = session.acks.pop(msg.id, None)
                    if waiting is not None:
                        waiting.set()
                elif isinstance(msg, protocol.Paused):  # a checkpoint's or restore's pause (daemon/checkpoints/)
                    self.checkpoints.pauses.answer(msg)
                elif isinstance(msg, protocol.AcquireWriteLock) and msg.checkpoint:  # policy before_writes
                    checkpoints.before_write(self, session, msg, control)
                elif isinstance(msg, protocol.AcquireWriteLock):
                    # Decided and sent under send_lock: a release in between
                    # would otherwise reach the worker before this grant.
                    with session.send_lock:
                        control.send(self._grant_write_lock(session, msg.id))
                elif isinstance(msg, protocol.MaySleep):
                    if self._sleep(session, control, msg.added):
                        return  # asleep, or ended: this watch is over
        except (OSError, protocol.ProtocolError):
            pass
        except Exception:  # noqa: BLE001  # a bug, no thread to be had: the session's one reader
            # must not end unseen (its worker's death unwatched, its System V
            # figure stale): as when its worker goes, the session ends.
            log.exception("event=watch_failed session=%s", session.id)
        ended.set()
        control.close()
        with session.lock:
            if decide(session.state, Op.WORKER_GONE).action is not Action.GO or session.control is not control:
                return  # replaced by a network switch, handed over to sleep, or closed on purpose
            # Our own descriptor: a close meanwhile closes the worker's.
            pidfd = os.dup(session.worker.pidfd) if session.worker is not None and session.worker.pidfd >= 0 else -1
        try:
            status = exits.exit_status(pidfd) if pidfd >= 0 else exits.Unknown.NO_HANDLE
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        word, sentence = exits.describe_exit(status, idle_timeout_s=session.policy.limits.idle_timeout_s,
                                             tool_server_is_init=has_pid_namespace(session))
        died = self.fork_server.death(0.1 if isinstance(status, exits.Unknown) or os.WIFSIGNALED(status) else 0.0)
        if died:  # its parent's end took the worker: that is the cause (daemon/helpers.py)
            word, sentence = "fork_server_died", f"{died}; dispatchd exits so that a new one is started: " \
                                                 "open the session again"
        elif not self.accepting and word == "worker_exited code=0":
            word, sentence = "daemon_stopping", "dispatchd stopped (calls in flight were let finish first)"
        log.info("event=session_ended session=%s reason=%s", session.id, word)
        # Only if this worker still serves it: a switch may have replaced it since.
        self._finish(session, sentence, Event.WORKER_DIED, control)

    @staticmethod
    def _keep_watch(session: Session, control: protocol.FrameSocket) -> None:
        """The descriptor ``WatchHeld`` carried, held by the session when it
        is an inotify instance (anything else a worker sends is dropped)."""
        try:
            fd = control.take_fd()
        except protocol.ProtocolError:
            return
        try:
            what = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            what = ""
        if what != "anon_inode:inotify":
            log.warning("event=watch_refused session=%s what=%s", session.id, what or "unknown")
            os.close(fd)
            return
        session.keep_watch(control, fd)

    def _sleep(self, session: Session, control: protocol.FrameSocket, added: int) -> bool:
        """The worker asks to sleep (``MaySleep``): let it (``Sleep``), take
        its channels and see it gone; True when the session is asleep, or was
        ended because that failed (this watch is then over). Refused
        (``StayAwake``) when the session is closing, replaced, or the daemon
        stops, or when the session's lock is busy (a close waits under it
        for this very watch to see the worker end: asked again later), or
        when it asked before it had taken every channel sent to it (``added``
        short of ``session.added``): a woken tool server's idle check may run
        before the daemon hands back the channels that woke it, and one
        handed over unread would only wake the session again at once, and
        again, as long as the daemon is slower than that check."""
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
                if added != session.added:  # a channel it had yet to see when it asked: asked again later
                    try:
                        control.send(protocol.StayAwake())
                    except OSError:
                        pass
                    return False
                if decide(session.state, Op.SLEEP).action is not Action.GO or session.control is not control \
                        or not self.accepting \
                        or not session.kit or session.worker is None or session.plan is None \
                        or session.wakes >= session.policy.limits.max_wakes or not self.sleepers.ensure():
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
            session.drop_watch()  # a woken tool server makes its own
            control.close()
            session.ended.set()  # this watch is over (its worker is no longer session.control)
            if not failed:
                session.nap = nap = Nap(channels, jobs)
                # Logged before the state is seen (status reads it without the
                # session's lock): whoever sees it asleep finds the line.
                log.info("event=session_asleep session=%s channels=%d", session.id, len(channels))
                session.move(Event.SLEPT)
                deadline = started + session.policy.limits.idle_timeout_s - session.policy.limits.sleep_after_s
                self.sleepers.add(session.id, nap.number, channels, deadline)
        finally:
            session.lock.release()
        if failed:
            log.warning("event=sleep_failed session=%s error=%s", session.id, failed)
            self._finish(session, f"its tool server failed going to sleep ({failed})", Event.SLEEP_FAILED)
        return True

    def _wake(self, sid: str, number: int) -> None:
        """A sleeping session's first request came: its tool server again,
        confined as at its start (``ForkServerClient.wake_worker``), given the
        environment changes and every channel held. On failure the session
        ends, saying why: it never runs less confined."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            return
        failed = ""
        woken: protocol.FrameSocket | None = None  # the woken tool server's channel
        # No process to be had (NoProcess: the sessions' shared bound, say,
        # taken by another session's build) ends nothing: the session stays
        # asleep, its request waiting, and the wake is tried again, less
        # often each time, until its idle timeout would have ended it asleep.
        waited_until = time.monotonic() + session.policy.limits.idle_timeout_s
        pause = WAKE_RETRY_FIRST_S
        while True:
            with session.lock:
                asleep = session.nap
                # Closing or closed: refused; awake: woken already (another channel's byte).
                if decide(session.state, Op.WAKE).action is not Action.GO or asleep is None \
                        or asleep.number != number or session.plan is None:
                    return
                self.sleepers.forget(sid)
                started = time.perf_counter()
                try:
                    worker, control, msg = self.fork_server.wake_worker(session.plan, session.kit, READY_TIMEOUT_S)
                except NoProcess as exc:
                    if time.monotonic() + pause >= waited_until or not self.accepting:  # or stopping
                        failed = str(exc)
                        break
                    if pause == WAKE_RETRY_FIRST_S:
                        log.warning("event=wake_waiting session=%s error=%s", sid, exc)
                except Exception as exc:  # noqa: BLE001 (any: left asleep, nobody would watch or wake it)
                    failed = str(exc) or type(exc).__name__
                    break
                else:
                    woken = control
                    failed = self._woken(session, asleep, worker, control, msg, started)
                    break
            time.sleep(pause)  # not holding the session: a close meanwhile is served
            pause = min(pause * 2, WAKE_RETRY_MOST_S)
        if failed:
            log.warning("event=wake_failed session=%s error=%s", sid, failed)
            # Woken and gone: only while that tool server is still the session's.
            self._finish(session, f"it could not be woken ({failed})", Event.WAKE_FAILED, woken)

    def _woken(self, session: Session, asleep: Nap, worker: Worker, control: protocol.FrameSocket,
               msg: protocol.WorkerReady, started: float) -> str:
        """With the session's lock: its woken tool server made the session's,
        given the environment changes and every channel held, and watched.
        Returns why that failed ("": it did not)."""
        failed = ""
        session.nap = None
        session.move(Event.WOKEN)
        session.wakes += 1
        session.worker, session.control = worker, control
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
                    session.added += 1
        except OSError as exc:
            failed = f"its woken tool server went away ({exc})"
        held = len(asleep.channels)
        asleep.close()
        log.debug("event=worker_ready session=%s pid=%s woken=1 steps_ms=%s", session.id, worker.pid,
                  ",".join(f"{k}:{v}" for k, v in msg.timings_ms.items()))
        log.info("event=session_woken session=%s ms=%.1f channels=%d", session.id,
                 (time.perf_counter() - started) * 1e3, held)
        try:
            threads.Thread(target=self._watch, args=(session, control, session.ended),
                           daemon=True, name=f"watch-{session.id}").start()
        except RuntimeError as exc:  # can't start new thread: unwatched, its MaySleep would hang it
            failed = failed or f"no thread to watch it ({exc})"
        return failed

    def _channel_gone(self, sid: str, number: int, fd: int) -> None:
        """A client closed its channel to a sleeping session: let it go, unwoken."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None:
            return
        with session.lock:
            nap = session.nap
            if nap is not None and nap.number == number and fd in nap.channels:
                nap.channels.remove(fd)
                os.close(fd)

    def _expire_asleep(self, sid: str, number: int) -> None:
        """Its idle timeout passed while it slept: it ends as an idle one does."""
        with self._lock:
            session = self._sessions.get(sid)
        nap = session.nap if session is not None else None
        if session is None or nap is None or nap.number != number:
            return
        self.end(sid, "idle", f"it ended idle (no call for {session.policy.limits.idle_timeout_s:g} s, "
                              "the policy's idle_timeout_s)")

    def attach(self, sid: str, holder: int | None = None) -> tuple[protocol.SessionInfo, socket.socket,
                                                                    list[protocol.ToolSchema]]:
        """A new stream socket to the session's tool server (the client's end),
        and the session's info, naming the sandbox that socket reaches."""
        session = self.get(sid)
        sandbox, ours = self._add_channel(session, holder)
        return session.info(sandbox), ours, tool_schemas(tuple(session.policy.tools))

    def _add_channel(self, session: Session, holder: int | None) -> tuple[tuple[int, str], socket.socket]:
        """``attach``'s channel, and the sandbox it reaches (``Session.sandbox``),
        both under the session's lock: a switch cannot come in between."""
        sid = session.id
        with session.lock:
            sent = False
            sandbox = session.sandbox
            go = decide(session.state, Op.ATTACH).action is Action.GO  # else closed meanwhile: why, below
            ahead = session.take_first_channel()  # the opener's, sent with the session
            if ahead is not None:
                if go:
                    if holder is not None:
                        self.holders.hold(sid, holder)
                    return sandbox, ahead
                ahead.close()
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            nap = session.nap
            if go and session.state is State.ASLEEP and nap is not None:
                limit = max_channels(session.policy.limits.max_processes, session.policy.limits.max_open_files)
                if len(nap.channels) >= limit:
                    # Refused as its tool server would: the client reads why on the channel.
                    try:
                        protocol.FrameSocket(theirs).send(protocol.ErrorReply(
                            id=0, code="too_many_channels", message=too_many_channels(limit)))
                    except OSError:
                        pass
                    theirs.close()
                    if holder is not None:
                        self.holders.hold(sid, holder)  # as an attach the tool server refuses
                    return sandbox, ours
                # Held with the others: its first request wakes the session.
                fd = theirs.detach()
                nap.channels.append(fd)
                self.sleepers.add_channel(session.id, fd)
                if holder is not None:
                    self.holders.hold(sid, holder)
                return sandbox, ours
            if go and session.control is not None and not session.ended.is_set():
                try:
                    with session.send_lock:
                        session.control.send(protocol.AddChannel(id=0), fds=[theirs.fileno()])
                        session.added += 1
                    sent = True
                except OSError:
                    pass  # the worker is gone: say why below
            theirs.close()
            if sent:
                if holder is not None:
                    self.holders.hold(sid, holder)
                return sandbox, ours
            ours.close()
        # Outside the session's lock: its watcher takes it to finish the session.
        raise self._ended_error(session)
