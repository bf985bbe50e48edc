"""Seccomp: the system calls a session may not make, whatever its paths.

Landlock (ABI 7) leaves holes that only a syscall filter closes. Once
``apply_seccomp`` has returned, the session cannot:
- create Unix sockets (``socket(AF_UNIX)``) unless the plan allows them (full
  mode, where the session has a root and a network namespace of its own, so
  no socket of the host's is there to reach): otherwise no connect to the daemon's socket,
  the user's D-Bus or ``systemd --user`` (``systemd-run --user`` would run
  anything unconfined), a container engine's socket, or any abstract socket.
  a stream or seqpacket ``socketpair`` still works, so pipes between a
  session's own processes do; any other kind (a datagram pair could
  ``sendto`` a named socket) does not;
- use the host's System V IPC or POSIX message queues when it has no IPC
  namespace of its own;
- open sockets of any family but IPv4/IPv6 (and netlink route queries); with
  the network off and no network namespace to hold it, not IPv4/IPv6 either;
- make new namespaces (``unshare``, ``setns``, ``clone`` with a ``CLONE_NEW*``
  flag; ``clone3`` answers ENOSYS so libc falls back to ``clone``), mount
  anything, or change its root;
- trace or read other processes' memory (``ptrace``, ``process_vm_*``);
- reach kernel surfaces an agent has no use for: io_uring, bpf, perf events,
  keyrings, userfaultfd, kernel modules, kexec, ``open_by_handle_at``;
- push characters into a terminal (``TIOCSTI``, ``TIOCLINUX``);
- set another process's resource limits, priority, scheduling or I/O
  class (``prlimit64``, ``setpriority``, ``sched_set*``, ``ioprio_set``):
  without a pid namespace, any process but itself; with one, its tool
  server (pid 1). Its own (pid 0) and reading anyone's stay.

- use Linux AIO (``io_setup``, ``io_submit``...): its events come from one
  machine-wide budget (``fs.aio-max-nr``);

Denials answer EPERM (a plain "not permitted" that tools report sensibly),
except ``clone3`` (ENOSYS, so glibc retries with ``clone``) and Linux AIO
(ENOSYS, so its users fall back to synchronous I/O, as on a kernel without it). Syscalls of another
architecture (32-bit entry on x86_64) kill the process: libseccomp's default.

The program is compiled once per plan by the fork server and only installed,
last, in the worker (``apply_seccomp``), as nsjail does.
"""

from __future__ import annotations

import errno
import functools
import os
import socket

import msgspec

from dispatchd.confine import _sys
from dispatchd.errors import ConfinementError

_NS_FLAGS = (
    _sys.CLONE_NEWNS, _sys.CLONE_NEWCGROUP, _sys.CLONE_NEWUTS, _sys.CLONE_NEWIPC,
    _sys.CLONE_NEWUSER, _sys.CLONE_NEWPID, _sys.CLONE_NEWNET,
)
_DENIED_ALWAYS = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
    "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "open_by_handle_at", "name_to_handle_at", "acct", "swapon", "swapoff", "reboot",
    "syslog", "quotactl", "lookup_dcookie", "vhangup",
)
_KERNEL_AIO = ("io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy")
# The host's IPC objects, when the session has no IPC namespace of its own:
# System V by key, POSIX message queues by name (Landlock checks opening one,
# not creating or unlinking it).
_HOST_IPC = ("shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl",
             "semget", "semop", "semtimedop", "semctl", "mq_open", "mq_unlink")
