"""Full mode on a machine where the network stack cannot run: offline sessions.

Two daemons with user namespaces, each lacking what "on" and "ports" need:
"no-stack" runs with a PATH that holds every command of the system's but
the two stacks, slirp4netns and pasta (how the daemon looks for them:
``shutil.which``), "no-tun" with the
network stack's probe opening a file the user cannot open in place of
/dev/net/tun (the daemon's testing option, which can only take the stack
away). In both, sessions with the network off (and "domains", which needs no
stack) open and are confined as anywhere; "on" and "ports" are refused at
open and at a switch, naming what is missing and the command that fixes it,
and ``status`` says which modes are unavailable and why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import REPO, Daemon, _refuse_root, shell
from tests.escape_core import assert_escape_core
from tests.sleeping import with_sleep_after

NO_STACK = ("neither slirp4netns nor pasta is installed (install one: sudo apt install slirp4netns; Fedora, "
            "RHEL: sudo dnf install slirp4netns; or sudo apt install passt; Fedora, RHEL: sudo dnf install passt)")
NO_TUN = ("/dev/net/tun cannot be opened by this user (Permission denied; allow it: sudo chmod 0666 "
          "/dev/net/tun); slirp4netns needs it")
MISSING = {"no-stack": NO_STACK, "no-tun": NO_TUN}
STACK_PROGRAMS = ("slirp4netns", "pasta", "passt")  # passt: pasta's other name


def refusal(mode: str, missing: str) -> str:
    return (f"network {mode!r} needs a user-mode network stack, which cannot run here: {missing}; "
            "network 'off' and 'domains' work without it")


def path_without(directory: Path, names: tuple[str, ...]) -> str:
    """A directory of links to every command on this PATH but ``names``,
    standing in for a system without them."""
    directory.mkdir()
    for folder in os.environ.get("PATH", "/usr/bin:/bin").split(":"):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            link = directory / name
            if name not in names and not link.exists():
                link.symlink_to(os.path.join(folder, name))
    return str(directory)


@pytest.fixture(scope="module", params=["no-stack", "no-tun"])
def offline(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[str, Daemon, dispatch.Client]]:
    _refuse_root()
    if shutil.which("pasta") is None or shutil.which("slirp4netns") is None:
        pytest.fail("slirp4netns and pasta are both installed by the set-up (scripts/_common.sh): the daemons "
                    "below would not test taking them away", pytrace=False)
    base = tmp_path_factory.mktemp(request.param)
    policies = base / "policies"
    shutil.copytree(REPO / "policies", policies)
    (policies / "sleepy.toml").write_text(with_sleep_after("description = 'sleeps at once'\n", 0.1))
    extra: list[str] = ["--policies", str(policies)]
    prefix: tuple[str, ...] = ()
    if request.param == "no-stack":
        prefix = ("env", f"PATH={path_without(base / 'bin', STACK_PROGRAMS)}")
    else:
        tun = base / "tun"
        tun.write_bytes(b"")
        tun.chmod(0)
        extra += ["--tun-for-testing", str(tun)]
    (base / "d").mkdir()
    d = Daemon(base / "d", *extra, prefix=prefix)
    try:
        with d.connect() as c:
            yield request.param, d, c
    finally:
        assert d.stop() == 0, d.log()


def test_an_offline_session_opens_and_is_confined(offline, worktree: Path) -> None:
    _, _, client = offline
    with client.open_session(str(worktree)) as s:
        r = shell(s, "echo hello")
        assert r.is_success and r.metadata["stdout"] == "hello\n"
        assert_escape_core(s, worktree, full=True)
        prot = s.status()["protections"]
        assert prot["mode"] == "full" and prot["network"]["mechanism"] == "network namespace with loopback only"


@pytest.mark.parametrize("mode", ["on", "ports"])
def test_on_and_ports_are_refused_at_open_saying_what_is_missing(offline, worktree: Path, mode: str) -> None:
    kind, _, client = offline
    with pytest.raises(dispatch.RequestFailed) as exc:
        client.open_session(str(worktree), network=True if mode == "on" else mode)
    assert exc.value.message == f"cannot apply network: {refusal(mode, MISSING[kind])}"
    assert client.list_sessions() == []


def test_a_switch_to_on_is_refused_and_the_session_stays_off(offline, worktree: Path) -> None:
    kind, _, client = offline
    with client.open_session(str(worktree)) as s:
        with pytest.raises(dispatch.RequestFailed) as exc:
            s.set_network(True)
        assert exc.value.message.endswith(refusal("on", MISSING[kind])), exc.value.message
        assert s.status()["protections"]["network"]["mode"] == "off"
        assert shell(s, "echo still here").metadata["stdout"] == "still here\n"
        # The allowed twin: a mode that needs no stack is switched to.
        s.set_network("domains", domains=["pypi.org"])
        assert s.status()["network"]["mode"] == "domains"
        assert shell(s, "echo $HTTPS_PROXY").metadata["stdout"] == "http://127.0.0.1:3128\n"


def test_status_says_which_network_modes_are_unavailable_and_why(offline) -> None:
    kind, d, client = offline
    kernel = client.status()["kernel"]
    assert kernel["network_unavailable"] == {"on": refusal("on", MISSING[kind]),
                                             "ports": refusal("ports", MISSING[kind])}
    out = subprocess.run([sys.executable, "-m", "dispatch.cli", "--no-autostart", "--socket", d.socket, "status"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert (f"network modes: off, domains; unavailable: on ({refusal('on', MISSING[kind])}); "
            f"ports ({refusal('ports', MISSING[kind])})") in out.stdout.splitlines()
    # And the daemon said so when it started.
    assert f"event=network_mode_unavailable mode=on why={refusal('on', MISSING[kind])!r}" in d.log()


def test_an_offline_session_sleeps_and_wakes(offline, worktree: Path) -> None:
    """Waking makes a fresh /proc as a detached mount (an anonymous mount
    namespace, counted in the session's user namespace): the budget left for
    the sandbox's own covers it without pasta's."""
    from tests.sleeping import wait_until_asleep

    _, d, client = offline
    with client.open_session(str(worktree), policy="sleepy") as s:
        for _ in range(2):
            wait_until_asleep(client, s.id, log=d.log()[-3000:])
            r = shell(s, "echo awake")
            assert r.is_success and r.metadata["stdout"] == "awake\n", r.error
