"""A session's processes, from the fork server's child to the tool server.

Runs in the child the fork server made for one session. ``confine`` is the
whole sandbox as one ordered checklist; ``run_session`` wraps it, reports the
outcome to the daemon on the control channel, and then keeps the session's
processes in one tree.

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

import os
import signal
import socket
import time
import traceback
from typing import NoReturn

import msgspec

from dispatchd import protocol
from dispatchd.confine import cgroups, hygiene, landlock, limits, mounts, namespaces, netns, seccomp, ucounts
from dispatchd.confine.plan import SessionPlan
from dispatchd.errors import ConfinementError
from dispatchd.tools import proctree
from dispatchd.worker import reaper


class _Clock:
    """Milliseconds per confinement step, reported with ``WorkerReady`` (debug logs)."""

    def __init__(self) -> None:
        self.last = time.perf_counter()
        self.steps: dict[str, float] = {}

    def __call__(self, step: str) -> None:
        now = time.perf_counter()
        self.steps[step] = round((now - self.last) * 1e3, 3)
        self.last = now


def confine(plan: SessionPlan, program: bytes, parent: int, keep: list[int], clock: _Clock,
            worktree_fd: int) -> list[str]:
    """Apply the plan to this process, in order. Returns the skipped (absent) paths.

    ``worktree_fd`` is the daemon's descriptor of the worktree it checked: the
    mounts bind it and Landlock grants it, never the path by name.
    On return the caller is W1: confined, single-threaded, with only ``keep`` open
    (with a network namespace of its own, its user and network namespaces are
    appended to it; under network "domains", then the proxy's listener).

    With user namespaces the caller was born in them (``clone3`` in the fork
    server, ``namespaces.spawn_in_namespaces``), in the session's cgroup, as
    pid 1; without, it is a plain fork and joins the cgroup here.
    """
    if plan.cgroup is not None and not plan.namespaces.user:
        # First, before any fork: every process of the session is born in its
        # cgroup, and cannot leave it (the cgroup files are out of its reach).
        cgroups.apply_cgroup(plan.cgroup.path)
        clock("cgroup")
    hygiene.new_session()  # own session and group, no controlling terminal
    # The fork server gone: the session gone. As pid 1 of the session's
    # namespace, the parent (outside it) reads as pid 0.
    hygiene.die_with_parent(0 if plan.namespaces.pid else parent)
    hygiene.close_inherited_fds([*keep, worktree_fd])  # only the control channel (and the worktree, below)
    clock("hygiene")
    namespaces.apply_id_maps(plan.namespaces)  # born in them: only the ids are left to map
    keep += namespaces.open_own(plan.namespaces)  # for the daemon, with WorkerReady
    clock("namespaces")
    # Needs CAP_SYS_RESOURCE in the new namespace, and /proc/sys before the
    # mounts make it read-only.
    ucounts.apply_ucounts(plan.ucounts)
    clock("ucounts")
    if not plan.namespaces.pid:
        hygiene.child_subreaper()  # orphans come back to us, not to the host's init
    if plan.mounts is not None:
        mounts.apply_mounts(plan.mounts, worktree_fd)  # needs the namespace's capabilities: before dropping them
        clock("mounts")
    if plan.loopback:
        netns.apply_loopback()  # likewise needs CAP_NET_ADMIN in the namespace
        clock("loopback")
    if plan.proxy_port:
        # The only door out of a "domains" session, made before any of its code
        # runs (so nothing of the session's can hold the port first); the
        # daemon's proxy serves what it accepts.
        keep.append(netns.open_proxy_listener(plan.proxy_port))
        clock("proxy listener")
    limits.apply_limits(plan.limits_plan)  # soft = hard, before capabilities go: none can raise them
    if plan.namespaces.user:
        hygiene.drop_capabilities()  # nothing below needs a capability
    hygiene.no_new_privs()  # required before Landlock and seccomp; setuid grants nothing
    hygiene.not_dumpable()  # commands (same uid) cannot ptrace or read our memory
    clock("privileges")
    # After mounts: rules bind to the inodes of the new root; the worktree's from the checked fd.
    skipped = landlock.apply_landlock(plan.landlock, {plan.paths.worktree: worktree_fd})
    os.close(worktree_fd)  # granted and bound: nothing in the session may hold it
    clock("landlock")
    seccomp.apply_seccomp(program)  # last: it forbids mount, unshare, ... used above
    clock("seccomp")
    return skipped


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


def run_session(plan: SessionPlan, program: bytes, control_fd: int, parent: int, worktree_fd: int) -> NoReturn:
    """Entry point of the fork server's child. Never returns."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = protocol.FrameSocket(socket.socket(fileno=control_fd), fds=True)
    clock = _Clock()
    keep = [control_fd]
    try:
        skipped = confine(plan, program, parent, keep, clock, worktree_fd)
    except ConfinementError as exc:
        _report(control, protocol.WorkerFailed(step=exc.step, errno=exc.errno, path=exc.path, message=exc.message))
        os._exit(1)
    except BaseException as exc:  # a bug: still say which, then go
        _report(control, protocol.WorkerFailed(step="worker start", errno=0, path="",
                                               message=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        os._exit(1)
    # What the session sees: the planned root, less what this machine lacks.
    protections = msgspec.structs.replace(plan.protections, absent_paths=skipped,
                                          root=[r for r in plan.protections.root if r.path not in skipped])

    from dispatchd.worker.tool_server import serve  # pre-imported by the fork server

    ready = protocol.WorkerReady(pid=os.getpid(), protections=protections, timings_ms=clock.steps,
                                 proxy_listener=bool(plan.proxy_port),
                                 namespaces=bool(plan.namespaces.user and plan.namespaces.net))
    if plan.namespaces.pid:
        # One process: the tool server is the session's init. Pid 1 of the
        # namespace already ignores every signal it has no handler for (no
        # command can end it), its death ends every process in the
        # namespace, and a thread of its own reaps the orphans (started at
        # the first command: before it there is nothing to reap).
        _report(control, ready, fds=keep[1:])
        for fd in keep[1:]:
            os.close(fd)  # the daemon has it; no command inherits it
        reaper.start_at_first_spawn(proctree.owns, proctree.CHILD_BORN, proctree.after_first_spawn)
        serve(control, plan)
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
        serve(control, plan)
        os._exit(0)
    control.close()
    for fd in keep[1:]:
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


def _report(control: protocol.FrameSocket, msg: protocol.WorkerReady | protocol.WorkerFailed,
            fds: list[int] | None = None) -> None:
    try:
        control.send(msg, fds=fds)
    except OSError:
        pass  # the daemon is gone; nobody to tell
