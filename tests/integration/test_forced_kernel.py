"""Older kernels, simulated: one daemon per forced kernel probe.

Each daemon is started with ``--force-kernel-for-testing`` (testing only: it
can take features away, never add one): Landlock ABI 1 to 7, with user
namespaces (full mode) and without (degraded mode, what Ubuntu's AppArmor
restriction leaves), no Landlock at all, and no binding from a detached
mount tree (kernels before 6.15). For each: the mode chosen and what
``status`` says it leaves open; the escape core in that mode (the home
directory unreadable, writes outside the worktree refused, network off
reaching nothing); that the older ruleset is the one in force, by a telltale
each ABI step changes (a rename across directories refused under ABI 1,
``truncate()`` by path not checked before ABI 3, a device's ioctls not
checked before ABI 5, signals to the user's other processes not scoped
before ABI 6); and that a policy needing what the
forced kernel lacks is refused, naming it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, probe, shell
from tests.escape_core import assert_escape_core

FULL = [f"landlock={abi}" for abi in range(1, 8)] + ["detached_mounts=no"]
DEGRADED = [f"landlock={abi},user_namespaces=no" for abi in range(1, 8)]
POLICIES = {
    "needs6": "description = 'needs Landlock ABI 6'\n[sandbox]\nmin_landlock_abi = 6\n",
    "required": "description = 'needs user namespaces'\n[sandbox]\nuser_namespaces = \"required\"\n",
}


class Forced:
    def __init__(self, spec: str, daemon: Daemon, client: dispatch.Client) -> None:
        self.spec = spec
        self.daemon = daemon
        self.client = client
        self.full = "user_namespaces=no" not in spec
        self.abi = int(spec.split("landlock=")[1].split(",")[0]) if "landlock=" in spec else 7


@pytest.fixture(scope="module", params=FULL + DEGRADED)
def forced(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Forced]:
    _refuse_root()
    base = tmp_path_factory.mktemp("forced")
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    for name, text in POLICIES.items():
        (policies / f"{name}.toml").write_text(text)
    (base / "d").mkdir()
    # No pool: a sandbox made ahead is planned alike, and each costs CPU here.
    d = Daemon(base / "d", "--policies", str(policies), "--pool", "0", "--force-kernel-for-testing", request.param)
    try:
        with d.connect() as c:
            if c.status()["kernel"]["landlock_abi"] < Forced(request.param, d, c).abi:
                pytest.skip("this kernel's Landlock is older than the one to force")
            yield Forced(request.param, d, c)
    finally:
        assert d.stop() == 0, d.log()


def test_the_mode_chosen_and_what_status_says(forced: Forced, worktree: Path) -> None:
    kernel = forced.client.status()["kernel"]
    assert kernel["forced_for_testing"] == forced.spec and kernel["landlock_abi"] == forced.abi
    assert kernel["user_namespaces"] is forced.full
    if forced.spec == "detached_mounts=no":
        # The host's root waits below the new one (OLD_ROOT) until the
        # session's binds, then is detached: nothing of it is left.
        assert kernel["host_tree_missing"].startswith("binding from a detached copy of the mount tree: forced off")
        assert "event=host_tree by_descriptor=False" in forced.daemon.log()
        with forced.client.open_session(str(worktree)) as s:
            r = shell(s, "ls -d /tmp; ls -d /.host")
            assert r.metadata["stderr"] == "ls: cannot access '/.host': No such file or directory\n"
            assert r.metadata["stdout"] == "/tmp\n"
    with forced.client.open_session(str(worktree)) as s:
        prot = s.status()["protections"]
        assert prot["landlock"]["abi"] == forced.abi
        assert prot["landlock"]["scopes"] == (["abstract_unix_socket", "signal"] if forced.abi >= 6 else [])
        assert prot["namespaces"] == {n: forced.full for n in ("user", "mount", "pid", "net")}
        gaps = " | ".join(prot["leaves_open"])
        assert prot["mode"] == ("full" if forced.full and forced.abi >= 6 else "degraded")
        assert ("no Landlock scopes (ABI < 6)" in gaps) is (forced.full and forced.abi < 6)
        assert ("signals: the session can signal every process of the user's" in gaps) is (
            not forced.full and forced.abi < 6)
        assert ("truncate() of files the user owns" in gaps) is (not forced.full and forced.abi < 3)
        assert ("network off is held by seccomp alone" in gaps) is (not forced.full and forced.abi < 4)
        assert ("chmod, chown, utime and xattr changes" in gaps) is (not forced.full)
        if forced.full:
            assert prot["network"]["mechanism"] == "network namespace with loopback only"
        else:
            assert prot["network"]["mechanism"] == ("seccomp: no IPv4/IPv6 sockets"
                                                    + (", Landlock: no TCP bind/connect" if forced.abi >= 4 else ""))
    out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--no-autostart", "--socket", forced.daemon.socket,
                          "status"], capture_output=True, text=True, timeout=30)
    assert (f"kernel features forced for testing (--force-kernel-for-testing {forced.spec}): sessions are "
            "planned and confined as on a kernel without them") in out.stdout.splitlines()


def test_the_escape_core_holds(forced: Forced, worktree: Path) -> None:
    with forced.client.open_session(str(worktree)) as s:
        assert_escape_core(s, worktree, full=forced.full)


def test_the_older_ruleset_is_the_one_in_force(forced: Forced, worktree: Path, tmp_path: Path) -> None:
    """Telltales of the forced ABI, enforced by this (newer) kernel all the same."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "tool.txt").write_text("a file of the user's on a read-only path\n")
    target = Path(os.path.realpath(extra / "tool.txt"))
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        with forced.client.open_session(str(worktree), read_only=[str(extra)]) as s:
            # REFER (ABI 2): under ABI 1 every reparenting is refused, even in
            # the worktree (rename(2) itself: mv would fall back to a copy).
            assert shell(s, "mkdir a b && echo x > a/f").is_success
            code = ("import os\ntry:\n    os.rename('a/f', 'b/f'); print('renamed')\n"
                    "except OSError as e:\n    print('error', e.strerror)\n")
            assert probe(s, code) == ("renamed" if forced.abi >= 2 else "error Invalid cross-device link")
            assert (worktree / "b" / "f").exists() is (forced.abi >= 2)
            # TRUNCATE (ABI 3): truncate() by path is not checked before it;
            # in full mode the read-only mount refuses it whatever the ABI.
            code = (f"import os\ntry:\n    os.truncate({str(target)!r}, 0); print('truncated')\n"
                    "except OSError as e:\n    print('error', e.strerror)\n")
            expected = ("error Read-only file system" if forced.full
                        else "truncated" if forced.abi < 3 else "error Permission denied")
            assert probe(s, code) == expected
            assert (target.read_text() == "") is (expected == "truncated")
            # IOCTL_DEV (ABI 5): a device's ioctls, refused unless granted (the
            # policy grants /dev/null reading and writing only); before, the
            # device itself answers (a terminal request to /dev/null: ENOTTY).
            code = ("import fcntl, termios\ntry:\n"
                    "    with open('/dev/null', 'rb') as f:\n"
                    "        fcntl.ioctl(f, termios.TCGETS, bytes(64)); print('answered')\n"
                    "except OSError as e:\n    print('error', e.strerror)\n")
            assert probe(s, code) == ("error Permission denied" if forced.abi >= 5
                                      else "error Inappropriate ioctl for device")
            # Signals (ABI 6 scopes): a process of the user's outside the session.
            code = (f"import os\ntry:\n    os.kill({sleeper.pid}, 0); print('signalled')\n"
                    "except OSError as e:\n    print('error', e.strerror)\n")
            expected = ("error No such process" if forced.full  # not in its pid namespace
                        else "signalled" if forced.abi < 6 else "error Operation not permitted")
            assert probe(s, code) == expected
    finally:
        sleeper.send_signal(signal.SIGKILL)
        sleeper.wait()


