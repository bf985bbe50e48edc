"""Escapes through inter-process communication with the world outside the session.

The daemon's socket, the user's other Unix sockets (D-Bus, systemd, a
journal, an agent), abstract sockets, System V IPC, POSIX message queues and
shared memory, the user's runtime directory. The seccomp docstring promises
no Unix socket reaching outside (``socket(AF_UNIX)`` refused; "socketpair
reaches nothing outside the session"), and the README "the rest of the
machine invisible"; each attempt's twin runs outside and gets through.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.escape.attempts import (
    EACCES, ECONNREFUSED, EISCONN, ENOENT, EPERM, EPROTOTYPE, SYS, DatagramListener, attempt, attempt_outside, background,
)
from tests.escape.conftest import Sandbox

_libc = ctypes.CDLL(None, use_errno=True)


def test_the_daemons_socket_cannot_be_reached(sandbox: Sandbox, session: dispatch.Session) -> None:
    path = sandbox.daemon.socket
    connect = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ns.settimeout(5)\nresult = s.connect({path!r})"
    assert attempt_outside(connect) == "OK None"
    assert attempt(session, connect) == EPERM  # seccomp: no socket(AF_UNIX)
    # The sockets a session may have, from socketpair, cannot be pointed at it
    # either; in full mode the path is not even there (a private /tmp, the
    # runtime directory covered).
    for kind, degraded in (("SOCK_STREAM", EISCONN), ("SOCK_DGRAM", EPROTOTYPE)):
        reconnect = f"a, b = socket.socketpair(socket.AF_UNIX, socket.{kind})\nresult = a.connect({path!r})"
        assert attempt(session, reconnect) == sandbox.expect(full=ENOENT, degraded=degraded)


def test_af_unix_with_high_bits_in_the_family_is_still_refused(session: dispatch.Session) -> None:
    """The kernel reads the family as an int; a filter comparing 64 bits must not let AF_UNIX | 1 << 32 by."""
    body = f"result = syscall({SYS['socket']}, (1 << 32) | socket.AF_UNIX, socket.SOCK_STREAM, 0) >= 0"
    assert attempt_outside(body) == "OK True"
    assert attempt(session, body) == EPERM


def test_abstract_unix_sockets_outside_are_unreachable(sandbox: Sandbox, session: dispatch.Session) -> None:
    name = b"\0dispatch-escape-" + secrets.token_hex(6).encode()
    with DatagramListener(socket.AF_UNIX, name) as listener:
        send = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nresult = s.sendto(b'escaped', {name!r})"
        assert attempt_outside(send) == "OK 7"
        assert listener.drain() == [b"escaped"]
        assert attempt(session, send) == EPERM
        # A socketpair's datagram socket can be aimed at any address with sendto:
        # full mode has its own abstract namespace (its network namespace), and
        # degraded mode Landlock's abstract-socket scope.
        send_from_pair = f"a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\nresult = a.sendto(b'escaped', {name!r})"
        assert attempt(session, send_from_pair) == sandbox.expect(full=ECONNREFUSED, degraded=EPERM)
        assert listener.drain() == []


@pytest.mark.parametrize("where", ["home", "runtime dir"])
def test_a_socketpair_cannot_reach_unix_sockets_outside(
    sandbox: Sandbox, session: dispatch.Session, where: str,
) -> None:
    """HOLE. ``socketpair(AF_UNIX, SOCK_DGRAM)`` is allowed, and a datagram
    socket may ``sendto`` any path: every datagram socket of the user's that
    the session can name (a journal, a notify socket, an agent) is reachable,
    with SCM_RIGHTS too, and with the network off. Only the runtime directory,
    covered in full mode, is out of the way. The refusal the rest of the suite
    gets for a Unix socket is seccomp's EPERM."""
    directory = Path.home() if where == "home" else sandbox.runtime_dir
    path = directory / f"escape-{secrets.token_hex(4)}.sock"
    try:
        with DatagramListener(socket.AF_UNIX, str(path)) as listener:
            send = f"a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\nresult = a.sendto(b'escaped', {str(path)!r})"
            assert attempt_outside(send) == "OK 7"
            assert listener.drain() == [b"escaped"]
            # The control: a socketpair between the session's own ends works.
            own = "a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)\na.send(b'own')\nresult = b.recv(8)"
            assert attempt(session, own) == "OK b'own'"
            out = attempt(session, send)
            arrived = listener.drain()
            hidden = where == "runtime dir" and sandbox.mode == "full"
            assert out == (ENOENT if hidden else EPERM), f"the datagram went out: {arrived}"
            assert arrived == []
    finally:
        path.unlink(missing_ok=True)


_HOLD_NAME = """
import os, socket, time
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    a.bind({name!r})
    verdict = "bound"
except OSError as exc:
    verdict = f"{{type(exc).__name__}} [Errno {{exc.errno}}]"
with open("hold.tmp", "w") as f:
    f.write(verdict)
os.rename("hold.tmp", "hold.verdict")
time.sleep(8)
"""


@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_a_session_cannot_take_an_abstract_name_on_the_host(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, network: bool,
) -> None:
    """HOLE where the session shares the host's network namespace (degraded
    mode, or the network on). A socketpair's socket can bind an abstract name:
    in the host's namespace that takes the name from the user's programs (an X
    server's, a desktop agent's) and receives what they send to it. Landlock's
    scope governs connecting and sending out, not binding."""
    name = b"\0dispatch-escape-squat-" + secrets.token_hex(6).encode()
    with client.open_session(str(worktree), network=network) as s:
        background(s, _HOLD_NAME.format(name=name), 10)
        verdict = worktree / "hold.verdict"
        deadline = time.monotonic() + 5
        while not verdict.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        own_namespace = sandbox.mode == "full" and not network
        bind = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nresult = s.bind({name!r})"
        taken = attempt_outside(bind)  # EADDRINUSE: the session holds the host's name
        # In its own namespace the session may bind what it likes; elsewhere it
        # must be refused, and the name stay the host's to take.
        assert (verdict.read_text(), taken) == ("bound" if own_namespace else "PermissionError [Errno 1]", "OK None")


