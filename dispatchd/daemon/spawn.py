"""Daemon side of the fork server, and the handle of a session's worker.

``start_worker`` asks the fork server for a worker and waits until it is
confined and ready (or names the step that failed); ``Worker`` holds it by
pidfd, so that signalling it can never hit a recycled pid, and stops it.
Safe to call from many threads; requests to the fork server are serialised
(a clone takes about a millisecond).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from dispatchd import fdwait, protocol
from dispatchd.confine.plan import SessionPlan, encode_plan
from dispatchd.confine.mounts import WORKTREE_STEP
from dispatchd.errors import ConfinementError, DispatchdError, WorktreeError


LAST_SWEEP_S = 3.0  # the fork server's last sweep is bounded by its LEFT_BEHIND_S (2 s)
STOP_CHILDREN_S = 10.0  # how long a stop waits for the fork server's processes to have exited


class SpawnError(DispatchdError):
    code = "spawn_failed"


class NoProcess(SpawnError):
    """The fork server had no process to start (EAGAIN: the session's, all
    sessions' or the user's process limit): a wait may find one."""

    code = "no_process"


class Worker:
    """The first process of a session (W1, its init), held by a pidfd so that signalling
    it can never hit a recycled pid."""

    def __init__(self, pid: int, pidfd: int) -> None:
        self.pid = pid
        self.pidfd = pidfd

    def signal(self, sig: int) -> None:
        if self.pidfd < 0:
            return  # let go of already (killed and waited for)
        try:
            signal.pidfd_send_signal(self.pidfd, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1

    def kill(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL, wait until it has exited (at most ``timeout_s``), and let
        go of it. With a pid namespace the worker is its pid 1, which exits only
        once every other process in it is gone: what follows (the git check,
        the write lock passing on) never races a process of the session.
        False when its exit was not seen in time."""
        self.signal(signal.SIGKILL)
        exited = True
        if self.pidfd >= 0:
            exited = fdwait.readable(self.pidfd, timeout_s)  # readable once it has exited
        self.close()
        return exited

    def stop(self, sig: int, ended: threading.Event, timeout_s: float) -> bool:
        """Send ``sig`` (what ends this worker's session: see the caller), wait
        for ``ended`` (its tool server gone), then SIGKILL whatever is left and
        let go. False when ``ended`` did not come in time, or its exit was not
        seen (``kill``): its processes are then not known gone."""
        self.signal(sig)
        in_time = ended.wait(timeout_s)
        return self.kill() and in_time


_Report = TypeVar("_Report", protocol.WorkerReady, protocol.WorkerPooled, protocol.WorkerNamespaces)


def await_report(worker: Worker, control: protocol.FrameSocket, worktree: str, timeout_s: float,
                 expect: type[_Report]) -> _Report:
    """What a worker starting (or a sandbox made ahead, given its session)
    reports: ``expect``. A worker that fails a step, says nothing in
    ``timeout_s`` or says something else is killed and its channel closed,
    and the error names the step (``ConfinementError``), or the worktree
    when it was swapped since the daemon checked it (``WorktreeError``)."""
    control.sock.settimeout(timeout_s)
    msg: object
    try:
        report = control.recv(protocol.from_worker_decoder)
        msg = report
    except (OSError, protocol.ProtocolError) as exc:
        msg = exc
    control.sock.settimeout(None)
    if isinstance(msg, expect):
        return msg
    worker.kill()
    control.close()
    if isinstance(msg, protocol.WorkerFailed) and msg.step == WORKTREE_STEP:
        # Raced: the worktree was swapped between the daemon's check and the worker's bind.
        raise WorktreeError(f"worktree {worktree} changed while the session was being opened "
                            "(moved or replaced since it was checked); nothing was opened", worktree)
    if isinstance(msg, protocol.WorkerFailed):
        err = ConfinementError(msg.step, msg.errno, msg.path, msg.message.split(": ", 1)[-1] if not msg.errno else "")
        err.message = f"session refused: {msg.message}"
        err.args = (err.message,)
        raise err
    raise ConfinementError("worker start", detail=f"the worker did not report {expect.__name__}: {msg!r}")


