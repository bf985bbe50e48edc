"""Network per session, in both modes: off, on, ports, and switching at run time.

The listeners are real, on 127.0.0.1, started by the test outside any sandbox.
"full" is a daemon with user namespaces: every session has a network namespace
of its own, "on" and "ports" reach out through the user-mode stack the daemon
picks (slirp4netns, where installed: the set-up installs both), and the host's
loopback is the gateway address (10.0.2.2); "pasta" is the same with
``--network-stack pasta``; "degraded" is a daemon started with
--no-user-namespaces (the host's network; network off = seccomp refusing
IPv4/IPv6 sockets, and Landlock TCP rules).
"""

from __future__ import annotations

import concurrent.futures
import errno
import secrets

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import Daemon, fork_server_of, probe, shell, wait_until
from tests.listeners import Greeter, Served

ECONNREFUSED, EPERM, EACCES, ENETUNREACH, EHOSTUNREACH = 111, 1, 13, 101, 113
# Where a session reaches the host's loopback.
HOST = {"full": "10.0.2.2", "pasta": "10.0.2.2", "degraded": "127.0.0.1"}
# What reaching it answers once the network is off.
REFUSED = {"full": f"error {ENETUNREACH}", "pasta": f"error {ENETUNREACH}", "degraded": f"error {EPERM}"}
# The stack each daemon runs: "auto" takes slirp4netns where it is installed.
STACK = {"full": "slirp4netns", "pasta": "pasta"}
DAEMON_ARGS = {"full": (), "pasta": ("--network-stack", "pasta"), "degraded": ("--no-user-namespaces",)}


@pytest.fixture(scope="module", params=["full", "pasta", "degraded"])
def mode_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dispatch.Client]]:
    """As the suite's (tests/integration/conftest.py), with a full-mode daemon
    of each stack: every test here runs through both."""
    d = Daemon(tmp_path_factory.mktemp(f"daemon-{request.param}"), *DAEMON_ARGS[request.param])
    try:
        with d.connect() as c:
            yield request.param, c
    finally:
        assert d.stop() == 0, d.log()


TcpListener = Greeter  # greets every client with "hello" and counts them


