"""dispatchd under systemd's protocols, with systemd's own tools and no systemd running.

- ``systemd-analyze verify`` (system and ``--user`` mode) on the shipped units
  and on the ones ``dispatchd install-units`` writes;
- ``systemd-socket-activate`` runs the installed unit's ``ExecStart=`` the way
  the user manager would: it listens, and on the first connection execs the
  daemon with ``LISTEN_FDS``/``LISTEN_PID``; that first client is served;
- a datagram socket stands in for ``$NOTIFY_SOCKET``: ``READY=1`` arrives once,
  from the daemon's own pid, when a client is answered at once; ``STOPPING=1``
  after SIGTERM.

Both tools come with Debian's ``systemd`` package (``scripts/_common.sh``
installs it in CI); without them these tests fail, they do not skip.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import dispatch
from dispatchd import units
from tests.conftest import REPO, Daemon, _refuse_root, shell

NEXT_STEP = "next: systemctl --user daemon-reload && systemctl --user enable --now dispatchd.socket\n"
UCRED = struct.Struct("3i")  # pid, uid, gid (SCM_CREDENTIALS)


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: install Debian's systemd package (apt-get install systemd; "
                    "scripts/_common.sh does it when run as root)", pytrace=False)
    return found


def base_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DISPATCH_SOCKET", "XDG_CONFIG_HOME", "NOTIFY_SOCKET")}
    env.update(HOME=str(home), PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def dispatchd_cli(*args: str, env: dict[str, str], python: str = sys.executable,
                  cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "dispatchd", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, stdin=subprocess.DEVNULL, timeout=60)


def verify(*unit_files: Path, user: bool, runtime: Path) -> subprocess.CompletedProcess[str]:
    """``systemd-analyze [--user] verify``. ``--user`` needs $XDG_RUNTIME_DIR
    (it resolves ``%t``); the system mode resolves it to /run."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/"),
           "LANG": "C.UTF-8", "XDG_RUNTIME_DIR": str(runtime)}
    mode = ["--user"] if user else []
    return subprocess.run([tool("systemd-analyze"), *mode, "verify", *map(str, unit_files)],
                          capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL, timeout=60)


@pytest.fixture
def home(tmp_path: Path) -> Path:
    _refuse_root()
    h = tmp_path / "home"
    h.mkdir()
    return h


# -- the unit files ----------------------------------------------------------

@pytest.mark.parametrize("user", [False, True], ids=["system-mode", "user-mode"])
def test_shipped_units_pass_systemd_analyze_verify(user: bool, tmp_path: Path) -> None:
    out = verify(REPO / "systemd" / "dispatchd.socket", REPO / "systemd" / "dispatchd.service",
                 user=user, runtime=tmp_path)
    # verify exits 0 on an unknown or misspelt setting and only prints it: no output is the pass.
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


@pytest.fixture
def user_manager(tmp_path: Path) -> Iterator[Path]:
    """A runtime directory where a user manager would listen: its private socket."""
    runtime = Path(tempfile.mkdtemp(prefix="rt-"))  # short: socket paths are limited to 107 bytes
    (runtime / "systemd").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(runtime / "systemd" / "private"))
    yield runtime
    sock.close()
    shutil.rmtree(runtime, ignore_errors=True)


def test_install_units_writes_both_units_for_this_interpreter(home: Path, user_manager: Path) -> None:
    out = dispatchd_cli("install-units", env=base_env(home, XDG_RUNTIME_DIR=str(user_manager)))
    directory = home / ".config" / "systemd" / "user"
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout == (f"wrote {directory}/dispatchd.socket\nwrote {directory}/dispatchd.service\n" + NEXT_STEP)
    service = (directory / "dispatchd.service").read_text()
    # The interpreter as this process knows it (the venv's bin/python), not its symlink target.
    assert f"\nExecStart={sys.executable} -P -m dispatchd --socket %t/dispatchd/dispatchd.sock\n" in service
    assert {p.name: p.read_text() for p in directory.iterdir()} == units.render(sys.executable)
    for user in (False, True):
        checked = verify(directory / "dispatchd.socket", directory / "dispatchd.service", user=user, runtime=home)
        assert (checked.returncode, checked.stdout, checked.stderr) == (0, "", ""), user