def adopt(worker: Worker, control: protocol.FrameSocket, plan: SessionPlan, worktree_fd: int, worktree: str,
          timeout_s: float, encoded: bytes | None = None,
          meanwhile: Callable[[], None] | None = None, channel_fd: int = -1) -> protocol.WorkerReady:
    """Give a sandbox made ahead its session: the plan (``encoded``: its
    ``encode_plan``, when made already), the checked worktree and, when
    ``channel_fd`` is one, the opener's channel. Its report, as
    ``start_worker``'s; on any failure it is killed.
    ``meanwhile`` runs once the session is sent, while the worker applies
    it (another process), before its report is read; what it raises is
    raised, the worker killed first."""
    try:
        payload = encoded if encoded is not None else encode_plan(plan)
        fds = [worktree_fd] if channel_fd < 0 else [worktree_fd, channel_fd]
        control.send(protocol.AdoptSession(plan=payload, channel=channel_fd >= 0), fds=fds)
    except OSError as exc:
        worker.kill()
        control.close()
        raise ConfinementError("pool", detail=f"the sandbox made ahead is gone: {exc}") from exc
    if meanwhile is not None:
        try:
            meanwhile()
        except BaseException:
            worker.kill()
            control.close()
            raise
    return await_report(worker, control, worktree, timeout_s, protocol.WorkerReady)


