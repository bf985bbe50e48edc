"""The probe every escape test runs, inside a session and outside it.

``attempt(session, body)`` runs ``body``, a Python snippet that sets
``result``, inside the sandbox (through ``shell_exec``, as an agent would);
``attempt_outside(body)`` runs the identical code as the same user outside any
sandbox: the allowed twin. Both print one line, which the tests compare whole:

    OK <repr(result)>                      the attempt went through
    PermissionError [Errno 13] EACCES      the OSError: class, number, name

so a test pins the exact errno and, through the class, what Python made of it.
The snippet may use ``syscall(nr, *args)`` (a raw system call through libc:
the result, or ``OSError`` with the errno, whatever libc wraps around it),
``worker_pid()`` (the tool server: the parent of the command's bash) and the
modules imported below. Syscall numbers are x86_64's (``SYS``).

The listeners here stand outside the sandbox, in the test process, and are
what a denied attempt would have reached; each records what arrived.
"""

from __future__ import annotations

import errno
import shlex
import socket
import textwrap
import threading
import time
from collections.abc import Callable
from types import TracebackType

import dispatch
from tests.conftest import probe, probe_outside, shell
from tests.listeners import Served


def _denied(name: str) -> str:
    number = getattr(errno, name)
    return f"{type(OSError(number, '')).__name__} [Errno {number}] {name}"


EPERM = _denied("EPERM")  # seccomp, Landlock scopes, no capability
ENOENT = _denied("ENOENT")  # not in this mount or pid namespace
ESRCH = _denied("ESRCH")
EACCES = _denied("EACCES")  # Landlock's refusal of a path
EXDEV = _denied("EXDEV")  # a link or rename across mounts or Landlock domains
EROFS = _denied("EROFS")  # the read-only mounts of full mode
ENOSYS = _denied("ENOSYS")
ENOTTY = _denied("ENOTTY")
ENXIO = _denied("ENXIO")
EINVAL = _denied("EINVAL")
EAFNOSUPPORT = _denied("EAFNOSUPPORT")  # the kernel has no such socket family
EOPNOTSUPP = _denied("ENOTSUP")  # the same number (95); Python names it ENOTSUP
EFAULT = _denied("EFAULT")
EISCONN = _denied("EISCONN")
EBUSY = _denied("EBUSY")  # a mount point cannot be moved or removed
EPROTOTYPE = _denied("EPROTOTYPE")
EADDRINUSE = _denied("EADDRINUSE")
ECONNREFUSED = _denied("ECONNREFUSED")  # nobody listens on the session's own loopback
ENETUNREACH = _denied("ENETUNREACH")  # no route out of the session's network namespace

# x86_64 system call numbers the probes make by hand.
SYS = {
    "ioctl": 16, "getpid": 39, "socket": 41, "socketpair": 53, "clone": 56, "ptrace": 101, "chroot": 161, "mount": 165,
    "add_key": 248, "request_key": 249, "keyctl": 250, "unshare": 272, "perf_event_open": 298,
    "name_to_handle_at": 303, "setns": 308, "process_vm_readv": 310, "renameat2": 316, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "open_tree": 428, "pidfd_open": 434, "clone3": 435,
    "pidfd_getfd": 438, "mount_setattr": 442,
    # System V IPC
    "shmget": 29, "shmat": 30, "shmctl": 31, "semget": 64, "semop": 65, "semctl": 66, "shmdt": 67, "msgget": 68,
    "msgsnd": 69, "msgrcv": 70, "msgctl": 71, "semtimedop": 220,
}
X32_SYSCALL_BIT = 0x40000000

_PRELUDE = '''\
import ctypes, errno, fcntl, os, signal, socket, subprocess, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def syscall(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) if isinstance(a, int) else a for a in args))
    if r == -1:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r
def worker_pid():
    pid = os.getppid()  # bash, or the tool server itself when bash exec'd us
    if open(f"/proc/{pid}/comm").read().strip() == "bash":
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    return pid
try:
'''
_EPILOGUE = '''
except OSError as exc:
    print(f"{type(exc).__name__} [Errno {exc.errno}] {errno.errorcode.get(exc.errno, '?')}")
else:
    print(f"OK {result!r}")
'''


def attempt_code(body: str) -> str:
    return _PRELUDE + textwrap.indent(textwrap.dedent(body).strip(), "    ") + _EPILOGUE


def attempt(session: dispatch.Session, body: str) -> str:
    """Run ``body`` in the sandbox; its one-line verdict."""
    return probe(session, attempt_code(body))


def attempt_outside(body: str) -> str:
    """The same ``body`` as the same user, unconfined: the allowed twin."""
    return probe_outside(attempt_code(body))


def background(session: dispatch.Session, code: str, seconds: int) -> None:
    """Start a Python snippet in the session that outlives the call (at most ``seconds``)."""
    r = shell(session, f"timeout {seconds} /usr/bin/python3 -c {shlex.quote(code)} >/dev/null 2>&1",
              background=True)
    assert r.is_success, r.error


def wait_for(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; its last value."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


class TcpListener(Served):
    """A TCP server outside the sandbox: greets every client with ``BANNER`` and
    records, per connection (in the order they came), the bytes it sent and
    whether it closed."""

    BANNER = b"dispatch-escape-banner\n"

    def __init__(self, host: str = "127.0.0.1", family: int = socket.AF_INET) -> None:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((host, 0))
        sock.listen(8)
        self.port: int = sock.getsockname()[1]
        self.received: list[bytes] = []  # one entry per connection, complete once it closed
        self.closed_by_peer: list[bool] = []
        self._handlers: list[threading.Thread] = []
        super().__init__(sock)

    def serve_once(self) -> None:
        conn, _ = self.sock.accept()
        self.received.append(b"")
        self.closed_by_peer.append(False)
        handler = threading.Thread(target=self._handle, args=(conn, len(self.received) - 1), daemon=True)
        self._handlers.append(handler)
        handler.start()

    def _handle(self, conn: socket.socket, index: int) -> None:
        with conn:
            conn.settimeout(0.2)
            conn.sendall(self.BANNER)
            while not self._stop.is_set():
                try:
                    data = conn.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    self.closed_by_peer[index] = True
                    return
                self.received[index] += data

    def close(self) -> None:
        super().close()
        for handler in self._handlers:
            handler.join(5)

    def __enter__(self) -> TcpListener:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class DatagramListener:
    """A datagram socket outside the sandbox (UDP, or a Unix address), read with a timeout."""

    def __init__(self, family: int, address: object) -> None:
        self.sock = socket.socket(family, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.address = self.sock.getsockname()

    def drain(self, timeout: float = 0.5, expect: int = 0) -> list[bytes]:
        """Every datagram that arrives within ``timeout`` of the previous one;
        with ``expect`` (an allowed twin's), the first ``expect`` of them are
        waited for up to 30 s (a datagram through pasta on a loaded machine
        may take longer than ``timeout``), the rest as before."""
        got: list[bytes] = []
        deadline = time.monotonic() + 30
        while True:
            waiting = len(got) < expect
            self.sock.settimeout(max(0.01, deadline - time.monotonic()) if waiting else timeout)
            try:
                got.append(self.sock.recv(65536))
            except TimeoutError:
                if waiting and time.monotonic() < deadline:
                    continue
                return got

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> DatagramListener:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
