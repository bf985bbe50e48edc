"""The fork server: a lean, single-threaded process that forks session workers.

The daemon forks it at start, before any thread exists, with every module a
worker needs already imported. A session then costs one ``clone3`` of this
small process (not of the daemon, whose memory grows with its clients) and no
imports: that is what keeps opening a session within milliseconds, and it is
what lets Landlock be applied safely, since Landlock binds only the calling
thread and a fork of a single-threaded process has exactly one.

Seccomp programs are compiled here once per plan and only installed in the
worker. The fork server dies with the daemon, and the workers with it; so do
the sessions' network stacks, which it starts (``StartStack``) with a
parent-death signal a multi-threaded daemon could not give them. It commits
nftables rules from a child that joins a session's namespaces (``NetRules``),
and, once a session's stack was stopped, ends what it left behind and looks
in there that no interface but the loopback is up (``NetClosed``; at a
close, ``EndLeftBehind``: no look). It is also a child subreaper, and ends
any process that lands on it but a session's first one or a stack, with
every process below it (``subtree.py``): the orphans of a session whose
init was killed, what a stopped stack forked, however deep. At the daemon's
stop it ends the stacks so too: their parent-death signal reaches no deeper.

It forks the workers itself: a zygote (a fork of it once warm, whose loop
only clones) saved 0.08-0.16 MiB an idle worker for 4.4 MiB once and slower
opens (docs/performance.md, "Memory: an idle session").
"""

from __future__ import annotations

import errno
import os
import select
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

import msgspec

from dispatchd import catalogue, protocol
from dispatchd.confine import hygiene, namespaces, netstack, seccomp, sharedprocs
from dispatchd.confine.ucounts import UcountsPlan
from dispatchd.confine.plan import SessionPlan, decode_plan, encode_plan, leave_seccomp_encoded, pool_key, seccomp_of
from dispatchd.errors import ConfinementError
from dispatchd.worker import forkhooks, stackstart, subtree, wake
from dispatchd.worker import tool_server as _tool_server  # noqa: F401  (pre-import for the workers)
from dispatchd.worker.session_init import run_session

ORPHAN_SWEEP_S = 0.5
LEFT_BEHIND_S = 2.0  # a SIGKILLed process has exited long before this


def _reap(workers: set[int], stacks: set[int]) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        workers.discard(pid)
        stacks.discard(pid)


def _end_left_behind(workers: set[int], deadline_s: float = LEFT_BEHIND_S) -> list[int]:
    """Every process below a child that is not a session's first process or
    a running stack, ended (``subtree.end_subtrees``) and exited on return:
    what a stack just stopped had forked, however deep (its children come
    here when it dies), its tap descriptor closed with it. Bounded by
    ``deadline_s``: what is still alive then is for the caller's look into
    the namespace to find. Said on stderr (the daemon's log). Returns the
    pids ended."""
    ended = subtree.end_subtrees(os.getpid(), workers, deadline_s)
    if ended:
        print(f"dispatchd: fork server: ended {len(ended)} process(es) a stopped network stack had left "
              f"behind (pids {' '.join(map(str, ended))})", file=sys.stderr, flush=True)
    return ended


def _net_closed(req: protocol.NetClosed, frames: protocol.FrameSocket,
                workers: set[int]) -> protocol.OkReply | protocol.ErrorReply:
    """A session's stack was stopped: end what it left behind (a taken-over
    stack that forked), said on stderr (the daemon's log), then look into
    the session's namespace from a child that joins it."""
    _end_left_behind(workers)
    return _in_namespaces(req.id, frames, netstack.links_up_in)


def _net_rules(req: protocol.NetRules, frames: protocol.FrameSocket) -> protocol.OkReply | protocol.ErrorReply:
    """Commit a session's nftables rules from a child that joins its namespaces."""
    return _in_namespaces(req.id, frames, lambda userns_fd, netns_fd:
                          netstack.apply_rules_in(userns_fd, netns_fd, req.rules))


