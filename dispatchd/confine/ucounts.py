"""Kernel budgets the user shares with a session, bounded in its user namespace.

Some kernel objects are counted per user, across every process of the user:
inotify instances (128 by default) and watches, fanotify groups and marks,
namespaces. A session that takes them all leaves the user's own programs and
other sessions with EMFILE/ENOSPC. Since Linux 4.9 each user namespace has
its own maxima for these (``/proc/sys/user/max_*``), checked at every level up
to the initial one; a process with CAP_SYS_RESOURCE in a namespace may lower
the maxima of that namespace.

Guarantees, where the session has its own user namespace: the session init
writes the policy's maxima into its namespace's ``/proc/sys/user/`` before
it drops its capabilities; after that nothing in the session can raise them
(no capability, and seccomp forbids new namespaces), so the session holds at
most those many of each, and the rest of the user's budget stays free. A
value that cannot be written refuses the session (the policy asked for it).

All sessions together, too: a share each is no bound on their sum (four
sessions of 32 inotify instances took the user's 128). Every session's user
namespace is made below one of the daemon's (``plan_shared``: half of each
of the user's limits; made by the fork server, ``namespaces.enter_shared``),
and the kernel counts a session's objects at each level up, so the sessions
of a daemon hold at most that half between them and the user's own programs
keep the rest, however many sessions are open. Where that namespace cannot
be made, ``budget_gaps`` says the sum is not bounded.

Without a user namespace nothing here applies; ``budget_gaps`` says which
budgets stay shared whatever the mode (epoll watches, socket buffers, CPU
without a cgroup), for ``status``'s ``leaves_open``.
"""

from __future__ import annotations

import os

import msgspec

from dispatchd.confine import sharedprocs
from dispatchd.errors import ConfinementError

SYSCTL_DIR = "/proc/sys/user"


class UcountsPlan(msgspec.Struct, frozen=True):
    maxima: dict[str, int]  # file under /proc/sys/user -> value; empty: nothing to apply
    # All sessions together only (plan_shared): the fork server's soft
    # RLIMIT_NPROC, every session's namespace's maximum (sharedprocs.py);
    # 0: not bounded. ``processes_of``: the limit it is half of, in words.
    processes: int = 0
    processes_of: str = ""


# What pasta, joining the session's user namespace to serve its network, makes
# there to isolate itself (a mount, IPC and UTS namespace), with room for the
# previous one's namespaces being freed (the kernel frees an IPC namespace
# later, from a workqueue) when a switch starts a new one.
STACK_NAMESPACES = {"mnt": 4, "ipc": 4, "uts": 4}
# What the sandbox itself makes in the session's user namespace: a detached
# mount lives in an anonymous mount namespace of its own (fsmount's always
# did; open_tree(OPEN_TREE_CLONE)'s too on recent kernels, 6.18 here),
# counted against max_mnt_namespaces like any other. A root of the session's
# own holds the host's as one (``open_tree(OPEN_TREE_CLONE)``,
# ``mounts._hold_host``) until the session's binds, and a woken session makes
# its fresh /proc as one (``fsmount``) before attaching it; one more for the
# previous one the kernel may not have freed yet. With a budget of 0 every
# open failed (ENOSPC at "hold the host's root") wherever pasta, whose
# allowance used to cover it, was missing.
SANDBOX_NAMESPACES = {"mnt": 2}


def plan_ucounts(*, user_namespace: bool, inotify_instances: int, inotify_watches: int,
                 fanotify_groups: int, fanotify_marks: int, network_stack: bool = False) -> UcountsPlan:
    if not user_namespace:
        return UcountsPlan(maxima={})
    maxima = {
        "max_inotify_instances": inotify_instances,
        "max_inotify_watches": inotify_watches,
        "max_fanotify_groups": fanotify_groups,
        "max_fanotify_marks": fanotify_marks,
    }
    # The session's own processes make no namespace: seccomp refuses unshare,
    # setns, clone's namespace flags, open_tree and fsmount; they hold no
    # capability (a mount namespace, even an anonymous one, needs
    # CAP_SYS_ADMIN in its user namespace); and max_user_namespaces is 0, so
    # none can get a user namespace in which it would have one. What is
    # budgeted here is what the sandbox (SANDBOX_NAMESPACES, before any code
    # of the session runs) and pasta (STACK_NAMESPACES, run by the daemon in
    # that user namespace) make; none of the rest of the user's budget is
    # the session's.
    for kind in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup", "time"):
        maxima[f"max_{kind}_namespaces"] = (SANDBOX_NAMESPACES.get(kind, 0)
                                            + (STACK_NAMESPACES.get(kind, 0) if network_stack else 0))
    return UcountsPlan(maxima=maxima)