def test_what_the_forced_kernel_lacks_is_refused_by_name(forced: Forced, worktree: Path) -> None:
    c = forced.client
    if forced.abi < 6:
        with pytest.raises(dispatch.RequestFailed) as exc:
            c.open_session(str(worktree), policy="needs6")
        assert exc.value.message == (f"cannot apply landlock: policy 'needs6' needs Landlock ABI >= 6; "
                                     f"this kernel offers: ABI {forced.abi}")
    else:
        c.open_session(str(worktree), policy="needs6").close()
    if forced.full:
        c.open_session(str(worktree), policy="required").close()
        c.open_session(str(worktree), network="domains", domains=["pypi.org"]).close()
        return
    with pytest.raises(dispatch.RequestFailed) as exc:
        c.open_session(str(worktree), policy="required")
    assert exc.value.message == ("cannot apply namespaces: policy 'required' requires user namespaces: "
                                 "forced off for testing")
    with pytest.raises(dispatch.RequestFailed) as exc:
        c.open_session(str(worktree), network="domains", domains=["pypi.org"])
    assert exc.value.message.startswith("cannot apply network: network 'domains' needs a network namespace")
    if forced.abi < 4:
        with pytest.raises(dispatch.RequestFailed) as exc:
            c.open_session(str(worktree), network="ports")
        assert exc.value.message == ("cannot apply network: network 'ports' needs Landlock TCP rules (ABI 4); "
                                     f"this kernel offers ABI {forced.abi}")
    else:
        c.open_session(str(worktree), network="ports").close()
    assert c.list_sessions() == []


