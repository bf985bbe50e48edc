"""The client talks only to the user's own daemon.

Another local user cannot be made by an unprivileged test, so the checks are
tested directly: a socket directory others can write, or a symlink, is refused
before any byte is sent (a fake listener there records whether anything
arrived), beside the twin where the same listener in a private directory does
receive the greeting. A peer of another uid is unit-tested
(``tests/unit/test_paths.py::test_peer_problem``); the same-uid path is every
other test. Autostart never imports from the current directory.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.integration.test_cli import _alive, _env, _stop, assert_error, dispatch_cli
from tests.listeners import Served


class FakeListener(Served):
    """A socket that accepts and records every byte it is sent."""

    def __init__(self, path: Path) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen(8)
        self.connections = 0
        self.received = b""
        super().__init__(sock)

    def serve_once(self) -> None:
        conn, _ = self.sock.accept()
        self.connections += 1
        conn.settimeout(0.5)
        try:
            while data := conn.recv(4096):
                self.received += data
        except TimeoutError:
            pass
        finally:
            conn.close()


@pytest.fixture
def short_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="dsp-"))  # short: the fake listener binds by name
    try:
        yield base
    finally:
        os.chmod(base, 0o700)
        shutil.rmtree(base, ignore_errors=True)


def listener_in(directory: Path, mode: int) -> FakeListener:
    directory.mkdir(mode=0o700)
    fake = FakeListener(directory / "dispatchd.sock")
    os.chmod(directory, mode)
    return fake


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o703])
def test_a_socket_directory_others_can_write_is_refused_before_any_byte(short_dir: Path, mode: int) -> None:
    fake = listener_in(short_dir / "run", mode)
    try:
        with pytest.raises(dispatch.UntrustedSocket) as info:
            dispatch.connect(str(fake.path), timeout=2)
        time.sleep(0.3)
        assert (fake.connections, fake.received) == (0, b"")
        assert str(info.value) == (
            f"refusing the socket directory {short_dir / 'run'}: it is writable by "
            f"{'group' if mode == 0o770 else 'others' if mode == 0o703 else 'group and others'} (mode {mode:04o}), "
            "so another user could put a socket there; use a directory of your own (mode 0700): remove or fix "
            f"{short_dir / 'run'}, or choose another path with --socket or $DISPATCH_SOCKET "
            "(refused before anything was sent)")
    finally:
        fake.close()


def test_the_same_listener_in_a_private_directory_hears_the_client(short_dir: Path) -> None:
    """The allowed twin: the probe is real, this listener does receive a greeting."""
    fake = listener_in(short_dir / "run", 0o700)
    try:
        with pytest.raises(dispatch.DispatchError):  # it never answers the hello
            dispatch.connect(str(fake.path), timeout=1)
        assert fake.connections == 1 and b"hello" in fake.received
    finally:
        fake.close()


def test_a_symlinked_socket_directory_is_refused(short_dir: Path) -> None:
    fake = listener_in(short_dir / "real", 0o700)
    (short_dir / "link").symlink_to(short_dir / "real")
    try:
        with pytest.raises(dispatch.UntrustedSocket) as info:
            dispatch.connect(str(short_dir / "link" / "dispatchd.sock"), timeout=2)
        assert str(info.value).startswith(f"refusing the socket directory {short_dir / 'link'}: it is a symlink")
        assert (fake.connections, fake.received) == (0, b"")
    finally:
        fake.close()


def test_the_cli_refuses_in_one_line_naming_the_path_and_what_to_do(short_dir: Path) -> None:
    fake = listener_in(short_dir / "run", 0o777)
    try:
        out = dispatch_cli("--socket", str(fake.path), "status")  # autostart on: still nothing is started
        assert_error(out, f"refusing the socket directory {short_dir / 'run'}: it is writable by group and others",
                     "use a directory of your own")
        assert (fake.connections, fake.received) == (0, b"")
    finally:
        fake.close()


def test_without_xdg_runtime_dir_the_socket_lives_in_the_users_state_directory(tmp_path: Path) -> None:
    """The fallback another user cannot create first; the daemon makes it 0700 and binds
    by descriptor, so even this long pytest path is no problem."""
    env = _env(XDG_STATE_HOME=str(tmp_path / "state"))
    env.pop("XDG_RUNTIME_DIR", None)
    pid = None
    try:
        out = dispatch_cli("status", "--json", env=env)
        assert out.returncode == 0, out.stderr
        st = json.loads(out.stdout)
        pid = st["pid"]
        want = tmp_path / "state" / "dispatchd" / "run" / "dispatchd.sock"
        assert st["socket"] == str(want)
        assert len(str(want)) > 0 and want.is_socket()
        assert (os.stat(want.parent).st_mode & 0o777) == 0o700
    finally:
        if pid is not None:
            _stop(pid)


def test_autostart_never_runs_a_dispatchd_package_of_the_current_directory(tmp_path: Path) -> None:
    """A worktree an agent wrote holds ``dispatchd/__main__.py``: run from there,
    autostart must start the installed daemon, never that one."""
    evil = tmp_path / "wt"
    (evil / "dispatchd").mkdir(parents=True)
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (evil / "dispatchd" / "__init__.py").write_text(code)
    (evil / "dispatchd" / "__main__.py").write_text(code)
    base = tempfile.mkdtemp(prefix="dsp-")
    sock = os.path.join(base, "run", "dispatchd.sock")
    env = _env(XDG_STATE_HOME=str(tmp_path / "state"))
    # The twin: plain `python -m dispatchd` from there does run the planted package.
    subprocess.run([sys.executable, "-m", "dispatchd", "--version"], cwd=evil, env=env, capture_output=True, timeout=30)
    assert marker.read_text() == "dispatchd\n__main__\n"
    marker.unlink()
    pid = None
    try:
        # The `dispatch` command as installed (its script's directory, not the cwd, is on its path).
        cli = Path(sys.executable).parent / "dispatch"
        out = subprocess.run([str(cli), "--socket", sock, "status", "--json"], cwd=evil, env=env,
                             capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert out.returncode == 0, out.stderr
        pid = json.loads(out.stdout)["pid"]
        assert _alive(pid)
        assert not marker.exists(), marker.read_text()
        assert os.readlink(f"/proc/{pid}/cwd") == "/"
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[1:4] == [b"-P", b"-m", b"dispatchd"]
    finally:
        if pid is not None:
            _stop(pid)
        shutil.rmtree(base, ignore_errors=True)
