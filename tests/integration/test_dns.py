"""DNS in network on and ports: the daemon's relay, whatever the host's resolver.

The daemon of this module forwards to a tiny DNS responder the test runs on
the host's loopback (127.0.0.1, a port of its own), named by a resolv.conf
the daemon is pointed at with its testing option (``--dns-resolv-conf-for-testing``):
the host's own resolver is never asked, and no name leaves the machine.
``testname.example`` answers ``192.0.2.55`` (an address of TEST-NET-1, never
connected to); every other name NXDOMAIN.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, probe, shell, wait_for_pool
from tests.dnsresponder import ADDRESS, NAME, SILENT, Responder
from tests.integration.test_cli import dispatch_cli

ECONNREFUSED, EPERM, EACCES = 111, 1, 13


@pytest.fixture(scope="module")
def responder() -> Iterator[Responder]:
    r = Responder()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def resolv(tmp_path_factory: pytest.TempPathFactory, responder: Responder) -> Path:
    path = tmp_path_factory.mktemp("dns") / "resolv.conf"
    path.write_text(f"# the test's responder\nnameserver 127.0.0.1:{responder.port}\n")
    return path


@pytest.fixture(scope="module")
def dns_daemon(tmp_path_factory: pytest.TempPathFactory, resolv: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("daemon-dns"), "--dns-resolv-conf-for-testing", str(resolv))
    try:
        yield d
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def dns_client(dns_daemon: Daemon) -> Iterator[dispatch.Client]:
    with dns_daemon.connect() as c:
        if c.status()["kernel"]["network_stack_missing"]:
            pytest.skip(f"no network stack: {c.status()['kernel']['network_stack_missing']}")
        yield c


def _query(name: str) -> bytes:
    return struct.pack("!HHHHHH", 0x1234, 0x0100, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00" + struct.pack("!HH", 1, 1)


def relay_probe(transport: str) -> str:
    """A query for NAME sent straight to the relay (127.0.0.53:53) inside the
    session: 'answer ADDRESS', or 'error ERRNO'."""
    query = _query(NAME)
    send = ("s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "s.settimeout(3)\n"
            "s.connect(('127.0.0.53', 53))\n"
            f"s.send({query!r})\n"
            "r = s.recv(4096)\n") if transport == "udp" else (
            "s = socket.create_connection(('127.0.0.53', 53), timeout=3)\n"
            f"s.sendall(struct.pack('!H', {len(query)}) + {query!r})\n"
            "n = struct.unpack('!H', s.recv(2, socket.MSG_WAITALL))[0]\n"
            "r = s.recv(n, socket.MSG_WAITALL)\n")
    return ("import socket, struct\n"
            "try:\n"
            + "".join("    " + line + "\n" for line in send.splitlines())
            + "    print('answer', socket.inet_ntoa(r[-4:]))\n"
            "except OSError as e:\n"
            "    print('error', e.errno)\n")


def getent(session: dispatch.Session, name: str = NAME) -> tuple[int, str, float]:
    started = time.monotonic()
    r = shell(session, f"getent hosts {name}")
    return r.metadata["exit_code"], r.metadata["stdout"].strip(), time.monotonic() - started


@pytest.mark.parametrize("network", ["on", "ports"])
def test_a_name_resolves_through_the_relay(dns_client: dispatch.Client, worktree: Path, responder: Responder,
                                           network: str) -> None:
    ports = [9] if network == "ports" else None  # 53 not listed: the relay is allowed all the same
    with dns_client.open_session(str(worktree), network=network, ports=ports) as s:
        assert s.status()["warnings"] == []
        code, out, took = getent(s)
        assert (code, out.split()) == (0, [ADDRESS, NAME])
        assert took < 2.0, took
        code, out, _ = getent(s, "other.example")
        assert (code, out) == (2, "")  # NXDOMAIN: not found, at once
        before = responder.tcp_queries
        assert probe(s, relay_probe("tcp")) == f"answer {ADDRESS}"  # a truncated reply's retry
        assert responder.tcp_queries == before + 1
        assert probe(s, relay_probe("udp")) == f"answer {ADDRESS}"


def test_ports_lets_dns_out_to_the_relay_only(dns_client: dispatch.Client, worktree: Path,
                                              responder: Responder) -> None:
    """Under ports without 53, the responder straight at the gateway (the
    host's loopback) is refused as any unlisted port; the relay answers."""
    direct = ("import socket\n"
              "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
              "try:\n"
              f"    s.sendto({_query(NAME)!r}, ('10.0.2.2', {responder.port}))\n"
              "    s.settimeout(2)\n"
              "    print('answer', socket.inet_ntoa(s.recv(4096)[-4:]))\n"
              "except OSError as e:\n"
              "    print('error', e.errno)\n")
    with dns_client.open_session(str(worktree), network="ports", ports=[9]) as s:
        assert probe(s, direct) == f"error {EPERM}"
        assert probe(s, relay_probe("udp")) == f"answer {ADDRESS}"
    with dns_client.open_session(str(worktree), network="on") as s:  # the twin: on reaches it straight
        assert probe(s, direct) == f"answer {ADDRESS}"


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_an_off_session_cannot_reach_the_relay(dns_client: dispatch.Client, worktree: Path, transport: str) -> None:
    with dns_client.open_session(str(worktree), network="off") as s:
        assert probe(s, relay_probe(transport)) == f"error {ECONNREFUSED}"  # its own loopback: no door
        code, _, took = getent(s)
        assert code == 2 and took < 2.0, (code, took)
        s.set_network(True)
        assert probe(s, relay_probe(transport)) == f"answer {ADDRESS}"  # the twin: the door opens with the stack
        s.set_network(False)
        assert probe(s, relay_probe(transport)) == f"error {ECONNREFUSED}"  # and closes with it
        # Nor can the session pose as the relay: port 53 needs a capability it does not have.
        kind = "SOCK_DGRAM" if transport == "udp" else "SOCK_STREAM"
        pose = (f"import socket\ns = socket.socket(socket.AF_INET, socket.{kind})\n"
                "try:\n    s.bind(('127.0.0.53', {port}))\n    print('bound')\n"
                "except OSError as e:\n    print('error', e.errno)\n")
        assert probe(s, pose.format(port=53)) == f"error {EACCES}"
        assert probe(s, pose.format(port=5353)) == "bound"  # the twin: an unprivileged port


def _worker_steps(d: Daemon, sid: str, made_ahead: bool) -> str:
    """The confinement steps its sandbox reported before it knew its session:
    with ``pool_made`` (made ahead), else with ``worker_ready`` (made at open)."""
    event = "pool_made kind=\\S+" if made_ahead else "worker_ready"
    found = re.findall(rf"event={event} session={sid} .*steps_ms=(\S+)", d.log())
    assert found, d.log()
    return found[-1]


@pytest.mark.parametrize("pool", ["2", "0"])
def test_a_sandbox_opened_with_the_network_on_makes_the_relays_door_itself(
        tmp_path_factory: pytest.TempPathFactory, resolv: Path, worktree: Path, pool: str) -> None:
    """Made ahead or at open, a network-on sandbox binds the relay's door while
    it still holds its namespace's capabilities (no child of the fork server
    joins its namespaces for it); the door answers. The twin: an offline
    sandbox makes none, and a switch to on (the sandbox confined by then)
    gets its door from the fork server, and it answers too."""
    d = Daemon(tmp_path_factory.mktemp("daemon-door"), "--dns-resolv-conf-for-testing", str(resolv), "--pool", pool)
    try:
        with d.connect() as c:
            if c.status()["kernel"]["network_stack_missing"]:
                pytest.skip(f"no network stack: {c.status()['kernel']['network_stack_missing']}")
            if pool != "0":
                c.open_session(str(worktree), network="on").close()  # the pool keeps that kind from here
                wait_for_pool(c, "default/on")
            with c.open_session(str(worktree), network="on") as s:
                assert s.status()["protections"].get("made_ahead", False) is (pool != "0")
                code, out, _ = getent(s)
                assert (code, out.split()) == (0, [ADDRESS, NAME])
                assert probe(s, relay_probe("tcp")) == f"answer {ADDRESS}"
                steps = [step.split(":")[0] for step in _worker_steps(d, s.id, made_ahead=pool != "0").split(",")]
                assert "dns_door" in steps  # made (a failure is named dns_door_failed_errno_N)
                assert re.findall(rf"event=dns_door_opened session={s.id} by=(\w+)", d.log()) == ["sandbox"]
                # Its sockets are the daemon's alone: none among the session's
                # descriptors (the twin: the probe's own socket is found).
                held = probe(s, "import os, socket\nmine = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                                "mine.bind(('127.0.0.53', 5353))\nfound = []\n"
                                "for fd in map(int, os.listdir('/proc/self/fd')):\n"
                                "    try:\n        s = socket.socket(fileno=os.dup(fd))\n"
                                "    except OSError:\n        continue\n"
                                "    try:\n        found.append(s.getsockname())\n    except OSError:\n        pass\n"
                                "    s.close()\nprint(sorted(map(str, found)))")
                assert "('127.0.0.53', 5353)" in held and "('127.0.0.53', 53)" not in held, held
                if pool != "0":  # made ahead: handed over with its namespaces before its root, its stack started meanwhile
                    assert steps.index("dns_door") < steps.index("namespaces_sent") < steps.index("root"), steps
            with c.open_session(str(worktree), network="off") as s:
                made = s.status()["protections"].get("made_ahead", False)
                assert "loopback:" in _worker_steps(d, s.id, made_ahead=made)  # the steps before the door's
                assert "dns_door:" not in _worker_steps(d, s.id, made_ahead=made)
                s.set_network(True)
                code, out, _ = getent(s)
                assert (code, out.split()) == (0, [ADDRESS, NAME])
                assert re.findall(rf"event=dns_door_opened session={s.id} by=(\w+)", d.log()) == ["fork_server"]
    finally:
        assert d.stop() == 0, d.log()


def _open_until(client: dispatch.Client, worktree: Path, want_warning: bool) -> dispatch.Session:
    """Open sessions (network on) until one's warnings are as wanted: the relay
    looks at the resolv.conf again at most once a second, and a check's
    answer stands a second."""
    deadline = time.monotonic() + 10
    while True:
        s = client.open_session(str(worktree), network="on")
        if bool(s.status()["warnings"]) == want_warning or time.monotonic() > deadline:
            return s
        s.close()


def _point_at(resolv: Path, text: str) -> None:
    new = resolv.with_suffix(".new")
    new.write_text(text)
    os.replace(new, resolv)


def test_a_resolver_that_does_not_answer_is_said_and_fails_fast(dns_daemon: Daemon, dns_client: dispatch.Client,
                                                                worktree: Path, resolv: Path) -> None:
    good = resolv.read_text()
    mine = Responder()
    _point_at(resolv, f"nameserver 127.0.0.1:{mine.port}\n")  # read again within a second
    try:
        with dns_client.open_session(str(worktree), network="on") as s:
            deadline = time.monotonic() + 10
            while not mine.udp_queries and time.monotonic() < deadline:
                code, out, _ = getent(s)
                assert (code, out.split()) == (0, [ADDRESS, NAME])
            assert mine.udp_queries > 0
        mine.stop()
        # The answer the last open's check had stands a second (CHECK_ANSWERED_KEEP_S,
        # tests/unit/test_dnsrelay.py): the first open past it asks, and says so.
        with _open_until(dns_client, worktree, want_warning=True) as s:
            warnings = s.status()["warnings"]
            # refused at once, or (the ICMP answer late on a loaded machine) timed out
            assert len(warnings) == 1 and warnings[0].startswith(tuple(
                f"DNS does not answer: no resolver of the host's answers (127.0.0.1:{mine.port}: {why})"
                for why in ("Connection refused", "timed out"))), warnings
            code, out, took = getent(s)
            assert (code, out) == (2, "") and took < 2.0, (code, out, took)
            said = probe(s, f"import socket\ntry:\n    socket.getaddrinfo({NAME!r}, 80)\n"
                            "except socket.gaierror as e:\n    print(e.errno, e.strerror)\n")
            assert said == f"{socket.EAI_AGAIN} Temporary failure in name resolution"
        # The command line says it on stderr, and the command fails at once.
        started = time.monotonic()
        cli = dispatch_cli("--socket", dns_daemon.socket, "--no-autostart", "exec", "--worktree", str(worktree),
                           "--network", "on", "--", "getent", "hosts", NAME)
        assert cli.returncode == 2 and cli.stdout == "" and time.monotonic() - started < 10, cli
        assert cli.stderr.startswith("dispatch: warning: DNS does not answer: no resolver of the host's answers "
                                     f"(127.0.0.1:{mine.port}: Connection refused)"), cli.stderr
        with dns_client.open_session(str(worktree), network="off") as s:  # a switch says it too
            assert s.status()["warnings"] == []
            info = dns_client.set_network(s.id, "ports", ports=[9])
            assert info["warnings"] and info["warnings"][0].startswith("DNS does not answer"), info["warnings"]
            assert dns_client.set_network(s.id, "off")["warnings"] == []
    finally:
        mine.stop()
        _point_at(resolv, good)
    # The twin: the module's responder again, and the next open answers.
    with _open_until(dns_client, worktree, want_warning=False) as s:
        assert s.status()["warnings"] == []
        code, out, _ = getent(s)
        assert (code, out.split()) == (0, [ADDRESS, NAME])


def test_a_lookup_unanswered_in_one_session_is_said_in_that_session_only(
        dns_client: dispatch.Client, tmp_path: Path, responder: Responder) -> None:
    """The warning follows each session's own lookups: one session's
    unanswered name does not warn another, and its answered one does not
    hide another's outage."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    unanswered = (f"DNS does not answer: no resolver of the host's answers (127.0.0.1:{responder.port}: timed out); "
                  "names will not resolve in this session (lookups fail at once) until one does")
    with dns_client.open_session(str(tmp_path / "a"), network="on") as a, \
            dns_client.open_session(str(tmp_path / "b"), network="on") as b:
        assert a.status()["warnings"] == b.status()["warnings"] == []
        assert getent(a, SILENT)[:2] == (2, "")
        assert a.status()["warnings"] == [unanswered]
        assert b.status()["warnings"] == []  # the twin: B asked nothing unanswered
        code, out, _ = getent(b)
        assert (code, out.split()) == (0, [ADDRESS, NAME])
        assert b.status()["warnings"] == []
        # B's own outage, then A's answer: B's warning stays, A's goes.
        assert getent(b, SILENT)[:2] == (2, "")
        code, out, _ = getent(a)
        assert (code, out.split()) == (0, [ADDRESS, NAME])
        assert a.status()["warnings"] == []
        assert b.status()["warnings"] == [unanswered]


def test_the_session_reads_the_relays_resolv_conf(dns_client: dispatch.Client, worktree: Path) -> None:
    with dns_client.open_session(str(worktree), network="on") as s:
        out = shell(s, "grep ^nameserver /etc/resolv.conf").metadata["stdout"]
        assert out == "nameserver 127.0.0.53\n"
        assert shell(s, "echo x >> /etc/resolv.conf").metadata["exit_code"] != 0  # read-only
