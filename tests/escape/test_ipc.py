"""Escapes through inter-process communication with the world outside the session.

The daemon's socket, the user's other Unix sockets (D-Bus, systemd, a
journal, an agent), abstract sockets, System V IPC, POSIX message queues and
shared memory, the user's runtime directory. Full mode (network off): Unix
sockets work inside, and none of the host's is there to reach — its paths
are not in the session's root (ENOENT) and its abstract names not in the
session's network namespace (ECONNREFUSED). Degraded mode: ``socket(AF_UNIX)``
is refused (EPERM; a stream ``socketpair`` allowed, a datagram pair refused
in both modes), System V IPC that is the
session's own (full mode: an IPC namespace) or refused (degraded mode), and
the README "the rest of the machine invisible"; each attempt's twin runs
outside and gets through.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

import pytest

import dispatch
from tests.escape.attempts import (
    EACCES, EADDRINUSE, ECONNREFUSED, EFAULT, EINVAL, EISCONN, ENOENT, EPERM, EPROTOTYPE, EXDEV, SYS, DatagramListener,
    attempt, attempt_outside, background, wait_for,
)
from tests.escape.conftest import Sandbox

_libc = ctypes.CDLL(None, use_errno=True)


class StreamListener:
    """A listening Unix stream socket outside the sandbox (a path or an
    abstract name) that never accepts: ``pending()`` counts the connections
    that reached it."""

    def __init__(self, address: str | bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(address)
        self.sock.listen(8)
        self.sock.setblocking(False)

    def pending(self) -> int:
        """Accept (and close) every connection waiting; how many there were."""
        n = 0
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return n
            conn.close()
            n += 1

    def __enter__(self) -> StreamListener:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.sock.close()


def _pair(kind: str, then: str) -> str:
    """A probe: a socketpair of ``kind`` (``a`` and ``b``), then ``then``."""
    return f"a, b = socket.socketpair(socket.AF_UNIX, socket.{kind})\n{then}"


# The control of every socketpair attempt: a stream pair between the session's own ends works.
_OWN_STREAM_PAIR = _pair("SOCK_STREAM", "a.send(b'own')\nresult = b.recv(8)")


def test_the_daemons_socket_cannot_be_reached(sandbox: Sandbox, session: dispatch.Session) -> None:
    path = sandbox.daemon.socket
    connect = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ns.settimeout(5)\nresult = s.connect({path!r})"
    assert attempt_outside(connect) == "OK None"
    # Full mode: not in the session's root. Degraded: seccomp, no socket(AF_UNIX).
    assert attempt(session, connect) == sandbox.expect(full=ENOENT, degraded=EPERM)
    # The twin: the same connect to a socket of the session's own, in its /tmp.
    own = "/tmp/own.sock"
    serve = f"l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nl.bind({own!r})\nl.listen(1)\n"
    assert attempt(session, serve + connect.replace(repr(path), repr(own))) == sandbox.expect(full="OK None",
                                                                                             degraded=EPERM)
    assert attempt(session, _OWN_STREAM_PAIR) == "OK b'own'"
    # A stream pair is connected from birth: the kernel will not connect it
    # again (EISCONN, outside as well); in full mode the path is not even
    # there (a private /tmp, the runtime directory covered).
    reconnect = _pair("SOCK_STREAM", f"result = a.connect({path!r})")
    assert attempt_outside(reconnect) == EISCONN
    assert attempt(session, reconnect) == sandbox.expect(full=ENOENT, degraded=EISCONN)
    # A datagram pair is refused whole (seccomp); outside, the kernel gets as
    # far as the daemon's socket and refuses only its type.
    dgram = _pair("SOCK_DGRAM", f"result = a.connect({path!r})")
    assert attempt_outside(dgram) == EPROTOTYPE
    assert attempt(session, dgram) == EPERM


def test_af_unix_with_high_bits_in_the_family_is_still_refused(session: dispatch.Session) -> None:
    """The kernel reads the family as an int; a filter comparing 64 bits must not let AF_UNIX | 1 << 32 by."""
    body = f"result = syscall({SYS['socket']}, (1 << 32) | socket.AF_UNIX, socket.SOCK_STREAM, 0) >= 0"
    assert attempt_outside(body) == "OK True"
    assert attempt(session, body) == EPERM


def test_abstract_unix_sockets_outside_are_unreachable(sandbox: Sandbox, session: dispatch.Session) -> None:
    """A datagram listener and a stream listener of the user's, on abstract
    names (an X server's, a desktop agent's, D-Bus's). The session's network
    is off: in full mode its abstract names are its own network namespace's
    (the host's are not there: ECONNREFUSED; its own work, the twin); in
    degraded mode there is no socket(AF_UNIX) (EPERM)."""
    token = secrets.token_hex(6).encode()
    dgram_name, stream_name = b"\0dispatch-escape-" + token, b"\0dispatch-escape-stream-" + token
    with DatagramListener(socket.AF_UNIX, dgram_name) as listener, StreamListener(stream_name) as stream:
        send = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\nresult = s.sendto(b'escaped', {dgram_name!r})"
        assert attempt_outside(send) == "OK 7"
        assert listener.drain(expect=1) == [b"escaped"]
        assert attempt(session, send) == sandbox.expect(full=ECONNREFUSED, degraded=EPERM)
        # A datagram pair could aim sendto at any name: refused whole (seccomp).
        send_from_pair = _pair("SOCK_DGRAM", f"result = a.sendto(b'escaped', {dgram_name!r})")
        assert attempt_outside(send_from_pair) == "OK 7"
        assert listener.drain(expect=1) == [b"escaped"]
        assert attempt(session, send_from_pair) == EPERM
        assert listener.drain() == []
        # The stream listener: reached from outside by a new socket, never by
        # the session's. A stream pair is connected from birth (EISCONN, as
        # outside); in full mode the name is not even in its namespace.
        connect = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = s.connect({stream_name!r})"
        assert attempt_outside(connect) == "OK None"
        assert stream.pending() == 1
        assert attempt(session, connect) == sandbox.expect(full=ECONNREFUSED, degraded=EPERM)
        own = (f"l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nl.bind({stream_name!r})\nl.listen(1)\n"
               + connect)  # the twin: its own listener on the same name, in its own namespace
        assert attempt(session, own) == sandbox.expect(full="OK None", degraded=EPERM)
        assert attempt(session, _OWN_STREAM_PAIR) == "OK b'own'"
        reconnect = _pair("SOCK_STREAM", f"result = a.connect({stream_name!r})")
        assert attempt_outside(reconnect) == EISCONN
        assert attempt(session, reconnect) == sandbox.expect(full=ECONNREFUSED, degraded=EISCONN)
        assert stream.pending() == 0


@pytest.mark.parametrize("where", ["home", "runtime dir"])
def test_a_socketpair_cannot_reach_unix_sockets_outside(
    sandbox: Sandbox, session: dispatch.Session, where: str,
) -> None:
    """A datagram socket may ``sendto`` any path: a datagram socketpair would
    reach every datagram socket of the user's that the session can name (a
    journal, a notify socket, an agent), with SCM_RIGHTS too, and with the
    network off. Seccomp refuses ``socketpair(AF_UNIX, SOCK_DGRAM)`` (EPERM)
    in both modes, wherever it would be aimed. A stream pair, allowed (asyncio
    and multiprocessing use it), is connected from birth: the kernel refuses
    to send it anywhere else or connect it again (EISCONN, outside as well),
    and in full mode the runtime directory is not even there (ENOENT)."""
    directory = Path.home() if where == "home" else sandbox.runtime_dir
    token = secrets.token_hex(4)
    dgram_path, stream_path = directory / f"escape-{token}.sock", directory / f"escape-{token}-stream.sock"
    try:
        with DatagramListener(socket.AF_UNIX, str(dgram_path)) as listener, StreamListener(str(stream_path)) as stream:
            send = _pair("SOCK_DGRAM", f"result = a.sendto(b'escaped', {str(dgram_path)!r})")
            assert attempt_outside(send) == "OK 7"
            assert listener.drain(expect=1) == [b"escaped"]
            assert attempt(session, _OWN_STREAM_PAIR) == "OK b'own'"  # the control
            out = attempt(session, send)
            arrived = listener.drain()
            assert out == EPERM, f"the datagram went out: {arrived}"
            assert arrived == []
            # The stream pair: no sendto elsewhere, no second connect.
            connect = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = s.connect({str(stream_path)!r})"
            assert attempt_outside(connect) == "OK None"
            assert stream.pending() == 1
            sendto = _pair("SOCK_STREAM", f"result = a.sendto(b'escaped', {str(dgram_path)!r})")
            assert attempt_outside(sendto) == EISCONN
            assert attempt(session, sendto) == EISCONN
            reconnect = _pair("SOCK_STREAM", f"result = a.connect({str(stream_path)!r})")
            assert attempt_outside(reconnect) == EISCONN
            # Full mode: neither directory is in the session's root.
            assert attempt(session, reconnect) == sandbox.expect(full=ENOENT, degraded=EISCONN)
            assert (listener.drain(), stream.pending()) == ([], 0)
    finally:
        dgram_path.unlink(missing_ok=True)
        stream_path.unlink(missing_ok=True)


_LISTEN = ("l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nl.bind({path!r})\nl.listen(1)\n"
           "c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = c.connect({path!r})")
_GAP = "Unix sockets can be made in "


def test_a_session_makes_no_socket_where_another_session_reaches(sandbox: Sandbox, client: dispatch.Client) -> None:
    """The worktree can be another session's too (given it read-only, or in
    turn), as can a policy's ``read_write`` path: a socket listening there
    let a session beside it connect and be handed descriptors (a file of the
    worktree open for writing, used after its giver's end had checked the
    file; a TCP socket for a session with the network off). Full mode: no
    socket is made there (Landlock, EACCES), nor moved there from /tmp
    (EXDEV: another mount); the twin, one in the session's own /tmp, listens
    and is connected to. Degraded mode: no ``socket(AF_UNIX)`` (EPERM). A
    worktree in the home directory, as most are (one below /tmp: below)."""
    worktree = Path.home() / f"dispatch-escape-wt-{secrets.token_hex(4)}"
    (worktree / "sub").mkdir(parents=True)
    try:
        with client.open_session(str(worktree)) as session:
            assert not [g for g in session.status()["protections"]["leaves_open"] if g.startswith(_GAP)]
            own = attempt(session, _LISTEN.format(path="/tmp/own.sock"))
            assert own == sandbox.expect(full="OK None", degraded=EPERM)
            for path in ("rendezvous.sock", str(worktree / "sub" / "rendezvous.sock")):
                assert attempt(session, _LISTEN.format(path=path)) == sandbox.expect(full=EACCES, degraded=EPERM)
            moved = ("l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nl.bind('/tmp/{how}.sock')\n"
                     "result = os.{how}('/tmp/{how}.sock', 'moved.sock')")
            for how in ("rename", "link"):
                assert attempt(session, moved.format(how=how)) == sandbox.expect(full=EXDEV, degraded=EPERM), how
        assert not list(worktree.rglob("*.sock"))
    finally:
        shutil.rmtree(worktree)


def test_a_worktree_below_tmp_is_said_to_hold_sockets(sandbox: Sandbox, session: dispatch.Session,
                                                      worktree: Path) -> None:
    """KNOWN LIMIT, stated: the private /tmp's rule, which lets a session make
    its sockets there, holds below it across the worktree's bind (Landlock
    cannot take a right away below a rule). Full mode, a worktree below
    /tmp (this suite's): a socket is made in it, and ``leaves_open`` says
    so; degraded mode: none at all (EPERM), nothing said."""
    assert worktree.is_relative_to("/tmp")
    gaps = [g for g in session.status()["protections"]["leaves_open"] if g.startswith(_GAP)]
    made = attempt(session, _LISTEN.format(path="rendezvous.sock"))
    assert (made, len(gaps)) == (("OK None", 1) if sandbox.mode == "full" else (EPERM, 0)), gaps
    assert gaps == [] or gaps[0].startswith(f"{_GAP}{worktree}: it lies below the session's private /tmp")


@pytest.mark.parametrize("where", ["home", "runtime dir"])
def test_a_unix_socket_cannot_connect_to_the_users_sockets(
    sandbox: Sandbox, session: dispatch.Session, where: str,
) -> None:
    """What D-Bus, ``systemd --user`` (``systemd-run --user`` would run anything
    unconfined), an ssh or gpg agent, or a container engine listen on: a
    pathname socket of the user's. Full mode: Unix sockets work inside, and
    the user's are not in the session's root (ENOENT); the twin, the same
    connect to a listener the session made in its /tmp, works. Degraded
    mode: no ``socket(AF_UNIX)`` (EPERM)."""
    directory = Path.home() if where == "home" else sandbox.runtime_dir
    path = directory / f"escape-{secrets.token_hex(4)}-bus.sock"
    try:
        with StreamListener(str(path)) as listener:
            connect = "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\ns.settimeout(5)\nresult = s.connect({path!r})"
            assert attempt_outside(connect.format(path=str(path))) == "OK None"
            assert listener.pending() == 1
            assert attempt(session, connect.format(path=str(path))) == sandbox.expect(full=ENOENT, degraded=EPERM)
            assert listener.pending() == 0
            own = ("l = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nl.bind('/tmp/own-bus.sock')\n"
                   "l.listen(1)\n" + connect.format(path="/tmp/own-bus.sock"))
            assert attempt(session, own) == sandbox.expect(full="OK None", degraded=EPERM)
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("where", ["home", "runtime dir"])
def test_a_raw_socketpair_cannot_reach_unix_sockets_outside(
    sandbox: Sandbox, session: dispatch.Session, where: str,
) -> None:
    """HOLE. For AF_UNIX the kernel makes a SOCK_RAW socket a datagram socket
    (``unix_create``: "BSD has AF_UNIX, SOCK_RAW though nothing uses it";
    SO_TYPE then says SOCK_DGRAM). The filter refuses only the type value
    SOCK_DGRAM, so ``socketpair(AF_UNIX, SOCK_RAW)`` is a datagram pair by
    another name, and its ``sendto`` reaches the user's datagram sockets as
    the SOCK_DGRAM pair did, in both modes, network off; only the runtime
    directory, covered in full mode, is out of the way. Refused, it must
    answer as the SOCK_DGRAM pair does: EPERM, whatever the path."""
    directory = Path.home() if where == "home" else sandbox.runtime_dir
    path = directory / f"escape-{secrets.token_hex(4)}.sock"
    try:
        with DatagramListener(socket.AF_UNIX, str(path)) as listener:
            send = _pair("SOCK_RAW", f"result = (a.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE), "
                                     f"a.sendto(b'escaped', {str(path)!r}))")
            assert attempt_outside(send) == f"OK ({int(socket.SOCK_DGRAM)}, 7)"  # a datagram socket
            assert listener.drain(expect=1) == [b"escaped"]
            assert attempt(session, _OWN_STREAM_PAIR) == "OK b'own'"  # the control
            out = attempt(session, send)
            arrived = listener.drain()
            assert (out, arrived) == (EPERM, []), f"socketpair(AF_UNIX, SOCK_RAW) was made: {out}; arrived: {arrived}"
    finally:
        path.unlink(missing_ok=True)


_HOLD_NAME = """
import os, socket, time
try:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.bind({name!r})
    verdict = "bound"
except OSError as exc:
    verdict = f"{{type(exc).__name__}} [Errno {{exc.errno}}]"
with open("hold.tmp", "w") as f:
    f.write(verdict)
os.rename("hold.tmp", "hold.verdict")
time.sleep(8)
"""
ABSTRACT_GAP = "abstract Unix socket names of the host can be taken (bind) by the session"
_SHARED_NS = pytest.mark.known_limit


@pytest.mark.parametrize(("sandbox", "network"), [
    pytest.param("full", "off", id="full-network-off"),
    pytest.param("full", "on", id="full-network-on"),
    pytest.param("full", "ports", id="full-network-ports"),
    pytest.param("woken", "off", id="woken-network-off"),
    pytest.param("woken", "on", id="woken-network-on"),
    pytest.param("woken", "ports", id="woken-network-ports"),
    pytest.param("degraded", "off", id="degraded-network-off", marks=_SHARED_NS),
    pytest.param("degraded", "on", id="degraded-network-on", marks=_SHARED_NS),
    pytest.param("degraded", "ports", id="degraded-network-ports", marks=_SHARED_NS),
], indirect=["sandbox"])
def test_taking_an_abstract_name_of_the_host(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, network: str,
) -> None:
    """A stream socketpair's socket can bind an abstract name: a bind is not a
    connect (Landlock's scope does not govern it) and seccomp cannot read the
    address behind the pointer. Abstract names belong to a network namespace.
    Full mode, every network mode: the session's namespace is its own (on and
    ports go out through pasta); the name is taken there (a second bind inside
    finds it taken) and the host's stays free. Where the session shares the
    host's network namespace (degraded mode; full mode without a user-mode
    stack): a KNOWN LIMIT, stated in leaves_open. The session takes the host's name (of the socket's type) and
    a program of the user's that binds it afterwards fails (EADDRINUSE); a
    socket connected to its pair can neither listen nor receive, so nothing
    connects to it (ECONNREFUSED) or is received through it."""
    name = b"\0dispatch-escape-squat-" + secrets.token_hex(6).encode()
    with client.open_session(str(worktree), network=network, ports=[] if network == "ports" else None) as s:
        assert s.status()["protections"]["mode"] == sandbox.mode
        background(s, _HOLD_NAME.format(name=name), 10)
        verdict = worktree / "hold.verdict"
        assert wait_for(verdict.exists)
        assert verdict.read_text() == "bound"
        assert attempt(s, _pair("SOCK_STREAM", f"result = a.bind({name!r})")) == EADDRINUSE  # taken, in its namespace
        bind = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = s.bind({name!r})"
        connect = f"s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\nresult = s.connect({name!r})"
        gaps = s.status()["protections"]["leaves_open"]
        listed = [g for g in gaps if g.startswith(ABSTRACT_GAP)]
        if sandbox.mode == "full":
            assert attempt_outside(bind) == "OK None"  # the host's name stays free
            assert attempt_outside(connect) == ECONNREFUSED  # nobody there
            assert listed == [], gaps
        else:
            assert attempt_outside(bind) == EADDRINUSE  # the session holds the host's name
            assert attempt_outside(connect) == ECONNREFUSED  # and nothing can be connected to it
            assert len(listed) == 1, gaps


IPC_CREAT, IPC_RMID, IPC_NOWAIT = 0o1000, 0, 0o4000
GETVAL, SETVAL = 12, 16


def _key() -> int:
    return secrets.randbits(30) + 1


def _host_sees(call: str, key: int) -> str:
    """Whether the host's IPC namespace holds ``key`` (a twin's verdict)."""
    return attempt_outside(f"result = syscall({SYS[call]}, {key}, 0, 0) >= 0")


@pytest.fixture
def host_shm() -> Iterator[tuple[int, bytes]]:
    """A System V shared memory segment of the user's, outside every session."""
    key, secret = _key(), b"shm-" + secrets.token_hex(8).encode()
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