def _in_namespaces(rid: int, frames: protocol.FrameSocket,
                   work: Callable[[int, int], str]) -> protocol.OkReply | protocol.ErrorReply:
    """``work(userns_fd, netns_fd)`` in a child that joins a session's
    namespaces (by the two descriptors that came with the request): setns
    into a user namespace needs a single-threaded caller, which a fork of
    this process is, and the child (never the session) holds the capability
    there. ``OkReply`` when it returns "", else ``ErrorReply`` with what it
    returned. Waited for here: a few milliseconds."""
    try:
        userns_fd, netns_fd = frames.take_fd(), frames.take_fd()
    except protocol.ProtocolError as exc:
        return protocol.ErrorReply(id=rid, code="spawn_failed", message=str(exc))
    err_r, err_w = os.pipe()
    try:
        try:
            pid = os.fork()
        except OSError as exc:  # answered, not a traceback in the daemon's log
            return _fork_refused(rid, "enter the session's namespaces", exc)
        if pid == 0:
            try:
                os.close(err_r)
                error = work(userns_fd, netns_fd)
                os.write(err_w, error.encode()[:4000])
                os._exit(1 if error else 0)
            finally:
                os._exit(2)
        os.close(err_w)
        err_w = -1
        chunks = []
        while chunk := os.read(err_r, 4096):
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
    finally:
        for fd in (userns_fd, netns_fd, err_r, err_w):
            if fd >= 0:
                os.close(fd)
    if os.waitstatus_to_exitcode(status) == 0:
        return protocol.OkReply(id=rid)
    message = b"".join(chunks).decode(errors="replace") or f"the namespaces' child ended with status {status}"
    return protocol.ErrorReply(id=rid, code="spawn_failed", message=message)


def _fork_refused(rid: int, to: str, exc: OSError) -> protocol.ErrorReply:
    """The answer to a request whose fork failed: ``no_process`` for EAGAIN
    (a process limit: the daemon keeps the session as it was and says so)."""
    if exc.errno == errno.EAGAIN:
        return protocol.ErrorReply(id=rid, code="no_process",
                                   message=f"cannot fork to {to}: {exc}: {sharedprocs.reached(errno.EAGAIN)}")
    return protocol.ErrorReply(id=rid, code="spawn_failed", message=f"cannot fork to {to}: {exc}")


def _dns_sockets(req: protocol.DnsSockets, frames: protocol.FrameSocket) -> None:
    """Make the DNS relay's door in a session's namespaces from a child that
    joins them (as ``_net_rules``), and send its two sockets to the daemon
    with ``DnsDoor``; or ``ErrorReply`` saying why. Waited for here."""
    try:
        userns_fd, netns_fd = frames.take_fd(), frames.take_fd()
    except protocol.ProtocolError as exc:
        frames.send(protocol.ErrorReply(id=req.id, code="spawn_failed", message=str(exc)))
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got: list[int] = []
    try:
        try:
            pid = os.fork()
        except OSError as exc:  # answered, not a traceback in the daemon's log
            frames.send(_fork_refused(req.id, "make the DNS relay's door", exc))
            return
        if pid == 0:
            try:
                ours.close()
                try:
                    udp, tcp = netstack.open_dns_sockets_in(userns_fd, netns_fd)
                    socket.send_fds(theirs, [b"ok"], [udp, tcp])
                except OSError as exc:
                    theirs.sendall(f"cannot make the DNS relay's door: {exc}".encode()[:4000])
                os._exit(0)
            finally:
                os._exit(2)
        theirs.close()
        msg, got, _, _ = socket.recv_fds(ours, 4096, 2)
        _, status = os.waitpid(pid, 0)
    finally:
        ours.close()
        theirs.close()
        for fd in (userns_fd, netns_fd):
            os.close(fd)
    if msg == b"ok" and len(got) == 2:
        try:
            frames.send(protocol.DnsDoor(id=req.id), fds=got)
        finally:
            for fd in got:
                os.close(fd)
        return
    for fd in got:
        os.close(fd)
    frames.send(protocol.ErrorReply(id=req.id, code="spawn_failed", message=(
        msg.decode(errors="replace") or f"the DNS door's child ended with status {status}")))


