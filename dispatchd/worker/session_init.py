"""A session's processes, from the fork server's child to the tool server.

Runs in the child the fork server made for one session. ``confine_shared``
then ``confine_session`` are the whole sandbox as one ordered checklist;
``run_session`` wraps them, reports the outcome to the daemon on the control
channel, and then keeps the session's processes in one tree. A sandbox made
ahead (``dispatchd.daemon.pool``) runs the first half, waits for its session
(``AdoptSession``: the session's plan, which must have the same ``pool_key``,
and the worktree's descriptor), then runs the second: no code of a session
runs in it before the whole plan is applied, and it serves one session only.

With user namespaces (full mode), one process:

    fork server ── W1 (tool server, and pid 1 of the session's pid namespace)
                    └── bash -c ... (commands; orphans come back to W1)

The fork server makes W1 with one ``clone3`` already in the session's
namespaces (and cgroup). As pid 1 it ignores every signal it has no handler
for, so no command can end it; when it exits the kernel kills everything left
in the namespace; it dies with the fork server; a thread of its own reaps the
orphans (``worker/reaper.py``).

Without user namespaces (degraded mode), two:

    fork server ── W1 (session init: a child subreaper)
                    └── W2 (tool server, in a nested Landlock domain)
                          └── bash -c ... (commands)

W1 is a plain fork that, on SIGTERM, kills every process of its Landlock
domain (the signal scope keeps ``kill(-1)`` inside it); the nested domain
keeps the tool server and the commands from signalling W1.
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import NoReturn

import msgspec

from dispatchd import protocol
from dispatchd.confine import cgroups, hygiene, landlock, limits, mounts, namespaces, netns, netstack, seccomp, ucounts
from dispatchd.confine.plan import SessionPlan, can_sleep, decode_plan, pool_key
from dispatchd.errors import ConfinementError
from dispatchd.tools import proctree
from dispatchd.worker import reaper, wake


class _Clock:
    """Milliseconds per confinement step, reported with ``WorkerReady`` (debug logs)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.last = time.perf_counter()
        self.steps: dict[str, float] = {}

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] = round((now - self.last) * 1e3, 3)
        self.last = now


class Held:
    """What ``confine_shared`` leaves open for ``confine_session``: the
    host's root by descriptor (-1: none; ``mounts._hold_host``) and the
    Landlock ruleset begun with the root (``landlock.start_ruleset``)."""

    def __init__(self, host_fd: int = -1, ruleset: landlock.Ruleset | None = None) -> None:
        self.host_fd = host_fd
        self.ruleset = ruleset
        self.dns_door = False  # the DNS relay's door made, after the namespaces in ``keep``
        # The session namespace's pid namespace budget, writable
        # (ucounts.open_pid_budget): for the wake kit, or closed.
        self.pid_budget = -1