_SHM_READ = """
libc.shmat.restype = ctypes.c_void_p
shmid = libc.shmget({key}, 0, 0)
if shmid == -1:
    raise OSError(ctypes.get_errno(), "shmget")
result = ctypes.string_at(libc.shmat(shmid, None, 0), {size})
"""
_SHM_MAKE = """
libc.shmat.restype = ctypes.c_void_p
made = libc.shmget({key}, 4096, {flags})
if made == -1:
    raise OSError(ctypes.get_errno(), "shmget")
ctypes.memmove(libc.shmat(made, None, 0), b"own", 3)
"""


def test_system_v_shared_memory_of_the_host_is_out_of_reach(
    sandbox: Sandbox, session: dispatch.Session, host_shm: tuple[int, bytes],
) -> None:
    """The user's shared memory segments (a database's, a desktop's), by key.
    Full mode: the session's own IPC namespace, where the key does not exist
    (ENOENT) and where the same read works on a segment the session made (the
    control), which the host never sees. Degraded mode: seccomp refuses
    System V IPC whole (EPERM), the session's own segments too."""
    key, secret = host_shm
    read = _SHM_READ.format(key=key, size=len(secret))
    assert attempt_outside(read) == f"OK {secret!r}"
    assert attempt(session, read) == sandbox.expect(full=ENOENT, degraded=EPERM)
    own = _key()
    make_and_read = _SHM_MAKE.format(key=own, flags=IPC_CREAT | 0o600) + _SHM_READ.format(key=own, size=3)
    assert attempt(session, make_and_read) == sandbox.expect(full="OK b'own'", degraded=EPERM)
    assert _host_sees("shmget", own) == ENOENT


