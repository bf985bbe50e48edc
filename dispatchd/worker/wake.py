"""A session that sleeps, made again: its tool server, confined as before.

An idle session's tool server hands its client channels to the daemon and
exits (``tool_server``: ``MaySleep``, ``Sleep``, ``Asleep``); its pid
namespace ends with it, and nothing of the session runs. What it leaves is
held by the daemon, by descriptor, since its first start: the *wake kit*,

    the complete Landlock ruleset (its rules bound to inodes then),
    the session's user, mount, IPC and (when it has one) network namespaces,
    its user namespace's max_pid_namespaces, open for writing (0 in there:
    the wake raises it for its one new pid namespace and sets it back),

with the session's cgroup and the channels. The next call wakes it:

    fork server ── intermediate: setns into the kit's namespaces,
                   a new pid namespace, then clone3(CLONE_PARENT) ──┐
    fork server ── W1 (pid 1 again, born in the session's cgroup) ──┘
                     a fresh /proc (read-only, as the first was made),
                     the per-process confinement of
                     ``session_init.confine_session`` (limits, capabilities,
                     no_new_privs, the kept ruleset, seccomp), then serves.

Guarantees:
- The woken tool server is confined like the first: the same mounts (the
  session's mount namespace, which nothing in the session could change: no
  capability, seccomp forbids mount), the same Landlock rules (restricted by
  the ruleset made at the first start, never paths looked up again, so what
  the session did to its files meanwhile cannot widen them; the one rule
  added is the plan's /proc rule on the fresh /proc's root, one a wake),
  the same seccomp program, limits and dropped capabilities; and pid 1 of a pid
  namespace of its own, so nothing inside can signal it.
- The ruleset lives in the daemon only: the session's processes never hold
  it (a tool server that could add rules to it would widen its successor).
- The intermediate runs no session code, holds nothing after ``clone3`` and
  exits at once; pid 1 is the fork server's child (``CLONE_PARENT``), dies
  with it, and its pid and pidfd reach the daemon as a spawn's do.
- A kit that does not match the plan (a missing namespace, a refused setns)
  fails the wake with the step named: the session then ends, never runs
  less confined.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from dispatchd import protocol
from dispatchd.confine import _sys, hygiene, landlock, limits, namespaces, seccomp
from dispatchd.confine.plan import SessionPlan
from dispatchd.errors import ConfinementError

# The kit's namespaces, in the order they travel after the ruleset, and
# joined: the user namespace first (it gives the capabilities the others need).
_USER = ("user", _sys.CLONE_NEWUSER)
_MOUNT = ("mnt", _sys.CLONE_NEWNS)
_IPC = ("ipc", _sys.CLONE_NEWIPC)
_NET = ("net", _sys.CLONE_NEWNET)


def kit_namespaces(plan: SessionPlan) -> list[tuple[str, int]]:
    """The namespaces a woken tool server joins, by ``/proc/self/ns`` name and ``setns`` type."""
    return [_USER, _MOUNT, _IPC, *([_NET] if plan.namespaces.net else [])]


def open_kit_namespaces(plan: SessionPlan) -> list[int]:
    """In the session's first process, before seccomp: its namespaces as
    descriptors for the daemon (closed here on failure)."""
    return namespaces.open_namespaces([name for name, _ in kit_namespaces(plan)],
                                      "sleep: open the session's namespaces")


def spawn_woken(plan: SessionPlan, kit: list[int], cgroup_fd: int) -> int:
    """In the fork server: make the session's pid 1 again, in the kit's
    namespaces (``kit``: ruleset first). Returns its pid, 0 in it. Raises
    ``ConfinementError`` naming the step when the intermediate failed."""
    names = kit_namespaces(plan)
    if len(kit) not in (1 + len(names), 2 + len(names)):
        raise ConfinementError("sleep: wake kit", detail=f"{len(kit)} descriptors, {1 + len(names)} expected")
    budget = kit[1 + len(names)] if len(kit) > 1 + len(names) else -1
    after = plan.ucounts.maxima.get("max_pid_namespaces", 0)
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    if middle == 0:
        os.close(read_end)
        _intermediate(names, kit[1:1 + len(names)], (budget, after), cgroup_fd, write_end)  # returns only in pid 1
        return 0
    os.close(write_end)
    chunks = []
    try:
        while chunk := os.read(read_end, 4096):
            chunks.append(chunk)
    finally:
        os.close(read_end)
        # Waited for here, not by the loop's reaping: not waiting measured
        # no faster (bench/wake.py, A/B).
        os.waitpid(middle, 0)
    said = b"".join(chunks).decode(errors="replace").strip()
    if not said.startswith("pid "):
        # "errno N step: words": the errno kept, so that EAGAIN (no process
        # to be had) can be told from a wake that cannot work.
        code, _, words = said.removeprefix("errno ").partition(" ") if said.startswith("errno ") else ("0", "", said)
        raise ConfinementError("sleep: join the session's namespaces", int(code) if code.isdigit() else 0,
                               detail=words or "the intermediate said nothing")
    return int(said[4:])


def _intermediate(names: list[tuple[str, int]], ns_fds: list[int], budget: tuple[int, int], cgroup_fd: int,
                  report: int) -> None:
    """The fork server's child: join, fork pid 1 as its parent's child, say its
    pid (or what failed) on ``report``, exit. Returns only in pid 1.
    ``budget``: the namespace's max_pid_namespaces (fd, -1: none) and the
    value it is set back to once the pid namespace is made (the session's
    own processes are never given one, and none runs meanwhile)."""
    step = "setns"
    try:
        for (name, nstype), fd in zip(names, ns_fds):
            step = f"setns {name}"
            _sys.setns(fd, nstype)
        budget_fd, after = budget
        if budget_fd >= 0:
            step = "raise max_pid_namespaces"
            # Room for the ones of ended naps the kernel has not freed yet.
            os.pwrite(budget_fd, b"4", 0)
        step = "unshare the pid namespace"
        _sys.unshare(_sys.CLONE_NEWPID)
        if budget_fd >= 0:
            step = "lower max_pid_namespaces"
            os.pwrite(budget_fd, str(after).encode(), 0)
        step = "clone3"
        # CLONE_PARENT: the fork server's child, as a first start's pid 1
        # is (it reaps it, and its death kills it); clone3 then wants no exit
        # signal of its own (the child gets this process's: SIGCHLD).
        pid, pidfd = _sys.clone3(_sys.CLONE_PARENT, 0, cgroup_fd)
        if pid == 0:
            os.close(report)
            return
        os.close(pidfd)
        os.write(report, f"pid {pid}\n".encode())
        os._exit(0)
    except BaseException as exc:  # noqa: BLE001 (said to the fork server, which fails the wake)
        try:
            os.write(report, f"errno {getattr(exc, 'errno', 0) or 0} {step}: {exc}".encode()[:4000])
        finally:
            os._exit(1)


def confine_woken(plan: SessionPlan, program: bytes, ruleset: int, keep: list[int],
                  clock: Callable[[str], None] = lambda step: None) -> None:
    """In the new pid 1: what ``confine_shared``/``confine_session`` did per
    process, in their order, after a /proc of the new pid namespace. The
    per-namespace steps (id maps, ucounts, mounts, loopback, the proxy's
    listener) hold from the first start. Closes ``ruleset``. ``clock(step)``
    after each step (milliseconds for the debug log)."""
    hygiene.die_with_parent(0)  # the fork server, outside the namespace
    hygiene.close_inherited_fds([*keep, ruleset])
    clock("hygiene")
    try:
        fresh = _sys.fresh_proc_mount()  # while the old /proc (of the ended namespace) is still visible
        try:
            _sys.umount2("/proc", _sys.MNT_DETACH)
            _sys.move_mount(fresh, "/proc")
            # The kept rules name the first /proc's root, not the fresh one's:
            # grant the fresh root itself, as the plan grants /proc. Not the
            # directory it is mounted on: Landlock's walk skips a mount point
            # on its way up (a rule there left /proc refused, EACCES). A new
            # inode at every wake: the kept ruleset grows by one rule a wake.
            landlock.grant_again(ruleset, plan.landlock, "/proc", fresh)
        finally:
            os.close(fresh)
    except OSError as exc:
        raise ConfinementError("sleep: a fresh /proc", exc.errno, "/proc") from exc
    # Once /proc is the new namespace's: new_group reads the terminal there.
    hygiene.new_group()
    clock("proc")
    hygiene.not_dumpable()
    hygiene.drop_bounding_set()
    limits.apply_limits(plan.limits_plan)
    hygiene.drop_capabilities()
    hygiene.no_new_privs()
    clock("privileges")
    try:
        landlock.restrict_with(ruleset)
    finally:
        os.close(ruleset)
    clock("landlock")
    seccomp.apply_seccomp(program)
    clock("seccomp")


def run_woken(plan: SessionPlan, program: bytes, control_fd: int, ruleset: int) -> NoReturn:
    """Entry point of a woken session's pid 1. Never returns."""
    from dispatchd.tools import proctree
    from dispatchd.worker import reaper
    from dispatchd.worker.tool_server import serve  # pre-imported by the fork server

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    control = protocol.FrameSocket(socket.socket(fileno=control_fd), fds=True)
    steps: dict[str, float] = {}
    last = [time.perf_counter()]

    def clock(step: str) -> None:
        now = time.perf_counter()
        steps[step] = round((now - last[0]) * 1e3, 3)
        last[0] = now

    try:
        confine_woken(plan, program, ruleset, [control_fd], clock)
    except BaseException as exc:
        fail(control, exc, "wake")
    _say(control, protocol.WorkerReady(pid=os.getpid(), protections=plan.protections, timings_ms=steps))
    reaper.start_at_first_spawn(proctree.owns, proctree.CHILD_BORN, proctree.after_first_spawn)
    serve(control, plan, woken=True)
    os._exit(0)


def fail(control: protocol.FrameSocket, exc: BaseException, step: str) -> NoReturn:
    """Tell the daemon why this worker cannot serve (a ConfinementError as it
    says it; anything else is a bug: its traceback, under ``step``), then exit."""
    if isinstance(exc, ConfinementError):
        msg = protocol.WorkerFailed(step=exc.step, errno=exc.errno, path=exc.path, message=exc.message)
    else:
        msg = protocol.WorkerFailed(step=step, errno=0, path="",
                                    message=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    _say(control, msg)
    os._exit(1)


def _say(control: protocol.FrameSocket, msg: protocol.WorkerReady | protocol.WorkerFailed) -> None:
    try:
        control.send(msg)
    except OSError:
        pass  # the daemon is gone; nobody to tell
