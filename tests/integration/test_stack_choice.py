"""Which user-mode stack a daemon runs, on machines that have one or the other.

Simulated as tests/integration/test_offline.py simulates a machine without
either: a PATH that holds every command of the system's but one stack. Each
daemon says in ``status`` which stack its sessions go out through, and a
network-on session reaches the host's loopback at the gateway through it; a
stack asked for by name (``--network-stack``) that is not there is named,
with the package that installs it, and the other is not taken instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import Daemon, _refuse_root, probe
from tests.listeners import Greeter
from tests.integration.test_offline import path_without

OTHER = {"slirp4netns": ("pasta", "passt"), "pasta": ("slirp4netns",)}  # passt: pasta's other name
NO_PASTA = "pasta is not installed (install it: sudo apt install passt; Fedora, RHEL: sudo dnf install passt)"


@pytest.fixture(scope="module")
def greeter() -> Iterator[int]:
    """A TCP listener on the host's loopback greeting each client: its port."""
    served = Greeter()
    yield served.port
    served.close()


def _daemon(base: Path, without: tuple[str, ...], *extra: str) -> Daemon:
    _refuse_root()
    (base / "d").mkdir()
    return Daemon(base / "d", *extra, prefix=("env", f"PATH={path_without(base / 'bin', without)}"))


@pytest.mark.parametrize("installed", ["slirp4netns", "pasta"])
def test_auto_takes_the_stack_that_is_installed(tmp_path: Path, worktree: Path, greeter: int, installed: str) -> None:
    d = _daemon(tmp_path, OTHER[installed])
    try:
        with d.connect() as client:
            kernel = client.status()["kernel"]
            assert (kernel["network_stack"], kernel["network_stack_missing"]) == (installed, "")
            with client.open_session(str(worktree), network="on") as s:
                code = (f"import socket; s = socket.create_connection(('10.0.2.2', {greeter}), timeout=10); "
                        "print('connected', s.recv(16).decode())")
                assert probe(s, code) == "connected hello"
                assert s.status()["protections"]["network"]["stack"] == installed
    finally:
        assert d.stop() == 0, d.log()


def test_a_stack_asked_for_by_name_and_missing_is_named_and_not_replaced(tmp_path: Path, worktree: Path) -> None:
    d = _daemon(tmp_path, ("pasta", "passt"), "--network-stack", "pasta")
    try:
        with d.connect() as client:
            kernel = client.status()["kernel"]
            assert (kernel["network_stack"], kernel["network_stack_missing"]) == ("", NO_PASTA)
            with pytest.raises(dispatch.RequestFailed) as exc:
                client.open_session(str(worktree), network="on")
            assert exc.value.message == (f"cannot apply network: network 'on' needs a user-mode network stack, which "
                                         f"cannot run here: {NO_PASTA}; network 'off' and 'domains' work without it")
            # The twin: slirp4netns is installed here, and "auto" would have taken it.
            with client.open_session(str(worktree)) as s:
                assert s.status()["protections"]["network"]["mode"] == "off"
    finally:
        assert d.stop() == 0, d.log()


def test_slirp4netns_dns_forwarder_answers_nothing_and_the_relay_resolves(tmp_path: Path, worktree: Path,
                                                                          greeter: int) -> None:
    """slirp4netns's own DNS forwarder (10.0.2.3) would read the host's
    resolv.conf, which Landlock keeps from it: a query there gets no answer
    and leaves the stack serving. The session's resolver is the daemon's
    relay, named by its /etc/resolv.conf (docs/dns.md)."""
    _refuse_root()
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--network-stack", "slirp4netns")
    query = ("import socket\n"
             "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1)\n"
             "s.sendto(bytes.fromhex('123401000001000000000000076578616d706c6503636f6d0000010001'), "
             "('10.0.2.3', 53))\n"
             "try:\n    print('answer', len(s.recv(512)))\nexcept TimeoutError:\n    print('no answer')\n")
    try:
        with d.connect() as client, client.open_session(str(worktree), network="on") as s:
            assert probe(s, query) == "no answer"
            assert probe(s, "print([l for l in open('/etc/resolv.conf') if l.startswith('nameserver')])") == \
                "['nameserver 127.0.0.53\\n']"
            code = (f"import socket; c = socket.create_connection(('10.0.2.2', {greeter}), timeout=10); "
                    "print('connected', c.recv(16).decode())")
            assert probe(s, code) == "connected hello"  # the twin: the stack still serves
    finally:
        assert d.stop() == 0, d.log()