@pytest.fixture
def host_queue() -> Iterator[tuple[int, bytes]]:
    """A System V message queue of the user's holding two copies of a message (one for the twin)."""
    key, secret = _key(), b"msg-" + secrets.token_hex(8).encode()
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


_MSG_TAKE = """
qid = libc.msgget({key}, 0)
if qid == -1:
    raise OSError(ctypes.get_errno(), "msgget")
buf = ctypes.create_string_buffer(256)
n = libc.msgrcv(qid, buf, 200, 0, {nowait})
if n == -1:
    raise OSError(ctypes.get_errno(), "msgrcv")
result = buf.raw[ctypes.sizeof(ctypes.c_long):ctypes.sizeof(ctypes.c_long) + n]
"""
_MSG_MAKE = """
made = libc.msgget({key}, {flags})
if made == -1:
    raise OSError(ctypes.get_errno(), "msgget")
msg = ctypes.create_string_buffer(ctypes.sizeof(ctypes.c_long) + 3)
ctypes.memmove(msg, ctypes.byref(ctypes.c_long(1)), ctypes.sizeof(ctypes.c_long))
ctypes.memmove(ctypes.addressof(msg) + ctypes.sizeof(ctypes.c_long), b"own", 3)
if libc.msgsnd(made, msg, 3, 0) == -1:
    raise OSError(ctypes.get_errno(), "msgsnd")
"""


