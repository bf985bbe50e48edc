"""dispatchd.daemon.localaddr, and the domains proxy refusing the machine's
own addresses.

In a user and network namespace of the test's own (no traffic leaves it):
its lo holds 127.0.0.1 and an address of "the machine" (as eth0, or a
bridge such as docker0 or virbr0, would on a host), and a range routed to
it; a service listens on every address (0.0.0.0), as databases, dev servers
and container engines' published ports often do. A listed name resolving to
the machine's own address reached that service through the proxy, as one
resolving to loopback does not.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dispatchd.daemon import localaddr

REPO = str(Path(__file__).resolve().parents[2])
OWN = "198.51.100.7"  # on the namespace's lo: an address of "the machine", not loopback
ROUTED = "203.0.113.0/24"  # routed to the machine itself (ip route add local ...)

needs_namespaces = pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("ip") is None,
                                      reason="needs unshare and ip")


def in_namespace(code: str) -> str:
    """``code`` run in a fresh user and network namespace, lo up with
    ``OWN`` and ``ROUTED``: its stdout."""
    prelude = textwrap.dedent(f"""
        import subprocess, sys
        sys.path.insert(0, {REPO!r})
        for args in (["link", "set", "lo", "up"], ["addr", "add", "{OWN}/32", "dev", "lo"],
                     ["route", "add", "local", "{ROUTED}", "dev", "lo"]):
            subprocess.run(["ip", *args], check=True)
    """)
    out = subprocess.run(["unshare", "--user", "--map-root-user", "--net", sys.executable, "-c",
                          prelude + textwrap.dedent(code)],
                         capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    if out.returncode != 0 and "unshare failed" in out.stderr:
        pytest.skip(f"no user namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.process
@needs_namespaces
def test_the_machines_own_addresses_are_local_and_others_not() -> None:
    asked = ["127.0.0.1", "127.9.9.9", "::1", "::ffff:127.0.0.1", OWN, f"::ffff:{OWN}", "203.0.113.77",
             "198.51.100.8", "192.0.2.1", "2001:db8::1"]
    got = json.loads(in_namespace(f"""
        import json
        from dispatchd.daemon.localaddr import is_local
        print(json.dumps({{a: is_local(a) for a in {asked!r}}}))
    """))
    assert got == {
        # Loopback, the machine's own address (in any spelling), a range routed to it.
        "127.0.0.1": True, "127.9.9.9": True, "::1": True, "::ffff:127.0.0.1": True, OWN: True, f"::ffff:{OWN}": True,
        "203.0.113.77": True,
        # The twins: its neighbour, and addresses it has no route to (a connect fails: ENETUNREACH).
        "198.51.100.8": False, "192.0.2.1": False, "2001:db8::1": False,
    }


def test_the_kernel_s_answers_read_closed() -> None:
    """An anycast address the host joined (a router of its IPv6 prefix) is
    delivered here like a local one; of the kernel's errors only those of
    no route (a connect fails the same way) say not local, any other says
    local. The twins: a unicast route elsewhere, and unreachable, are not."""
    assert localaddr._verdict(localaddr.RTM_NEWROUTE, 0, localaddr.RTN_ANYCAST) is True
    assert localaddr._verdict(localaddr.RTM_NEWROUTE, 0, localaddr.RTN_LOCAL) is True
    assert localaddr._verdict(localaddr.RTM_NEWROUTE, 0, 1) is False  # RTN_UNICAST: another machine
    assert localaddr._verdict(localaddr.NLMSG_ERROR, errno.ENOMEM, 0) is True
    assert localaddr._verdict(localaddr.NLMSG_ERROR, errno.ENETUNREACH, 0) is False


def test_what_is_not_an_address_or_cannot_be_asked_is_local(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing is relayed on a guess."""
    assert localaddr.is_local("not-an-address") is True
    assert localaddr.is_local("") is True

    def refused(*args: object, **kwargs: object) -> socket.socket:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(localaddr.socket, "socket", refused)
    assert localaddr.is_local("192.0.2.1") is True


_PROXY = """
    import socket, threading
    from dispatchd.daemon.proxy import SessionProxy
    from dispatchd.domains import parse_domains
    service = socket.create_server(("0.0.0.0", 0))
    port = service.getsockname()[1]
    def serve():
        while True:
            c, _ = service.accept()
            c.sendall(b"machine-service\\n")
            c.close()
    threading.Thread(target=serve, daemon=True).start()
    # own.test and routed.test: what listed names resolve to, as getaddrinfo
    # gives them (not exempt); exempt.test: the testing option's mapping,
    # relayed whatever it is.
    table = {"own.test": [("OWN", False)], "routed.test": [("203.0.113.77", False)],
             "exempt.test": [("OWN", True)]}
    p = SessionProxy("s1", lambda host, _port: table[host])
    p.configure("domains", parse_domains([f"{name}:{port}" for name in table]))
    listener = socket.create_server(("127.0.0.1", 0))
    p.serve(listener)
    for name in table:
        with socket.create_connection(listener.getsockname(), timeout=5) as s:
            s.sendall(f"CONNECT {name}:{port} HTTP/1.1\\r\\n\\r\\n".encode())
            got = b""
            while chunk := s.recv(4096):
                got += chunk
                if got.startswith(b"HTTP/1.1 200") and b"machine-service" in got:
                    break
        print(name, repr(got.decode().replace(str(port), "PORT")))
"""


@pytest.mark.process
@needs_namespaces
def test_a_name_resolving_to_an_address_of_the_machine_is_not_relayed() -> None:
    lines = dict(line.split(" ", 1) for line in in_namespace(_PROXY.replace("OWN", OWN)).splitlines())
    refusal = ("HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {n}\r\n"
               "Connection: close\r\nProxy-Connection: close\r\n\r\n{body}")
    for name, address in (("own.test", OWN), ("routed.test", "203.0.113.77")):
        body = (f"dispatchd proxy: {name} resolves only to addresses the proxy never relays to ({address}: "
                "loopback, link-local, unspecified or this machine's own)\n")
        assert lines[name] == repr(refusal.format(n=len(body), body=body)), name
    # The twin: the same service through the testing option's exempt mapping is reached.
    assert lines["exempt.test"] == repr("HTTP/1.1 200 Connection established\r\n\r\nmachine-service\n")