def test_a_slirp4netns_without_the_options_it_is_started_with_is_passed_over_naming_them(
        tmp_path: Path, worktree: Path, greeter: int) -> None:
    """slirp4netns before 0.4.0 lacks --enable-seccomp, --netns-type and
    --userns-path (0.3.3 refuses the first: every network-on open failed,
    though the probe had taken it). The probe reads them from the
    executable: "auto" takes pasta, and slirp4netns asked for by name is
    refused saying what it lacks. Stood in for by an executable that names
    none of them (``true``); the twin: the real one, in the tests above."""
    _refuse_root()
    bindir = tmp_path / "bin"
    path = path_without(bindir, ("slirp4netns",))
    (bindir / "slirp4netns").symlink_to(os.path.realpath(shutil.which("true") or "/bin/true"))
    lacks = ("slirp4netns (" + str(bindir / "slirp4netns") + ") lacks --configure, --mtu, --ready-fd, "
             "--enable-seccomp, --netns-type, --userns-path, which dispatchd starts it with (slirp4netns 0.4.0 "
             "and later have them: upgrade it, or use --network-stack pasta)")
    for choice, expected in (("auto", ("pasta", "")), ("slirp4netns", ("", lacks))):
        (tmp_path / choice).mkdir()
        d = Daemon(tmp_path / choice, "--network-stack", choice, prefix=("env", f"PATH={path}"))
        try:
            with d.connect() as client:
                kernel = client.status()["kernel"]
                assert (kernel["network_stack"], kernel["network_stack_missing"]) == expected
                if choice == "auto":
                    with client.open_session(str(worktree), network="on") as s:
                        code = (f"import socket; c = socket.create_connection(('10.0.2.2', {greeter}), timeout=10); "
                                "print('connected', c.recv(16).decode())")
                        assert probe(s, code) == "connected hello"
                        assert s.status()["protections"]["network"]["stack"] == "pasta"
                else:
                    with pytest.raises(dispatch.RequestFailed) as exc:
                        client.open_session(str(worktree), network="on")
                    assert exc.value.message == (f"cannot apply network: network 'on' needs a user-mode network "
                                                 f"stack, which cannot run here: {lacks}; network 'off' and "
                                                 "'domains' work without it")
        finally:
            assert d.stop() == 0, d.log()


def test_a_slirp4netns_built_elsewhere_loads_its_libraries_from_there(tmp_path: Path, worktree: Path,
                                                                      greeter: int) -> None:
    """slirp4netns built into /opt or a home directory finds libslirp there
    through its RUNPATH, outside the system's directories its Landlock rules
    granted: it could not load it ("Permission denied"), and every
    network-on open failed though the probe had taken it. The daemon now
    lists what it loads (its loader's ``--list``) and grants those files.
    Stood in for by a copy of the system's slirp4netns and libslirp under
    the test's directory, the copy's RUNPATH set to the library's copy
    (patchelf); the stack is seen running with that copy mapped. The twin
    (the packaged one, every library in the system's directories) is in the
    tests above."""
    _refuse_root()
    if shutil.which("patchelf") is None:
        pytest.fail("patchelf is installed by the set-up (scripts/_common.sh)", pytrace=False)
    system = os.path.realpath(shutil.which("slirp4netns") or "slirp4netns")
    listed = subprocess.run(["ldd", system], capture_output=True, text=True, check=True).stdout
    libslirp = next(line.split("=>")[1].split()[0] for line in listed.splitlines() if "libslirp.so" in line)
    built = tmp_path / "built"
    (built / "bin").mkdir(parents=True)
    (built / "lib").mkdir()
    shutil.copy(system, built / "bin" / "slirp4netns")
    shutil.copy(os.path.realpath(libslirp), built / "lib" / os.path.basename(libslirp))
    subprocess.run(["patchelf", "--set-rpath", str(built / "lib"), str(built / "bin" / "slirp4netns")], check=True)
    ours = subprocess.run(["ldd", str(built / "bin" / "slirp4netns")], capture_output=True, text=True, check=True)
    assert str(built / "lib" / os.path.basename(libslirp)) in ours.stdout, ours.stdout  # the copy is what loads
    bindir = tmp_path / "bin"
    path = path_without(bindir, ("slirp4netns",))
    (bindir / "slirp4netns").symlink_to(built / "bin" / "slirp4netns")
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--network-stack", "slirp4netns", prefix=("env", f"PATH={path}"))
    try:
        with d.connect() as client:
            kernel = client.status()["kernel"]
            assert (kernel["network_stack"], kernel["network_stack_missing"]) == ("slirp4netns", "")
            with client.open_session(str(worktree), network="on") as s:
                code = (f"import socket; c = socket.create_connection(('10.0.2.2', {greeter}), timeout=10); "
                        "print('connected', c.recv(16).decode())")
                assert probe(s, code) == "connected hello"
                assert s.status()["protections"]["network"]["stack"] == "slirp4netns"
                # This session's, and those of sandboxes made ahead: each one the copy, with its library.
                # A made-ahead sandbox's stack may end while it is read (the pool replaces it): those
                # are left out; this session's stays while the session is open, so one is always read.
                stacks = _stacks_read(d.proc.pid)
                assert stacks and {exe for exe, _ in stacks} == {str(built / "bin" / "slirp4netns")}
                for _, mapped in stacks:
                    assert str(built / "lib" / os.path.basename(libslirp)) in mapped, mapped
    finally:
        assert d.stop() == 0, d.log()


def _stacks_read(daemon: int) -> list[tuple[str, set[str]]]:
    """Each slirp4netns below the daemon: its executable and the files it maps,
    the ones that end while read left out."""
    read = []
    for p in psutil.Process(daemon).children(recursive=True):
        try:
            if p.name() == "slirp4netns":
                read.append((p.exe(), {m.path for m in p.memory_maps()}))
        except psutil.NoSuchProcess:
            continue
    return read
