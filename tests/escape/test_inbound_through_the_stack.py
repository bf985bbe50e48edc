"""What comes into a session through its user-mode stack: only the replies
to what it sent.

For each UDP flow a session begins, both stacks open a socket on the host,
bound to every address of the host, and hand the session whatever arrives
there, from any sender (any local program, any user's, any machine that
reaches the host), as from the gateway (a sender on the host's loopback) or
the sender's own address, with the sender's port. The session's namespace
drops all of it but the replies of the flow's own peer (nftables' input
chain, conntrack), in every mode where a stack runs. pasta binds the host's
port of the session's source port number: the session's UDP source ports are
moved into the host's ephemeral range, so that it cannot pick which port of
the host it holds (a port the user's own program then cannot bind).

Full mode only (degraded mode runs no stack: the session is on the host's
network). Only the host's loopback is used: the flow goes to a listener of
the test's on 127.0.0.1 (10.0.2.2 from the session), the third party sends
to 127.0.0.1.
"""

from __future__ import annotations

import concurrent.futures
import errno
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, shell
from tests.listeners import Served

# pasta's UDP source ports, as the session's rules move them (netstack.UDP_SOURCE_PORTS).
EPHEMERAL = range(32768, 60999 + 1)
THIRD_PARTY = b"from-a-third-party"


class Echo(Served):
    """A UDP listener of the host's on 127.0.0.1: records each datagram and
    where it came from, and echoes it."""

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.received: list[tuple[bytes, tuple[str, int]]] = []
        super().__init__(sock, 0.1)

    def serve_once(self) -> None:
        data, addr = self.sock.recvfrom(100)
        self.received.append((data, addr))
        self.sock.sendto(b"echo:" + data, addr)


@pytest.fixture(scope="module", params=["slirp4netns", "pasta"])
def stack_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[tuple[str, dispatch.Client]]:
    stack = request.param
    if shutil.which(stack) is None:
        pytest.skip(f"{stack} is not installed")
    d = Daemon(tmp_path_factory.mktemp(f"daemon-{stack}"), "--network-stack", stack)
    try:
        with d.connect() as c:
            if not c.status()["kernel"]["user_namespaces"]:
                pytest.skip("this kernel refuses user namespaces: no stack runs")
            yield stack, c
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture
def echo() -> Iterator[Echo]:
    e = Echo()
    yield e
    e.close()


def _free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bind(port: int) -> str:
    """What the host's own program gets binding 127.0.0.1:``port`` (UDP)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as mine:
            mine.bind(("127.0.0.1", port))
    except OSError as exc:
        return errno.errorcode[exc.errno or 0]
    return "bound"


# The session: from source port SPORT, one datagram to the listener on the
# host's loopback, then every datagram that comes back for 4 s.
_FLOW = """
import socket, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", SPORT))
s.sendto(b"hello", ("10.0.2.2", PORT))
s.settimeout(0.2)
end = time.monotonic() + 4
while time.monotonic() < end:
    try:
        data, _ = s.recvfrom(100)
    except TimeoutError:
        continue
    print(data.decode())
"""


class Flow:
    """A session's UDP flow to ``echo``, seen from the host while it lives."""

    def __init__(self, session: dispatch.Session, echo: Echo, sport: int) -> None:
        self.echo = echo
        code = _FLOW.replace("SPORT", str(sport)).replace("PORT", str(echo.port))
        self._pool = concurrent.futures.ThreadPoolExecutor(1)
        self._running = self._pool.submit(shell, session, f"python3 -c '{code}'")
        deadline = time.monotonic() + 20
        while not echo.received and time.monotonic() < deadline:
            time.sleep(0.05)
        assert echo.received, "the flow never reached the listener"

    @property
    def host_port(self) -> int:
        """The port of the host the stack sends the flow from (and holds)."""
        return self.echo.received[0][1][1]

    def received(self) -> list[str]:
        """What the session received, once its 4 s are over."""
        r = self._running.result(timeout=60)
        self._pool.shutdown()
        assert r.is_success, r.metadata
        return str(r.metadata["stdout"]).split()


@pytest.mark.parametrize("mode", ["on", "ports"])
def test_a_third_party_s_datagrams_into_a_session_s_udp_flow_are_dropped(
        stack_client: tuple[str, dispatch.Client], worktree: Path, echo: Echo, mode: str) -> None:
    _, client = stack_client
    with client.open_session(str(worktree), network=mode, ports=[echo.port] if mode == "ports" else None) as s:
        flow = Flow(s, echo, _free_udp_port())
        # Any local program, any user's, sending to the port the stack holds
        # for the flow: the stack hands it in as from 10.0.2.2 and the
        # sender's port, not the listener's.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
            for _ in range(5):
                other.sendto(THIRD_PARTY, ("127.0.0.1", flow.host_port))
                time.sleep(0.1)
        got = flow.received()
    # The allowed twin: the reply of the peer the session wrote to comes in.
    assert got == ["echo:hello"], got


def test_a_session_does_not_pick_the_udp_port_it_holds_on_the_host(
        stack_client: tuple[str, dispatch.Client], worktree: Path, echo: Echo) -> None:
    stack, client = stack_client
    wanted = _free_udp_port()
    with client.open_session(str(worktree), network="ports", ports=[echo.port]) as s:
        flow = Flow(s, echo, wanted)
        # The host's own program binds the port the session sent from...
        assert (flow.host_port != wanted, _bind(wanted)) == (True, "bound"), (stack, flow.host_port, wanted)
        # ...while the flow's own port of the host is the stack's, as any
        # outgoing flow of the host's holds one.
        assert _bind(flow.host_port) == "EADDRINUSE"
        if stack == "pasta":
            assert flow.host_port in EPHEMERAL
        assert flow.received() == ["echo:hello"]  # the twin: the flow itself works


# The session: 20,000 datagrams to ports of its own loopback, then the
# namespace's count of conntrack entries, and one flow out to the listener.
_LOOPBACK_FLOOD = """
import socket
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
u.bind(("127.0.0.1", 0))
for p in range(1024, 1024 + 20000):
    u.sendto(b"", ("127.0.0.1", p))
print(open("/proc/sys/net/netfilter/nf_conntrack_count").read().strip())
o = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
o.sendto(b"out", ("10.0.2.2", PORT))
print(open("/proc/sys/net/netfilter/nf_conntrack_count").read().strip())
"""


@pytest.mark.parametrize("mode", ["on", "ports"])
def test_a_session_s_loopback_traffic_holds_no_conntrack_entries(
        stack_client: tuple[str, dispatch.Client], worktree: Path, echo: Echo, mode: str) -> None:
    """Loopback is let in whatever its state, so it is not tracked: a session
    cannot hold a kernel entry a datagram (up to nf_conntrack_max, 262,144 a
    namespace). The twin: the flow out through the stack is tracked (its
    replies are let in by it)."""
    stack, client = stack_client
    code = _LOOPBACK_FLOOD.replace("PORT", str(echo.port))
    with client.open_session(str(worktree), network=mode, ports=[echo.port] if mode == "ports" else None) as s:
        r = shell(s, f"python3 -c '{code}'")
    assert r.is_success, r.metadata
    assert str(r.metadata["stdout"]).split() == ["0", "1"], (stack, r.metadata)