def confine_shared(plan: SessionPlan, parent: int, keep: list[int], clock: _Clock, hold: list[int],
                   early: Callable[[list[int], bool], None] | None = None) -> Held:
    """The part of the plan every session of its kind shares (``pool_key``):
    what a sandbox made ahead applies before it knows its session.

    On return only ``keep`` and ``hold`` are open (with a network namespace
    of its own, its user and network namespaces are appended to ``keep``),
    and what it returns (``Held``): with a root of its own the host's root is
    still reachable, below ``mounts.OLD_ROOT`` or by its descriptor
    (``mounts._hold_host``), and a Landlock ruleset is begun, so no code of a
    session may run until ``confine_session`` (given them) has returned.

    With user namespaces the caller was born in them (``clone3`` in the fork
    server, ``namespaces.spawn_in_namespaces``), in the session's cgroup, as
    pid 1; without, it is a plain fork and joins the cgroup here.

    ``early(fds, dns_door)``: given its namespaces (and the DNS relay's door)
    as soon as they are made, before the root (the daemon starts the network
    stack meanwhile); it must close them, and they are not left in ``keep``.
    """
    if plan.cgroup is not None and not plan.namespaces.user:
        # First, before any fork: every process of the session is born in its
        # cgroup, and cannot leave it (the cgroup files are out of its reach).
        cgroups.apply_cgroup(plan.cgroup.path)
        clock("cgroup")
    hygiene.new_group()  # own group, in the fork server's session: no controlling terminal
    # The fork server gone: the session gone. As pid 1 of the session's
    # namespace, the parent (outside it) reads as pid 0.
    hygiene.die_with_parent(0 if plan.namespaces.pid else parent)
    hygiene.close_inherited_fds([*keep, *hold])  # only the control channel (and the worktree)
    clock("hygiene")
    namespaces.apply_id_maps(plan.namespaces)  # born in them: only the ids are left to map
    keep += namespaces.open_own(plan.namespaces)  # for the daemon, with WorkerReady (or WorkerNamespaces)
    clock("namespaces")
    # Needs CAP_SYS_RESOURCE in the new namespace, and /proc/sys before the
    # mounts make it read-only.
    ucounts.apply_ucounts(plan.ucounts)
    held = Held()
    held.pid_budget = ucounts.open_pid_budget(plan.ucounts) if can_sleep(plan) else -1
    clock("ucounts")
    if plan.loopback:
        netns.apply_loopback()  # needs CAP_NET_ADMIN in the namespace (no mount: before the root)
        clock("loopback")
    if plan.dns_door:
        # Port 53 of its loopback needs the namespace's CAP_NET_BIND_SERVICE:
        # now, before any of its session's code, handed over with the
        # namespaces. Not made: the daemon has the fork server make it.
        try:
            keep += netstack.open_dns_door()
            held.dns_door = True
            clock("dns_door")
        except OSError as exc:
            clock(f"dns_door_failed_errno_{exc.errno}")  # the daemon's debug log says so
    if early is not None and len(keep) > 1:
        early(keep[1:], held.dns_door)
        del keep[1:]
        held.dns_door = False  # handed over already
        clock("namespaces_sent")
    if not plan.namespaces.pid:
        hygiene.child_subreaper()  # orphans come back to us, not to the host's init
    if plan.mounts is not None:
        held.host_fd = mounts.apply_root(plan.mounts)  # needs the namespace's capabilities: before dropping them
        clock("root")
    if plan.landlock.ahead:
        # After the root: the rules bind to its inodes (restricted only at the end, in confine_session).
        held.ruleset = landlock.start_ruleset(plan.landlock)
        clock("landlock_ahead")
    # After the id maps (a process that is not dumpable cannot write its own);
    # from here nothing of the user's may ptrace or read us, made ahead or not.
    hygiene.not_dumpable()
    if plan.namespaces.user:
        hygiene.drop_bounding_set()  # no exec gains a capability; those in effect stay for the mounts
    clock("bounding_set")
    return held


def confine_session(plan: SessionPlan, program: bytes, keep: list[int], clock: _Clock,
                    worktree_fd: int, held: Held | None = None, kit: list[int] | None = None) -> list[str]:
    """The rest of the plan, after ``confine_shared``, in order. Returns the
    skipped (absent) paths. ``worktree_fd`` is the daemon's descriptor of the
    worktree it checked: the mounts bind it and Landlock grants it, never the
    path by name; it is closed here. On return the caller is confined,
    single-threaded, with only ``keep`` open (under network "domains", the
    proxy's listener appended). ``held``: what ``confine_shared`` returned
    (the host's root, closed here with the session's binds; the ruleset
    begun, restricted here). ``kit``: for a session that may sleep
    (``can_sleep``), the wake kit is appended to it (``worker/wake.py``:
    the complete ruleset, then the namespaces), for the daemon alone."""
    held = held or Held()
    if plan.mounts is not None:
        # Still with the namespace's capabilities.
        mounts.apply_session_mounts(plan.mounts, worktree_fd, clock, host_fd=held.host_fd)
        clock("read_only")
    if plan.proxy_port:
        # The only door out of a "domains" session, made before any of its code
        # runs (so nothing of the session's can hold the port first); the
        # daemon's proxy serves what it accepts.
        keep.append(netns.open_proxy_listener(plan.proxy_port))
        clock("proxy listener")
    namespaces_kept = wake.open_kit_namespaces(plan) if kit is not None and can_sleep(plan) else []
    limits.apply_limits(plan.limits_plan)  # soft = hard, before capabilities go: none can raise them
    if plan.namespaces.user:
        hygiene.drop_capabilities()  # nothing below needs a capability
    hygiene.no_new_privs()  # required before Landlock and seccomp; setuid grants nothing
    clock("privileges")
    # After mounts: rules bind to the inodes of the new root; the worktree's from the checked fd.
    ruleset_kept: list[int] | None = [] if namespaces_kept else None
    # Without a mount namespace git's directories are granted where they are:
    # each opened with no symlink on the way, so that what is bound is what
    # the daemon looked at (in full mode the binds are, and refuse a swap).
    exact = landlock.open_exact(list(plan.paths.git.writable)) if not plan.namespaces.mount else {}
    try:
        skipped = landlock.apply_landlock(plan.landlock, {**exact, plan.paths.worktree: worktree_fd},
                                          begun=held.ruleset, kept=ruleset_kept)
    finally:
        for fd in exact.values():
            os.close(fd)
    os.close(worktree_fd)  # granted and bound: nothing in the session may hold it
    if kit is not None and ruleset_kept:
        # Sent to the daemon with WorkerReady, closed here then.
        kit += ruleset_kept + namespaces_kept + ([held.pid_budget] if held.pid_budget >= 0 else [])
    elif held.pid_budget >= 0:
        os.close(held.pid_budget)
    held.pid_budget = -1
    clock("landlock")
    seccomp.apply_seccomp(program)  # last: it forbids mount, unshare, ... used above
    clock("seccomp")
    return skipped


