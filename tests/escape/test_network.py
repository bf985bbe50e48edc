"""Escapes through the network from a session whose network is off.

Full mode holds "off" with a network namespace that has only its own
loopback: 127.0.0.1 there is not the host's (ECONNREFUSED), nothing else is
routed (ENETUNREACH), and a datagram sent goes nowhere. Degraded mode holds it
with seccomp (no IPv4/IPv6 socket: EPERM) and Landlock's TCP rules. The
control of each attempt is the same code in a session with the network on,
which reaches the same listener, outside, in the test process.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.escape.attempts import (
    EAFNOSUPPORT, ECONNREFUSED, ENETUNREACH, EPERM, DatagramListener, TcpListener, attempt, attempt_outside,
    background, wait_for,
)
from tests.escape.conftest import Sandbox


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
        with client.open_session(str(worktree), network=True) as on:
            assert attempt(on, connect) == f"OK {TcpListener.BANNER!r}"
        with client.open_session(str(worktree), network=False) as off:
            assert attempt(off, connect) == sandbox.expect(full=full, degraded=EPERM)
        assert len(listener.received) == 1  # the control's connection only


def test_udp_from_a_network_off_session_never_arrives(sandbox: Sandbox, client: dispatch.Client, worktree: Path) -> None:
    with DatagramListener(socket.AF_INET, ("127.0.0.1", 0)) as listener:
        send = f"s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nresult = s.sendto(b'escaped', {listener.address!r})"
        with client.open_session(str(worktree), network=True) as on:
            assert attempt(on, send) == "OK 7"
        assert listener.drain() == [b"escaped"]
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
s = socket.create_connection(("127.0.0.1", {port}), timeout=5)
s.recv(100)
s.sendall(b"early\\n")
time.sleep(3)
s.sendall(b"late\\n")
time.sleep(5)
"""


def test_switching_the_network_off_ends_connections_made_while_it_was_on(
    client: dispatch.Client, worktree: Path, make_worktree: Callable[[str], Path],
) -> None:
    """Two sessions with the network on each start a process that connects out,
    says "early", and "late" three seconds later. One session is switched off
    in between: its process must be gone, its connection closed, "late" never
    sent. The other (the control) says both."""
    with TcpListener() as listener, \
            client.open_session(str(worktree), network=True) as switched, \
            client.open_session(str(make_worktree("control")), network=True) as control:
        for n, s in enumerate((switched, control)):
            background(s, _TALK_LATE.format(port=listener.port), 15)
            assert wait_for(lambda: len(listener.received) > n and listener.received[n] == b"early\n")
        assert switched.set_network(False) is False
        assert wait_for(lambda: listener.received[1] == b"early\nlate\n", 10)
        assert listener.received == [b"early\n", b"early\nlate\n"]
        assert listener.closed_by_peer == [True, False]
