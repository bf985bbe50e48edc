"""Escapes through the network: from a session whose network is off, after a
switch to off, and around "ports".

Full mode gives every session a network namespace of its own. "off" has only
its own loopback: 127.0.0.1 there is not the host's (ECONNREFUSED), nothing
else is routed (ENETUNREACH), and a datagram sent goes nowhere. "on" and
"ports" go out through pasta, which maps the gateway address (10.0.2.2) to the
host's loopback; "ports" is nftables inside the namespace. Degraded mode holds
"off" with seccomp (no IPv4/IPv6 socket: EPERM) and Landlock's TCP rules, and
"ports" with Landlock alone. The control of each attempt is the same code in a
session with the network on, which reaches the same listener, outside, in the
test process.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.escape.attempts import (
    EACCES, EAFNOSUPPORT, ECONNREFUSED, ENETUNREACH, EPERM, DatagramListener, TcpListener, attempt, attempt_outside,
    _denied, background, wait_for,
)
from tests.escape.conftest import MODES_WITH_LIMIT, Sandbox

EHOSTUNREACH = _denied("EHOSTUNREACH")  # nftables' admin-prohibited, in a "ports" session


def host_loopback(sandbox: Sandbox) -> str:
    """Where a session with the network on reaches the host's 127.0.0.1."""
    return sandbox.expect(full="10.0.2.2", degraded="127.0.0.1")


def _external_ipv4() -> str:
    """An address of this machine other than loopback: the host seen from its network."""
    for name, addrs in psutil.net_if_addrs().items():
        stats = psutil.net_if_stats().get(name)
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127.") and stats and stats.isup:
                return a.address
    pytest.skip("this machine has no non-loopback IPv4 address")


_CONNECT = """
s = socket.socket(socket.{family}, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect(({host!r}, {port}))
    result = s.recv(100)
finally:
    s.close()
"""
# Where a network-off session tries to connect, and what full mode answers.
TARGETS = {
    "loopback": ("127.0.0.1", "AF_INET", ECONNREFUSED),  # its own lo: nobody listens there
    "loopback6": ("::1", "AF_INET6", ECONNREFUSED),
    "external": (None, "AF_INET", ENETUNREACH),  # no route out of the namespace
}


@pytest.mark.parametrize("target", TARGETS)
def test_tcp_from_a_network_off_session_reaches_nothing_outside(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, target: str,
) -> None:
    host, family, full = TARGETS[target]
    host = host or _external_ipv4()
    with TcpListener(host, getattr(socket, family)) as listener:
        connect = _CONNECT.format(family=family, host=host, port=listener.port)
        # The control: the same listener reached from a session with the network
        # on (in full mode the host's loopback is the gateway address; pasta
        # carries IPv4 only, so ::1 is reached from outside).
        control = connect
        if target == "loopback" and sandbox.mode == "full":
            control = _CONNECT.format(family=family, host=host_loopback(sandbox), port=listener.port)
        with client.open_session(str(worktree), network=True) as on:
            if target == "loopback6" and sandbox.mode == "full":
                assert attempt_outside(connect) == f"OK {TcpListener.BANNER!r}"
            else:
                assert attempt(on, control) == f"OK {TcpListener.BANNER!r}"
        with client.open_session(str(worktree), network=False) as off:
            assert attempt(off, connect) == sandbox.expect(full=full, degraded=EPERM)
        assert len(listener.received) == 1  # the control's connection only


def test_udp_from_a_network_off_session_never_arrives(sandbox: Sandbox, client: dispatch.Client, worktree: Path) -> None:
    with DatagramListener(socket.AF_INET, ("127.0.0.1", 0)) as listener:
        send = f"s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nresult = s.sendto(b'escaped', {listener.address!r})"
        control = send.replace(repr(listener.address), repr((host_loopback(sandbox), listener.address[1])))
        with client.open_session(str(worktree), network=True) as on:
            assert attempt(on, control) == "OK 7"
            # while the session lives: a close drops what pasta had not yet relayed
            assert listener.drain(expect=1) == [b"escaped"]
        with client.open_session(str(worktree), network=False) as off:
            # Full mode: sent, into the session's own loopback, where nobody hears it.
            assert attempt(off, send) == sandbox.expect(full="OK 7", degraded=EPERM)
        assert listener.drain() == []


@pytest.mark.parametrize("network", [False, True], ids=["network-off", "network-on"])
def test_vsock_to_the_hypervisor_is_refused_whatever_the_network(
    client: dispatch.Client, worktree: Path, network: bool,
) -> None:
    """AF_VSOCK is not in any network namespace: only seccomp stands between a
    session and the host's (or hypervisor's) vsock services."""
    create = "s = socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)\ns.close()\nresult = 'created'"
    assert attempt_outside(create) in ("OK 'created'", EAFNOSUPPORT)
    with client.open_session(str(worktree), network=network) as s:
        assert attempt(s, create) == EPERM