def test_system_v_message_queues_of_the_host_are_out_of_reach(
    sandbox: Sandbox, session: dispatch.Session, host_queue: tuple[int, bytes],
) -> None:
    """As for shared memory: the user's queue, by key, and its message taken.
    Full mode: not in the session's IPC namespace (ENOENT); a queue the session
    makes is its own (the control) and never the host's. Degraded: EPERM."""
    key, secret = host_queue
    take = _MSG_TAKE.format(key=key, nowait=IPC_NOWAIT)
    assert attempt_outside(take) == f"OK {secret!r}"
    assert attempt(session, take) == sandbox.expect(full=ENOENT, degraded=EPERM)
    own = _key()
    make_and_take = _MSG_MAKE.format(key=own, flags=IPC_CREAT | 0o600) + _MSG_TAKE.format(key=own, nowait=IPC_NOWAIT)
    assert attempt(session, make_and_take) == sandbox.expect(full="OK b'own'", degraded=EPERM)
    assert _host_sees("msgget", own) == ENOENT


@pytest.fixture
def host_semaphore() -> Iterator[tuple[int, int]]:
    """A System V semaphore set of the user's (one semaphore, a known value)."""
    key, value = _key(), secrets.randbelow(1000) + 1
    semid = _libc.semget(key, 1, IPC_CREAT | 0o600)
    assert semid >= 0, os.strerror(ctypes.get_errno())
    assert _libc.semctl(semid, 0, SETVAL, ctypes.c_int(value)) == 0
    try:
        yield key, value
    finally:
        _libc.semctl(semid, 0, IPC_RMID)


