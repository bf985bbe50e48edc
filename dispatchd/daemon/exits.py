"""Why a session's worker ended, told in words (daemon side).

The session's processes pass the cause up as exit codes (see
``dispatchd.worker.session_init``): in full mode the tool server is the
session's init (W1) and its status is W1's; in degraded mode its own code, or
128+N when a signal N killed it, becomes the session init's (W1's). The daemon
is not W1's parent (the fork server is), so it reads W1's wait status through
the pidfd it holds (``PIDFD_GET_INFO`` with ``PIDFD_INFO_EXIT``, Linux 6.15+):
no race with the fork server reaping it, no recycled pid.

Guarantees: ``exit_status`` never blocks longer than its timeout and never
raises, and tells a kernel that cannot say (``NO_KERNEL``) from a status not
known in time (``NOT_YET``: a loaded machine, a namespace's init waiting for
its last processes); ``describe_exit`` is pure and always returns a
``reason=`` word and a sentence for the client that says which.
"""

from __future__ import annotations

import ctypes
import enum
import fcntl
import os
import signal
import time

from dispatchd import fdwait
from dispatchd.protocol.internal import EXIT_DRAINED, EXIT_IDLE

# Signals a process brings on itself (a fault, an abort, a system call
# seccomp answers with SIGSYS): never "from outside".
_FAULTS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT, signal.SIGSYS,
                     signal.SIGTRAP})
REASON_WAIT_S = 3.0  # how long a client's request waits for the daemon to see a worker gone
# How long the daemon waits for a gone worker's status: a pid namespace's init
# exits only once the kernel has ended every process of its namespace, and the
# fork server reaps it at its next turn; on a loaded machine that took > 2 s.
STATUS_WAIT_S = 10.0

_PIDFD_GET_INFO = 0xC040FF0B  # _IOWR(0xFF, 11, struct pidfd_info) with its 64-byte first version
_PIDFD_INFO_EXIT = 1 << 3


class _PidfdInfo(ctypes.Structure):
    _fields_ = [("mask", ctypes.c_uint64), ("cgroupid", ctypes.c_uint64)] + [
        (name, ctypes.c_uint32) for name in ("pid", "tgid", "ppid", "ruid", "rgid", "euid", "egid", "suid", "sgid",
                                             "fsuid", "fsgid")
    ] + [("exit_code", ctypes.c_int32)]


class Unknown(enum.Enum):
    """Why a gone worker's wait status is not known."""
    NO_KERNEL = "this kernel does not say how: Linux 6.15+ does"
    NOT_YET = f"how was not known within {STATUS_WAIT_S:g} s"
    NO_HANDLE = "the daemon held no pidfd to ask how"


def exit_status(pidfd: int, timeout_s: float = STATUS_WAIT_S) -> int | Unknown:
    """The session init's wait status (as ``waitpid`` gives it), or why it is
    not known: the kernel cannot say (before 6.15), or the process has not
    exited and been reaped within the timeout."""
    deadline = time.monotonic() + timeout_s
    try:
        if not fdwait.readable(pidfd, timeout_s):  # readable once the process has exited
            return Unknown.NOT_YET
        while True:
            info = _PidfdInfo(mask=_PIDFD_INFO_EXIT)
            try:
                fcntl.ioctl(pidfd, _PIDFD_GET_INFO, info)
            except OSError:
                return Unknown.NO_KERNEL  # ENOTTY/EINVAL: this kernel has no PIDFD_GET_INFO
            if info.mask & _PIDFD_INFO_EXIT:
                return int(info.exit_code)
            # Exited but not reaped by the fork server yet: the status comes with the reaping.
            if time.monotonic() > deadline:
                return Unknown.NOT_YET
            time.sleep(0.005)
    except (OSError, ValueError):
        return Unknown.NOT_YET


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def describe_exit(status: int | Unknown, *, idle_timeout_s: float,
                  tool_server_is_init: bool = False) -> tuple[str, str]:
    """(log word, sentence) for the session init's wait status. In full mode
    the tool server is the init (``tool_server_is_init``): a signal that
    killed it came from outside the session (pid 1 ignores its own
    namespace's), and it is named as the tool server's."""
    if isinstance(status, Unknown):
        return "worker_exited", f"its worker exited ({status.value})"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if tool_server_is_init:
            if sig in _FAULTS:  # its own doing: a crash, or a system call seccomp kills for
                return (f"tool_server_killed signal={sig}",
                        f"its tool server crashed (signal {sig}, {_signame(sig)})")
            # Pid 1 takes from its own namespace no signal it does not handle.
            return (f"tool_server_killed signal={sig}",
                    f"its tool server was killed by signal {sig} ({_signame(sig)}) from outside the session")
        return (f"worker_killed signal={sig}",
                f"its worker was killed by signal {sig} ({_signame(sig)}) from outside the session")
    code = os.WEXITSTATUS(status)
    if code == EXIT_IDLE:
        return "idle", f"it ended idle (no call for {idle_timeout_s:g} s, the policy's idle_timeout_s)"
    if code > 128:
        sig = code - 128
        return (f"tool_server_killed signal={sig}",
                f"its tool server was killed by signal {sig} ({_signame(sig)})")
    if code == EXIT_DRAINED:
        return "worker_exited code=0", "its tool server exited"
    return f"worker_failed code={code}", f"its tool server failed (exit status {code})"
