"""``dispatchd.systemd`` (notify, listen fds) and ``dispatchd.units`` (the unit
texts, where they go, install and uninstall), without systemd: real sockets
and a temporary directory, nothing else."""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dispatchd import systemd, units
from dispatchd.errors import DispatchdError

REPO = Path(__file__).resolve().parent.parent.parent


# -- notify ------------------------------------------------------------------

@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket standing in for systemd's notify socket, and its path."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    yield sock, path
    sock.close()


@pytest.mark.parametrize(("value", "address"), [
    ("/run/user/1000/systemd/notify", "/run/user/1000/systemd/notify"),
    ("@/org/freedesktop/systemd1/notify/42", "\0/org/freedesktop/systemd1/notify/42"),
    ("@", None),
    ("relative/notify", None),
    ("vsock:2:1234", None),
])
def test_notify_address(value: str, address: str | None) -> None:
    assert systemd.notify_address(value) == address


def test_notify_without_notify_socket_does_nothing() -> None:
    assert systemd.notify("READY=1", env={}) is False
    assert systemd.notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False


def test_notify_sends_one_datagram_to_a_path(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    assert systemd.notify("READY=1", "STATUS=serving", env={"NOTIFY_SOCKET": path}) is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


def test_notify_sends_to_an_abstract_address() -> None:
    name = f"dispatchd-test-notify-{os.getpid()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert systemd.notify("STOPPING=1", env={"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(4096) == b"STOPPING=1"
    finally:
        sock.close()


def test_notify_reads_the_environment_by_default(receiver: tuple[socket.socket, str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert systemd.notify("READY=1") is True
    assert sock.recv(4096) == b"READY=1"
    assert os.environ["NOTIFY_SOCKET"] == path  # kept: the daemon notifies again when it stops


@pytest.mark.parametrize("value", ["relative/notify", "vsock:2:1234"])
def test_notify_to_an_address_it_cannot_use_is_logged_not_raised(
        value: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dispatchd.systemd"):
        assert systemd.notify("READY=1", env={"NOTIFY_SOCKET": value}) is False
    assert "event=notify_failed" in caplog.text and value in caplog.text


def test_notify_to_nobody_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dispatchd.systemd"):
        assert systemd.notify("READY=1", env={"NOTIFY_SOCKET": str(tmp_path / "nobody")}) is False
    assert "event=notify_failed" in caplog.text and "No such file or directory" in caplog.text


@pytest.mark.parametrize("item", ["READY", "READY=1\nSTATUS=x"])
def test_notify_refuses_what_is_not_one_assignment(item: str, receiver: tuple[socket.socket, str]) -> None:
    with pytest.raises(ValueError, match="KEY=VALUE"):
        systemd.notify(item, env={"NOTIFY_SOCKET": receiver[1]})


# -- listen fds --------------------------------------------------------------

@pytest.mark.parametrize(("env", "expected"), [
    ({}, []),
    ({"LISTEN_FDS": "1"}, []),                                   # no LISTEN_PID: not for us
    ({"LISTEN_PID": "7", "LISTEN_FDS": "1"}, []),               # another process's
    ({"LISTEN_PID": "x", "LISTEN_FDS": "1"}, []),
    ({"LISTEN_PID": "100", "LISTEN_FDS": "0"}, []),
    ({"LISTEN_PID": "100", "LISTEN_FDS": "1"}, [(3, "unknown")]),
    ({"LISTEN_PID": "100", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "dispatchd.socket:other"},
     [(3, "dispatchd.socket"), (4, "other")]),
])
def test_parse_listen_fds(env: dict[str, str], expected: list[tuple[int, str]]) -> None:
    assert systemd.parse_listen_fds(env, 100) == expected


@pytest.mark.parametrize(("env", "message"), [
    ({"LISTEN_PID": "100", "LISTEN_FDS": "one"}, "LISTEN_FDS='one'"),
    ({"LISTEN_PID": "100", "LISTEN_FDS": "-1"}, "LISTEN_FDS='-1'"),
    ({"LISTEN_PID": "100", "LISTEN_FDS": "\u00b9"}, "LISTEN_FDS='\u00b9' is not a count"),  # a digit to isdigit, not to int
    ({"LISTEN_PID": "100", "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a"}, "names 1 sockets but LISTEN_FDS=2"),
])
def test_parse_listen_fds_refuses_a_malformed_handover(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        systemd.parse_listen_fds(env, 100)


def test_listen_socket_without_a_handover_is_none_and_clears_the_variables() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x", "HOME": "/home/u"}
    assert systemd.listen_socket(env) is None
    assert env == {"HOME": "/home/u"}  # a stale copy reaches nothing we start


def test_listen_socket_refuses_a_malformed_handover_and_clears_the_variables() -> None:
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "many"}
    with pytest.raises(DispatchdError, match="bad socket activation environment: LISTEN_FDS='many'"):
        systemd.listen_socket(env)
    assert env == {}


def test_listen_socket_refuses_several_sockets() -> None:
    env = {"LISTEN_PID": str(os.getpid()), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "a:b"}
    with pytest.raises(DispatchdError, match=r"passed 2 sockets \(a, b\); dispatchd listens on exactly one"):
        systemd.listen_socket(env)


def test_adopt_listener_takes_a_listening_unix_stream_socket(tmp_path: Path) -> None:
    original = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        original.bind(str(tmp_path / "s"))
        original.listen(1)
        fd = os.dup(original.fileno())
        os.set_inheritable(fd, True)  # as systemd passes it
        adopted = systemd.adopt_listener(fd, "dispatchd.socket")
        try:
            assert adopted.fileno() == fd
            assert adopted.family == socket.AF_UNIX and adopted.type == socket.SOCK_STREAM
            assert os.get_inheritable(fd) is False  # workers and commands do not get it
            assert adopted.getsockname() == str(tmp_path / "s")
        finally:
            adopted.close()
    finally:
        original.close()


def _refused_fd(kind: str, tmp_path: Path) -> int:
    if kind == "pipe":
        r, w = os.pipe()
        os.close(w)
        return r
    sock = {
        "unix stream, not listening": lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM),
        "unix datagram": lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM),
        "tcp listening": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
    }[kind]()
    if kind == "tcp listening":
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
    return sock.detach()


@pytest.mark.parametrize(("kind", "message"), [
    ("pipe", r"fd \d+ \(x\), which is not a socket"),
    ("unix stream, not listening", r"as AF_UNIX/SOCK_STREAM, not listening: dispatchd needs a listening Unix stream"),
    ("unix datagram", r"as AF_UNIX/SOCK_DGRAM, not listening: dispatchd needs"),
    ("tcp listening", r"as AF_INET/SOCK_STREAM: dispatchd needs a listening Unix stream socket"),
])
def test_adopt_listener_refuses_anything_else_and_closes_it(kind: str, message: str, tmp_path: Path) -> None:
    fd = _refused_fd(kind, tmp_path)
    with pytest.raises(DispatchdError, match=message):
        systemd.adopt_listener(fd, "x")
    with pytest.raises(OSError):  # closed (nothing else opened an fd since)
        os.fstat(fd)


# -- units -------------------------------------------------------------------

def test_the_shipped_units_are_the_rendered_ones() -> None:
    """``systemd/`` is the one text of the units: what ``install-units``
    writes for /usr/bin/python3, byte for byte, read through the package's
    link to it (``dispatchd/unit-files``)."""
    assert (REPO / "dispatchd" / "unit-files").resolve() == (REPO / "systemd").resolve()
    for name, text in units.render("/usr/bin/python3").items():
        assert (REPO / "systemd" / name).read_text() == text, name


def test_only_exec_start_names_the_interpreter() -> None:
    shipped = units.render("/usr/bin/python3")
    rendered = units.render("/opt/venv/bin/python")
    assert rendered["dispatchd.socket"] == shipped["dispatchd.socket"]
    assert rendered["dispatchd.service"] == shipped["dispatchd.service"].replace(
        "\nExecStart=/usr/bin/python3 ", "\nExecStart=/opt/venv/bin/python ")
    assert rendered["dispatchd.service"] != shipped["dispatchd.service"]


def _keys(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def test_the_service_unit() -> None:
    service = _keys(units.render("/opt/venv/bin/python")["dispatchd.service"])
    assert service["ExecStart"] == ["/opt/venv/bin/python -P -m dispatchd --socket %t/dispatchd/dispatchd.sock"]
    for key, value in [("Type", "notify"), ("NotifyAccess", "main"), ("Restart", "on-failure"),
                       ("KillMode", "mixed"), ("Delegate", "yes"), ("NoNewPrivileges", "yes"),
                       ("LockPersonality", "yes"), ("RestrictRealtime", "yes"),
                       ("SystemCallArchitectures", "native"), ("Requires", "dispatchd.socket"),
                       ("Also", "dispatchd.socket")]:
        assert service[key] == [value], key
    # Options that need or forbid user namespaces for the service, or W^X, would break the workers.
    for key in ("PrivateUsers", "RestrictNamespaces", "ProtectSystem", "ProtectHome", "PrivateTmp",
                "MemoryDenyWriteExecute", "SystemCallFilter", "RestrictAddressFamilies", "User"):
        assert key not in service, key


def test_the_socket_unit() -> None:
    sock = _keys(units.render("/usr/bin/python3")["dispatchd.socket"])
    assert sock == {"Description": sock["Description"], "ListenStream": ["%t/dispatchd/dispatchd.sock"],
                    "SocketMode": ["0600"], "DirectoryMode": ["0700"], "RemoveOnStop": ["yes"],
                    "WantedBy": ["sockets.target"]}


@pytest.mark.parametrize("name", units.UNIT_NAMES)
def test_every_setting_is_explained(name: str) -> None:
    """Each setting in [Socket] and [Service] sits under a comment saying why
    (one comment may cover the settings right under it)."""
    section, explained = "", False
    for line in units.render("/usr/bin/python3")[name].splitlines():
        if line.startswith("["):
            section, explained = line, False
        elif not line:
            explained = False
        elif line.startswith("#"):
            explained = True
        elif section in ("[Socket]", "[Service]"):
            assert explained, f"{name}: {line} has no comment"


@pytest.mark.parametrize(("path", "word"), [
    ("/usr/bin/python3", "/usr/bin/python3"),
    ("/home/u/src/dispatchd/.venv/bin/python", "/home/u/src/dispatchd/.venv/bin/python"),
    ("/home/u/my venv/bin/python", '"/home/u/my venv/bin/python"'),
    ("/home/u/100%/bin/python", "/home/u/100%%/bin/python"),
    ("/home/u/$HOME/bin/python", "/home/u/$HOME/bin/python"),
])
def test_exec_path(path: str, word: str) -> None:
    assert units.exec_path(path) == word


@pytest.mark.parametrize(("path", "message"), [
    ("python3", "needs an absolute interpreter path"),
    ("", "needs an absolute interpreter path"),
    ('/home/u/"q"/bin/python', "systemd refuses '\"'"),
    ("/home/u/a\\b/bin/python", r"systemd refuses '\\\\'"),
    ("/home/u/a\nb/bin/python", r"systemd refuses '\\n'"),
])
def test_exec_path_refuses_what_systemd_cannot_run(path: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        units.exec_path(path)


def test_render_keeps_the_interpreter_path_as_given(tmp_path: Path) -> None:
    """A venv's bin/python is a symlink: its target would run without the venv."""
    link = tmp_path / "bin" / "python"
    link.parent.mkdir()
    link.symlink_to("/usr/bin/python3")
    assert f"\nExecStart={link} -P -m dispatchd " in units.render(str(link))["dispatchd.service"]


@pytest.mark.parametrize(("env", "expected"), [
    ({"XDG_CONFIG_HOME": "/cfg"}, "/cfg/systemd/user"),
    ({"XDG_CONFIG_HOME": "relative"}, "~/.config/systemd/user"),  # not absolute: ignored, as XDG says
    ({"XDG_CONFIG_HOME": ""}, "~/.config/systemd/user"),
    ({}, "~/.config/systemd/user"),
])
def test_user_unit_dir(env: dict[str, str], expected: str) -> None:
    assert units.user_unit_dir(env) == Path(os.path.expanduser(expected))


def test_install_writes_and_replaces_the_units(tmp_path: Path) -> None:
    directory = tmp_path / "config" / "systemd" / "user"
    assert units.install(directory, units.render("/old/venv/bin/python")) == [
        directory / "dispatchd.socket", directory / "dispatchd.service"]
    texts = units.render("/new/venv/bin/python")
    units.install(directory, texts)
    for name, text in texts.items():
        assert (directory / name).read_text() == text
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o644
    assert sorted(p.name for p in directory.iterdir()) == ["dispatchd.service", "dispatchd.socket"]  # no temp left


def test_uninstall_removes_the_units_and_their_enable_links_only(tmp_path: Path) -> None:
    directory = tmp_path / "user"
    units.install(directory, units.render("/usr/bin/python3"))
    wants = directory / "sockets.target.wants"
    wants.mkdir()
    (wants / "dispatchd.socket").symlink_to(directory / "dispatchd.socket")  # as `systemctl --user enable` does
    (wants / "other.socket").symlink_to(directory / "other.socket")
    (directory / "other.service").write_text("[Service]\nExecStart=/bin/true\n")
    (directory / "dispatchd.service.d").mkdir()  # your drop-ins stay yours
    assert units.uninstall(directory) == [wants / "dispatchd.socket", directory / "dispatchd.socket",
                                          directory / "dispatchd.service"]
    assert sorted(str(p.relative_to(directory)) for p in directory.rglob("*")) == [
        "dispatchd.service.d", "other.service", "sockets.target.wants", "sockets.target.wants/other.socket"]
    assert units.uninstall(directory) == []