# Calls that act on a process named by pid, asking only that it be the same
# user's: no ptrace check, so neither Landlock's ptrace rule nor its signal
# scope covers them. Without a pid namespace a session named the daemon by
# pid and set its RLIMIT_NOFILE to 3 (it accepted no one again, and only
# CAP_SYS_RESOURCE raises a hard limit), its RLIMIT_CPU to 1 s (SIGXCPU), or
# SCHED_IDLE; PRIO_USER reached every process of the user at once.
_SCHED_BY_PID = ("sched_setscheduler", "sched_setparam", "sched_setattr", "sched_setaffinity")
PRIO_PROCESS, IOPRIO_WHO_PROCESS = 0, 1
_PID_BITS = 0xFFFFFFFF  # the kernel reads a pid as a 32-bit int: 0x1_00000001 is pid 1
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
_AF_MAX = 46  # families are below this on 6.x kernels; anything at or above is denied


class ArgCheck(msgspec.Struct, frozen=True, array_like=True):
    arg: int
    op: str  # "eq", "ne", "ge", "masked_eq"
    value: int
    mask: int = 0


class SeccompRule(msgspec.Struct, frozen=True, array_like=True):
    syscall: str
    errno: int
    args: list[ArgCheck] = []


class SeccompPlan(msgspec.Struct, frozen=True):
    rules: list[SeccompRule]
    allow_inet: bool


def _other_processes(pid_namespace: bool) -> list[SeccompRule]:
    """No limit, priority, scheduling or I/O class set on another process
    (see ``_SCHED_BY_PID``). Without a pid namespace: none but the caller's
    own (pid 0; a thread's own by its tid is refused too). With one, only the
    session's own processes are there, and pid 1, its tool server, is held.
    A process group or a user's every process (``PRIO_PGRP``,
    ``PRIO_USER``, their I/O twins) is refused in both."""
    if pid_namespace:  # pid 1, by its low 32 bits
        target = [ArgCheck(0, "masked_eq", 1, _PID_BITS)]
        who = [ArgCheck(1, "masked_eq", 1, _PID_BITS)]
    else:  # anything but 0: a wider value the kernel would cut to 0 is refused too, harmlessly
        target, who = [ArgCheck(0, "ne", 0)], [ArgCheck(1, "ne", 0)]
    rules = [SeccompRule("prlimit64", errno.EPERM, [*target, ArgCheck(2, "ne", 0)])]  # reading one's limits stays
    rules += [SeccompRule(name, errno.EPERM, target) for name in _SCHED_BY_PID]
    rules += [SeccompRule("setpriority", errno.EPERM, [ArgCheck(0, "ne", PRIO_PROCESS)]),
              SeccompRule("setpriority", errno.EPERM, who),
              SeccompRule("ioprio_set", errno.EPERM, [ArgCheck(0, "ne", IOPRIO_WHO_PROCESS)]),
              SeccompRule("ioprio_set", errno.EPERM, who)]
    return rules


