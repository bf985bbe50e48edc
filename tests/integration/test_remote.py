"""Sessions through ``dispatch bridge``: a local command's stdio, and real ssh.

The bridge runs against a real daemon; the client reaches it through
``host_command`` (the bridge as a local process), then through an sshd this
test starts itself on 127.0.0.1 (unprivileged: it logs in the same user).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
import dispatch.aio
from dispatch.client import Cancellation
from tests.conftest import REPO, Daemon
from tests.sleeping import daemon_with_policies, wait_until_asleep, with_sleep_after
from tests.sshd import Sshd


def bridge_command(daemon: Daemon, *extra: str) -> str:
    return shlex.join([sys.executable, "-m", "dispatch.cli", "--no-autostart", "bridge", "--socket", daemon.socket,
                       *extra])


@pytest.fixture
def remote(daemon: Daemon) -> Iterator[dispatch.Client]:
    with dispatch.connect(host_command=bridge_command(daemon)) as c:
        yield c


def shell(session: dispatch.Session, command: str, **params: object) -> dispatch.Result:
    return session.registry.get("shell_exec").call({"command": command, **params})


def _exercise(session: dispatch.Session) -> None:
    """Every kind of call: plain, streamed, cancelled, a job, a network switch."""
    assert shell(session, "echo hi; echo err >&2").metadata["stdout"] == "hi\n"
    assert session.registry.get("read_file").call({"path": "README.md"}).output.endswith("1: world")
    # A large file: many link frames, back to one reply.
    big = "x" * 999 + "\n"
    assert session.registry.get("write_file").call({"path": "big.txt", "content": big * 3000}).is_success
    r = shell(session, "wc -c < big.txt")
    assert r.output.strip() == str(len(big) * 3000)
    # Streaming: output arrives before the call returns.
    chunks: list[tuple[str, str]] = []
    r = session.registry.get("shell_exec").call({"command": "echo one; sleep 0.3; echo two"},
                                                on_output=lambda s, t: chunks.append((s, t)))
    assert r.is_success and "".join(t for s, t in chunks if s == "stdout") == "one\ntwo\n"
    # Cancellation: a handle, and Session.cancel.
    c = Cancellation()
    threading.Timer(0.5, c.cancel).start()
    started = time.monotonic()
    r = session.registry.get("shell_exec").call({"command": "sleep 30"}, {"cancellation": c})
    assert r.metadata["cancelled"] is True and time.monotonic() - started < 5
    results: list[dispatch.Result] = []
    t = threading.Thread(target=lambda: results.append(shell(session, "sleep 30")))
    t.start()
    deadline = time.monotonic() + 5
    while session.cancel() == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    t.join(5)
    assert results and results[0].metadata["cancelled"] is True
    # A background job.
    r = shell(session, "echo from-job; sleep 0.2; echo done", background=True)
    job = r.metadata["job"]
    out = session.registry.get("job_output").call({"job": job, "wait": 5})
    while out.metadata["running"]:
        out = session.registry.get("job_output").call({"job": job, "wait": 5})
    assert "from-job" in session.registry.get("job_output").call({"job": job}).output
    # A network switch: a new channel comes over the bridge.
    session.set_network("on")
    assert session.network_mode == "on"
    assert shell(session, "echo after-switch").output == "after-switch\n"
    session.set_network("off")
    assert shell(session, "echo back").output == "back\n"


def test_a_session_through_a_bridge_does_what_a_local_one_does(daemon: Daemon, remote: dispatch.Client,
                                                                worktree: Path) -> None:
    assert remote.socket_path == bridge_command(daemon)  # what error messages name
    with remote.open_session(str(worktree)) as session:
        _exercise(session)
        status = session.status()
        assert status["worktree"] == str(worktree)
    assert session.id not in [s["id"] for s in remote.list_sessions()]


def test_many_calls_in_flight_on_one_bridge(remote: dispatch.Client, worktree: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    with remote.open_session(str(worktree)) as a, remote.open_session(str(other)) as b:
        results: list[str] = []
        lock = threading.Lock()

        def work(s: dispatch.Session, n: int) -> None:
            for i in range(20):
                r = shell(s, f"echo {n}-{i}")
                out = r.output if r.is_success else f"failed: {r.error}"
                with lock:
                    results.append(out)

        threads = [threading.Thread(target=work, args=(s, n)) for n, s in enumerate([a, b, a, b])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == sorted(f"{n}-{i}\n" for n in range(4) for i in range(20))


def test_a_bridge_killed_mid_call_ends_the_call_and_a_new_bridge_attaches(
        daemon: Daemon, worktree: Path) -> None:
    first = dispatch.connect(host_command=bridge_command(daemon))
    session = first.open_session(str(worktree))
    sid = session.id
    results: list[dispatch.Result] = []
    call = threading.Thread(target=lambda: results.append(shell(session, "sleep 20; echo late")))
    call.start()
    time.sleep(0.5)
    transport = first._transport
    os.kill(transport.pid, signal.SIGKILL)
    call.join(10)
    assert not call.is_alive()
    (r,) = results
    assert r.is_failure and r.metadata["bridge_lost"] is True
    assert "the bridge to" in r.error and "went away" in r.error and "killed by signal 9" in r.error, r.error
    assert f"client.session('{sid}')" in r.error
    # The daemon request fails as clearly.
    with pytest.raises(dispatch.ConnectionLost, match="the bridge to .* went away"):
        first.list_sessions()
    with pytest.raises(dispatch.ConnectionLost):
        session.close()  # its channel closed here; the daemon cannot be asked to close it
    first.close()
    # A new bridge: the session is there, by id, and works.
    with dispatch.connect(host_command=bridge_command(daemon)) as second:
        again = second.session(sid)
        assert shell(again, "echo again").output == "again\n"
        again.close()  # attached here, not opened: its channel only
        second.close_session(sid)


def test_a_bridge_that_cannot_reach_its_daemon_says_why(tmp_path: Path) -> None:
    missing = tmp_path / "run" / "none.sock"
    (tmp_path / "run").mkdir(mode=0o700)
    command = shlex.join([sys.executable, "-m", "dispatch.cli", "--no-autostart", "bridge", "--socket", str(missing)])
    with pytest.raises(dispatch.DaemonUnavailable, match=f"no dispatchd is listening on {missing}"):
        dispatch.connect(host_command=command, timeout=10)


def test_a_bridge_checks_the_socket_as_a_local_client_does(tmp_path: Path) -> None:
    # The allowed twin is every test above: a socket in the daemon's own 0700 directory.
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    command = shlex.join([sys.executable, "-m", "dispatch.cli", "--no-autostart", "bridge",
                          "--socket", str(shared / "d.sock")])
    with pytest.raises(dispatch.DaemonUnavailable,
                       match=f"refusing the socket directory {shared}: .*refused before anything was sent"):
        dispatch.connect(host_command=command, timeout=10)


def test_a_command_that_is_not_a_bridge_is_refused_with_what_it_printed() -> None:
    with pytest.raises(dispatch.DaemonUnavailable, match=r"ended before it answered \(exit status 0\).*'hello'"):
        dispatch.connect(host_command="echo hello", timeout=10)
    with pytest.raises(dispatch.DaemonUnavailable, match="cannot run the bridge command"):
        dispatch.connect(host_command="/nonexistent/bridge", timeout=10)


def test_the_cli_through_a_bridge(daemon: Daemon, worktree: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    base = [sys.executable, "-m", "dispatch.cli", "--host-command", bridge_command(daemon)]
    out = subprocess.run([*base, "exec", "--worktree", str(worktree), "--", "echo", "a b"], capture_output=True,
                         text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert (out.returncode, out.stdout) == (0, "a b\n"), out.stderr
    out = subprocess.run([*base, "call", "--worktree", str(worktree), "read_file", '{"path": "README.md"}', "--text"],
                         capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 0 and "world" in out.stdout, out.stderr
    # Ctrl-C cancels the command in the sandbox, through the bridge (which
    # runs in a session of its own: the signal is the client's alone).
    with subprocess.Popen([*base, "exec", "--worktree", str(worktree), "--", "sh", "-c", "echo started; sleep 30"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          stdin=subprocess.DEVNULL) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            assert proc.stdout.readline() == "started\n", proc.stderr.read()
            started = time.monotonic()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(15) == 130, proc.stderr.read()
            assert time.monotonic() - started < 10
        finally:
            if proc.poll() is None:
                proc.kill()
    # ssh:// spelled wrong: one line, exit 2, nothing run.
    out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--host", "ssh://-oProxyCommand=x", "status"],
                         capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and out.stderr.startswith("dispatch: the host in") and out.stdout == ""


def test_the_asyncio_client_through_a_bridge(daemon: Daemon, worktree: Path) -> None:
    async def main() -> str:
        async with dispatch.aio.connect(host_command=bridge_command(daemon)) as client:
            session = await client.open_session(str(worktree))
            try:
                r = await session.registry.call("read_file", {"path": "README.md"})
                return str(r.output)
            finally:
                await session.close()

    assert asyncio.run(main()).endswith("1: world")


def test_a_session_sleeps_and_wakes_through_a_bridge(tmp_path: Path, worktree: Path) -> None:
    d = daemon_with_policies(tmp_path, nap=with_sleep_after((REPO / "policies" / "default.toml").read_text(), 0.3))
    try:
        with dispatch.connect(host_command=bridge_command(d)) as client:
            if not client.status()["kernel"]["user_namespaces"]:
                pytest.skip("sessions sleep in full mode only, and this kernel refuses user namespaces")
            with client.open_session(str(worktree), policy="nap") as session:
                assert shell(session, "echo > made-awake").is_success
                wait_until_asleep(client, session.id, log=d.log()[-3000:])
                # The wake is the daemon's business: the channel over the bridge stays the same.
                assert session.registry.get("read_file").call({"path": "README.md"}).output.endswith("1: world")
                assert shell(session, "echo woken").output == "woken\n"
    finally:
        assert d.stop() == 0, d.log()


# --- real ssh ---------------------------------------------------------------


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    if not os.path.exists("/usr/sbin/sshd") or shutil.which("ssh") is None:
        pytest.fail("openssh-server and openssh-client are needed (scripts/_common.sh installs them)")
    venv_bin = os.path.dirname(sys.executable)
    server = Sshd(tmp_path_factory.mktemp("sshd"), f"{venv_bin}:/usr/bin:/bin")
    yield server
    server.stop()


def test_a_session_over_real_ssh_with_an_ssh_url(daemon: Daemon, sshd: Sshd, worktree: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISPATCH_SSH_COMMAND", f"ssh -F {sshd.client_config}")
    with dispatch.connect(daemon.socket, host=f"ssh://{pwd.getpwuid(os.getuid()).pw_name}@127.0.0.1:{sshd.port}",
                          autostart=False) as client:
        assert client.socket_path.startswith("ssh://")
        with client.open_session(str(worktree)) as session:
            _exercise(session)


def test_a_session_over_real_ssh_as_a_host_command_and_the_cli(daemon: Daemon, sshd: Sshd, worktree: Path) -> None:
    command = shlex.join(["ssh", "-F", str(sshd.client_config), "-T", "127.0.0.1",
                          os.path.join(os.path.dirname(sys.executable), "dispatch"), "--no-autostart", "bridge",
                          "--socket", daemon.socket])
    with dispatch.connect(host_command=command) as client, client.open_session(str(worktree)) as session:
        assert session.registry.get("read_file").call({"path": "src/main.py"}).output.endswith("return 42")
    env = {k: v for k, v in os.environ.items() if k != "DISPATCH_SOCKET"}
    env["DISPATCH_HOST"] = f"ssh://127.0.0.1:{sshd.port}"
    env["DISPATCH_SSH_COMMAND"] = f"ssh -F {sshd.client_config}"
    out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--socket", daemon.socket, "--no-autostart", "exec",
                          "--worktree", str(worktree), "--", "cat", "README.md"],
                         capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
    assert (out.returncode, out.stdout) == (0, "hello\nworld\n"), out.stderr


def test_ssh_refusing_the_login_is_reported(sshd: Sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(sshd.client_config.read_text().replace(str(sshd.base / "user_key"), str(other)))
    monkeypatch.setenv("DISPATCH_SSH_COMMAND", f"ssh -F {config}")
    with pytest.raises(dispatch.DaemonUnavailable, match=r"exit status 255.*Permission denied \(publickey\)"):
        dispatch.connect(host=f"ssh://127.0.0.1:{sshd.port}", timeout=15)

