"""User, mount, pid and network namespaces for a session.

Guarantees, where the kernel allows unprivileged user namespaces:
- ``spawn_in_namespaces`` (in the fork server) makes the session's first
  process with one ``clone3``: pid 1 of a new pid namespace (the session sees
  only its own processes, and when that pid 1 exits the kernel kills every
  process left in the namespace), in a new user namespace, a new mount
  namespace, a new IPC namespace (System V IPC and POSIX message queues of
  its own) and a new network namespace (every mode, when a user-mode stack is
  there to reach out through; otherwise only when the network is off), born
  in the session's cgroup where there is one;
- ``apply_id_maps`` (in that process, first) maps only the user's own uid and
  gid (no root inside, setgroups denied);
- ``open_own`` gives the daemon the session's user and network namespaces as
  descriptors (by descriptor from the process itself: no pid to recycle, and
  /proc/PID/ns of the non-dumpable worker is not the daemon's to open);
- nothing here is undone later: seccomp forbids ``unshare``/``setns`` after;
- ``enter_shared`` (the fork server, at its start) puts the fork server, so
  every session's user namespace and every process it starts, below one user
  namespace of the daemon's: the user's own ids mapped, the maxima of
  ``ucounts.plan_shared`` written (all sessions together hold at most those
  of the user's inotify and fanotify budgets), its soft RLIMIT_NPROC lowered
  to the processes all sessions may run together (``sharedprocs``), then no
  capability left in it.

Where user namespaces are refused, ``probe_user_namespaces`` says so and the
session runs without them (policy ``user_namespaces = "auto"``) or refuses to
open (``"required"``).
"""

from __future__ import annotations

import errno
import os
import signal

import msgspec

from dispatchd.confine import _sys, hygiene, sharedprocs
from dispatchd.confine.ucounts import UcountsPlan, apply_ucounts
from dispatchd.errors import ConfinementError


class NamespacePlan(msgspec.Struct, frozen=True):
    user: bool
    mount: bool
    pid: bool
    net: bool
    uid: int
    gid: int


def plan_namespaces(*, use_userns: bool, network_off: bool, uid: int, gid: int,
                    own_network: bool | None = None) -> NamespacePlan:
    """``own_network`` (default: ``network_off``) says whether the session gets
    a network namespace of its own (see ``netstack.plan_network``)."""
    net = network_off if own_network is None else own_network
    return NamespacePlan(user=use_userns, mount=use_userns, pid=use_userns, net=use_userns and net, uid=uid, gid=gid)


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def clone_flags(plan: NamespacePlan) -> int:
    """The ``clone3`` namespace flags of ``plan`` (0: no namespaces, a plain fork)."""
    if not plan.user:
        return 0
    flags = _sys.CLONE_NEWUSER
    flags |= (_sys.CLONE_NEWNS | _sys.CLONE_NEWIPC) if plan.mount else 0
    flags |= _sys.CLONE_NEWPID if plan.pid else 0
    flags |= _sys.CLONE_NEWNET if plan.net else 0
    return flags


def spawn_in_namespaces(plan: NamespacePlan, cgroup_fd: int = -1) -> tuple[int, int]:
    """Fork the session's first process into its namespaces (and cgroup, when
    ``cgroup_fd`` >= 0): ``(0, -1)`` in the child, ``(pid, pidfd)`` in the
    parent. One system call: no intermediate process waits outside the pid
    namespace, and the cgroup is joined at birth (``CLONE_INTO_CGROUP``),
    without the cgroup.procs write that waits for an RCU grace period."""
    try:
        return _sys.clone3(clone_flags(plan), signal.SIGCHLD, cgroup_fd)
    except OSError as exc:
        step = "cgroup: clone3 into the session's cgroup" if cgroup_fd >= 0 else "namespaces: clone3"
        raise ConfinementError(step, exc.errno, detail=limit_reached(exc.errno, plan_kinds(plan))
                               or sharedprocs.reached(exc.errno)) from exc


# The kernel's per-user counts of namespaces (``/proc/sys/user/max_*``),
# which clone3, unshare and open_tree answer with ENOSPC once reached, in
# the caller's user namespace or any above it (a container's own limits).
_LIMITS = (("user", "max_user_namespaces"), ("mount", "max_mnt_namespaces"), ("pid", "max_pid_namespaces"),
           ("net", "max_net_namespaces"), ("ipc", "max_ipc_namespaces"))


def limit_reached(err: int | None, kinds: tuple[str, ...]) -> str:
    """For ENOSPC from a call that makes namespaces of ``kinds`` ("user",
    "mount", "pid", "net", "ipc"), what it means, naming the limits they
    count against; "" for any other error (the error's own words then). Pure."""
    if err != errno.ENOSPC:
        return ""
    names = [f"user.{limit}" for kind, limit in _LIMITS if kind in kinds]
    return ("ENOSPC: a limit on namespaces is reached: " + ", ".join(names) + " (sysctl, in this user "
            "namespace or one above it, e.g. a container's), counted for all of the user's processes; "
            "close sessions, or raise the limit")


