"""Resource limits of a session: what a runaway or hostile command can take.

Guarantees, once ``apply_limits`` has returned (hard and soft limits alike, so
nothing in the session can raise them again — it has no CAP_SYS_RESOURCE):
- processes: at most ``max_processes`` (threads count). With a user namespace
  the kernel counts them per namespace, so this is the session's own budget
  (a fork bomb stops there and the user's other processes are untouched).
  Without one the kernel counts every task (thread) of the user, so the limit
  is set to what the user runs at open, threads included, plus the session's
  budget: headroom the user's processes started later take from (a call is
  then refused, or its forks fail, until they end; SECURITY.md). With one,
  the levels above the session's are checked too, each against the limit
  its namespace's creator had when it made it (Linux 5.14+,
  ``enforced_nproc_rlimit``): all sessions' tasks against the processes they
  may run together (the fork server's soft limit, ``sharedprocs.py``), and
  the user's whole count against the user's own limit, which the fork
  server's namespace keeps, so the user's processes elsewhere never stop the
  session's forks
  (``test_long_work.py::test_a_session_forks_while_the_user_runs_more_tasks_elsewhere_than_its_limit``).
  The limit set here is never above the fork server's;
- memory: each process's data segment is capped at ``max_data_bytes``
  (RLIMIT_DATA: heap and private writable mappings; reserved-but-unused
  address space, as V8 and the JVM make, does not count);
- per-user budgets: at most ``max_pending_signals`` queued signals and
  ``max_msgqueue_bytes`` of POSIX message queues (with a user namespace the
  kernel counts the session's own at its level, so the user keeps the rest);
- files: no file larger than ``max_file_bytes`` (RLIMIT_FSIZE), at most
  ``max_open_files`` descriptors per command, and no core dumps (they would
  write a process's memory, secrets included, into the worktree);
- descriptors in flight: the kernel counts the descriptors sent over Unix
  sockets (SCM_RIGHTS) and not yet received per user, and refuses a send
  (ETOOMANYREFS) once that count is over the *sender's* RLIMIT_NOFILE. The
  session's own processes (its init, its tool server) keep
  ``FD_PASSING_RESERVE`` descriptors more than its commands
  (``proctree.spawn`` lowers theirs): commands that fill the user's count
  stop ``SCM_MAX_FD`` short of where the session's own sends (its report
  to the daemon, a woken tool server's kit) would be refused.

These hold in every mode. Where the daemon has a delegated cgroup v2 subtree,
a per-session cgroup adds limits over the whole session (``cgroups.py``);
``status`` says which holds for each resource.
"""

from __future__ import annotations

import os
import resource

import msgspec

from dispatchd.errors import ConfinementError

# Descriptors over the commands' RLIMIT_NOFILE that the session's own
# processes keep: at least SCM_MAX_FD (253, what one message may carry over
# the limit) plus what the tool server sends at once.
FD_PASSING_RESERVE = 512


class LimitsPlan(msgspec.Struct, frozen=True):
    max_processes: int
    processes_per_namespace: bool  # False: the user's whole process count is what the kernel checks
    max_data_bytes: int
    max_file_bytes: int
    max_open_files: int
    # Budgets the kernel counts per user and checks at every user-namespace
    # level (Linux 5.14+): the session's total at its own level is bounded by
    # these, so it cannot take the user's whole budget (see SECURITY.md).
    max_pending_signals: int = 4096  # RLIMIT_SIGPENDING (the user's: about 96,000)
    max_msgqueue_bytes: int = 204800  # RLIMIT_MSGQUEUE (the user's: 819,200)


def plan_limits(*, max_processes: int, max_data_bytes: int, max_file_bytes: int, max_open_files: int,
                user_namespace: bool, max_pending_signals: int = 4096,
                max_msgqueue_bytes: int = 204800) -> LimitsPlan:
    return LimitsPlan(max_processes=max_processes, processes_per_namespace=user_namespace,
                      max_data_bytes=max_data_bytes, max_file_bytes=max_file_bytes, max_open_files=max_open_files,
                      max_pending_signals=max_pending_signals, max_msgqueue_bytes=max_msgqueue_bytes)


def _processes_of(uid: int) -> int:
    """What the kernel counts against RLIMIT_NPROC for ``uid``: tasks, so every
    thread of every process (a daemon with a hundred threads is a hundred). A
    count of processes alone left no room to fork where the user ran threads."""
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid != uid:
                    continue
                with open(f"/proc/{entry}/stat", "rb") as f:
                    # Field 20 (num_threads), counted after the command name,
                    # which is in parentheses and may hold spaces.
                    count += int(f.read().rsplit(b")", 1)[1].split()[17])
            except (OSError, IndexError, ValueError):
                continue
    return count


def _set(name: str, which: int, value: int) -> None:
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)  # we can only lower a hard limit
    try:
        resource.setrlimit(which, (value, value))
    except (OSError, ValueError) as exc:
        raise ConfinementError(f"limits: {name}", getattr(exc, "errno", 0) or 0, detail=str(exc)) from exc


def apply_limits(plan: LimitsPlan) -> None:
    processes = plan.max_processes
    if not plan.processes_per_namespace:
        processes += _processes_of(os.getuid())
    # Never above what the fork server has: there it is the processes all
    # sessions may run together (sharedprocs.py), which a session without a
    # namespace of its own is checked against only through its own limit.
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft != resource.RLIM_INFINITY:
        processes = min(processes, soft)
    _set("RLIMIT_NPROC", resource.RLIMIT_NPROC, processes)
    _set("RLIMIT_DATA", resource.RLIMIT_DATA, plan.max_data_bytes)
    _set("RLIMIT_FSIZE", resource.RLIMIT_FSIZE, plan.max_file_bytes)
    # The commands get max_open_files (proctree.spawn): see FD_PASSING_RESERVE.
    _set("RLIMIT_NOFILE", resource.RLIMIT_NOFILE, plan.max_open_files + FD_PASSING_RESERVE)
    _set("RLIMIT_CORE", resource.RLIMIT_CORE, 0)
    _set("RLIMIT_SIGPENDING", resource.RLIMIT_SIGPENDING, plan.max_pending_signals)
    _set("RLIMIT_MSGQUEUE", resource.RLIMIT_MSGQUEUE, plan.max_msgqueue_bytes)