_TALK_LATE = """
import socket, time
s = socket.create_connection(({host!r}, {port}), timeout=5)
s.recv(100)
s.sendall(b"early\\n")
time.sleep(3)
s.sendall(b"late\\n")
time.sleep(5)
"""


def test_switching_the_network_off_ends_connections_made_while_it_was_on(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, make_worktree: Callable[[str], Path],
) -> None:
    """Two sessions with the network on each start a process that connects out,
    says "early", and "late" three seconds later. One session is switched off
    in between: its process must be gone, its connection closed, "late" never
    sent. The other (the control) says both."""
    with TcpListener() as listener, \
            client.open_session(str(worktree), network=True) as switched, \
            client.open_session(str(make_worktree("control")), network=True) as control:
        for n, s in enumerate((switched, control)):
            background(s, _TALK_LATE.format(host=host_loopback(sandbox), port=listener.port), 15)
            assert wait_for(lambda: len(listener.received) > n and listener.received[n] == b"early\n")
        assert switched.set_network(False) is False
        assert wait_for(lambda: listener.received[1] == b"early\nlate\n", 10)
        assert listener.received == [b"early\n", b"early\nlate\n"]
        assert listener.closed_by_peer == [True, False]


# --- the switch to off, against a sendfile queue ------------------------------------------

_PAYLOAD_MB = 48
_SENDFILE = """
import os, socket
s = socket.create_connection(({host!r}, {port}), timeout=30)
s.settimeout(None)
fd = os.open("payload.bin", os.O_RDONLY)
os.sendfile(s.fileno(), fd, 0, {size})
"""
_PWRITE_MARKERS = """
fd = os.open("payload.bin", os.O_WRONLY)
for offset in range(0, {size}, 4096):
    os.pwrite(fd, b"MARKER", offset)
os.close(fd)
result = "written"
"""


class SlowReceiver:
    """Outside the sandbox, on the host's loopback: a receiver with a tiny
    window that reads a byte now and then (the connection stays alive, the
    sender's queue stays full), until ``drain`` reads all it gets."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.data = bytearray()
        self.conn: socket.socket | None = None

    def accept(self, timeout: float = 10) -> None:
        self.sock.settimeout(timeout)
        self.conn, _ = self.sock.accept()

    def trickle(self, seconds: float) -> None:
        """A byte at a time, a pause between: the sender's queues fill up."""
        self._receive(seconds, size=1, timeout=0.2, pause=0.2)

    def drain(self, seconds: float) -> None:
        """Everything that arrives for ``seconds``."""
        self._receive(seconds, size=1 << 20, timeout=0.5, pause=0.0)

    def _receive(self, seconds: float, *, size: int, timeout: float, pause: float) -> None:
        assert self.conn is not None
        self.conn.settimeout(timeout)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                chunk = self.conn.recv(size)
            except TimeoutError:
                continue
            except OSError:
                return  # the connection is gone: what came is all there is
            if not chunk:
                return
            self.data += chunk
            time.sleep(pause)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.sock.close()


@pytest.mark.parametrize("sandbox", MODES_WITH_LIMIT, indirect=True)
@pytest.mark.parametrize("switch", [True, False], ids=["switched-off", "control-still-on"])
def test_no_byte_written_after_the_switch_to_off_leaves(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, switch: bool,
) -> None:
    """A queued send outliving the switch: with the network on, a background process
    sendfile()s a worktree file to a slow receiver; the session switches off;
    then it pwrite()s a marker all over the file. The socket's queue holds the
    file's page-cache pages, so on the host's network the marker is sent after
    the switch. Full mode: the queue is inside the session's namespace, whose
    only way out (pasta, which copies what it reads) was killed before the
    switch returned: no marker arrives. Degraded mode: a KNOWN LIMIT, it does
    (SECURITY.md). The control, without the switch, gets the marker."""
    size = _PAYLOAD_MB << 20
    Path(worktree, "payload.bin").write_bytes(b"A" * size)
    receiver = SlowReceiver()
    try:
        with client.open_session(str(worktree), network=True) as s:
            background(s, _SENDFILE.format(host=host_loopback(sandbox), port=receiver.port, size=size), 120)
            receiver.accept()
            receiver.trickle(1.5)  # the sender's queues fill up with the file's pages
            assert receiver.data and set(receiver.data) == {ord("A")}
            if switch:
                assert s.set_network(False) is False
            assert attempt(s, _PWRITE_MARKERS.format(size=size)) == "OK 'written'"
            receiver.drain(8)
            arrived = b"MARKER" in receiver.data
            if switch and sandbox.mode == "full":
                assert not arrived, f"{receiver.data.count(b'MARKER')} markers arrived after the switch to off"
                assert len(receiver.data) < size  # the transfer was cut, not finished
            else:
                assert arrived  # the control (and the degraded mode's known limit)
    finally:
        receiver.close()


