"""The DNS relay's pure parts: resolv.conf, the checks on queries and replies,
where the session's resolv.conf is bound; and one relay, on loopback, against
a responder of the test's (no namespace: a door's sockets made here)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatchd.confine.mountplan import Bind, plan_mounts
from dispatchd.daemon import dnsdoor, dnshost, dnsrelay, dnswire
from dispatchd.daemon.dnshost import DEFAULT_SERVER, parse_resolv_conf, session_resolv_binds
from dispatchd.daemon.dnswire import check_query, error_reply, matches


def query(name: str = "a.example", qtype: int = 1, ident: int = 0x1234, flags: int = 0x0100) -> bytes:
    return struct.pack("!HHHHHH", ident, flags, 1, 0, 0, 0) + b"".join(
        bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\x00" + struct.pack("!HH", qtype, 1)


def test_resolv_conf_is_read_as_glibc_reads_it():
    text = ("# comment\nsearch example.org\nnameserver 127.0.0.53\nnameserver   10.0.0.1 \n"
            "nameserver fe80::1%eth0\nnameserver 192.0.2.9\noptions edns0\n")
    assert parse_resolv_conf(text) == [("127.0.0.53", 53), ("10.0.0.1", 53), ("fe80::1%eth0", 53)]  # 3 at most
    assert parse_resolv_conf("nameserver not-an-address\nnameserver 127.0.0.1:5353\n") == [DEFAULT_SERVER]
    assert parse_resolv_conf("") == [DEFAULT_SERVER]  # glibc's default
    assert parse_resolv_conf("nameserver 10.0.0.1\nnameserver 10.0.0.1\n") == [("10.0.0.1", 53)]


@pytest.mark.parametrize("kind", ["fifo", "directory", "regular file"])
def test_only_a_regular_resolv_conf_is_read_and_a_fifo_never_blocks(kind: str, tmp_path: Path):
    """A FIFO bound over the host's resolv.conf held the daemon's start and
    every network-on open for ever (an ``open`` that waits for a writer):
    it, and any file not regular, is glibc's default at once. The twin: a
    regular file's servers are read."""
    path = tmp_path / "resolv.conf"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text("nameserver 192.0.2.7\n")
    with pytest.raises(OSError) if kind != "regular file" else contextlib.nullcontext():
        dnshost.read_regular(str(path))
    started = time.monotonic()
    servers = dnshost.HostResolvers(str(path)).servers()
    assert time.monotonic() - started < 1
    assert servers == ([("192.0.2.7", 53)] if kind == "regular file" else [DEFAULT_SERVER])


def test_the_search_list_and_ndots_are_kept():
    text = "domain a.example\nsearch corp.example lab.example\noptions edns0 ndots:2 timeout:9\nnameserver 10.0.0.1\n"
    assert dnshost.kept_lines(text) == ["search corp.example lab.example", "options ndots:2"]
    assert dnshost.kept_lines("search x.example\ndomain y.example\n") == ["search y.example"]  # the last wins
    assert dnshost.resolv_conf_text(["search corp.example"]).splitlines()[2:] == [
        "nameserver 127.0.0.53", "search corp.example", "options timeout:5 attempts:1"]


def test_the_session_file_follows_the_hosts_search_list(tmp_path: Path):
    conf = tmp_path / "resolv.conf"
    conf.write_text("search one.example\nnameserver 10.0.0.1\n")
    relay = dnsrelay.DnsRelay(str(conf))
    try:
        path = relay.session_file(str(tmp_path))
        inode = os.stat(path).st_ino
        assert "search one.example\n" in Path(path).read_text()
        new = tmp_path / "new"
        new.write_text("search two.example\nnameserver 10.0.0.1\n")
        os.replace(new, conf)
        deadline = time.monotonic() + 5
        while "two.example" not in Path(path).read_text() and time.monotonic() < deadline:
            relay.resolvers.servers()  # looks at most once a second
            time.sleep(0.05)
        assert "search two.example\n" in Path(path).read_text() and os.stat(path).st_ino == inode  # in place
    finally:
        relay.stop()