def test_install_units_follows_xdg_config_home(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "config"
    out = dispatchd_cli("install-units", env=base_env(home, XDG_CONFIG_HOME=str(config)))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (config / "systemd" / "user").iterdir()) == ["dispatchd.service", "dispatchd.socket"]
    assert not (home / ".config").exists()


def test_install_units_says_why_it_cannot_write(home: Path, tmp_path: Path) -> None:
    config = tmp_path / "not-a-directory"
    config.write_text("")
    out = dispatchd_cli("install-units", env=base_env(home, XDG_CONFIG_HOME=str(config)))
    assert (out.returncode, out.stdout) == (1, "")
    assert out.stderr == f"dispatchd: install-units: {config}/systemd/user: Not a directory\n"


def test_install_units_dry_run_prints_the_units_and_writes_nothing(home: Path) -> None:
    out = dispatchd_cli("install-units", "--dry-run", env=base_env(home))
    assert (out.returncode, out.stderr) == (0, "")
    directory = home / ".config" / "systemd" / "user"
    expected = "".join(f"==> {directory / name} <==\n{text}\n" for name, text in units.render(sys.executable).items())
    assert out.stdout == expected
    assert not (home / ".config").exists()


def test_install_units_refuses_a_python_systemd_could_not_start_dispatchd_with(home: Path) -> None:
    """The interpreter the venv was made from (Debian's python3 here)
    reaches this checkout only through PYTHONPATH, which systemd would not
    give it: no unit is written, and the message says why. The suite runs
    from a venv (scripts/test makes it), which this test needs."""
    python = sys._base_executable  # the same version: it can load the venv's compiled packages
    site = next(Path(sys.prefix, "lib").glob("python3*/site-packages"))
    env = base_env(home, PYTHONPATH=f"{REPO}:{site}")
    out = dispatchd_cli("install-units", env=env, python=python)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stdout == ""
    assert out.stderr == (f"dispatchd: {python} cannot import dispatchd without this directory or "
                          "PYTHONPATH, as systemd would start it: install dispatchd for it (pip install .), "
                          "or run install-units with the Python it is installed for\n")
    assert not (home / ".config").exists()
    dry = dispatchd_cli("install-units", "--dry-run", env=env, python=python)
    assert dry.returncode == 0 and f"ExecStart={python} -P -m dispatchd" in dry.stdout
    assert dry.stderr.startswith(f"dispatchd: warning: {python} cannot import dispatchd")


def test_uninstall_units_removes_the_units_and_the_enable_link(home: Path) -> None:
    env = base_env(home)
    assert dispatchd_cli("install-units", env=env).returncode == 0
    directory = home / ".config" / "systemd" / "user"
    (directory / "sockets.target.wants").mkdir()
    (directory / "sockets.target.wants" / "dispatchd.socket").symlink_to(directory / "dispatchd.socket")
    out = dispatchd_cli("uninstall-units", env=env)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == (f"removed {directory}/sockets.target.wants/dispatchd.socket\n"
                          f"removed {directory}/dispatchd.socket\nremoved {directory}/dispatchd.service\n"
                          "next: systemctl --user stop dispatchd.socket dispatchd.service; "
                          "systemctl --user daemon-reload\n")
    assert [p.name for p in directory.rglob("*")] == ["sockets.target.wants"]


# -- readiness, stopping, socket activation ------------------------------------

class NotifySocket:
    """What systemd listens on for ``sd_notify``: datagrams, with the sender's
    credentials (SO_PASSCRED), so a test can tell who said READY."""

    def __init__(self, address: str) -> None:
        self.env_value = address  # a path, or "@name" for the abstract namespace
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind("\0" + address[1:] if address.startswith("@") else address)

    def receive(self, timeout: float) -> tuple[list[str], int] | None:
        """One message's assignments and the sender's pid, or None on timeout."""
        self.sock.settimeout(timeout)
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(UCRED.size))
        except TimeoutError:
            return None
        pids = [UCRED.unpack(d[:UCRED.size])[0] for level, kind, d in ancillary
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS]
        assert len(pids) == 1, ancillary
        return data.decode().split("\n"), pids[0]

    def close(self) -> None:
        self.sock.close()