class UdpListener(Served):
    """Echoes every datagram, prefixed, and records them."""

    def __init__(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.received: list[bytes] = []
        super().__init__(sock, 0.1)

    def serve_once(self) -> None:
        data, addr = self.sock.recvfrom(100)
        self.received.append(data)
        self.sock.sendto(b"echo:" + data, addr)


@pytest.fixture
def tcp() -> Iterator[TcpListener]:
    listener = TcpListener()
    yield listener
    listener.close()


@pytest.fixture
def udp() -> Iterator[UdpListener]:
    listener = UdpListener()
    yield listener
    listener.close()


def tcp_probe(port: int, host: str = "127.0.0.1") -> str:
    return (
        "import socket\n"
        "try:\n"
        f"    s = socket.create_connection(({host!r}, {port}), timeout=2)\n"
        "    print('connected', s.recv(10).decode().strip())\n"
        "except OSError as e:\n"
        "    print('error', e.errno)\n"
    )


def udp_probe(port: int, host: str = "127.0.0.1") -> str:
    return (
        "import socket\n"
        "try:\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    s.settimeout(1)\n"
        f"    s.sendto(b'ping', ({host!r}, {port}))\n"
        "    print('reply', s.recv(100).decode())\n"
        "except TimeoutError:\n"
        "    print('no reply')\n"
        "except OSError as e:\n"
        "    print('error', e.errno)\n"
    )


def test_off_reaches_no_tcp_listener_outside(mode_client, worktree: Path, tcp: TcpListener) -> None:
    mode, client = mode_client
    with client.open_session(str(worktree), network=False) as s:
        expected = f"error {ECONNREFUSED}" if mode != "degraded" else f"error {EPERM}"
        assert probe(s, tcp_probe(tcp.port)) == expected
        assert s.status()["protections"]["network"]["mode"] == "off"
    assert tcp.accepted == 0


def test_on_reaches_the_tcp_listener(mode_client, worktree: Path, tcp: TcpListener) -> None:
    mode, client = mode_client
    with client.open_session(str(worktree), network=True) as s:
        assert probe(s, tcp_probe(tcp.port, HOST[mode])) == "connected hello"
        net = s.status()["protections"]["network"]
        if mode != "degraded":
            stack = STACK[mode]
            assert net["stack"] == stack and net["mechanism"].startswith(f"own network namespace, out through {stack}")
            assert not any("abstract Unix" in gap for gap in s.status()["protections"]["leaves_open"])
        else:
            assert net["mechanism"] == "host network"
    assert tcp.accepted == 1


def test_on_has_a_loopback_of_its_own_in_full_mode(mode_client, worktree: Path, tcp: TcpListener) -> None:
    """The host's services on 127.0.0.1 are reached at the gateway address,
    never at the session's own 127.0.0.1 (pasta forwards no loopback port)."""
    mode, client = mode_client
    with client.open_session(str(worktree), network=True) as s:
        expected = f"error {ECONNREFUSED}" if mode != "degraded" else "connected hello"
        assert probe(s, tcp_probe(tcp.port, "127.0.0.1")) == expected


def test_off_reaches_no_udp_listener_outside(mode_client, worktree: Path, udp: UdpListener) -> None:
    mode, client = mode_client
    with client.open_session(str(worktree), network=False) as s:
        # Full mode: the datagram goes to the session's own loopback, where
        # nothing listens; degraded mode: no IPv4 socket can be made at all.
        assert probe(s, udp_probe(udp.port)) == ("no reply" if mode != "degraded" else f"error {EPERM}")
    time.sleep(0.2)
    assert udp.received == []


def test_on_reaches_the_udp_listener(mode_client, worktree: Path, udp: UdpListener) -> None:
    mode, client = mode_client
    with client.open_session(str(worktree), network=True) as s:
        assert probe(s, udp_probe(udp.port, HOST[mode])) == "reply echo:ping"
    assert udp.received == [b"ping"]


def test_off_reaches_no_abstract_socket(mode_client, worktree: Path) -> None:
    """Full mode: Unix sockets are allowed, and the host's abstract name is not
    in the session's own network namespace (ECONNREFUSED: nobody there).
    Degraded mode: no socket(AF_UNIX) at all (EPERM)."""
    mode, client = mode_client
    name = f"\0dispatchd-test-{time.monotonic_ns()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen(1)
    code = ("import socket\ntry:\n    s = socket.socket(socket.AF_UNIX)\n"
            f"    s.connect({name!r}); print('connected')\nexcept OSError as e:\n    print('error', e.errno)\n")
    try:
        with client.open_session(str(worktree), network=False) as s:
            assert probe(s, code) == (f"error {errno.ECONNREFUSED}" if mode != "degraded" else f"error {EPERM}")
        # The allowed twin: the same connect from outside the sandbox.
        outside = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        outside.connect(name)
        outside.close()
    finally:
        server.close()


def test_ports_reaches_a_listed_port_and_not_another(mode_client, worktree: Path, tcp: TcpListener) -> None:
    mode, client = mode_client
    other = TcpListener()
    try:
        with client.open_session(str(worktree), network="ports", ports=[tcp.port]) as s:
            assert s.network_mode == "ports"
            assert probe(s, tcp_probe(tcp.port, HOST[mode])) == "connected hello"
            # nftables in the session's namespace (admin-prohibited); Landlock's TCP rule in degraded mode
            denied = f"error {EHOSTUNREACH}" if mode != "degraded" else f"error {EACCES}"
            assert probe(s, tcp_probe(other.port, HOST[mode])) == denied
            net = s.status()["protections"]["network"]
            assert net["connect_ports"] == [tcp.port] and net["bind_ports"] == []
        assert other.accepted == 0
    finally:
        other.close()


def test_ports_refuses_binding_an_unlisted_port(mode_client, worktree: Path) -> None:
    mode, client = mode_client
    code = ("import socket\nfor port in (0, {p}):\n    s = socket.socket()\n    try:\n"
            "        s.bind(('127.0.0.1', port)); print('bound', port)\n"
            "    except OSError as e:\n        print('error', e.errno)\n    s.close()\n")
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    with client.open_session(str(worktree), network="ports", ports=[], bind_ports=[port]) as s:
        out = probe(s, code.replace("{p}", str(port)))
    if mode != "degraded":
        # In its own namespace a listener is private to the session (nothing
        # is forwarded in): any port may be bound.
        assert out.splitlines()[1] == f"bound {port}" and out.splitlines()[0].startswith("bound ")
    else:
        # Binding port 0 asks for any port: not listed, refused; the listed one works.
        assert out.splitlines() == [f"error {EACCES}", f"bound {port}"]


def test_a_server_inside_an_off_session_answers_a_client_inside(mode_client, worktree: Path) -> None:
    mode, client = mode_client
    server = ("import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
              "s.bind(('127.0.0.1', 47123)); s.listen(1); open('listening', 'w').close()\n"
              "c, _ = s.accept(); c.sendall(b'inside\\n')\n")
    Path(worktree, "server.py").write_text(server)
    with client.open_session(str(worktree), network=False) as s:
        # The client starts once the server listens, or has failed (degraded mode).
        wait = "for i in $(seq 300); do [ -e listening ] || [ -s server.err ] && break; sleep 0.1; done"
        r = shell(s, f"python3 server.py 2>server.err & {wait}; python3 -c \"" + tcp_probe(47123).replace('"', '\\"')
                  + "\"; wait")
        if mode != "degraded":
            assert r.metadata["stdout"].strip() == "connected inside", r
        else:
            # Without a network namespace there is no private loopback to give:
            # "off" refuses every IPv4/IPv6 socket, loopback included (docs/network.md).
            assert r.metadata["stdout"].strip() == f"error {EPERM}"
            assert "PermissionError: [Errno 1]" in Path(worktree, "server.err").read_text()


def test_off_on_off_in_one_session(mode_client, worktree: Path, tcp: TcpListener) -> None:
    mode, client = mode_client
    host, refused = HOST[mode], REFUSED[mode]
    with client.open_session(str(worktree), network=False) as s:
        assert probe(s, tcp_probe(tcp.port, host)) == refused
        assert s.set_network(True) is True
        assert probe(s, tcp_probe(tcp.port, host)) == "connected hello"
        assert s.set_network(False) is False
        assert probe(s, tcp_probe(tcp.port, host)) == refused
        assert s.status()["network"]["mode"] == "off"
    assert tcp.accepted == 1


def test_two_sessions_switch_independently(mode_client, tmp_path: Path, tcp: TcpListener) -> None:
    mode, client = mode_client
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    host, refused = HOST[mode], REFUSED[mode]
    with client.open_session(str(a), network=False) as sa, client.open_session(str(b), network=False) as sb:
        sa.set_network(True)
        assert probe(sa, tcp_probe(tcp.port, host)) == "connected hello"
        assert probe(sb, tcp_probe(tcp.port, host)) == refused
        sb.set_network(True)
        sa.set_network(False)
        assert probe(sa, tcp_probe(tcp.port, host)) == refused
        assert probe(sb, tcp_probe(tcp.port, host)) == "connected hello"


def test_a_background_process_started_while_on_cannot_reach_after_off(mode_client, worktree: Path, tcp: TcpListener) -> None:
    mode, client = mode_client
    loop = ("import socket, time\nwhile True:\n    try:\n"
            f"        socket.create_connection(({HOST[mode]!r}, {tcp.port}), timeout=1).close()\n"
            "        print('ok', flush=True)\n    except OSError as e:\n        print('error', e.errno, flush=True)\n"
            "    time.sleep(0.05)\n")
    # A name of its own: in degraded mode ps sees every process of the
    # machine, this very test's loop in a run beside this one too.
    script = f"loop-{secrets.token_hex(4)}.py"
    Path(worktree, script).write_text(loop)
    with client.open_session(str(worktree), network=True) as s:
        assert shell(s, f"nohup python3 {script} > loop.log 2>&1 &", background=True).is_success
        deadline = time.monotonic() + 5
        while tcp.accepted < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tcp.accepted >= 3  # the background process does reach it while on
        s.set_network(False)
        after = tcp.accepted
        size = Path(worktree, "loop.log").stat().st_size
        time.sleep(0.5)
        assert tcp.accepted == after  # nothing of the session reaches it any more
        if mode != "degraded":
            # Switched in place: the process lives on, and fails to reach out.
            # The loop and its job's keeper (jobs.py).
            assert "switched in place, 2 process(es) of the session kept" in s.status()["note"]
            assert "every connection outside the session is cut" in s.status()["note"]
            # (a connect in flight at the switch times out after its 1 s; the next fail at once)
            deadline = time.monotonic() + 5
            while f"error {ENETUNREACH}" not in Path(worktree, "loop.log").read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert f"error {ENETUNREACH}" in Path(worktree, "loop.log").read_text()
            assert tcp.accepted == after
            assert f"python3 {script}" in shell(s, "ps ax -o args").metadata["stdout"]
        else:
            assert "process(es) the session had started were ended" in s.status()["note"]
            assert "no user namespaces" in s.status()["note"]
            assert Path(worktree, "loop.log").stat().st_size == size  # the process is gone
            assert f"python3 {script}" not in shell(s, "ps ax -o args").metadata["stdout"]


def test_a_call_running_on_the_same_handle_goes_on_through_a_switch_in_place(mode_client, worktree: Path) -> None:
    """One thread's ``shell_exec`` runs while another switches the same
    ``Session`` off: switched in place, the sandbox is the one the call runs
    in, and the call returns its output (the handle used to attach anew at
    every switch and close the channel under the call). The twin: where the
    sandbox is replaced (degraded mode), the call is said lost, naming why."""
    mode, client = mode_client
    with client.open_session(str(worktree), network=True) as s:
        running = concurrent.futures.ThreadPoolExecutor(1).submit(
            shell, s, "echo started > started.txt; sleep 1.5; echo finished")
        assert wait_until(lambda: Path(worktree, "started.txt").exists(), 10)
        s.set_network(False)
        result = running.result(timeout=30)
        if mode != "degraded":
            assert "switched in place" in s.status()["note"]
            assert result.is_success and result.output == "finished\n", (result.output, result.error)
        else:
            assert not result.is_success
            assert f"the sandbox of session {s.id} went away during shell_exec: the session's sandbox was " \
                   "replaced (its network was switched)" in result.error, result.error
        assert shell(s, "echo after").output == "after\n"  # the handle serves the next call either way


def test_a_server_started_while_on_keeps_serving_the_session_after_off(mode_client, worktree: Path) -> None:
    mode, client = mode_client
    # A port the kernel picks, written once listening: in degraded mode the
    # loopback is the host's, shared with any run beside this one.
    server = ("import os, socket\ns = socket.socket()\n"
              "s.bind(('127.0.0.1', 0)); s.listen(8)\n"
              "open('port.tmp', 'w').write(str(s.getsockname()[1])); os.rename('port.tmp', 'port')\n"
              "while True:\n    c, _ = s.accept(); c.sendall(b'still\\n'); c.close()\n")
    Path(worktree, "server.py").write_text(server)
    with client.open_session(str(worktree), network=True) as s:
        assert shell(s, "nohup python3 server.py > server.log 2>&1 &", background=True).is_success
        assert wait_until(lambda: Path(worktree, "port").exists()), Path(worktree, "server.log").read_text()
        port = int(Path(worktree, "port").read_text())
        assert probe(s, tcp_probe(port)) == "connected still"
        assert s.set_network(False) is False
        if mode == "degraded":
            # The sandbox was replaced (no namespace to switch in place): the server is gone.
            assert probe(s, tcp_probe(port)) == f"error {EPERM}"
            return
        assert probe(s, tcp_probe(port)) == "connected still"
        s.set_network("ports", ports=[])
        assert s.network_mode == "ports"
        assert probe(s, tcp_probe(port)) == "connected still"  # the session's own loopback is not filtered


def test_unknown_network_mode_is_refused(mode_client, worktree: Path) -> None:
    _, client = mode_client
    with client.open_session(str(worktree)) as s:
        with pytest.raises(dispatch.RequestFailed) as exc:
            s._client.set_network(s.id, "ports", ports=[70000])
        assert "70000 is not a TCP port" in exc.value.message
        with pytest.raises(ValueError, match="network must be"):
            s.set_network("sometimes")
        assert s.network is False  # unchanged


@pytest.mark.parametrize("stack", ["slirp4netns", "pasta"])
def test_the_stack_is_the_fork_servers_child_and_dies_with_a_killed_daemon(tmp_path: Path, worktree: Path,
                                                                           tcp: TcpListener, stack: str) -> None:
    """The stack is started by the fork server, which dies with the daemon: a
    daemon killed with SIGKILL (no chance to stop anything) leaves no stack
    idling in an empty namespace. Its twin: while the daemon lives, the stack
    is there and carries the session's traffic."""
    import os
    import signal

    import psutil

    d = Daemon(tmp_path, "--network-stack", stack)
    with d.connect() as client:
        session = client.open_session(str(worktree), network="on")
        assert probe(session, tcp_probe(tcp.port, HOST["full"])) == "connected hello"
        fork_server = fork_server_of(d.proc.pid)
        # The session's stack, and those of the sandboxes made ahead for sessions like it.
        stacks = []
        for child in fork_server.children():
            try:
                if child.name().startswith((stack, "passt")):
                    stacks.append(child)
            except psutil.NoSuchProcess:
                continue  # a short-lived child of the fork server (a sandbox let go, an nft run): gone meanwhile
        assert stacks, fork_server.children()
        assert all(s.is_running() for s in stacks)
        os.kill(d.proc.pid, signal.SIGKILL)
        d.proc.wait()
        _gone, alive = psutil.wait_procs([*stacks, *fork_server.children(), fork_server], timeout=10)
        assert alive == [], alive
        session.detach()
    d.stop()


_PLANT_REDIRECT = (
    "mkdir evilc && ln -s ../.git/objects evilc/objects && ln -s ../.git/refs evilc/refs && cp .git/HEAD evilc/HEAD"
    " && printf '[core]\\n\\trepositoryformatversion = 0\\n\\tfsmonitor = \"echo {marker} >&2; false\"\\n'"
    " > evilc/config && echo ../evilc > .git/commondir && echo planted")


@pytest.mark.parametrize("how", ["closed", "switch failed"])
def test_a_session_ended_by_a_failed_switch_has_its_git_checked_too(tmp_path: Path, worktree: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A switch that failed half way (pasta not ready, nft
    refusing) ended the session without the end-of-session git check, so a
    ``.git/commondir`` it planted stayed in effect for the user's own git.
    Every end now winds down one way. Its twin is the plain close. pasta is
    made to fail by a wrapper earlier on the daemon's PATH that works once."""
    import secrets
    import subprocess


    subprocess.run(["git", "init", "-q", str(worktree)], check=True, timeout=30)
    bindir, starts = tmp_path / "bin", tmp_path / "pasta-starts"
    bindir.mkdir()
    (bindir / "pasta").write_text(f"#!/bin/sh\necho x >> {starts}\n"
                                  f"[ $(wc -l < {starts}) -ge 2 ] && {{ echo 'refused by the test' >&2; exit 1; }}\n"
                                  "exec /usr/bin/pasta \"$@\"\n")
    (bindir / "pasta").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    marker = f"PLANTED-{secrets.token_hex(4)}"
    (tmp_path / "d").mkdir()
    # The wrapper counts pasta starts: none made ahead.
    d = Daemon(tmp_path / "d", "--pool", "0", "--network-stack", "pasta")
    try:
        with d.connect() as client:
            session = client.open_session(str(worktree), network="on")
            assert shell(session, _PLANT_REDIRECT.format(marker=marker)).output == "planted\n"
            # The probe is live: while the session runs, the user's git obeys the redirect.
            during = subprocess.run(["git", "-C", str(worktree), "status"], capture_output=True, text=True,
                                    timeout=30)
            assert marker in during.stderr, during.stderr
            if how == "closed":
                session.close()
            else:
                session.set_network(False)
                with pytest.raises(dispatch.DispatchError) as info:
                    session.set_network(True)
                assert "start pasta: refused by the test" in str(info.value)
                assert session.id not in [s["id"] for s in client.list_sessions()]
                session.detach()
        assert not (worktree / ".git" / "commondir").exists()
        assert "event=git_redirect_quarantined" in d.log()
        after = subprocess.run(["git", "-C", str(worktree), "status"], capture_output=True, text=True, timeout=30)
        assert marker not in after.stderr
    finally:
        assert d.stop() == 0, d.log()


@pytest.mark.parametrize("mode", ["full", "pasta", "degraded"])
def test_a_policy_can_close_the_hosts_loopback(mode: str, tmp_path: Path, worktree: Path, tcp: TcpListener) -> None:
    """``[network] host_loopback = false``: a network-on session no longer
    reaches the host's 127.0.0.1 at the gateway (slirp4netns's
    --disable-host-loopback: ENETUNREACH; pasta's --no-map-gw), and the
    listener sees no one; where that cannot be held (degraded mode: the host's network)
    the session is refused, saying why. The twin: the shipped policy
    reaches the same listener."""
    import shutil

    from dispatchd.policy import default_policy_dir

    policies = tmp_path / "policies"
    shutil.copytree(default_policy_dir(), policies)
    text = (policies / "default.toml").read_text()
    (policies / "closed.toml").write_text(text.replace("host_loopback = true", "host_loopback = false"))
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--policies", str(policies), *DAEMON_ARGS[mode])
    try:
        with d.connect() as client:
            with client.open_session(str(worktree), network=True) as s:  # the twin
                assert probe(s, tcp_probe(tcp.port, HOST[mode])) == "connected hello"
            assert tcp.accepted == 1
            if mode == "degraded":
                with pytest.raises(dispatch.RequestFailed) as err:
                    client.open_session(str(worktree), network=True, policy="closed")
                assert "network 'on' without user namespaces is the host's network, its loopback included; the " \
                       "policy closes the host's loopback ([network] host_loopback = false)" in err.value.message
                with client.open_session(str(worktree), network=False, policy="closed") as s:
                    assert s.status()["protections"]["network"]["mode"] == "off"
                return
            with client.open_session(str(worktree), network=True, policy="closed") as s:
                assert "the host's loopback closed" in s.status()["protections"]["network"]["mechanism"]
                if mode == "full":  # slirp4netns refuses the gateway's connections itself
                    assert probe(s, tcp_probe(tcp.port, HOST[mode])) == f"error {ENETUNREACH}"
                # pasta with --no-map-gw routes 10.0.2.2 like any outside address: a probe
                # would leave the machine, which tests never do (tests/unit/test_stacks.py
                # checks its argument; the session above opened with it).
            assert tcp.accepted == 1
    finally:
        assert d.stop() == 0, d.log()
