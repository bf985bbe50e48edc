"""dispatchd.paths: where the socket and the state live, and the private-directory rule.

Environments are passed as explicit dicts, so the daemon's own environment
(and the test runner's) never decides a result by accident.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from dispatchd import paths
from dispatchd.paths import (
    UnsafeDirectory,
    default_socket_path,
    ensure_private_dir,
    open_socket_dir,
    peer_problem,
    resolve_socket_path,
    socket_dir_problem,
    state_dir,
    via_fd,
)

BOTH = {"DISPATCH_SOCKET": "/srv/d/dispatchd.sock", "XDG_RUNTIME_DIR": "/run/user/1000"}


# -- the socket path ---------------------------------------------------------------


def test_dispatch_socket_wins():
    assert default_socket_path(BOTH, uid=1000) == "/srv/d/dispatchd.sock"


def test_xdg_runtime_dir_next():
    assert default_socket_path({"XDG_RUNTIME_DIR": "/run/user/1000"}, uid=1000) == (
        "/run/user/1000/dispatchd/dispatchd.sock")


def test_fallback_is_in_the_users_own_state_directory():
    """Not /tmp/dispatchd-$UID, which another user could create first and listen in."""
    assert default_socket_path({"HOME": "/home/u"}, uid=1234) == "/home/u/.local/state/dispatchd/run/dispatchd.sock"
    assert default_socket_path({"XDG_STATE_HOME": "/srv/st"}, uid=1234) == "/srv/st/dispatchd/run/dispatchd.sock"


def test_empty_variables_count_as_unset():
    assert default_socket_path({"DISPATCH_SOCKET": "", "XDG_RUNTIME_DIR": "/run/user/7"}, uid=7) == (
        "/run/user/7/dispatchd/dispatchd.sock")
    assert default_socket_path({"DISPATCH_SOCKET": "", "XDG_RUNTIME_DIR": "", "HOME": "/h"}, uid=7) == (
        "/h/.local/state/dispatchd/run/dispatchd.sock")


def test_relative_xdg_variables_are_ignored():
    """The XDG spec says so; a relative one would put the socket wherever the command runs."""
    env = {"XDG_RUNTIME_DIR": "run", "XDG_STATE_HOME": "state", "HOME": "/h"}
    assert default_socket_path(env, uid=7) == "/h/.local/state/dispatchd/run/dispatchd.sock"
    assert state_dir(env) == "/h/.local/state/dispatchd"


def test_unrelated_variables_do_not_matter():
    assert default_socket_path({"HOME": "/home/u", "TMPDIR": "/var/tmp"}, uid=5) == (
        "/home/u/.local/state/dispatchd/run/dispatchd.sock")


def test_uid_defaults_to_ours(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", "/home/zed")
    assert default_socket_path({}) == "/home/zed/.local/state/dispatchd/run/dispatchd.sock"


def test_env_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("DISPATCH_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    assert default_socket_path() == "/run/user/4242/dispatchd/dispatchd.sock"
    monkeypatch.setenv("DISPATCH_SOCKET", "/x/y.sock")
    assert default_socket_path() == "/x/y.sock"


def test_resolve_socket_path_explicit_wins_over_the_environment():
    assert resolve_socket_path("/opt/s.sock", BOTH) == "/opt/s.sock"


def test_resolve_socket_path_makes_an_explicit_path_absolute(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    assert resolve_socket_path("run/s.sock", BOTH) == os.path.join(os.getcwd(), "run", "s.sock")
    assert resolve_socket_path("./a/../s.sock", {}) == os.path.join(os.getcwd(), "s.sock")


@pytest.mark.parametrize("explicit", [None, ""])
def test_resolve_socket_path_without_an_explicit_path(explicit: str | None):
    assert resolve_socket_path(explicit, BOTH) == "/srv/d/dispatchd.sock"
    assert resolve_socket_path(explicit, {"XDG_RUNTIME_DIR": "/run/user/9"}) == "/run/user/9/dispatchd/dispatchd.sock"
    assert resolve_socket_path(explicit, {"HOME": "/h"}) == "/h/.local/state/dispatchd/run/dispatchd.sock"


# -- the state directory -----------------------------------------------------------


def test_state_dir_with_xdg_state_home():
    assert state_dir({"XDG_STATE_HOME": "/srv/state"}) == "/srv/state/dispatchd"


def test_state_dir_without_xdg_state_home(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HOME", "/home/zed")
    assert state_dir({}) == "/home/zed/.local/state/dispatchd"
    assert state_dir({"XDG_STATE_HOME": ""}) == "/home/zed/.local/state/dispatchd"


def test_state_dir_defaults_to_the_process_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("XDG_STATE_HOME", "/var/lib/u")
    assert state_dir() == "/var/lib/u/dispatchd"


# -- ensure_private_dir ------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_creates_a_private_directory(tmp_path: Path):
    target = tmp_path / "run" / "dispatchd"
    ensure_private_dir(str(target))
    assert target.is_dir()
    assert mode(target) == 0o700
    assert os.lstat(target).st_uid == os.getuid()


def test_creates_with_0700_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)
    try:
        ensure_private_dir(str(tmp_path / "d"))
    finally:
        os.umask(old)
    assert mode(tmp_path / "d") == 0o700


def test_tightens_an_open_directory_it_owns(tmp_path: Path):
    target = tmp_path / "open"
    target.mkdir()
    target.chmod(0o755)
    ensure_private_dir(str(target))
    assert mode(target) == 0o700


@pytest.mark.parametrize("loose", [0o701, 0o710, 0o770, 0o777, 0o707])
def test_tightens_any_group_or_other_bit(tmp_path: Path, loose: int):
    target = tmp_path / "loose"
    target.mkdir()
    target.chmod(loose)
    ensure_private_dir(str(target))
    assert mode(target) == 0o700


def test_leaves_a_private_directory_alone(tmp_path: Path):
    target = tmp_path / "private"
    target.mkdir(mode=0o700)
    (target / "keep").write_text("x")
    ensure_private_dir(str(target))
    assert mode(target) == 0o700
    assert (target / "keep").read_text() == "x"


def test_refuses_a_symlink_to_a_directory(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(UnsafeDirectory) as info:
        ensure_private_dir(str(link))
    assert str(info.value) == f"{link} is not a directory (a symlink?); {paths.what_to_do()}"
    assert mode(real) == 0o755  # the target was not touched


def test_refuses_a_dangling_symlink(tmp_path: Path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UnsafeDirectory) as info:
        ensure_private_dir(str(link))
    assert str(info.value) == f"cannot create {link}: File exists; {paths.what_to_do()}"
    assert not (tmp_path / "nowhere").exists()


def test_refuses_a_regular_file(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UnsafeDirectory) as info:
        ensure_private_dir(str(f))
    assert str(info.value) == f"cannot create {f}: File exists; {paths.what_to_do()}"


def test_refuses_a_path_through_a_file(tmp_path: Path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UnsafeDirectory) as info:
        ensure_private_dir(str(f / "sub"))
    assert str(info.value) == f"cannot create {f / 'sub'}: Not a directory; {paths.what_to_do()}"
    assert isinstance(info.value.__cause__, OSError)


def test_refuses_another_users_directory(tmp_path: Path):
    if os.geteuid() == 0:  # root can make one; anyone else uses root's own /usr
        target = tmp_path / "theirs"
        target.mkdir()
        target.chmod(0o777)
        os.chown(target, 54321, 54321)
        owner = 54321
    else:
        target, owner = Path("/usr"), 0
    before = mode(target)
    with pytest.raises(UnsafeDirectory) as info:
        ensure_private_dir(str(target))
    assert str(info.value) == f"{target} belongs to uid {owner}, not to us ({os.getuid()}); {paths.what_to_do()}"
    assert "e.g. --socket /" in paths.what_to_do()
    assert mode(target) == before  # refused before any chmod


# -- the client's checks: the socket's directory and its peer ------------------------


def fake_stat(mode: int, uid: int) -> os.stat_result:
    return os.stat_result((mode, 0, 0, 1, uid, uid, 0, 0, 0, 0))


@pytest.mark.parametrize(("st_mode", "owner", "problem"), [
    (stat.S_IFDIR | 0o700, 1000, None),
    (stat.S_IFDIR | 0o755, 1000, None),  # what systemd makes for a socket unit: fine
    (stat.S_IFDIR | 0o777, 1000, "it is writable by group and others (mode 0777)"),
    (stat.S_IFDIR | 0o1777, 1000, "it is writable by group and others (mode 1777)"),
    (stat.S_IFDIR | 0o770, 1000, "it is writable by group (mode 0770)"),
    (stat.S_IFDIR | 0o702, 1000, "it is writable by others (mode 0702)"),
    (stat.S_IFDIR | 0o700, 1001, "it belongs to uid 1001, not to you (uid 1000)"),
    (stat.S_IFDIR | 0o700, 0, "it belongs to uid 0, not to you (uid 1000)"),
    (stat.S_IFLNK | 0o777, 1000, "it is a symlink"),
    (stat.S_IFREG | 0o600, 1000, "it is not a directory"),
], ids=["private", "0755", "0777", "sticky-1777", "group", "others", "other-uid", "root", "symlink", "file"])
def test_socket_dir_problem(st_mode: int, owner: int, problem: str | None):
    assert socket_dir_problem(fake_stat(st_mode, owner), 1000) == problem


def test_peer_problem():
    assert peer_problem(1000, 42, 1000) is None
    assert peer_problem(1001, 42, 1000) == "it is served by uid 1001 (pid 42), not by you (uid 1000)"
    assert peer_problem(0, 1, 1000) == "it is served by uid 0 (pid 1), not by you (uid 1000)"


def test_open_socket_dir_accepts_a_private_directory_and_names_it_by_descriptor(tmp_path: Path):
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    fd = open_socket_dir(str(d))
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(d))
        assert via_fd(fd, "s.sock") == f"/proc/self/fd/{fd}/s.sock"
        assert os.path.realpath(f"/proc/self/fd/{fd}") == str(d)
    finally:
        os.close(fd)


@pytest.mark.parametrize("loose", [0o777, 0o775, 0o722])
def test_open_socket_dir_refuses_a_directory_others_can_write(tmp_path: Path, loose: int):
    d = tmp_path / "run"
    d.mkdir()
    d.chmod(loose)
    with pytest.raises(UnsafeDirectory) as info:
        open_socket_dir(str(d))
    message = str(info.value)
    assert message.startswith(f"refusing the socket directory {d}: it is writable by ")
    assert f"(mode {loose:04o}), so another user could put a socket there; use a directory of your own" in message
    assert mode(d) == loose  # the client changes nothing


def test_open_socket_dir_refuses_a_symlink(tmp_path: Path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(UnsafeDirectory) as info:
        open_socket_dir(str(tmp_path / "link"))
    assert str(info.value).startswith(f"refusing the socket directory {tmp_path / 'link'}: it is a symlink")


def test_open_socket_dir_refuses_another_users_directory(tmp_path: Path):
    if os.geteuid() == 0:  # root can make one; anyone else uses root's own /usr
        target, owner = tmp_path / "theirs", 54321
        target.mkdir(mode=0o700)
        os.chown(target, owner, owner)
    else:
        target, owner = Path("/usr"), 0
    with pytest.raises(UnsafeDirectory) as info:
        open_socket_dir(str(target))
    assert f"it belongs to uid {owner}, not to you (uid {os.getuid()})" in str(info.value)


def test_open_socket_dir_missing_and_through_a_file(tmp_path: Path):
    with pytest.raises(FileNotFoundError):
        open_socket_dir(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        open_socket_dir(str(tmp_path / "file"))