def test_two_daemons_on_one_state_directory_share_the_session_file(tmp_path: Path):
    """The second daemon's start rewrites the file in place: the first one's
    sessions, which bind its inode, read what it says from then on too; and
    two starting at once each write a temporary file of their own."""
    conf = tmp_path / "resolv.conf"
    conf.write_text("search one.example\nnameserver 10.0.0.1\n")
    state = tmp_path / "state"
    state.mkdir()
    relays = [dnsrelay.DnsRelay(str(conf)) for _ in range(2)]
    try:
        first = relays[0].session_file(str(state))
        inode = os.stat(first).st_ino
        assert relays[1].session_file(str(state)) == first and os.stat(first).st_ino == inode
        assert "search one.example\n" in Path(first).read_text()
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            for _ in range(20):
                os.unlink(first)  # none there: each of two at once makes it whole
                assert list(ex.map(lambda r: r.session_file(str(state)), relays)) == [first, first]
                assert Path(first).read_text().count("search one.example\n") == 1
        assert sorted(os.listdir(state)) == ["dns-resolv.conf"]  # no temporary file left
        # One a daemon killed between its write and its rename left: removed at the next start once
        # old; the twin, one as new as a start's own, is another daemon's being written: kept.
        old, new = state / "dns-resolv.conf.0badc0de.tmp", state / "dns-resolv.conf.1badc0de.tmp"
        old.write_text("x")
        new.write_text("x")
        os.utime(old, (time.time() - 120, time.time() - 120))
        relays[0].session_file(str(state))
        assert sorted(os.listdir(state)) == ["dns-resolv.conf", new.name]
    finally:
        for relay in relays:
            relay.stop()


def test_ports_only_with_the_testing_option():
    text = "nameserver 127.0.0.1:5353\nnameserver [::1]:5354\nnameserver 127.0.0.1:99999\n"
    assert parse_resolv_conf(text, ports=True) == [("127.0.0.1", 5353), ("::1", 5354)]
    assert parse_resolv_conf(text) == [DEFAULT_SERVER]


def test_a_port_int_cannot_read_is_skipped_as_any_bad_entry():
    """'\u00b9' is a digit to ``str.isdigit``, not to ``int``: the entry is
    skipped, not a ValueError out of the relay's read of the file."""
    text = "nameserver 127.0.0.1:\u00b9\nnameserver [::1]:4\u00b2\nnameserver 127.0.0.2:" + "4" * 5000 + "\n"
    assert parse_resolv_conf(text + "nameserver 127.0.0.1:5353\n", ports=True) == [("127.0.0.1", 5353)]
    assert parse_resolv_conf(text, ports=True) == [DEFAULT_SERVER]


@pytest.mark.parametrize(("msg", "why"), [
    (query(), ""),
    (query(flags=0x8180), "a reply, not a query"),
    (query(flags=0x2800), "not a standard query (opcode)"),  # UPDATE
    (query()[:11], "shorter than a DNS header"),
    (query()[:4] + b"\x00\x02" + query()[6:], "not exactly one question"),
    (query()[:12] + b"\xc0\x0c" + b"\x00\x01\x00\x01", "compressed or extended label in a question"),
    (query()[:12] + b"\x05abc", "question name runs past the message"),
    (query()[:-2], "question without type and class"),
    (query("a" * 63 + "." + "b" * 63 + "." + "c" * 63 + "." + "d" * 63), "question name longer than 255 bytes"),
    (query() + b"\x00" * dnswire.MAX_QUERY, f"a query of {len(query()) + dnswire.MAX_QUERY} bytes (at most 4096)"),
])
def test_only_one_well_formed_query_is_forwarded(msg: bytes, why: str):
    assert check_query(msg) == why


def test_error_reply_answers_the_query():
    q = query("x.example", ident=0xBEEF)
    reply = error_reply(q, 2)
    assert reply == b"\xbe\xef\x81\x82\x00\x01\x00\x00\x00\x00\x00\x00" + q[12:]
    assert matches(q, reply)
    assert error_reply(b"\x01\x02\x00", 1)[:4] == b"\x01\x02\x80\x81"  # the header alone


def test_a_reply_must_answer_the_query():
    q = query("a.example")
    ok = q[:2] + b"\x81\x80" + q[4:]
    assert matches(q, ok)
    assert matches(q, ok.replace(b"example", b"ExAmPle"))  # 0x20 case randomisation
    assert not matches(q, q)  # not a reply
    assert not matches(q, b"\x00\x00" + ok[2:])  # another ID
    assert not matches(q, query("b.example", flags=0x8180))
    assert not matches(q, ok[:11])