_SEM_GET = """
semid = libc.semget({key}, 0, 0)
if semid == -1:
    raise OSError(ctypes.get_errno(), "semget")
result = libc.semctl(semid, 0, {getval})
"""
_SEM_MAKE = """
made = libc.semget({key}, 1, {flags})
if made == -1:
    raise OSError(ctypes.get_errno(), "semget")
if libc.semctl(made, 0, {setval}, ctypes.c_int(3)) == -1:
    raise OSError(ctypes.get_errno(), "semctl")
"""


def test_system_v_semaphores_of_the_host_are_out_of_reach(
    sandbox: Sandbox, session: dispatch.Session, host_semaphore: tuple[int, int],
) -> None:
    """The user's semaphores, by key (what a lock between the user's programs
    rests on). Full mode: not in the session's IPC namespace (ENOENT); the
    session's own set works (the control). Degraded: EPERM."""
    key, value = host_semaphore
    read = _SEM_GET.format(key=key, getval=GETVAL)
    assert attempt_outside(read) == f"OK {value}"
    assert attempt(session, read) == sandbox.expect(full=ENOENT, degraded=EPERM)
    own = _key()
    make_and_read = (_SEM_MAKE.format(key=own, flags=IPC_CREAT | 0o600, setval=SETVAL)
                     + _SEM_GET.format(key=own, getval=GETVAL))
    assert attempt(session, make_and_read) == sandbox.expect(full="OK 3", degraded=EPERM)
    assert _host_sees("semget", own) == ENOENT