class Started(Daemon):
    """A process that becomes dispatchd (directly, or by way of
    systemd-socket-activate), with conftest's log and clean stop (SIGTERM,
    then SIGKILL after 15 s); unlike ``Daemon``, it does not wait to connect."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT)


@pytest.fixture
def notify_path(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(str(tmp_path / "notify"))
    yield n
    n.close()


@pytest.fixture
def notify_abstract(tmp_path: Path) -> Iterator[NotifySocket]:
    n = NotifySocket(f"@dispatchd-test/{os.getpid()}/{tmp_path.name}")
    yield n
    n.close()


def wait_for_ready(notify: NotifySocket, started: Started, timeout: float = 60) -> tuple[list[str], int]:
    # As generous as conftest's Daemon: a start takes seconds on a loaded machine, never a cause of failure.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = notify.receive(0.05)
        if got is not None:
            return got
        if started.proc.poll() is not None:
            pytest.fail(f"dispatchd exited with {started.proc.returncode} before READY=1:\n{started.log()}")
    pytest.fail(f"no READY=1 within {timeout} s:\n{started.log()}")


def rest_of_messages(notify: NotifySocket) -> list[tuple[list[str], int]]:
    """What arrives after the process ended (it is queued by then)."""
    found = []
    while (got := notify.receive(0.2)) is not None:
        found.append(got)
    return found


def test_ready_once_the_daemon_answers_and_stopping_on_sigterm(home: Path, tmp_path: Path,
                                                               notify_abstract: NotifySocket) -> None:
    sock = tmp_path / "run" / "dispatchd.sock"
    env = base_env(home, XDG_STATE_HOME=str(tmp_path / "state"), NOTIFY_SOCKET=notify_abstract.env_value)
    started = Started([sys.executable, "-m", "dispatchd", "--socket", str(sock)], env, tmp_path / "log", cwd=home)
    try:
        ready, sender = wait_for_ready(notify_abstract, started)
        # At this moment, with no retry: the socket accepts and the daemon answers.
        with dispatch.connect(str(sock)) as client:
            status = client.status()
        assert ready == ["READY=1", f"STATUS=serving on {sock}"]
        assert sender == started.proc.pid  # NotifyAccess=main: only the daemon's own pid counts
        assert status["kernel"]["landlock_abi"] >= 1
        log = started.log()
        assert log.index("event=kernel") < log.index("event=ready")
    finally:
        code = started.stop()
    assert code == 0, started.log()
    assert rest_of_messages(notify_abstract) == [
        (["STOPPING=1", "STATUS=stopping: ending sessions"], started.proc.pid)]


ACCEPTCON = 0x10000  # /proc/net/unix's Flags of a listening socket (__SO_ACCEPTCON)


def listens(path: Path) -> bool:
    """Whether a stream socket listens at ``path``, seen in /proc/net/unix
    without connecting (a connection would start the activated daemon)."""
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[7] == str(path) and int(fields[3], 16) & ACCEPTCON:
            return True
    return False


def _installed_exec_start(home: Path, runtime: Path) -> list[str]:
    """ExecStart= of the unit install-units wrote, as the user manager would run it."""
    out = dispatchd_cli("install-units", env=base_env(home))
    assert out.returncode == 0, out.stderr
    service = (home / ".config" / "systemd" / "user" / "dispatchd.service").read_text()
    line = next(ln for ln in service.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart=").replace("%t", str(runtime)))


def test_socket_activation_serves_the_client_that_started_it(home: Path, tmp_path: Path, worktree: Path,
                                                             notify_path: NotifySocket) -> None:
    runtime = tmp_path / "runtime"
    sock = runtime / "dispatchd" / "dispatchd.sock"
    sock.parent.mkdir(parents=True, mode=0o700)  # DirectoryMode=0700
    argv = _installed_exec_start(home, runtime)
    assert argv == [sys.executable, "-P", "-m", "dispatchd", "--socket", str(sock)]
    setenv = [f"--setenv={k}={v}" for k, v in {
        "HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
        "XDG_RUNTIME_DIR": str(runtime), "XDG_STATE_HOME": str(tmp_path / "state"),
        "NOTIFY_SOCKET": notify_path.env_value, "PYTHONDONTWRITEBYTECODE": "1"}.items()]
    started = Started([tool("systemd-socket-activate"), f"--listen={sock}", *setenv, *argv],
                      base_env(home), tmp_path / "log", cwd=home)  # a user service runs in $HOME
    first: dict[str, Any] = {}

    def first_client() -> None:  # connects before dispatchd exists: its connection starts it
        try:
            with dispatch.connect(str(sock), timeout=60) as client:  # it answers once started: wait as for READY
                first["status"] = client.status()
                with client.open_session(str(worktree)) as session:
                    first["env"] = shell(session, "env").metadata["stdout"]
        except Exception as exc:  # reported below; a thread must not raise into pytest
            first["error"] = exc

    thread = threading.Thread(target=first_client)
    try:
        deadline = time.monotonic() + 10
        # Listening, not only bound: the path appears at bind(), and a client
        # that came before listen() was refused and started nothing.
        while not listens(sock):
            assert time.monotonic() < deadline and started.proc.poll() is None, started.log()
            time.sleep(0.01)
        thread.start()
        ready, sender = wait_for_ready(notify_path, started)
        thread.join(90)
        assert not thread.is_alive(), started.log()
        assert "error" not in first, (first, started.log())
        assert ready == ["READY=1", f"STATUS=serving on {sock}"]
        assert sender == started.proc.pid  # systemd-socket-activate exec'd the daemon: same pid
        assert first["status"]["kernel"]["landlock_abi"] >= 1
        # The handover and the notify socket are the daemon's, never a session's.
        assert not [ln for ln in first["env"].splitlines() if ln.startswith(("LISTEN_", "NOTIFY_SOCKET"))]
        assert f"Execing {sys.executable}" in started.log()
    finally:
        code = started.stop()
        if thread.is_alive():
            thread.join(30)
    assert code == 0, started.log()
    assert rest_of_messages(notify_path) == [(["STOPPING=1", "STATUS=stopping: ending sessions"], started.proc.pid)]
    assert sock.is_socket()  # systemd's socket, not ours to remove (RemoveOnStop= does it)


def test_a_socket_dispatchd_cannot_serve_is_refused_without_ready(home: Path, tmp_path: Path,
                                                                  notify_path: NotifySocket) -> None:
    """A datagram socket (a .socket unit with ListenDatagram=) stops the daemon
    with a message, and no READY=1 is ever sent."""
    sock = tmp_path / "dgram.sock"
    env = base_env(home, XDG_STATE_HOME=str(tmp_path / "state"))
    started = Started([tool("systemd-socket-activate"), "--datagram", f"--listen={sock}",
                       f"--setenv=NOTIFY_SOCKET={notify_path.env_value}", f"--setenv=HOME={home}",
                       f"--setenv=XDG_STATE_HOME={tmp_path / 'state'}",
                       sys.executable, "-P", "-m", "dispatchd", "--socket", str(sock)], env, tmp_path / "log", cwd=home)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert time.monotonic() < deadline and started.proc.poll() is None, started.log()
            time.sleep(0.01)
        trigger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            trigger.sendto(b"hello", str(sock))
        finally:
            trigger.close()
        code = started.proc.wait(30)
    finally:
        started.stop()
    assert code == 1, started.log()
    assert ("dispatchd: systemd passed fd 3 (unknown) as AF_UNIX/SOCK_DGRAM, not listening: dispatchd needs "
            "a listening Unix stream socket (ListenStream=PATH in the .socket unit)") in started.log()
    assert rest_of_messages(notify_path) == []


def test_install_units_without_a_user_manager_says_so_and_what_to_do(home: Path, tmp_path: Path) -> None:
    runtime = tmp_path / "runtime"
    runtime.mkdir()
    out = dispatchd_cli("install-units", env=base_env(home, XDG_RUNTIME_DIR=str(runtime)))
    directory = home / ".config" / "systemd" / "user"
    assert out.returncode == 0  # the units are written: they work once a manager runs
    assert out.stdout == (f"wrote {directory}/dispatchd.socket\nwrote {directory}/dispatchd.service\n" + NEXT_STEP)
    assert out.stderr == (
        f"dispatchd: no systemd user manager is running for you here (no {runtime}/systemd/private), so "
        "`systemctl --user` cannot start these units yet. Either run the daemon in the foreground "
        "(`dispatchd`), or let `dispatch` start it in the background (it does when none answers); or "
        "get a user manager: log in through a session that starts one (ssh or a desktop login, not "
        "`su`), or have root run `loginctl enable-linger $USER`, then run the next step\n")


def test_help_names_install_units(home: Path) -> None:
    out = dispatchd_cli("--help", env=base_env(home))
    assert out.returncode == 0
    assert "dispatchd install-units [--dry-run]" in out.stdout and "dispatchd uninstall-units" in out.stdout
    assert "(default: info)" in out.stdout and "(seconds; default: 30)" in out.stdout
