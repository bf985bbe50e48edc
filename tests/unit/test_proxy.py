"""dispatchd.daemon.proxy and proxyhead: request parsing by equality; the proxy itself on
real sockets on the host's loopback (the listener a worker would hand over
is made here by the test), with hostile clients.

The session-level behaviour (a namespace with only loopback, the variables,
status) is in tests/integration/test_domains.py and tests/escape/test_domains.py.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dispatchd.domains import parse_domains
from dispatchd.daemon import proxy
from dispatchd.daemon.proxy import SessionProxy
from dispatchd.daemon.proxyhead import HttpError, parse_head, split_authority
from tests.listeners import accepted


@pytest.mark.parametrize("head, expected", [
    (b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443", ("CONNECT", "pypi.org", 443, "")),
    (b"CONNECT [2001:db8::1]:8443 HTTP/1.1", ("CONNECT", "2001:db8::1", 8443, "")),
    (b"GET http://Example.ORG./simple/?q=1#frag HTTP/1.1\r\nAccept: */*", ("GET", "example.org", 80, "/simple/?q=1")),
    (b"GET http://example.org HTTP/1.0", ("GET", "example.org", 80, "/")),
    (b"POST http://example.org:8080?x HTTP/1.1", ("POST", "example.org", 8080, "/?x")),
])
def test_parse_head(head: bytes, expected: tuple[str, str, int, str]):
    r = parse_head(head)
    assert (r.method, r.host, r.port, r.path) == expected


@pytest.mark.parametrize("head, why", [
    (b"GET / HTTP/1.1", "a proxy request names its URL in full"),
    (b"GET https://example.org/ HTTP/1.1", "https:// goes through CONNECT"),
    (b"GET ftp://example.org/ HTTP/1.1", "a proxy request names its URL in full"),
    (b"CONNECT example.org HTTP/1.1", "CONNECT needs host:port"),
    (b"CONNECT example.org:99999 HTTP/1.1", "not a TCP port"),
    (b"CONNECT 2001:db8::1:443 HTTP/1.1", "an IPv6 address must be in brackets"),
    (b"GET http://user@evil.org/ HTTP/1.1", "not a host[:port]"),
    (b"CONNECT 127.1:443 HTTP/1.1", "looks like a numeric address"),
    (b"GET http://ex ample.org/ HTTP/1.1", "not an HTTP request line"),
    (b"CONNECT a.org:443 HTTP/2", "unsupported version"),
    (b"CONNECT a.org:443 HTTP/1.1\r\n folded: header", "malformed header line"),
    (b"CONNECT a.org:443 HTTP/1.1\r\nno colon", "malformed header line"),
    (b"\x00\xff garbage", "not an HTTP request line"),
])
def test_parse_head_refuses(head: bytes, why: str):
    with pytest.raises(HttpError) as exc:
        parse_head(head)
    assert exc.value.status == 400 and why in exc.value.body


def test_upstream_head_sets_the_urls_host_and_drops_hop_by_hop_headers():
    r = parse_head(b"GET http://registry.test:8080/x HTTP/1.1\r\nHost: evil.org\r\nProxy-Authorization: secret\r\n"
                   b"Proxy-Connection: keep-alive\r\nConnection: keep-alive\r\nAccept: */*")
    assert r.upstream_head() == (b"GET /x HTTP/1.1\r\nHost: registry.test:8080\r\nAccept: */*\r\n"
                                 b"Connection: close\r\n\r\n")


def test_split_authority():
    assert split_authority("a.org", 80) == ("a.org", 80)
    assert split_authority("[::1]:1", None) == ("[::1]", 1)
    with pytest.raises(HttpError):
        split_authority("", 80)


# --- the proxy on real sockets ------------------------------------------------------


class Upstream:
    """A TCP server on the host's loopback that greets and echoes."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        for conn in accepted(self.sock):
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            conn.sendall(b"hi\n")
            while data := conn.recv(1024):
                conn.sendall(data)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream()
    yield u
    u.sock.close()


@pytest.fixture
def served(upstream: Upstream) -> Iterator[tuple[SessionProxy, int]]:
    """A proxy for session "s1" allowing registry.test (resolved to the
    upstream, exempt as the daemon's testing option makes it) and localhost
    (resolved as the system does: loopback, not exempt)."""
    def resolve(host: str, port: int) -> list[tuple[str, bool]]:
        return [("127.0.0.1", host == "registry.test")]

    p = SessionProxy("s1", resolve)
    p.configure("domains", parse_domains([f"registry.test:{upstream.port}", f"localhost:{upstream.port}"]))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    p.serve(listener)
    yield p, port
    p.stop()


def ask(port: int, data: bytes, wait: float = 5) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
        return got