# Each System V IPC call with arguments the kernel itself refuses, with its own errno.
_MISSING = secrets.randbits(30) + 1  # a key nobody has
SYSV_CALLS = {
    "shmget": (f"{_MISSING}, 0, 0", ENOENT),
    "shmat": ("-1, 0, 0", EINVAL),
    "shmdt": ("0", EINVAL),
    "shmctl": ("-1, 2, 0", EINVAL),  # IPC_STAT
    "msgget": (f"{_MISSING}, 0, 0", ENOENT),
    "msgsnd": ("-1, 0, 0, 0", EFAULT),  # the message is read before the queue is looked up
    "msgrcv": ("-1, 0, 0, 0, 0", EINVAL),
    "msgctl": ("-1, 2, 0", EINVAL),
    "semget": (f"{_MISSING}, 0, 0", ENOENT),
    "semop": ("-1, 0, 0", EINVAL),
    "semtimedop": ("-1, 0, 0, 0", EINVAL),
    "semctl": ("-1, 0, 2, 0", EINVAL),
}


@pytest.mark.parametrize("call", SYSV_CALLS)
def test_every_system_v_ipc_call_is_refused_without_an_ipc_namespace(
    sandbox: Sandbox, session: dispatch.Session, call: str,
) -> None:
    """Full mode: the call reaches the kernel (in the session's own IPC
    namespace) and gets the kernel's answer, as outside. Degraded mode:
    seccomp answers EPERM before the kernel reads an argument."""
    args, kernel = SYSV_CALLS[call]
    body = f"result = syscall({SYS[call]}, {args})"
    assert attempt_outside(body) == kernel
    assert attempt(session, body) == sandbox.expect(full=kernel, degraded=EPERM)