@functools.lru_cache(maxsize=32)  # four booleans: the same plan, shared (frozen), at every open
def plan_seccomp(*, allow_inet: bool, ipc_namespace: bool = True, allow_unix: bool = False,
                 netlink: bool = True, pid_namespace: bool = True) -> SeccompPlan:
    """The filter for one session; pure. ``allow_inet`` is False only for network
    off without a network namespace, where seccomp is what holds the network.
    ``allow_unix``: ``socket(AF_UNIX)`` is allowed (the session's root and
    network namespace are its own: the mounts and namespaces hold it).
    ``netlink``: route queries allowed (what ``ip addr`` needs); else none.
    ``pid_namespace``: the session has one (``_other_processes``)."""
    rules = [SeccompRule(name, errno.EPERM) for name in _DENIED_ALWAYS]
    rules += _other_processes(pid_namespace)
    rules += [SeccompRule("clone", errno.EPERM, [ArgCheck(0, "masked_eq", f, f)]) for f in _NS_FLAGS]
    rules.append(SeccompRule("clone3", errno.ENOSYS))
    # Linux AIO: the kernel counts its events against one machine-wide
    # budget (fs.aio-max-nr, 65,536), which one session could take whole.
    # ENOSYS, as a kernel built without AIO answers: libaio users (databases,
    # fio, qemu) then fall back to synchronous or thread-pool I/O, where
    # EPERM reads as a hard failure. glibc's POSIX aio_* uses threads, not these.
    rules += [SeccompRule(name, errno.ENOSYS) for name in _KERNEL_AIO]
    rules += [SeccompRule("ioctl", errno.EPERM, [ArgCheck(1, "masked_eq", req, 0xFFFFFFFF)]) for req in (TIOCSTI, TIOCLINUX)]
    allowed = ({socket.AF_NETLINK} if netlink else set()) | ({socket.AF_UNIX} if allow_unix else set())
    if allow_inet:
        allowed |= {socket.AF_INET, socket.AF_INET6}
    for family in range(_AF_MAX):
        if family not in allowed:
            rules.append(SeccompRule("socket", errno.EPERM, [ArgCheck(0, "eq", family)]))
    rules.append(SeccompRule("socket", errno.EPERM, [ArgCheck(0, "ge", _AF_MAX)]))
    if netlink:  # only for route queries (what `ip addr` needs), not audit, uevents...
        rules.append(SeccompRule("socket", errno.EPERM, [ArgCheck(0, "eq", socket.AF_NETLINK), ArgCheck(2, "ne", 0)]))
    # socketpair(AF_UNIX, SOCK_STREAM) stays (asyncio, multiprocessing use it):
    # (kept as it is where socket(AF_UNIX) is allowed too: nothing needs a datagram pair)
    # a connected stream pair cannot be reconnected elsewhere. A datagram pair
    # could sendto() any named socket of the user's, so it is refused.
    for family in range(_AF_MAX):
        if family != socket.AF_UNIX:
            rules.append(SeccompRule("socketpair", errno.EPERM, [ArgCheck(0, "eq", family)]))
    rules.append(SeccompRule("socketpair", errno.EPERM, [ArgCheck(0, "ge", _AF_MAX)]))
    # Only connected kinds: SOCK_RAW on AF_UNIX is a datagram socket by another name.
    for kind in range(16):
        if kind not in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
            rules.append(SeccompRule("socketpair", errno.EPERM, [ArgCheck(1, "masked_eq", kind, 0xF)]))
    if not ipc_namespace:
        # Without an IPC namespace, IPC is the host's: the user's shared
        # memory, queues and semaphores, reachable by key or name.
        rules += [SeccompRule(name, errno.EPERM) for name in _HOST_IPC]
    return SeccompPlan(rules=rules, allow_inet=allow_inet)


def compile_seccomp(plan: SeccompPlan) -> bytes:
    """Compile the plan to a classic-BPF program with libseccomp (no kernel change)."""
    import pyseccomp as sc  # loaded here: only the fork server compiles

    ops = {"eq": sc.EQ, "ne": sc.NE, "ge": sc.GE, "masked_eq": sc.MASKED_EQ}
    filt = sc.SyscallFilter(sc.ALLOW)
    for rule in plan.rules:
        args = [
            sc.Arg(a.arg, ops[a.op], a.mask, a.value) if a.op == "masked_eq" else sc.Arg(a.arg, ops[a.op], a.value)
            for a in rule.args
        ]
        filt.add_rule(sc.ERRNO(rule.errno), rule.syscall, *args)
    # A memfd rather than a pipe: the program may outgrow a pipe's buffer.
    fd = os.memfd_create("dispatchd-seccomp", os.MFD_CLOEXEC)
    with os.fdopen(fd, "w+b") as buf:
        filt.export_bpf(buf)
        buf.seek(0)
        return buf.read()


def apply_seccomp(program: bytes) -> None:
    """Install the compiled program on the calling thread (no_new_privs first).
    Raises ``ConfinementError`` (step "seccomp") if the kernel refuses it."""
    try:
        _sys.install_seccomp_program(program)
    except OSError as exc:
        raise ConfinementError("seccomp", exc.errno) from exc