def _hand_over_namespaces(control: protocol.FrameSocket, fds: list[int], dns_door: bool) -> None:
    """A sandbox made ahead: its namespaces (and the relay's door) to the
    daemon now, and closed here: no command of its session inherits them."""
    try:
        _report(control, protocol.WorkerNamespaces(pid=os.getpid(), dns_door=dns_door), fds=fds)
    finally:
        for fd in fds:
            os.close(fd)


def _wait_for_session(control: protocol.FrameSocket, made_for: SessionPlan, made_bytes: bytes,
                      clock: _Clock) -> tuple[SessionPlan, int, int]:
    """A sandbox made ahead (its namespaces handed over already, by
    ``confine_shared``'s ``early``): say so, and wait for the session (its
    plan, worktree and, when sent, the opener's channel: -1 if not). Leaves
    quietly when the daemon lets go of it; refuses a plan it was not made
    for (``pool_key``). ``made_bytes``: ``made_for`` as the daemon encoded it."""
    # The daemon makes a sandbox with the plan of its likely session (the
    # kind's last open, as this one): an AdoptSession of these same bytes is
    # that plan, taken as it is; any other is decoded, and both keys are
    # computed and compared then (at adoption, beside the daemon's longer
    # join: computed here, for every sandbox, the key's objects cost each
    # some 50-80 KiB of copied pages). Warm what adoption runs first (the
    # split of the binds): the pages it touches are copied from the fork
    # server now, not while a session waits.
    if made_for.mounts is not None:
        made_for.mounts.split_binds()
    from dispatchd.worker.tool_server import warm_up  # pre-imported by the fork server

    warm_up(made_for)
    _report(control, protocol.WorkerPooled(pid=os.getpid(), timings_ms=clock.steps))
    try:
        msg = control.recv(protocol.to_worker_decoder)
    except (OSError, protocol.ProtocolError):
        os._exit(0)
    if msg is None:
        os._exit(0)  # retired unused
    clock.restart()
    if not isinstance(msg, protocol.AdoptSession):
        raise ConfinementError("pool", detail=f"expected the session's plan, got {type(msg).__name__}")
    try:
        worktree_fd = control.take_fd()
        channel_fd = control.take_fd() if msg.channel else -1
    except protocol.ProtocolError as exc:
        raise ConfinementError("pool", detail=str(exc)) from exc
    if made_bytes and msg.plan == made_bytes:
        return made_for, worktree_fd, channel_fd  # the same bytes: the plan it was made with
    plan = decode_plan(msg.plan)
    made_for_key = pool_key(made_for)
    if made_for_key is None or pool_key(plan) != made_for_key:
        for fd in (worktree_fd, channel_fd):
            if fd >= 0:
                os.close(fd)
        raise ConfinementError("pool", detail="the session's plan is not the one this sandbox was made for")
    return plan, worktree_fd, channel_fd


def _kill_session(plan: SessionPlan) -> None:
    """End every process of the session (degraded mode: no pid namespace to do it for us)."""
    if plan.landlock.scoped & landlock.SCOPE_SIGNAL:
        # Scoped by Landlock, kill(-1) reaches only this domain: the session's
        # own processes, never the user's others.
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return
    import psutil

    for _ in range(3):  # again, for children forked while we were killing
        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass


def run_session(plan: SessionPlan, program: bytes, control_fd: int, parent: int, worktree_fd: int,
                plan_bytes: bytes = b"") -> NoReturn:
    """Entry point of the fork server's child. Never returns. ``plan_bytes``:
    ``plan`` as the daemon encoded it (the request's)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = protocol.FrameSocket(socket.socket(fileno=control_fd), fds=True)
    clock = _Clock()
    keep = [control_fd]
    kit: list[int] = []  # what waking the session will need (worker/wake.py), for the daemon
    made_ahead = worktree_fd < 0  # a sandbox of the pool: its session comes later
    channel_fd = -1  # the opener's channel, when it came with the session
    try:
        held = confine_shared(plan, parent, keep, clock, [] if made_ahead else [worktree_fd],
                              early=functools.partial(_hand_over_namespaces, control) if made_ahead else None)
        if made_ahead:
            plan, worktree_fd, channel_fd = _wait_for_session(control, plan, plan_bytes, clock)
        skipped = confine_session(plan, program, keep, clock, worktree_fd, held, kit)
    except BaseException as exc:
        wake.fail(control, exc, "worker start")
    # What the session sees: the planned root, less what this machine lacks.
    protections = msgspec.structs.replace(plan.protections, absent_paths=skipped, made_ahead=made_ahead,
                                          root=[r for r in plan.protections.root if r.path not in skipped])

    from dispatchd.worker.tool_server import serve  # pre-imported by the fork server

    ready = protocol.WorkerReady(pid=os.getpid(), protections=protections, timings_ms=clock.steps,
                                 proxy_listener=bool(plan.proxy_port),
                                 # Made ahead: handed over with WorkerNamespaces already.
                                 namespaces=bool(plan.namespaces.user and plan.namespaces.net) and not made_ahead,
                                 dns_door=held.dns_door and not made_ahead,
                                 wake_kit=len(kit))
    if plan.namespaces.pid:
        # One process: the tool server is the session's init. Pid 1 of the
        # namespace already ignores every signal it has no handler for (no
        # command can end it), its death ends every process in the
        # namespace, and a thread of its own reaps the orphans (started at
        # the first command: before it there is nothing to reap).
        _report(control, ready, fds=keep[1:] + kit)
        for fd in keep[1:] + kit:
            os.close(fd)  # the daemon has it; no command inherits it (nor holds the ruleset)
        reaper.start_at_first_spawn(proctree.owns, proctree.CHILD_BORN, proctree.after_first_spawn)
        serve(control, plan, first_channel=channel_fd)
        os._exit(0)
    try:
        server = os.fork()
    except OSError as exc:  # the process limit, already: say so rather than vanish
        _report(control, protocol.WorkerFailed(step="fork the tool server", errno=exc.errno or 0, path="",
                                               message=f"cannot fork the tool server: {exc.strerror}"))
        os._exit(1)
    if server == 0:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if plan.landlock.scoped & landlock.SCOPE_SIGNAL:
            # No pid namespace makes the session init unkillable from inside:
            # a domain of their own keeps the tool server and every command
            # from signalling it, so it is always there to end them all.
            try:
                landlock.scope_signals_below()
            except ConfinementError as exc:
                _report(control, protocol.WorkerFailed(step=exc.step, errno=exc.errno, path=exc.path,
                                                       message=exc.message))
                os._exit(1)
            clock("nested scope")
        _report(control, ready, fds=keep[1:])
        for fd in keep[1:]:
            os.close(fd)  # the daemon has it; no command inherits it
        serve(control, plan, first_channel=channel_fd)
        os._exit(0)
    control.close()
    for fd in keep[1:] + ([channel_fd] if channel_fd >= 0 else []):
        os.close(fd)
    # Only now, confined by Landlock's signal scope, may SIGTERM mean
    # "kill(-1)": from here it reaches the session's processes alone. The
    # parent's death then sends SIGTERM too, so the session is ended, not
    # orphaned, when the fork server goes.
    def end_session(*_: object) -> None:
        _kill_session(plan)
        os._exit(0)

    signal.signal(signal.SIGTERM, end_session)
    hygiene.die_with_parent(parent, signal.SIGTERM)
    _reap_until(server, plan)


def _reap_until(server: int, plan: SessionPlan) -> NoReturn:
    """Session init: reap every orphan; when the tool server ends, end the session."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            os._exit(0)
        except InterruptedError:
            continue
        if pid == server:
            _kill_session(plan)
            # The tool server's fate goes up as our exit code: the daemon tells it.
            os._exit(_passed_up(status))


def _passed_up(status: int) -> int:
    """An exit code that says how a child ended: its own code, or 128+N for
    signal N (what ``dispatchd.daemon.exits`` reads back)."""
    if os.WIFSIGNALED(status):
        return min(128 + os.WTERMSIG(status), 255)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


def _report(control: protocol.FrameSocket,
            msg: protocol.WorkerReady | protocol.WorkerPooled | protocol.WorkerNamespaces | protocol.WorkerFailed,
            fds: list[int] | None = None) -> None:
    try:
        control.send(msg, fds=fds)
    except OSError:
        pass  # the daemon is gone; nobody to tell