def _wake(req: protocol.WakeWorker, frames: protocol.FrameSocket, sock: socket.socket,
          programs: dict[bytes, bytes], workers: set[int]) -> None:
    """Make a sleeping session's pid 1 again (``worker/wake.py``) and answer
    as for a spawn: ``Spawned`` with its pidfd, or ``ErrorReply``."""
    fds: list[int] = []
    cgroup_fd = -1
    try:
        try:
            fds.append(frames.take_fd())  # its end of the new control channel
            plan = decode_plan(req.plan)
            for _ in range(req.kit):
                fds.append(frames.take_fd())
            key = msgspec.msgpack.encode(plan.seccomp)
            if key not in programs:
                programs[key] = seccomp.compile_seccomp(seccomp_of(plan))
            if plan.cgroup is not None:
                try:
                    cgroup_fd = os.open(plan.cgroup.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                except OSError as exc:
                    raise ConfinementError("cgroup", exc.errno, plan.cgroup.path) from exc
            pid = wake.spawn_woken(plan, fds[1:], cgroup_fd)
        except Exception as exc:
            message = str(exc) if isinstance(exc, ConfinementError) else f"bad wake request: {exc}"
            if getattr(exc, "errno", None) == errno.EAGAIN:
                # No process to be had (the session's, all sessions' or the
                # user's limit): the daemon keeps the session asleep and tries again.
                frames.send(protocol.ErrorReply(id=req.id, code="no_process", message=(
                    f"no process to wake it with: {sharedprocs.reached(errno.EAGAIN)}")))
                return
            frames.send(protocol.ErrorReply(id=req.id, code="spawn_failed", message=message))
            return
        if pid == 0:
            forkhooks.put_back()
            sock.close()
            wake.run_woken(plan, programs[key], fds[0], fds[1])
        workers.add(pid)
        pidfd = os.pidfd_open(pid)  # our child (CLONE_PARENT): its pid cannot be reused before we reap it
    finally:
        _close(cgroup_fd, *fds)
    try:
        frames.send(protocol.Spawned(id=req.id, pid=pid), fds=[pidfd])
    finally:
        os.close(pidfd)


def _close(*fds: int) -> None:
    for fd in fds:
        if fd >= 0:
            os.close(fd)


def _spawn(plan: SessionPlan) -> tuple[int, int]:
    """The session's first process: ``(0, -1)`` in it, ``(pid, pidfd)`` here.

    With user namespaces one ``clone3`` makes it pid 1 of its own namespaces,
    born in the session's cgroup; without, a plain fork (it joins the cgroup
    itself). Raises ``ConfinementError`` naming the step."""
    if not plan.namespaces.user:
        pid = os.fork()
        return (0, -1) if pid == 0 else (pid, os.pidfd_open(pid))
    cgroup_fd = -1
    if plan.cgroup is not None:
        try:
            cgroup_fd = os.open(plan.cgroup.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfinementError("cgroup", exc.errno, plan.cgroup.path) from exc
    try:
        return namespaces.spawn_in_namespaces(plan.namespaces, cgroup_fd)
    finally:
        if cgroup_fd >= 0:
            os.close(cgroup_fd)


WARM_RUNS = 20  # past 3.11's warm-up (8 calls) and its first specialisations


def _warm_workers_code(plan: SessionPlan) -> None:
    """Run here, before the first fork, the pure code every worker runs
    (the plan's key and decoding, the split of its binds, a first call's
    request and reply): Python 3.11 quickens a function's bytecode (a warm-up
    counter, then inline caches written into it) the first times it runs;
    done here, the workers inherit it done instead of each writing its own
    copy of those code objects' pages."""
    payload = encode_plan(plan)
    # What the daemon sends a worker, and what a worker reports (as it sends it).
    to_worker = [protocol.encode(m)[4:] for m in (protocol.AdoptSession(plan=payload),
                                                     protocol.AddChannel(id=1))]
    protections = msgspec.structs.replace(plan.protections, absent_paths=[], made_ahead=True,
                                          root=list(plan.protections.root))
    for _ in range(WARM_RUNS):
        pool_key(plan)
        decode_plan(payload)
        if plan.mounts is not None:
            plan.mounts.split_binds()
        for m in to_worker:
            protocol.decode(protocol.to_worker_decoder, m)
        protocol.encode(protocol.WorkerPooled(pid=1, timings_ms={"hygiene": 0.1}))
        protocol.encode(protocol.WorkerReady(pid=1, protections=protections, timings_ms={"seccomp": 0.1}))
        _tool_server.warm_up(plan)


def serve_fork_server(sock: socket.socket, daemon_pid: int, shared: UcountsPlan | None = None) -> NoReturn:
    hygiene.die_with_parent(daemon_pid)
    # First of all, before any child: below the user namespace every session's
    # is made in (namespaces.enter_shared), when the daemon asked for one. Its
    # first frame tells the daemon whether it is (OkReply) or why not.
    hello: protocol.OkReply | protocol.ErrorReply = protocol.OkReply(id=0)
    if shared is not None:
        try:
            why = namespaces.enter_shared(shared, os.getuid(), os.getgid())
        except ConfinementError as exc:
            print(f"dispatchd: fork server: {exc}", file=sys.stderr, flush=True)
            os._exit(1)
        if why:
            hello = protocol.ErrorReply(id=0, code="shared_budgets", message=why)
    # A session of its own, with no terminal, that every worker shares
    # (hygiene.new_group): one scheduler group for all the tool servers.
    hygiene.lead_session()
    # Nothing of the daemon's but our channel (not its listening socket, not
    # systemd's): stdio stays, for a traceback to reach the daemon's log.
    keep = sock.fileno()
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 20)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    hygiene.child_subreaper()
    leave_seccomp_encoded()  # before any plan is decoded here: see plan.leave_seccomp_encoded
    catalogue.warm_conversions()  # once here, not at each session's first call of each tool
    # Single-threaded for good: threading's and logging's at-fork hooks would
    # only rebuild, in each worker, what is already right (forkhooks.py).
    if not forkhooks.leave_out():
        # Nothing breaks (every hook runs, as in any fork), but each sandbox
        # writes more pages: said once, for whoever reads the log.
        print(f"dispatchd: fork server: threading's and logging's at-fork hooks not found where Python "
              f"{sys.version_info.major}.{sys.version_info.minor} keeps them; left in (each sandbox runs them)",
              file=sys.stderr, flush=True)
    frames = protocol.FrameSocket(sock, fds=True)
    frames.send(hello)
    programs: dict[bytes, bytes] = {}
    workers: set[int] = set()
    stacks: set[int] = set()  # the running stacks among ``workers``
    me = os.getpid()
    warmed = False
    while True:
        # Wake up now and then to reap workers that have ended, and to end
        # what lands here: a child subreaper, the fork server gets a process
        # of a session whose init died (killed from inside the session,
        # where there is no pid namespace to protect it), or one a stopped
        # stack forked, instead of the host's init; it ends here, with all
        # it forked, so closing a session still leaves nothing running.
        ready, _, _ = select.select([sock], [], [], ORPHAN_SWEEP_S)
        _reap(workers, stacks)
        subtree.end_subtrees(me, workers)
        if not ready:
            continue
        try:
            req = frames.recv(protocol.fork_server_request_decoder)
        except protocol.DescriptorsLost as exc:
            # Out of descriptors: this one request is refused (its frame was
            # read whole, the stream goes on), the daemon is told why.
            frames.drop_fds()
            _answer(frames, protocol.ErrorReply(id=protocol.request_id_of(exc.payload), code="spawn_failed",
                                                message=f"dispatchd's fork server cannot take this request: {exc}; "
                                                "nothing was started"))
            continue
        except (protocol.ProtocolError, OSError):
            os._exit(1)
        if req is None:
            _last_sweep(workers, stacks)
        try:
            warmed = _serve_one(req, frames, sock, programs, workers, stacks, me, warmed)
        except Exception as exc:
            if os.getpid() != me:  # a child of ours must never serve as the fork server
                os._exit(127)
            # Out of descriptors (EMFILE on a pipe, a socket pair, a pidfd) or
            # a bug: this request fails with why, the fork server goes on.
            # Every handler answers last, so nothing was sent for it yet.
            traceback.print_exc()
            frames.drop_fds()
            _answer(frames, protocol.ErrorReply(id=req.id, code="spawn_failed",
                                                message=f"dispatchd's fork server could not serve this request: {exc}"))


def _last_sweep(workers: set[int], stacks: set[int]) -> NoReturn:
    """The daemon closed its channel (its stop): the stacks and all they
    forked, and whatever else is left behind, ended here and exited, since
    a parent-death signal reaches a direct child only. Then stopped, not
    exited: the daemon lists the sessions' first processes still ours (none
    reaped meanwhile) and waits for their namespaces' teardown before it
    kills us (``ForkServerClient.stop``)."""
    _end_left_behind(workers - stacks)
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(0)


def _answer(frames: protocol.FrameSocket, reply: protocol.ErrorReply) -> None:
    try:
        frames.send(reply)
    except OSError:
        os._exit(1)  # the daemon's end is gone


def _serve_one(req: protocol.ForkServerRequest, frames: protocol.FrameSocket, sock: socket.socket,
               programs: dict[bytes, bytes], workers: set[int], stacks: set[int], me: int, warmed: bool) -> bool:
    """One request, answered (by every path but an exception raised before
    its answer: the caller answers that). Returns whether the workers' code
    is warmed now (``_warm_workers_code``, before the first spawn)."""
    if isinstance(req, protocol.NetRules):
        frames.send(_net_rules(req, frames))
        return warmed
    if isinstance(req, protocol.NetClosed):
        frames.send(_net_closed(req, frames, workers))
        return warmed
    if isinstance(req, protocol.EndLeftBehind):
        _end_left_behind(workers)
        frames.send(protocol.OkReply(id=req.id))
        return warmed
    if isinstance(req, protocol.DnsSockets):
        _dns_sockets(req, frames)
        return warmed
    if isinstance(req, protocol.WakeWorker):
        _wake(req, frames, sock, programs, workers)
        return warmed
    if isinstance(req, protocol.StartStack):
        reply, pidfd = stackstart.start_stack(req, frames, workers)
        if isinstance(reply, protocol.Spawned):
            stacks.add(reply.pid)
        try:
            frames.send(reply, fds=[pidfd] if pidfd >= 0 else None)
        finally:
            if pidfd >= 0:
                os.close(pidfd)
        return warmed
    control_fd = worktree_fd = -1  # no worktree for a sandbox made ahead: its session sends it (AdoptSession)
    try:
        control_fd = frames.take_fd()
        if not req.pooled:
            worktree_fd = frames.take_fd()  # the daemon's checked O_PATH descriptor of the worktree
    except protocol.ProtocolError as exc:
        _close(control_fd)
        frames.send(protocol.ErrorReply(id=req.id, code="spawn_failed", message=str(exc)))
        return warmed
    try:
        plan = decode_plan(req.plan)
        if not warmed:
            _warm_workers_code(plan)
            warmed = True
        key = msgspec.msgpack.encode(plan.seccomp)
        if key not in programs:
            programs[key] = seccomp.compile_seccomp(seccomp_of(plan))
        program = programs[key]
        pid, pidfd = _spawn(plan)
    except Exception as exc:
        _close(control_fd, worktree_fd)
        message = str(exc) if isinstance(exc, ConfinementError) else f"bad plan: {exc}"
        frames.send(protocol.ErrorReply(id=req.id, code="spawn_failed", message=message))
        return warmed
    if pid == 0:
        forkhooks.put_back()  # the worker starts threads: its own forks get every hook
        sock.close()
        run_session(plan, program, control_fd, me, worktree_fd, req.plan)
    workers.add(pid)
    _close(control_fd, worktree_fd)
    try:
        frames.send(protocol.Spawned(id=req.id, pid=pid), fds=[pidfd])
    finally:
        os.close(pidfd)
    return True


def start_fork_server(shared: UcountsPlan | None = None) -> tuple[int, socket.socket]:
    """Fork the fork server (below a user namespace bounded by ``shared``,
    when given: ``namespaces.enter_shared``). Call before any thread exists.
    Returns its pid and the daemon's end of the channel to it, whose first
    frame says how that went (``ForkServerClient.hello``)."""
    daemon_pid = os.getpid()
    return fork_serving(lambda child_end: serve_fork_server(child_end, daemon_pid, shared))


def fork_serving(serve: Callable[[socket.socket], object], exit_code: int = 1) -> tuple[int, socket.socket]:
    """Fork a child that runs ``serve`` on its end of a new socket pair, then
    exits with ``exit_code`` (whatever ``serve`` did: it never returns into
    the parent's code). Returns the child's pid and the parent's end."""
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        parent_end.close()
        try:
            serve(child_end)
        finally:
            os._exit(exit_code)
    child_end.close()
    return pid, parent_end