# --- "ports": held by nftables in the session's namespace (full mode) ---------------------------

IPPROTO_MPTCP = 262
_PORTS_CONNECT = {
    "tcp": "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\ns.settimeout(5)\ns.connect(({host!r}, {port}))\nresult = s.recv(100)",
    "mptcp": f"s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, {IPPROTO_MPTCP})\ns.settimeout(5)\n"
             "s.connect(({host!r}, {port}))\nresult = s.recv(100)",
    # The implicit connect of a Fast Open sendto: Landlock's TCP rules never see it.
    "fastopen": "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
                "s.sendto(b'tfo', socket.MSG_FASTOPEN, ({host!r}, {port}))\ns.settimeout(5)\nresult = s.recv(100)",
}


@pytest.mark.parametrize("sandbox", MODES_WITH_LIMIT, indirect=True)
@pytest.mark.parametrize("kind", _PORTS_CONNECT)
def test_ports_holds_against_tcp_mptcp_and_fast_open(sandbox: Sandbox, client: dispatch.Client, worktree: Path,
                                                     kind: str) -> None:
    """A listed port is reached by each kind of connect (the allowed twin), an
    unlisted one by none: EHOSTUNREACH from nftables' admin-prohibited. In
    degraded mode Landlock's TCP rules hold plain TCP (EACCES) but not MPTCP
    or Fast Open: a KNOWN LIMIT (SECURITY.md)."""
    with TcpListener() as allowed, TcpListener() as other:
        host = host_loopback(sandbox)
        code = _PORTS_CONNECT[kind]
        with client.open_session(str(worktree), network="ports", ports=[allowed.port]) as s:
            assert attempt(s, code.format(host=host, port=allowed.port)) == f"OK {TcpListener.BANNER!r}"
            out = attempt(s, code.format(host=host, port=other.port))
        if sandbox.mode == "full":
            assert out == EHOSTUNREACH
            assert other.received == []
        elif kind == "tcp":
            assert out == EACCES
        else:
            assert out == f"OK {TcpListener.BANNER!r}"  # the known limit: Landlock does not see it


def test_ports_holds_udp_and_dns(sandbox: Sandbox, client: dispatch.Client, worktree: Path) -> None:
    """UDP goes out to listed ports only (so DNS only when 53 is listed): full
    mode rejects the datagram (EPERM); degraded mode's Landlock has no UDP
    rules and it arrives (SECURITY.md, leaves_open says so)."""
    with DatagramListener(socket.AF_INET, ("127.0.0.1", 0)) as allowed, \
            DatagramListener(socket.AF_INET, ("127.0.0.1", 0)) as other:
        host = host_loopback(sandbox)
        send = "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nresult = s.sendto(b'udp', ({host!r}, {port}))"
        with client.open_session(str(worktree), network="ports", ports=[allowed.address[1]]) as s:
            assert attempt(s, send.format(host=host, port=allowed.address[1])) == "OK 3"
            out = attempt(s, send.format(host=host, port=other.address[1]))
            gaps = " ".join(s.status()["protections"]["leaves_open"])
            # Drained while the session (and its pasta) lives: a close drops
            # what its stack had not yet relayed.
            assert allowed.drain(expect=1) == [b"udp"]
            if sandbox.mode == "full":
                assert out == EPERM
                assert other.drain() == []
                assert "UDP" not in gaps
            else:
                assert out == "OK 3" and other.drain(expect=1) == [b"udp"]
                assert "UDP (DNS included)" in gaps


def test_switching_to_ports_cuts_a_connection_to_an_unlisted_port(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path,
) -> None:
    """A connection made while on, to a port "ports" does not list, carries
    nothing after the switch: nftables sees every packet, not just connects."""
    with TcpListener() as listener:
        with client.open_session(str(worktree), network=True) as s:
            background(s, _TALK_LATE.format(host=host_loopback(sandbox), port=listener.port), 15)
            assert wait_for(lambda: listener.received == [b"early\n"])
            s.set_network("ports", ports=[])
            time.sleep(4)
            assert listener.received == [b"early\n"]
            if sandbox.mode == "full":
                assert "switched in place" in s.status()["note"]


def test_abstract_names_of_the_host_cannot_be_taken_with_the_network_on(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path,
) -> None:
    """Full mode: abstract Unix names live in the network namespace, which is
    the session's own in every mode, so binding one never takes the host's
    name (the host's program binding it afterwards succeeds). Unix sockets are
    refused by seccomp anyway (EPERM): this pins the leaves_open line."""
    with client.open_session(str(worktree), network=True) as s:
        gaps = " ".join(s.status()["protections"]["leaves_open"])
    assert ("abstract Unix socket names of the host can be taken" in gaps) == (sandbox.mode == "degraded")