def open_pid_budget(plan: UcountsPlan) -> int:
    """In the session's user namespace, before the mounts make /proc/sys
    read-only: its ``max_pid_namespaces``, open for writing (-1: not
    bounded here). For the daemon alone (a sleeping session's wake kit):
    waking makes the session a new pid namespace, within a budget of 0, so
    the wake raises it for that one ``unshare`` and sets it back."""
    if "max_pid_namespaces" not in plan.maxima:
        return -1
    try:
        return os.open(f"{SYSCTL_DIR}/max_pid_namespaces", os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1
    except OSError as exc:
        raise ConfinementError("ucounts", exc.errno or 0, f"{SYSCTL_DIR}/max_pid_namespaces") from exc


def apply_ucounts(plan: UcountsPlan) -> None:
    """In the session's user namespace, with its capabilities still held."""
    for name, value in plan.maxima.items():
        path = f"{SYSCTL_DIR}/{name}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue  # an older kernel without this count: nothing of it to share
        except OSError as exc:
            raise ConfinementError("ucounts", exc.errno or 0, path) from exc
        try:
            os.write(fd, str(value).encode())
        except OSError as exc:
            raise ConfinementError("ucounts", exc.errno or 0, path) from exc
        finally:
            os.close(fd)


def describe(plan: UcountsPlan, shared: str = "") -> str:
    """A session's bounds in words; ``shared``: what all sessions together
    may hold (``describe_shared``), "" when that is not bounded."""
    if not plan.maxima:
        return (f"{shared}; no share of its own (no user namespace of its own)" if shared
                else "shared with the user (no user namespace of its own)")
    m = plan.maxima
    return (f"{shared + '; ' if shared else ''}in its user namespace: inotify {m['max_inotify_instances']} instances, "
            f"{m['max_inotify_watches']} watches; fanotify {m['max_fanotify_groups']} groups, "
            f"{m['max_fanotify_marks']} marks; no namespaces made by the session's processes (room for the sandbox's detached "
            "mounts and the network stack's); queued signals and message queues "
            "by rlimit (max_pending_signals, max_msgqueue_bytes)")


# The user's limits of the budgets bounded here: the initial namespace's
# sysctl, and the daemon's own namespace's maximum (a container's), the lower
# counting.
_USER_LIMITS = {
    "max_inotify_instances": "fs/inotify/max_user_instances",
    "max_inotify_watches": "fs/inotify/max_user_watches",
    "max_fanotify_groups": "fs/fanotify/max_user_groups",
    "max_fanotify_marks": "fs/fanotify/max_user_marks",
}


def read_user_limits(proc_sys: str = "/proc/sys") -> dict[str, int]:
    """The user's limit of each budget ``plan_shared`` bounds (one this kernel
    lacks is left out)."""
    found: dict[str, int] = {}
    for name, sysctl in _USER_LIMITS.items():
        values: list[int] = []
        for path in (f"{proc_sys}/{sysctl}", f"{proc_sys}/user/{name}"):
            try:
                with open(path, encoding="ascii") as f:
                    values.append(int(f.read()))
            except (OSError, ValueError):
                continue
        if values:
            found[name] = min(values)
    return found


def plan_shared(limits: dict[str, int], process_limits: dict[str, int] | None = None) -> UcountsPlan:
    """What all sessions of a daemon may hold together: half of each of the
    user's ``limits`` (at least one), the other half left to the user's own
    programs (an editor's file watching, a build tool's); and half of the
    lowest of ``process_limits`` in processes (``sharedprocs.read_limits``).
    Pure."""
    processes, of = sharedprocs.plan(process_limits or {})
    if of:
        of = f"{of} {(process_limits or {})[of]:,}"
    return UcountsPlan(maxima={name: max(1, value // 2) for name, value in sorted(limits.items())},
                       processes=processes, processes_of=of)


def describe_shared(plan: UcountsPlan) -> str:
    """``plan_shared``'s bound in words, for ``status``."""
    m = plan.maxima
    words = {"max_inotify_instances": "inotify instances", "max_inotify_watches": "inotify watches",
             "max_fanotify_groups": "fanotify groups", "max_fanotify_marks": "fanotify marks"}
    processes = (f"; {plan.processes:,} processes and threads (half of the lowest limit they meet, "
                 f"{plan.processes_of})" if plan.processes else "")
    return ("all sessions together at most " + ", ".join(f"{m[k]:,} {w}" for k, w in words.items() if k in m)
            + " (half of the user's)" + processes)


SCM_MAX_FD = 253  # descriptors one message may carry: how far past a sender's limit the count can go


def budget_gaps(*, user_namespace: bool, cgroup_controllers: tuple[str, ...], max_open_files: int = 4096,
                max_processes: int = 1024, fd_passing_reserve: int = 512, shared_missing: str = "") -> list[str]:
    """What a session can still take from the user's shared kernel budgets
    (docs/budgets.md has how each was measured); ``shared_missing``: why all
    sessions together are not bounded (``plan_shared``), "" when they are. Pure."""
    gaps = ["epoll watches (fs.epoll.max_user_watches) are counted per user across every namespace: "
            "a session can take them all, and the user's other programs then get ENOSPC from epoll_ctl",
            f"descriptors in flight over Unix sockets (SCM_RIGHTS) are counted per user: the session's commands "
            f"can hold up to {max_open_files + SCM_MAX_FD:,} in flight (their RLIMIT_NOFILE, {max_open_files:,}, "
            f"plus one message); meanwhile the user's programs with a lower soft RLIMIT_NOFILE (1,024 by default) "
            f"get ETOOMANYREFS passing descriptors. The session's own processes keep {fd_passing_reserve} more, "
            "so its opens and wakes go on; only a uid of its own would bound the user's side",
            "pipe buffers are counted per user (fs.pipe-user-pages-soft: 16,384 pages, 64 MiB): about 1,000 "
            "pipes of the default 64 KiB in a session leave every new pipe of the user at 2 pages (8 KiB) "
            "until they are closed",
            f"open files come from the machine-wide table (fs.file-max, about 2.5 million on a 16 GiB machine): "
            f"a session may hold up to {max_open_files:,} per process x {max_processes:,} processes = "
            f"{max_open_files * max_processes:,}; nothing but a lower policy bounds that sum",
            "TCP buffer memory is counted machine-wide (net.ipv4.tcp_mem), whatever the namespace: loopback "
            "connections inside a session, network off included, can put every program's TCP under memory "
            "pressure" + ("" if "memory" in cgroup_controllers else
                          "; without a cgroup's memory controller nothing bounds the session's share")]
    if not user_namespace and shared_missing:
        gaps.append("inotify and fanotify budgets (128 inotify instances by default) are shared with the "
                    "user's other programs: no user namespace to bound them in")
    elif not user_namespace:
        gaps.append("inotify and fanotify budgets: no share of its own (no user namespace of its own), so the "
                    "session may take all that the sessions together may hold; the user's programs keep the rest")
    elif shared_missing:
        gaps.append(f"inotify and fanotify budgets: each session holds at most its share, but all sessions "
                    f"together are not bounded (a few sessions can take all of the user's): {shared_missing}")
    if shared_missing:
        gaps.append(f"processes: each session runs at most {max_processes:,}, but all sessions together are not "
                    f"bounded: enough sessions can take every process the user (RLIMIT_NPROC) or the machine "
                    f"(kernel.pid_max) may run, after which nothing of the user's can fork: {shared_missing}")
    if "memory" not in cgroup_controllers:
        gaps.append("kernel memory no process owns (socket buffers, pipes: about 450 MiB per process with "
                    "4096 descriptors; a memfd held only by a message in flight, up to max_file_bytes each) is "
                    "outside the memory watchdog's sum: only a cgroup's memory.max holds it")
    if "cpu" not in cgroup_controllers:
        gaps.append("CPU: without a cgroup's cpu controller, hundreds of spinning processes (each setsid makes "
                    "an autogroup of its own) slow the user's programs and the daemon")
    return gaps