IPC_CREAT, IPC_RMID = 0o1000, 0


@pytest.fixture
def host_shm() -> Iterator[tuple[int, bytes]]:
    """A System V shared memory segment of the user's, outside every session."""
    key, secret = secrets.randbits(30) + 1, b"shm-" + secrets.token_hex(8).encode()
    _libc.shmat.restype = ctypes.c_void_p
    shmid = _libc.shmget(key, 4096, IPC_CREAT | 0o600)
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    addr = _libc.shmat(shmid, None, 0)
    ctypes.memmove(addr, secret, len(secret))
    try:
        yield key, secret
    finally:
        _libc.shmdt(ctypes.c_void_p(addr))
        _libc.shmctl(shmid, IPC_RMID, None)


def test_system_v_shared_memory_of_the_host_is_out_of_reach(
    sandbox: Sandbox, session: dispatch.Session, host_shm: tuple[int, bytes],
) -> None:
    """HOLE. No IPC namespace in full mode, no seccomp rule in either: the
    user's shared memory segments (a database's, a desktop's) can be read and
    written by key. With an IPC namespace the key would not exist (ENOENT); in
    degraded mode only seccomp could refuse shmget (EPERM)."""
    key, secret = host_shm
    read = f"""
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget({key}, 0, 0)
if shmid == -1:
    raise OSError(ctypes.get_errno(), "shmget")
result = ctypes.string_at(libc.shmat(shmid, None, 0), {len(secret)})
"""
    assert attempt_outside(read) == f"OK {secret!r}"
    assert attempt(session, read) == sandbox.expect(full=ENOENT, degraded=EPERM)


@pytest.fixture
def host_queue() -> Iterator[tuple[int, bytes]]:
    """A System V message queue of the user's holding two copies of a message (one for the twin)."""
    key, secret = secrets.randbits(30) + 1, b"msg-" + secrets.token_hex(8).encode()
    qid = _libc.msgget(key, IPC_CREAT | 0o600)
    assert qid >= 0, os.strerror(ctypes.get_errno())
    msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + len(secret))
    ctypes.memmove(msg, ctypes.byref(ctypes.c_long(1)), ctypes.sizeof(ctypes.c_long))
    ctypes.memmove(ctypes.addressof(msg) + ctypes.sizeof(ctypes.c_long), secret, len(secret))
    for _ in range(2):
        assert _libc.msgsnd(qid, msg, len(secret), 0) == 0
    try:
        yield key, secret
    finally:
        _libc.msgctl(qid, IPC_RMID, None)


def test_system_v_message_queues_of_the_host_are_out_of_reach(
    sandbox: Sandbox, session: dispatch.Session, host_queue: tuple[int, bytes],
) -> None:
    """HOLE, as for shared memory: the session finds the user's queue by key
    and takes its message."""
    key, secret = host_queue
    take = f"""
qid = libc.msgget({key}, 0)
if qid == -1:
    raise OSError(ctypes.get_errno(), "msgget")
buf = ctypes.create_string_buffer(256)
n = libc.msgrcv(qid, buf, 200, 0, 0o4000)  # IPC_NOWAIT
if n == -1:
    raise OSError(ctypes.get_errno(), "msgrcv")
result = buf.raw[ctypes.sizeof(ctypes.c_long):ctypes.sizeof(ctypes.c_long) + n]
"""
    assert attempt_outside(take) == f"OK {secret!r}"
    assert attempt(session, take) == sandbox.expect(full=ENOENT, degraded=EPERM)


def test_posix_message_queues_of_the_host_are_out_of_reach(session: dispatch.Session) -> None:
    name = f"/dispatch-escape-{secrets.token_hex(6)}".encode()
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    fd = rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    try:
        open_it = f"""
rt = ctypes.CDLL("librt.so.1", use_errno=True)
mq = rt.mq_open({name!r}, os.O_RDWR)
if mq == -1:
    raise OSError(ctypes.get_errno(), "mq_open")
result = mq >= 0
"""
        assert attempt_outside(open_it) == "OK True"
        assert attempt(session, open_it) == EACCES  # Landlock: the queue is a file of the mqueue filesystem
    finally:
        os.close(fd)
        rt.mq_unlink(name)


def test_the_hosts_posix_shared_memory_is_out_of_reach(sandbox: Sandbox, session: dispatch.Session) -> None:
    path = Path("/dev/shm") / f"dispatch-escape-{secrets.token_hex(6)}"
    path.write_text("host shm\n")
    try:
        read = f"result = open({str(path)!r}).read()"
        assert attempt_outside(read) == "OK 'host shm\\n'"
        # Full mode: /dev/shm is the session's own tmpfs. Degraded: not granted.
        assert attempt(session, read) == sandbox.expect(full=ENOENT, degraded=EACCES)
    finally:
        path.unlink()


def test_the_users_runtime_directory_is_out_of_reach(sandbox: Sandbox, session: dispatch.Session) -> None:
    """Where D-Bus, systemd --user, the keyring and the agents keep their sockets."""
    read = f"result = open({str(sandbox.runtime_dir / 'bus')!r}).read()"
    assert attempt_outside(read) == f"OK {sandbox.canary!r}"
    # Full mode: covered by an empty tmpfs. Degraded: not granted.
    assert attempt(session, read) == sandbox.expect(full=ENOENT, degraded=EACCES)