_MQ = """
rt = ctypes.CDLL("librt.so.1", use_errno=True)
def mq(r, what):
    if r == -1:
        raise OSError(ctypes.get_errno(), what)
    return r
"""
_rt = ctypes.CDLL("librt.so.1", use_errno=True)


def _host_has_queue(name: bytes) -> bool:
    fd = _rt.mq_open(name, os.O_RDONLY)
    if fd >= 0:
        os.close(fd)
    return fd >= 0


@pytest.fixture
def mq_names() -> Iterator[list[bytes]]:
    """Names for POSIX message queues; whatever holds them in the host's namespace at the end is removed."""
    names: list[bytes] = []
    yield names
    for name in names:
        _rt.mq_unlink(name)


def _host_queue(names: list[bytes]) -> bytes:
    name = f"/dispatch-escape-{secrets.token_hex(6)}".encode()
    names.append(name)
    fd = _rt.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, None)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    os.close(fd)
    return name


def _new_name(names: list[bytes]) -> bytes:
    name = f"/dispatch-escape-{secrets.token_hex(6)}".encode()
    names.append(name)
    return name


def test_posix_message_queues_of_the_host_are_out_of_reach(
    sandbox: Sandbox, session: dispatch.Session, mq_names: list[bytes],
) -> None:
    """Full mode: the session's IPC namespace has its own queues, and the
    user's name is not there (ENOENT); a queue the session made itself is
    there, and refused like every queue (EACCES: Landlock, a file of the
    mqueue filesystem outside every rule). Degraded mode: no IPC namespace,
    so mq_open is refused by seccomp (EPERM) before Landlock is asked."""
    name = _host_queue(mq_names)
    open_it = _MQ + f"result = mq(rt.mq_open({name!r}, os.O_RDWR), 'mq_open') >= 0"
    assert attempt_outside(open_it) == "OK True"
    assert attempt(session, open_it) == sandbox.expect(full=ENOENT, degraded=EPERM)
    if sandbox.mode == "full":
        own = _new_name(mq_names)
        make = _MQ + f"result = mq(rt.mq_open({own!r}, os.O_CREAT | os.O_RDWR, 0o600, None), 'mq_open') >= 0"
        assert attempt(session, make) == EACCES  # made, in its namespace, then refused
        assert attempt(session, open_it.replace(repr(name), repr(own))) == EACCES  # there: found, refused
        assert not _host_has_queue(own)