def tunnel(port: int, host: str, upstream_port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(f"CONNECT {host}:{upstream_port} HTTP/1.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200 Connection established"), head
    assert s.recv(3) == b"hi\n"
    return s


def test_a_tunnel_to_a_listed_host_echoes(served: tuple[SessionProxy, int], upstream: Upstream) -> None:
    _, port = served
    with tunnel(port, "registry.test", upstream.port) as s:
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"


def test_a_name_resolving_to_loopback_is_not_relayed(served: tuple[SessionProxy, int], upstream: Upstream) -> None:
    _, port = served
    got = ask(port, f"CONNECT localhost:{upstream.port} HTTP/1.1\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 502 Bad Gateway\r\n")
    assert b"localhost resolves only to addresses the proxy never relays to (127.0.0.1" in got
    assert upstream.accepted == 0


def test_outside_domains_mode_everything_is_refused(served: tuple[SessionProxy, int], upstream: Upstream) -> None:
    p, port = served
    p.configure("on", p.rules)
    got = ask(port, f"CONNECT registry.test:{upstream.port} HTTP/1.1\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 403 Forbidden by dispatchd: network is not in domains mode (on)\r\n")
    assert upstream.accepted == 0
    assert p.denied() == []  # not a host refused by the list


def test_a_denied_host_is_counted(served: tuple[SessionProxy, int]) -> None:
    p, port = served
    for _ in range(3):
        got = ask(port, b"GET http://other.test/x HTTP/1.1\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 403 Forbidden by dispatchd: other.test is not in this session's domains\r\n")
        assert b"X-Dispatchd-Denied: other.test:80\r\n" in got
    ask(port, b"CONNECT pypi.org:443 HTTP/1.1\r\n\r\n")
    assert [(h, port_, n) for h, port_, n, _ in p.denied()] == [("pypi.org", 443, 1), ("other.test", 80, 3)]


def test_denied_hosts_kept_are_the_last_twenty(served: tuple[SessionProxy, int]) -> None:
    p, port = served
    for i in range(25):
        ask(port, f"CONNECT h{i}.example:443 HTTP/1.1\r\n\r\n".encode())
    assert [h for h, *_ in p.denied()] == [f"h{i}.example" for i in range(24, 4, -1)]


def test_an_oversized_head_gets_431(served: tuple[SessionProxy, int]) -> None:
    _, port = served
    got = ask(port, b"GET http://registry.test/ HTTP/1.1\r\nX: " + b"a" * (proxy.MAX_HEAD + 10))
    assert got.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


def test_a_slow_head_gets_408(served: tuple[SessionProxy, int], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "HEAD_TIMEOUT_S", 0.3)
    _, port = served
    started = time.monotonic()
    got = ask(port, b"CONNECT registry.test:1 HTTP/1.1\r\n")  # never finished
    assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert time.monotonic() - started < 3


def test_connections_beyond_the_cap_get_503(served: tuple[SessionProxy, int], upstream: Upstream,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(proxy, "MAX_CONNECTIONS", 2)
    p, port = served
    held = [tunnel(port, "registry.test", upstream.port) for _ in range(2)]
    try:
        got = ask(port, b"")
        assert got.startswith(b"HTTP/1.1 503 Service Unavailable\r\n") and b"already has 2 connections" in got
    finally:
        for s in held:
            s.close()
    assert _eventually(lambda: p.connections() == 0)
    with tunnel(port, "registry.test", upstream.port):  # room again
        pass


def test_configure_cuts_connections_no_longer_allowed(served: tuple[SessionProxy, int], upstream: Upstream) -> None:
    p, port = served
    with tunnel(port, "registry.test", upstream.port) as s:
        assert p.configure("domains", parse_domains([f"registry.test:{upstream.port}"])) == 0  # still listed
        s.sendall(b"x")
        assert s.recv(1) == b"x"
        assert p.configure("domains", parse_domains(["pypi.org"])) == 1
        assert s.recv(10) == b""  # closed


def test_stop_closes_the_listener_and_every_connection(served: tuple[SessionProxy, int], upstream: Upstream) -> None:
    p, port = served
    with tunnel(port, "registry.test", upstream.port) as s:
        p.stop()
        assert s.recv(10) == b""
    assert _eventually(lambda: _refused(port))


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True


def _eventually(cond, seconds: float = 3.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_request_for_an_address_with_a_zone_is_a_400_naming_no_zone() -> None:
    with pytest.raises(HttpError) as exc:
        parse_head(b"CONNECT [fe80::1%\x1b[2K\nFAKE$(id)]:443 HTTP/1.1")
    assert exc.value.status == 400
    assert exc.value.body == ("dispatchd proxy: fe80::1%<zone>: an IPv6 address with a zone is refused "
                              "(write the address alone)\n")
    # The twin: the same address without a zone is parsed (and then refused, or not, by the list).
    assert parse_head(b"CONNECT [fe80::1]:443 HTTP/1.1").host == "fe80::1"


def test_the_suggested_command_is_quoted_for_a_shell() -> None:
    """Each word as a shell reads it back: a wildcard's ``*`` and the
    brackets of an IPv6 address quoted; plain names left bare, as before."""
    import shlex

    p = SessionProxy("s1", lambda host, port: [])
    rules = parse_domains(["pypi.org", "*.pythonhosted.org"])
    command = p.allow_command("2001:db8::1", 8443, rules)
    assert command == "dispatch network s1 domains --domains 'pypi.org,*.pythonhosted.org,[2001:db8::1]:8443'"
    assert shlex.split(command)[-1] == "pypi.org,*.pythonhosted.org,[2001:db8::1]:8443"
    assert parse_domains(shlex.split(command)[-1].split(","))[-1].ports == (8443,)  # the port after the brackets
    assert p.allow_command("other.test", 443, parse_domains(["pypi.org"])) == (
        "dispatch network s1 domains --domains pypi.org,other.test")


# --- ports int() cannot read -------------------------------------------------------

# str.isdigit() is True for each, int() reads none (the last is past Python's
# 4,300 digits): the check let them through to a ValueError that ended the
# serving thread, and the client got no answer, only the close.
ODD_PORTS = {"superscript-one": "\u00b9", "superscript-two-three": "4\u00b2\u00b3", "5000-digits": "4" * 5000}
# Each as the 400 quotes it (printable ASCII, at most 100 characters).
ODD_SHOWN = {"\u00b9": "registry.test:\\xb9", "4\u00b2\u00b3": "registry.test:4\\xb2\\xb3",
             "4" * 5000: "registry.test:" + "4" * 86 + "..."}


@pytest.mark.parametrize("port", ODD_PORTS.values(), ids=ODD_PORTS.keys())
def test_a_port_int_cannot_read_is_a_400_naming_it(port: str) -> None:
    with pytest.raises(HttpError) as exc:
        parse_head(f"CONNECT registry.test:{port} HTTP/1.1".encode("latin-1"))
    assert (exc.value.status, exc.value.body) == (400, f"dispatchd proxy: not a TCP port: {ODD_SHOWN[port]!r}\n")
    with pytest.raises(HttpError) as exc:
        parse_head(f"GET http://registry.test:{port}/simple/ HTTP/1.1".encode("latin-1"))
    assert (exc.value.status, exc.value.body) == (400, f"dispatchd proxy: not a TCP port: {ODD_SHOWN[port]!r}\n")


@pytest.mark.parametrize(("authority", "port"), [
    ("registry.test:1", 1), ("registry.test:65535", 65535), ("registry.test:08443", 8443),
])
def test_the_twins_ascii_ports_in_range_are_read(authority: str, port: int) -> None:
    assert split_authority(authority, None) == ("registry.test", port)


@pytest.mark.parametrize("authority", ["registry.test:0", "registry.test:65536", "registry.test:000443",
                                       "registry.test:+443", "registry.test: 443", "registry.test:443\n"])
def test_ports_out_of_range_or_not_plain_ascii_digits_are_a_400(authority: str) -> None:
    with pytest.raises(HttpError) as exc:
        split_authority(authority, None)
    assert (exc.value.status, exc.value.body) == (400, f"dispatchd proxy: not a TCP port: {authority!r}\n"
                                                  .replace("\\n'", "?'"))


@pytest.mark.parametrize("port", ODD_PORTS.values(), ids=ODD_PORTS.keys())
def test_a_port_int_cannot_read_is_answered_400_and_the_proxy_serves_on(served: tuple[SessionProxy, int],
                                                                        upstream: Upstream, port: str) -> None:
    _, proxy_port = served
    got = ask(proxy_port, f"CONNECT registry.test:{port} HTTP/1.1\r\n\r\n".encode("latin-1"))
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert got.endswith(f"\r\n\r\ndispatchd proxy: not a TCP port: {ODD_SHOWN[port]!r}\n".encode())
    # The twin, on the same proxy: a plain port is relayed.
    with tunnel(proxy_port, "registry.test", upstream.port) as s:
        s.sendall(b"ping")
        assert s.recv(4) == b"ping"


def test_a_value_error_no_check_foresaw_is_a_400_not_a_dead_thread(served: tuple[SessionProxy, int],
                                                                   upstream: Upstream,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def unforeseen(head: bytes) -> object:
        raise ValueError("no check foresaw this\x1b[2K")

    _, port = served
    monkeypatch.setattr(proxy, "parse_head", unforeseen)
    got = ask(port, b"CONNECT registry.test:443 HTTP/1.1\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert got.endswith(b"\r\n\r\ndispatchd proxy: no check foresaw this?[2K\n")
    monkeypatch.undo()
    with tunnel(port, "registry.test", upstream.port):  # the twin: served as before
        pass