class ForkServerClient:
    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        # Held by pidfd (our child: its pid cannot be reused before we reap
        # it), so that the daemon learns at once when it has gone (helpers.py).
        self.pidfd = os.pidfd_open(pid)
        self._frames = protocol.FrameSocket(sock, fds=True)
        self._lock = threading.Lock()
        self._next = 0
        self._death = ""  # how it ended, once known
        self._death_lock = threading.Lock()

    def hello(self, timeout_s: float = 10.0) -> str:
        """The fork server's first frame: "" when it is below the sessions'
        user namespace it was asked for (or none was asked), else why not.
        Raises ``SpawnError`` when it said nothing (it exited: its standard
        error, the daemon's log, says why)."""
        self._frames.sock.settimeout(timeout_s)
        try:
            reply = self._frames.recv(protocol.fork_server_reply_decoder)
        except (OSError, protocol.ProtocolError) as exc:
            raise SpawnError(f"the fork server did not start: {exc}") from exc
        finally:
            self._frames.sock.settimeout(None)
        if reply is None:
            raise SpawnError(f"the fork server did not start ({self.death(1.0) or 'it closed its channel'})")
        if isinstance(reply, protocol.ErrorReply):
            return reply.message
        if not isinstance(reply, protocol.OkReply):
            raise SpawnError(f"the fork server began with {type(reply).__name__}")
        return ""

    def death(self, wait_s: float = 0.0) -> str:
        """How the fork server ended, in words ("" while it runs), waiting up
        to ``wait_s`` for it to end. Reaps it: only the daemon may."""
        if self._death or self.pidfd < 0 or not fdwait.readable(self.pidfd, wait_s):
            return self._death
        with self._death_lock:  # one reaper: a second waitpid would find no child
            if not self._death:
                self._death = self._reap()
        return self._death

    def _reap(self) -> str:
        try:
            _, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            status = 0
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            how = f"was killed by signal {sig} ({signal.strsignal(sig)})"
        else:
            how = f"exited with status {os.waitstatus_to_exitcode(status)}"
        return f"dispatchd's fork server (pid {self.pid}) {how}"

    def _request(self, make: Callable[[int], msgspec.Struct], fds: list[int]) -> tuple[Any, int]:
        """One request to the fork server and its reply, serialised: the reply
        and the descriptor that came with it (-1 if none was expected: an
        ``OkReply``). Every failure is a ``SpawnError`` saying why."""
        reply, got = self._request_fds(make, fds)
        return reply, (got[0] if got else -1)

    def _request_fds(self, make: Callable[[int], msgspec.Struct], fds: list[int]) -> tuple[Any, list[int]]:
        """``_request``, for a reply with any number of descriptors (``DnsDoor``: two)."""
        with self._lock:
            self._next += 1
            try:
                self._frames.send(make(self._next), fds=fds)
                reply = self._frames.recv(protocol.fork_server_reply_decoder)
                if reply is None:
                    raise SpawnError("the fork server has exited")
                if isinstance(reply, protocol.ErrorReply):
                    raise (NoProcess if reply.code == "no_process" else SpawnError)(reply.message)
                wanted = 1 if isinstance(reply, protocol.Spawned) else 2 if isinstance(reply, protocol.DnsDoor) else 0
                got: list[int] = []
                try:
                    for _ in range(wanted):
                        got.append(self._frames.take_fd())
                except protocol.ProtocolError:
                    for fd in got:
                        os.close(fd)
                    raise
                return reply, got
            except protocol.DescriptorsLost as exc:
                # Its answer came whole without the descriptors it carried
                # (the daemon is out of them): this request fails, the channel
                # to the fork server reads on. A worker it started has no
                # control channel any more and ends by itself.
                raise SpawnError(f"dispatchd cannot take the fork server's answer: {exc}") from exc
            except (OSError, protocol.ProtocolError) as exc:
                raise SpawnError(f"the fork server is not answering: {exc}") from exc

    def spawn_worker(self, plan: SessionPlan, control_end: socket.socket, worktree_fd: int) -> Worker:
        """Fork a worker for ``plan``; ``worktree_fd`` (the checked worktree, by
        descriptor) travels with the request (SCM_RIGHTS) to be bound and granted."""
        encoded = encode_plan(plan)
        reply, pidfd = self._request(lambda rid: protocol.SpawnWorker(id=rid, plan=encoded),
                                     [control_end.fileno(), worktree_fd])
        if not isinstance(reply, protocol.Spawned):
            raise SpawnError(f"the fork server answered {type(reply).__name__}")
        return Worker(reply.pid, pidfd)

    def start_worker(self, plan: SessionPlan, worktree_fd: int, worktree: str,
                     timeout_s: float) -> tuple[Worker, protocol.FrameSocket, protocol.WorkerReady]:
        """A session's worker, confined and ready: its handle, its control
        channel (the daemon's end) and what it reported (see ``await_report``)."""
        worker, control = self._spawn_with_channel(plan, worktree_fd)
        return worker, control, await_report(worker, control, worktree, timeout_s, protocol.WorkerReady)

    def make_ahead(self, plan: SessionPlan, timeout_s: float,
                   early: Callable[[Worker, protocol.FrameSocket, protocol.WorkerNamespaces], None] | None = None,
                   encoded: bytes | None = None) -> tuple[Worker, protocol.FrameSocket, protocol.WorkerPooled]:
        """A sandbox made ahead for sessions of ``plan``'s kind (its ``pool_key``
        part applied), waiting for ``adopt``. With namespaces of its own it
        sends them first (``WorkerNamespaces``): ``early`` is given them while
        the sandbox goes on (its network started meanwhile); what it raises is
        raised, the worker killed first. ``encoded``: ``encode_plan(plan)``,
        when made already."""
        worker, control = self._spawn_with_channel(plan, -1, encoded)
        if plan.namespaces.user and plan.namespaces.net:
            first = await_report(worker, control, "", timeout_s, protocol.WorkerNamespaces)
            try:
                if early is not None:
                    early(worker, control, first)
            except BaseException:
                worker.kill()
                control.close()
                raise
            finally:
                control.drop_fds()  # those ``early`` did not take
        return worker, control, await_report(worker, control, "", timeout_s, protocol.WorkerPooled)

    def _spawn_with_channel(self, plan: SessionPlan, worktree_fd: int,
                            encoded: bytes | None = None) -> tuple[Worker, protocol.FrameSocket]:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if worktree_fd >= 0:
                worker = self.spawn_worker(plan, theirs, worktree_fd)
            else:
                payload = encoded if encoded is not None else encode_plan(plan)
                reply, pidfd = self._request(lambda rid: protocol.SpawnWorker(id=rid, plan=payload, pooled=True),
                                             [theirs.fileno()])
                if not isinstance(reply, protocol.Spawned):
                    raise SpawnError(f"the fork server answered {type(reply).__name__}")
                worker = Worker(reply.pid, pidfd)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return worker, protocol.FrameSocket(ours, fds=True)

    def wake_worker(self, plan: SessionPlan, kit: list[int],
                    timeout_s: float) -> tuple[Worker, protocol.FrameSocket, protocol.WorkerReady]:
        """A sleeping session's tool server again (``worker/wake.py``), in the
        namespaces and under the ruleset of its ``kit`` (sent, still ours), ready."""
        encoded = encode_plan(plan)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            reply, pidfd = self._request(lambda rid: protocol.WakeWorker(id=rid, plan=encoded, kit=len(kit)),
                                         [theirs.fileno(), *kit])
            if not isinstance(reply, protocol.Spawned):
                raise SpawnError(f"the fork server answered {type(reply).__name__}")
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        worker, control = Worker(reply.pid, pidfd), protocol.FrameSocket(ours, fds=True)
        return worker, control, await_report(worker, control, "", timeout_s, protocol.WorkerReady)

    def start_stack(self, fds: list[int], *, stack: str, executable: str, confinement: bytes,
                    cgroup: str = "", host_loopback: bool = True) -> tuple[int, int]:
        """Have the fork server start a session's network stack ``stack``,
        confined by ``confinement`` (see ``netstack.start_stack`` for ``fds``,
        ``stacks.Launch`` for the rest), in the session's ``cgroup`` when it
        has one: ``(pid, pidfd)``, or ``SpawnError`` with the fork server's
        reason."""
        reply, pidfd = self._request(lambda rid: protocol.StartStack(id=rid, stack=stack, executable=executable,
                                                                     confinement=confinement, cgroup=cgroup,
                                                                     host_loopback=host_loopback), fds)
        if not isinstance(reply, protocol.Spawned):
            raise SpawnError(f"the fork server answered {type(reply).__name__}")
        return reply.pid, pidfd

    def net_rules(self, rules: str, userns_fd: int, netns_fd: int) -> None:
        """Commit nftables ``rules`` in a session's namespaces (see
        ``netstack.apply_rules_in``); raises ``SpawnError`` with nft's message."""
        self._request(lambda rid: protocol.NetRules(id=rid, rules=rules), [userns_fd, netns_fd])

    def net_closed(self, userns_fd: int, netns_fd: int) -> None:
        """Once a session's stack was stopped: what it left behind ended, and
        no interface but the loopback up in its namespaces (see
        ``netstack.links_up_in``); raises ``SpawnError`` saying what is."""
        self._request(lambda rid: protocol.NetClosed(id=rid), [userns_fd, netns_fd])

    def end_left_behind(self) -> None:
        """Once a closed session's stack has exited: every process it left
        behind, however deep, ended and exited (``EndLeftBehind``); raises
        ``SpawnError`` when the fork server cannot be asked."""
        self._request(lambda rid: protocol.EndLeftBehind(id=rid), [])

    def dns_sockets(self, userns_fd: int, netns_fd: int) -> tuple[socket.socket, socket.socket]:
        """The DNS relay's door in a session's namespaces (see
        ``netstack.open_dns_sockets_in``): its UDP socket and TCP listener."""
        reply, got = self._request_fds(lambda rid: protocol.DnsSockets(id=rid), [userns_fd, netns_fd])
        if not isinstance(reply, protocol.DnsDoor) or len(got) != 2:
            for fd in got:
                os.close(fd)
            raise SpawnError(f"the fork server answered {type(reply).__name__}")
        return socket.socket(fileno=got[0]), socket.socket(fileno=got[1])

    def stop(self, timeout_s: float = STOP_CHILDREN_S) -> None:
        """End it, and wait (up to ``timeout_s``) until every process it had
        has exited too: they die with it (their parent-death signal), but the
        kernel tears a namespace down after its parent has gone, and a daemon
        that returned then would leave sandboxes made ahead and their network
        stacks running on for a second or more."""
        self._frames.close()
        children: list[int] = []
        if not self._death:
            # At the channel's end it ends the stacks and all they forked
            # (a parent-death signal reaches a direct child only), then
            # stops itself: waited for, within a bound.
            self._stopped_itself(LAST_SWEEP_S)
            try:
                # Stopped first, so that it reaps none of its children while
                # we open them (a pid reaped could be another process's).
                signal.pidfd_send_signal(self.pidfd, signal.SIGSTOP)
                children = self._children()
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)  # its SIGTERM is the default action
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        if self.pidfd >= 0:
            os.close(self.pidfd)
            self.pidfd = -1
        deadline = time.monotonic() + timeout_s
        for pidfd in children:
            fdwait.readable(pidfd, deadline - time.monotonic())  # readable once it has exited
            os.close(pidfd)

    def _stopped_itself(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if os.waitid(os.P_PID, self.pid, os.WSTOPPED | os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return
            except ChildProcessError:
                return
            time.sleep(0.002)

    def _children(self) -> list[int]:
        """A pidfd for each process the (stopped) fork server has now."""
        try:
            with open(f"/proc/{self.pid}/task/{self.pid}/children", "rb") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            return []
        pidfds = []
        for pid in pids:
            try:
                pidfds.append(os.pidfd_open(pid))
            except OSError:
                continue  # gone already
        return pidfds