@pytest.mark.parametrize("op", ["unlink", "create"])
def test_the_hosts_posix_message_queues_cannot_be_removed_or_planted(
    sandbox: Sandbox, session: dispatch.Session, mq_names: list[bytes], op: str,
) -> None:
    """Landlock refuses opening a queue, but ``mq_unlink`` and the making half
    of ``mq_open(O_CREAT)`` are not opens. Degraded mode (no IPC namespace):
    seccomp refuses both, and the host's queues stay as they were (glibc's
    ``mq_unlink`` reports the kernel's EPERM as EACCES, as POSIX asks). Full
    mode: the session's own namespace (the user's name is not there: ENOENT;
    a queue it makes stays there: EACCES from Landlock)."""
    if op == "unlink":
        name, twin = _host_queue(mq_names), _host_queue(mq_names)
        code = _MQ + "result = mq(rt.mq_unlink({name!r}), 'mq_unlink')"
        assert attempt_outside(code.format(name=twin)) == "OK 0"
        assert not _host_has_queue(twin)
        out = attempt(session, code.format(name=name))
        assert (out, _host_has_queue(name)) == (sandbox.expect(full=ENOENT, degraded=EACCES), True), \
            f"{out}; the user's queue is {'still there' if _host_has_queue(name) else 'gone'}"
    else:
        name, twin = _new_name(mq_names), _new_name(mq_names)
        code = _MQ + "result = mq(rt.mq_open({name!r}, os.O_CREAT | os.O_RDWR, 0o600, None), 'mq_open') >= 0"
        assert attempt_outside(code.format(name=twin)) == "OK True"
        assert _host_has_queue(twin)
        out = attempt(session, code.format(name=name))
        assert (out, _host_has_queue(name)) == (sandbox.expect(full=EACCES, degraded=EPERM), False), \
            f"{out}; a queue {'was' if _host_has_queue(name) else 'was not'} planted in the user's namespace"


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


# Holds a read lock on a file of the system for a while, and says so.
_LOCKER = ("import fcntl, os, time\nfd = os.open('/usr/bin/true', os.O_RDONLY)\nfcntl.lockf(fd, fcntl.LOCK_SH)\n"
           "open('locked', 'w').close()\ntime.sleep(20)\n")
# Asks whether a write lock on the same file would conflict (F_GETLK).
_ASK = ("import fcntl, struct\nfd = os.open('/usr/bin/true', os.O_RDONLY)\n"
        "got = fcntl.fcntl(fd, fcntl.F_GETLK, struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 0, 0))\n"
        "result = struct.unpack('hhqqi', got)[0] == fcntl.F_RDLCK")


@pytest.mark.known_limit
def test_two_sessions_see_each_others_locks_on_system_files_known_limit(
    sandbox: Sandbox, client: dispatch.Client, session: dispatch.Session, make_worktree: Callable[[str], Path],
) -> None:
    """KNOWN LIMIT, both modes: lock state is per inode, and the system's
    inodes are every session's; no layer of the sandbox has a say over it.
    A session on another worktree, with no path in common, sees a read lock
    this one holds (a bit of a storage channel: SECURITY.md, "Known limits").
    The twin: before the lock, it sees none."""
    assert attempt(session, _ASK) == "OK False"
    elsewhere = make_worktree("other")
    with client.open_session(str(elsewhere)) as other:
        background(other, _LOCKER, 25)
        assert wait_for(lambda: (elsewhere / "locked").exists(), 10)
        assert attempt(session, _ASK) == "OK True"
