"""The processes all sessions of a daemon may run together.

Each session is held to ``max_processes`` tasks (``limits.py``), but a share
each is no bound on their sum: sixteen sessions of 1,024 took every pid of a
machine whose ``kernel.pid_max`` is 32,768, after which nothing of anyone's
could fork, the user's shell and the daemon included. The lowest of the
limits a task meets on its way up (the user's ``RLIMIT_NPROC``,
``kernel.threads-max``, ``kernel.pid_max``, the ``pids.max`` of the daemon's
cgroup and those above it) is the budget the sessions share with everything
else; ``plan`` gives the sessions together half of it, at least one.

Guarantees, where the fork server is below a user namespace of its own
(``namespaces.enter_shared``): the fork server lowers its soft
``RLIMIT_NPROC`` to that half *after* making the namespace, so the namespace
keeps the user's own limit at the level above (the user's processes
elsewhere never stop a session's forks), while every session's user
namespace, which the fork server makes, gets the half as its maximum (Linux
5.14+: a new user namespace's ``RLIMIT_NPROC`` maximum is its creator's limit,
and ``copy_process`` checks the count at every level up). The kernel then
counts every task of every session, every sandbox made ahead and every
network stack at the fork server's level against the half: a fork past it
fails with EAGAIN, whatever the session does with its own limits (it cannot
raise a namespace's maximum). A session opened then is refused with the
words of ``reached``.

Sessions without a user namespace of their own (policy ``user_namespaces =
"never"``) are counted at the fork server's level directly, against their
own limit, which ``limits.apply_limits`` keeps at most the fork server's.
Where the fork server's namespace cannot be made nothing here applies, and
``status`` says the sum is not bounded (``ucounts.budget_gaps``).
"""

from __future__ import annotations

import errno
import os
import resource

_UNLIMITED = 1 << 62


def read_limits(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> dict[str, int]:
    """Every limit a task of this process meets, by name; an unlimited or
    unreadable one is left out. None for root: the kernel does not hold the
    global root user to RLIMIT_NPROC (``copy_process``), so no bound would hold."""
    found: dict[str, int] = {}
    if os.geteuid() == 0:
        return found
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        found["the user's RLIMIT_NPROC"] = soft
    for name in ("threads-max", "pid_max"):
        value = _read_int(f"{proc}/sys/kernel/{name}")
        if value is not None:
            found[f"kernel.{name}"] = value
    for path, value in _pids_max(proc, cgroup_root):
        found[f"pids.max of the cgroup {path}"] = value
    return found


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": unlimited


def _pids_max(proc: str, cgroup_root: str) -> list[tuple[str, int]]:
    """The ``pids.max`` of this process's cgroup and of each above it: in
    cgroup v2, and in v1's pids hierarchy (a hybrid or v1-only machine, where
    the v2 tree holds no controller)."""
    try:
        with open(f"{proc}/self/cgroup", encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            found += _walk_up(f"{cgroup_root}", path, "")
        elif "pids" in controllers.split(","):
            found += _walk_up(f"{cgroup_root}/pids", path, " (cgroup v1)")
    return found


def _walk_up(root: str, path: str, kind: str) -> list[tuple[str, int]]:
    found = []
    path = path or "/"
    while True:
        value = _read_int(f"{root}{path.rstrip('/')}/pids.max")
        if value is not None:
            found.append((path + kind, value))
        if path == "/":
            return found
        path = os.path.dirname(path.rstrip("/")) or "/"


def plan(limits: dict[str, int]) -> tuple[int, str]:
    """Half of the lowest of ``limits`` (at least one), and the name of that
    limit; (0, "") when none is given. Pure."""
    if not limits:
        return 0, ""
    name = min(sorted(limits), key=lambda k: limits[k])
    return max(1, limits[name] // 2), name


def said(max_processes: int, own_namespace: bool, shared: int) -> int | str:
    """A session's process limit as its report says it: its budget (counted
    above what the user ran at open, without a namespace of its own), and
    all sessions' bound ``shared`` where that is the lower (0: none). Pure."""
    own: int | str = max_processes if own_namespace else f"{max_processes} more than the user ran at open"
    return f"{own}, but all sessions together at most {shared:,}" if 0 < shared < max_processes else own


def apply(processes: int) -> None:
    """In the fork server, once its user namespace is made: its
    ``RLIMIT_NPROC`` lowered to ``processes``, soft and hard (0: left as it
    is). Hard too: a network stack runs in this namespace (counted against
    the namespace above, which keeps the user's limit), and one that a
    packet took over must not raise its own limit back."""
    if processes <= 0:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    value = min(processes, hard if hard != resource.RLIM_INFINITY else _UNLIMITED)
    if soft == resource.RLIM_INFINITY or value < soft or value < hard:
        resource.setrlimit(resource.RLIMIT_NPROC, (min(value, soft), value))


def reached(err: int | None) -> str:
    """For EAGAIN from the fork server's clone3 (its ``RLIMIT_NPROC`` is the
    sessions' shared budget when ``apply`` ran), what it means; "" for any
    other error."""
    if err != errno.EAGAIN:
        return ""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    bound = "unbounded" if soft == resource.RLIM_INFINITY else f"{soft:,}"
    return (f"EAGAIN: the processes all sessions of this daemon may run together ({bound}, its fork server's "
            "RLIMIT_NPROC: half of the lowest limit of the user's, the machine's or the cgroup's) are running, "
            "or one of those limits is reached; close sessions or end their commands")