def plan_kinds(plan: NamespacePlan) -> tuple[str, ...]:
    """The kinds of namespace ``clone_flags(plan)`` makes. Pure."""
    return ("user", *(("mount", "ipc") if plan.mount else ()), *(("pid",) if plan.pid else ()),
            *(("net",) if plan.net else ()))


def open_own(plan: NamespacePlan) -> list[int]:
    """In the session's first process: its user and network namespaces as
    fds, for the daemon (the network stack joins the session through them),
    or none when it has no network namespace of its own."""
    if not (plan.user and plan.net):
        return []
    return open_namespaces(["user", "net"], "namespaces: /proc/self/ns")


def open_namespaces(names: list[str], step: str) -> list[int]:
    """The caller's namespaces ``names`` (``/proc/self/ns/NAME``) as
    descriptors, all or none (``ConfinementError`` naming ``step``)."""
    fds: list[int] = []
    try:
        for ns in names:
            fds.append(os.open(f"/proc/self/ns/{ns}", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as exc:
        for fd in fds:
            os.close(fd)
        raise ConfinementError(step, exc.errno) from exc
    return fds


def apply_id_maps(plan: NamespacePlan) -> None:
    """In the session's first process: map the user's own ids, nothing else."""
    if not plan.user:
        return
    # The same ids inside as outside: files keep their owners, and no process
    # in the session is root, even in its own namespace.
    for path, text in (
        ("/proc/self/setgroups", "deny"),
        ("/proc/self/uid_map", f"{plan.uid} {plan.uid} 1"),
        ("/proc/self/gid_map", f"{plan.gid} {plan.gid} 1"),
    ):
        try:
            _write(path, text)
        except OSError as exc:
            raise ConfinementError("namespaces: id map", exc.errno, path) from exc


def enter_shared(shared: UcountsPlan, uid: int, gid: int) -> str:
    """Move this (single-threaded) process into a new user namespace, the
    parent of every session's, bounded by ``shared``. Returns "" once in it,
    or why it could not be made (nothing changed then). Raises
    ``ConfinementError`` when it was made but could not be finished: a fork
    server in a half-made namespace must not serve.

    Nothing a session could use is gained: this namespace maps only the user's
    own uid and gid (so no process in it is root), its capabilities are
    dropped here, bounding set first, before any child exists; a session's
    own namespace, below it, is what it always was. What changes for a
    process here is only where the kernel counts its objects."""
    try:
        _sys.unshare(_sys.CLONE_NEWUSER)
    except OSError as exc:
        why = limit_reached(exc.errno, ("user",)) or os.strerror(exc.errno or 0)
        return f"a user namespace for all sessions cannot be made here: {why}"
    apply_id_maps(NamespacePlan(user=True, mount=False, pid=False, net=False, uid=uid, gid=gid))
    apply_ucounts(shared)
    # After the namespace is made, so that it keeps the user's own limit at
    # the level above: every session's namespace, made from here, gets this.
    sharedprocs.apply(shared.processes)
    hygiene.drop_bounding_set()
    hygiene.drop_capabilities()
    return ""


_UCOUNT_PROBE = "/proc/sys/user/max_inotify_instances"
_SYS_READ_ONLY = 251  # the probe child's exit code: /proc/sys read-only in a new user namespace


def probe_user_namespaces() -> tuple[bool, str]:
    """Can this user make a user namespace (with mount, pid, net inside)? Forks a
    throw-away child to find out, so call it before any thread exists."""
    uid = os.getuid()  # read before unshare: inside, unmapped, it reads as the overflow uid
    pid = os.fork()
    if pid == 0:
        try:
            _sys.unshare(_sys.CLONE_NEWUSER | _sys.CLONE_NEWNS | _sys.CLONE_NEWPID | _sys.CLONE_NEWNET)
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{uid} {uid} 1")
        except OSError as exc:
            os._exit(min(exc.errno or 1, 250))
        try:
            # A session's user namespace bounds its share of the user's kernel
            # budgets here (confine/ucounts.py): a /proc/sys mounted read-only
            # (a container's default) would refuse every open.
            with open(_UCOUNT_PROBE, encoding="ascii") as f:
                value = f.read()
            _write(_UCOUNT_PROBE, value)
        except FileNotFoundError:
            pass
        except OSError:
            os._exit(_SYS_READ_ONLY)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return True, "available"
    if code == _SYS_READ_ONLY:
        return False, ("a user namespace can be made, but /proc/sys is read-only in it (a container's default), "
                       "so a session's share of the user's kernel budgets cannot be bounded; for full mode run "
                       "the container with Podman's --security-opt unmask=ALL or Docker's --security-opt "
                       "systempaths=unconfined (packaging/containers/README.md)")
    return False, f"refused by the kernel: {os.strerror(code) if code > 0 else 'killed'}"