def _start(tmp_path: Path, spec: str) -> subprocess.CompletedProcess[str]:
    """A daemon started with the forced kernel ``spec``, expected to stop at once."""
    _refuse_root()
    return subprocess.run([sys.executable, "-m", "dispatchd", "--socket", str(tmp_path / "s.sock"),
                           "--force-kernel-for-testing", spec], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})


def test_a_kernel_without_landlock_opens_nothing(tmp_path: Path) -> None:
    out = _start(tmp_path, "landlock=0")
    assert out.returncode == 1
    assert out.stderr.endswith("dispatchd: this kernel has no Landlock (CONFIG_SECURITY_LANDLOCK, lsm=landlock): "
                               "sessions cannot be confined, so none will be opened.\n"), out.stderr
    assert not (tmp_path / "s.sock").exists()


def test_the_option_only_takes_away(tmp_path: Path) -> None:
    out = _start(tmp_path, "landlock=99")
    assert out.returncode == 2
    last = out.stderr.splitlines()[-1]  # after the start's log lines
    assert last.startswith("dispatchd: --force-kernel-for-testing: landlock=99: this kernel offers ABI ")
    assert last.endswith("; forcing only takes away")


def test_network_on_goes_out_through_slirp4netns_confined_for_that_kernel(forced: Forced, worktree: Path) -> None:
    """Full mode: the stack's Landlock ruleset is planned for the forced ABI
    (its handled rights and scopes, as that kernel would take them) and still
    lets slirp4netns start and carry the session to the host's loopback.
    Degraded mode has no stack: "on" is the host's network (the twin)."""
    from tests.listeners import Greeter

    server = Greeter()
    host = "10.0.2.2" if forced.full else "127.0.0.1"
    try:
        with forced.client.open_session(str(worktree), network="on") as s:
            code = (f"import socket; c = socket.create_connection(({host!r}, {server.port}), "
                    "timeout=10); print('connected', c.recv(16).decode())")
            assert probe(s, code) == "connected hello"
            assert s.status()["protections"]["network"].get("stack", "") == ("slirp4netns" if forced.full else "")
    finally:
        server.close()
