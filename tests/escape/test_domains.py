"""Escapes from a network "domains" session: every way out but the proxy.

Full mode only: degraded mode refuses "domains" (tests/integration/test_domains.py).
The session has a network namespace with only loopback; the proxy's listener
is the one socket there that leads out. Each attempt stands beside its allowed
twin: the same request through the proxy, or the same probe from a session
with the network on, reaching the same listener outside.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, probe
from tests.escape.attempts import (
    ECONNREFUSED, ENETUNREACH, DatagramListener, TcpListener, attempt, attempt_outside, background, wait_for,
)
from tests.escape.conftest import connect
from tests.fake_registry import domains_daemon
from tests.sleeping import sleepy_policies


@pytest.fixture(scope="module", params=["full", "woken"])
def client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dispatch.Client]:
    """Full mode; woken: every session opened asleep (tests/escape/conftest.py)."""
    _refuse_root()
    base = tmp_path_factory.mktemp(f"escape-domains-{request.param}")
    extra: list[str] = []
    if request.param == "woken":
        policies = base / "policies"
        shutil.copytree(REPO / "policies", policies)
        sleepy_policies(policies)
        extra = ["--policies", str(policies)]
    d: Daemon = domains_daemon(base / "d", *extra)
    try:
        with connect(d, request.param) as c:
            yield c
    finally:
        assert d.stop() == 0, d.log()


def _via_proxy(host: str, port: int) -> str:
    """A CONNECT through the session's proxy, then read what the far end says first."""
    return f"""
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT {host}:{port} HTTP/1.1\\r\\nHost: {host}:{port}\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
result = (head.split(b"\\r\\n")[0].decode(), s.recv(100))
"""


_CONNECT = """
s = socket.socket(socket.{family}, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(({host!r}, {port}))
result = s.recv(100)
"""


def test_direct_tcp_reaches_nothing_but_the_proxy_does(client: dispatch.Client, worktree: Path) -> None:
    with TcpListener() as upstream, \
            client.open_session(str(worktree), network="domains", domains=[f"registry.test:{upstream.port}"]) as s:
        # The allowed twin: the same listener, named, through the proxy.
        assert attempt(s, _via_proxy("registry.test", upstream.port)) == (
            f"OK ('HTTP/1.1 200 Connection established', {TcpListener.BANNER!r})")
        # Its address, directly: 127.0.0.1 in here is the session's own loopback.
        assert attempt(s, _CONNECT.format(family="AF_INET", host="127.0.0.1", port=upstream.port)) == ECONNREFUSED
        # Any other address: no route out of the namespace (TEST-NET and documentation ranges).
        assert attempt(s, _CONNECT.format(family="AF_INET", host="192.0.2.1", port=443)) == ENETUNREACH
        assert attempt(s, _CONNECT.format(family="AF_INET6", host="2001:db8::1", port=443)) == ENETUNREACH
        assert len(upstream.received) == 1  # the twin's connection only


def test_udp_and_dns_reach_nothing(client: dispatch.Client, worktree: Path) -> None:
    send = "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nresult = s.sendto(b'escaped', {addr!r})"
    with DatagramListener(socket.AF_INET, ("127.0.0.1", 0)) as listener:
        with client.open_session(str(worktree), network=True) as on:  # the twin
            # With pasta, the host's loopback is the gateway address (docs/network.md).
            host = "10.0.2.2" if on.status()["protections"]["network"].get("stack") else "127.0.0.1"
            assert attempt(on, send.format(addr=(host, listener.address[1]))) == "OK 7"
            # while the session lives: a close drops what pasta had not yet relayed
            assert listener.drain(expect=1) == [b"escaped"]
        with client.open_session(str(worktree), network="domains", domains=["registry.test"]) as s:
            # Sent into the session's own loopback: it never arrives outside.
            assert attempt(s, send.format(addr=listener.address)) == "OK 7"
            assert attempt(s, send.format(addr=("192.0.2.1", 53))) == ENETUNREACH
            # No resolver is reachable: names are resolved by the proxy, outside.
            dns = ("import socket\ntry:\n    socket.getaddrinfo('registry.test', 80)\n    print('resolved')\n"
                   "except socket.gaierror as e:\n    print('gaierror')\n")
            assert probe(s, dns) == "gaierror"
        assert listener.drain() == []