def test_the_relays_resolv_conf_is_bound_where_the_hosts_leads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    run = tmp_path / "run" / "systemd" / "resolve"
    run.mkdir(parents=True)
    (run / "stub-resolv.conf").write_text("nameserver 127.0.0.53\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "resolv.conf").symlink_to("../run/systemd/resolve/stub-resolv.conf")
    (etc / "plain.conf").write_text("nameserver 10.0.0.1\n")
    monkeypatch.setattr(dnshost, "_ROOTS", (str(tmp_path) + "/",))
    assert session_resolv_binds("/state/dns-resolv.conf", str(etc / "resolv.conf")) == [
        str(run / "stub-resolv.conf"), "/state/dns-resolv.conf"]
    assert session_resolv_binds("/s", str(etc / "plain.conf")) == [str(etc / "plain.conf"), "/s"]
    assert session_resolv_binds("", str(etc / "plain.conf")) == []
    assert session_resolv_binds("/s", str(etc / "missing.conf")) == []
    monkeypatch.setattr(dnshost, "_ROOTS", ("/etc/", "/run/"))
    assert session_resolv_binds("/s", str(etc / "plain.conf")) == []  # not under /etc or /run


def test_the_relays_resolv_conf_wins_over_the_policys_path():
    plan = plan_mounts(root="minimal", worktree="/w", worktree_rw=True, private_tmp="/s/tmp", read_write=[],
                       read_only=["/etc", "/run/systemd/resolve/stub-resolv.conf"],
                       files=[("/run/systemd/resolve/stub-resolv.conf", "/state/dns-resolv.conf")],
                       system=["/etc", "/run/systemd/resolve/stub-resolv.conf"])
    assert Bind("/run/systemd/resolve/stub-resolv.conf", "ro", "/state/dns-resolv.conf") in plan.binds
    shared, session = plan.split_binds()
    assert Bind("/etc", "ro") in shared
    assert Bind("/run/systemd/resolve/stub-resolv.conf", "ro", "/state/dns-resolv.conf") in session


# --- one relay, on loopback ---------------------------------------------------------


class Upstream:
    def __init__(self, answer: bool = True) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.seen: list[bytes] = []
        self.answer = answer
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            while True:
                q, peer = self.sock.recvfrom(4096)
                if not q:
                    return
                self.seen.append(q)
                if self.answer:
                    self.sock.sendto(q[:2] + b"\x81\x80" + q[4:], peer)
        except OSError:
            return

    def refuse(self) -> None:
        """From now on a query to its port is refused, and the port stays
        ours (see ``_refusing``)."""
        self.sock.connect(("127.0.0.1", 9))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes its reader; ENOTCONN for UDP, done all the same
        except OSError:
            pass
        self.sock.close()


def _refusing() -> socket.socket:
    """A port nothing answers on: the kernel refuses a datagram to it (ICMP
    port unreachable: ECONNREFUSED on the sender's connected socket). Held
    by a socket connected elsewhere, which the kernel's lookup does not match
    for anyone else's datagrams: a port merely closed may be taken by another
    socket meanwhile on a busy host (tests running beside), which takes the
    query and answers nothing, a timeout instead of a refusal."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.connect(("127.0.0.1", 9))
    return sock


@pytest.fixture
def door_pair(tmp_path: Path) -> Iterator[tuple[dnsrelay.DnsRelay, Path]]:
    conf = tmp_path / "resolv.conf"
    relay = dnsrelay.DnsRelay(str(conf), ports=True)
    yield relay, conf
    relay.stop()


def _door(relay: dnsrelay.DnsRelay) -> tuple[dnsrelay.Door, tuple[str, int]]:
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(4)
    return relay.open_door("t", udp, tcp), udp.getsockname()


def _client(addr: tuple[str, int], timeout: float = 30) -> socket.socket:
    """A session's resolver library: a UDP socket connected to the door."""
    c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    c.settimeout(timeout)
    c.connect(addr)
    return c


def test_the_relay_tries_the_next_resolver_and_says_when_none_answers(door_pair: tuple[dnsrelay.DnsRelay, Path],
                                                                     monkeypatch: pytest.MonkeyPatch):
    # Waits far longer than "at once" below: a refusal is told from a timeout
    # however loaded the machine.
    monkeypatch.setattr(dnsdoor, "UPSTREAM_TIMEOUT_S", 60.0)
    monkeypatch.setattr(dnsdoor, "QUERY_DEADLINE_S", 120.0)
    relay, conf = door_pair
    dead = _refusing()
    dead_port = dead.getsockname()[1]
    up = Upstream()
    conf.write_text(f"nameserver 127.0.0.1:{dead_port}\nnameserver 127.0.0.1:{up.port}\n")
    door, addr = _door(relay)
    try:
        with _client(addr) as c:
            q = query(ident=0x4321)
            c.send(q)
            reply = c.recv(4096)
            assert reply[:4] == b"\x43\x21\x81\x80" and reply[4:] == q[4:]  # the client's ID again
            assert up.seen and up.seen[0][2:] == q[2:] and up.seen[0][:2] != b""  # our own ID on the way
            assert relay.check() == ""
            up.refuse()
            started = time.monotonic()
            c.send(q)
            assert c.recv(4096)[:4] == b"\x43\x21\x81\x82"  # SERVFAIL, at once
            assert time.monotonic() - started < 20  # not after a resolver's timeout
            assert door.warning().startswith(f"DNS does not answer: no resolver of the host's answers "
                                             f"(127.0.0.1:{dead_port}: Connection refused; 127.0.0.1:{up.port}: "
                                             "Connection refused)")
            assert relay.warning() == ""  # the door's session's word, not the relay's
            c.send(query(flags=0x8180))  # a reply, sent to the relay: dropped, nothing forwarded
            c.settimeout(0.3)
            with pytest.raises(TimeoutError):
                c.recv(4096)
    finally:
        door.stop()
        dead.close()
        up.close()


def test_a_stopped_door_forwards_nothing_more(door_pair: tuple[dnsrelay.DnsRelay, Path]):
    relay, conf = door_pair
    up = Upstream()
    conf.write_text(f"nameserver 127.0.0.1:{up.port}\n")
    door, addr = _door(relay)
    door.stop()
    assert door.stopped and door.udp.fileno() == -1 and door.tcp.fileno() == -1
    with _client(addr, 1) as c:
        c.send(query())
        with pytest.raises(ConnectionRefusedError):
            c.recv(4096)
    assert door.send_if_open(lambda: pytest.fail("sent after the stop")) is False
    assert up.seen == []
    up.close()


def test_in_flight_queries_are_bounded(door_pair: tuple[dnsrelay.DnsRelay, Path], monkeypatch: pytest.MonkeyPatch):
    # The others wait far longer than the one past the bound, however loaded the machine.
    monkeypatch.setattr(dnsdoor, "UPSTREAM_TIMEOUT_S", 60.0)
    monkeypatch.setattr(dnsdoor, "QUERY_DEADLINE_S", 120.0)
    relay, conf = door_pair
    silent = Upstream(answer=False)
    conf.write_text(f"nameserver 127.0.0.1:{silent.port}\n")
    door, addr = _door(relay)
    try:
        with _client(addr) as c:
            for i in range(dnsdoor.MAX_IN_FLIGHT + 1):
                c.send(query(ident=i))
            # The one past the bound: SERVFAIL at once, while the others wait for the silent resolver.
            assert c.recv(4096)[:4] == struct.pack("!H", dnsdoor.MAX_IN_FLIGHT) + b"\x81\x82"
    finally:
        door.stop()
        silent.close()


def test_a_flood_is_read_at_the_bounded_rate(door_pair: tuple[dnsrelay.DnsRelay, Path],
                                             monkeypatch: pytest.MonkeyPatch):
    """Past MAX_PER_WINDOW datagrams in a window, the door waits for the next
    window: the rest are answered later, none lost (they wait in the buffer)."""
    monkeypatch.setattr(dnsdoor, "MAX_PER_WINDOW", 20)
    monkeypatch.setattr(dnsdoor, "RATE_WINDOW_S", 3.0)  # long enough for 20 replies on a loaded machine
    relay, conf = door_pair
    conf.write_text("nameserver 127.0.0.1:1\n")
    door, addr = _door(relay)
    bad = query()[:4] + b"\x00\x02" + query()[6:]  # two questions: FORMERR at once, nothing forwarded
    try:
        with _client(addr) as c:
            started = time.monotonic()
            for _ in range(30):
                c.send(bad)
            times = []
            for _ in range(30):
                assert c.recv(4096)[3] & 0x0F == 1
                times.append(time.monotonic() - started)
        assert times[19] < 3.0 <= times[20], times  # 20 in the first window, the rest after it
    finally:
        door.stop()


def test_a_check_asks_when_begun_and_notes_only_when_read(door_pair: tuple[dnsrelay.DnsRelay, Path],
                                                         monkeypatch: pytest.MonkeyPatch):
    # An open begins the check as soon as it has its plan and reads it once
    # its sandbox is ready; an open that fails in between leaves no trace.
    monkeypatch.setattr(dnshost, "RELOAD_EVERY_S", 0.0)  # the file is read at each check
    relay, conf = door_pair
    dead = _refusing()
    up = Upstream()
    try:
        conf.write_text(f"nameserver 127.0.0.1:{dead.getsockname()[1]}\n")
        relay.begin_check()  # never read: refused, and noted nowhere
        time.sleep(0.2)
        assert relay.problem() == "" and relay.warning() == ""
        refused = relay.begin_check()
        assert refused.result("s1").startswith("DNS does not answer: no resolver of the host's answers "
                                               f"(127.0.0.1:{dead.getsockname()[1]}: Connection refused)")
        conf.write_text(f"nameserver 127.0.0.1:{up.port}\n")  # other servers: asked again at once
        begun = relay.begin_check()
        deadline = time.monotonic() + 30
        while not up.seen and time.monotonic() < deadline:  # asked before anyone reads the answer
            time.sleep(0.01)
        assert len(up.seen) == 1
        assert begun.result("s2") == "" and relay.problem() == ""
    finally:
        dead.close()
        up.close()


def test_an_answered_check_stands_a_second_and_a_querys_word_ends_it(door_pair: tuple[dnsrelay.DnsRelay, Path],
                                                                     monkeypatch: pytest.MonkeyPatch):
    """Opened back to back, network-on sessions do not each ask the host's
    resolvers: an answer had less than CHECK_ANSWERED_KEEP_S ago stands (the
    second check sends nothing); past it, or once a session's query had its
    own word, the next check asks again (the twins)."""
    monkeypatch.setattr(dnshost, "RELOAD_EVERY_S", 0.0)
    monkeypatch.setattr(dnsrelay, "CHECK_ANSWERED_KEEP_S", 0.5)
    relay, conf = door_pair
    up = Upstream()
    try:
        conf.write_text(f"nameserver 127.0.0.1:{up.port}\n")
        assert relay.begin_check().result("s1") == "" and len(up.seen) == 1
        assert relay.begin_check().result("s2") == "" and len(up.seen) == 1  # stood: nothing sent
        time.sleep(0.6)
        assert relay.begin_check().result("s3") == "" and len(up.seen) == 2  # past it: asked again
        relay.queried("")  # a session's query answered: the next open asks for itself
        assert relay.begin_check().result("s4") == "" and len(up.seen) == 3
        up.answer = False
        up.refuse()  # refused from now on, the same server: the answer still stands
        assert relay.begin_check().result("s5") == "" and len(up.seen) == 3
    finally:
        up.close()


def test_a_search_list_change_not_written_for_the_sessions_is_tried_again(tmp_path, monkeypatch):
    """Before, the change was taken as made when its rewrite failed: the
    sessions kept the old search list until the host's file changed again."""
    monkeypatch.setattr(dnshost, "RELOAD_EVERY_S", 0.0)
    path = tmp_path / "resolv.conf"
    path.write_text("search a.example\nnameserver 192.0.2.7\n")
    resolvers = dnshost.HostResolvers(str(path))
    taken: list[list[str]] = []
    answers = [False, True]
    resolvers.on_change = lambda kept: (taken.append(kept), answers.pop(0))[1]
    assert resolvers.servers() == [("192.0.2.7", 53)]  # not written: the servers are the file's all the same
    assert resolvers.kept == []
    assert resolvers.servers() == [("192.0.2.7", 53)]  # looked at again: written now
    assert taken == [["search a.example"], ["search a.example"]] and resolvers.kept == ["search a.example"]
    assert resolvers.servers() == [("192.0.2.7", 53)] and len(taken) == 2  # the twin: once taken, not again