def test_the_proxy_never_relays_to_the_hosts_loopback(client: dispatch.Client, worktree: Path) -> None:
    """A listed name that resolves to the host's loopback (as localhost does) is
    not relayed: the proxy is no way to the user's local services. The twin is
    the same listener through a name the testing option maps there."""
    with TcpListener() as upstream, client.open_session(
            str(worktree), network="domains",
            domains=[f"localhost:{upstream.port}", f"registry.test:{upstream.port}"]) as s:
        out = attempt(s, _via_proxy("localhost", upstream.port))
        assert out.startswith("OK ('HTTP/1.1 502 Bad Gateway', b'dispatchd proxy: localhost resolves only to "
                              "addresses the proxy never relays to"), out
        assert attempt(s, _via_proxy("registry.test", upstream.port)).startswith(
            "OK ('HTTP/1.1 200 Connection established'")
        assert len(upstream.received) == 1


def test_another_session_cannot_use_the_proxy(client: dispatch.Client, worktree: Path,
                                              make_worktree) -> None:  # type: ignore[no-untyped-def]
    """The listener is a socket of the domains session's namespace: from a
    session with the network on (the host's loopback), port 3128 is nobody's."""
    connect = _CONNECT.format(family="AF_INET", host="127.0.0.1", port=3128)
    with client.open_session(str(worktree), network="domains", domains=["registry.test"]) as s, \
            client.open_session(str(make_worktree("other")), network=True) as other:
        assert attempt(s, "s = socket.create_connection(('127.0.0.1', 3128), timeout=5)\nresult = 'connected'") \
            == "OK 'connected'"
        assert attempt(other, connect) == ECONNREFUSED
        assert attempt_outside(connect) == ECONNREFUSED


_TALK_LATE = """
import socket, time
s = socket.create_connection(("127.0.0.1", 3128), timeout=5)
s.sendall(b"CONNECT {host}:{port} HTTP/1.1\\r\\n\\r\\n")
s.recv(100)
s.sendall(b"early\\n")
time.sleep(3)
s.sendall(b"late\\n")
time.sleep(5)
"""


@pytest.mark.parametrize("switch", ["off", "other-domains"])
def test_a_tunnel_does_not_outlive_a_switch(client: dispatch.Client, worktree: Path, make_worktree,  # type: ignore[no-untyped-def]
                                            switch: str) -> None:
    """Two sessions each tunnel to the same listener, say "early", and "late" three
    seconds later. One is switched (to off; or to a list without that host, in
    place): its tunnel is closed, "late" never arrives. The other (the control)
    says both."""
    with TcpListener() as upstream:
        listed = [f"registry.test:{upstream.port}"]
        with client.open_session(str(worktree), network="domains", domains=listed) as switched, \
                client.open_session(str(make_worktree("control")), network="domains", domains=listed) as control:
            for n, s in enumerate((switched, control)):
                background(s, _TALK_LATE.format(host="registry.test", port=upstream.port), 15)
                assert wait_for(lambda: len(upstream.received) > n and upstream.received[n] == b"early\n")
            if switch == "off":
                switched.set_network(False)
            else:
                switched.set_network("domains", domains=["pypi.org"])
                assert "1 connection(s) to hosts no longer listed were closed" in switched.status()["note"]
            assert wait_for(lambda: upstream.closed_by_peer[0], 2)  # closed when the switch returned
            assert wait_for(lambda: upstream.received[1] == b"early\nlate\n", 10)
            assert upstream.received == [b"early\n", b"early\nlate\n"]
            assert upstream.closed_by_peer[0] is True
