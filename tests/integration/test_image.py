"""The image of packaging/kubernetes/build-image.sh, run as
packaging/kubernetes/daemonset.yaml runs it, under rootless Podman.

The image is built from Debian packages by the script (mmdebstrap in its
unshare mode, as the test user; no image is pulled from a registry) and run
with, for each security setting and volume of the DaemonSet, the podman flags
tests/image_podman.py gives: the user and user namespace, the seccomp profile,
AppArmor, no new privileges, an unmasked /proc, no capabilities, /dev/net/tun,
the worktrees and the socket's directory as host paths (directories of this
test standing for the node's disk), the state as an anonymous volume.

Checked: the daemon chooses full mode and says so, and the manifest's
readiness probe passes; the escape core (tests/escape_core.py) holds in a
session inside the container, and a session with the network on gets out
through slirp4netns; a client on the host reaches the daemon through the socket's
host path, and is refused it when the container's uid is not the host user's
(a pod's with ``hostUsers: false``); and
``dispatch --host-command "podman exec -i CONTAINER dispatch bridge"`` drives
it as an orchestrator's ``kubectl exec`` would.

Building the image takes about two minutes (the Debian archive and PyPI), so
the tree is cached in ~/.cache/dispatchd-image/ under a hash of its inputs
(the script, the project's sources and metadata, this machine's apt sources
and release); a change of any of them builds it anew, and the older tree is
removed. What the Debian archive and PyPI serve can change without the hash:
delete the cache to build from them again. Each run imports the tree into a
Podman storage of its own, removed after it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dispatch
from tests import image_podman
from tests.conftest import REPO, _refuse_root

RUNC = shutil.which("runc") or "/usr/sbin/runc"
CACHE = Path.home() / ".cache" / "dispatchd-image"
BUILD = REPO / "packaging" / "kubernetes" / "build-image.sh"
# What the tree is made of: a change to any of these builds it anew.
INPUTS = ("packaging/kubernetes/build-image.sh", "pyproject.toml", "setup.py", "dispatchd", "client", "policies",
          "systemd")
TESTS_IN_CONTAINER = "/opt/dispatchd-tests"  # the checkout's tests/, read-only: the escape core's code


def _apt_sources() -> list[Path]:
    return [p for p in (Path("/etc/apt/sources.list.d/debian.sources"), Path("/etc/apt/sources.list"),
                        Path("/etc/os-release")) if p.exists()]


def inputs_key() -> str:
    h = hashlib.sha256()
    files: list[Path] = []
    for name in INPUTS:
        p = REPO / name
        files += sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        if "__pycache__" in f.parts or f.suffix in (".so", ".pyc") or ".egg-info" in str(f):
            continue
        h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    for f in _apt_sources():
        h.update(str(f).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def cached_tree(key: str) -> Path:
    """The image's root file system for these inputs: built once, then reused.
    Two runs at once (another checkout's, the same user's cache) take turns:
    the second finds the first's tree."""
    tree = CACHE / f"rootfs-{key}.tar"
    if tree.exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "build.lock", "a", encoding="ascii") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tree.exists():
            return tree
        partial = CACHE / f"rootfs-{key}.tar.partial-{os.getpid()}"
        done = subprocess.run(["bash", str(BUILD), "--tar", str(partial)], capture_output=True, text=True,
                              timeout=1200)
        assert done.returncode == 0, f"build-image.sh failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
        partial.rename(tree)  # whole or not at all: a run that dies leaves a .partial, never a tree
        for old in CACHE.iterdir():
            # Older trees, and partial ones a run that died left (no other builds now: the lock).
            if old != tree and old.name.startswith("rootfs-") and (old.suffix == ".tar" or ".partial-" in old.name):
                old.unlink(missing_ok=True)
    return tree


@dataclass
class Podman:
    base: list[str]  # podman with this run's own storage
    env: dict[str, str]
    image: str = ""

    def __call__(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check:
            assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
        return done

    @property
    def command(self) -> str:
        return shlex.join(self.base)


@dataclass
class Node:
    podman: Podman
    name: str  # the container's
    root: Path  # this test's stand-in for the node's disk
    socket: Path  # the daemon's socket, as the node sees it
    worktrees: Path  # the worktrees' directory, as the node sees it


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Podman, str]]:
    _refuse_root()
    missing = [c for c in ("podman", "mmdebstrap", "newuidmap") if shutil.which(c) is None]
    if missing or not os.path.exists(RUNC):
        pytest.fail(f"{', '.join(missing) or 'runc'} missing: scripts/_common.sh installs podman, runc, uidmap and "
                    "mmdebstrap (as root): run ./scripts/test as root once", pytrace=False)
    base = tmp_path_factory.mktemp("podman")
    runtime = base / "xdg-run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    # overlay, the kernel's own (rootless since 5.13): a container of the
    # image is made and removed at once, where vfs copies its 350 MB each way
    # podman refuses a runroot path over 50 characters (a worker's temporary
    # directory under xdist is longer): a short one of its own under /tmp
    runroot = tempfile.mkdtemp(prefix="dtpm-", dir="/tmp")
    engine = Podman(["podman", "--root", str(base / "storage"), "--runroot", runroot,
                     "--storage-driver", "overlay", "--runtime", RUNC], env)
    key = inputs_key()
    tree = cached_tree(key)
    image = engine.image = f"localhost/dispatchd-test:{key}"
    done = subprocess.run(["bash", str(BUILD), "--import", str(tree), image], capture_output=True, text=True,
                          timeout=600, env=dict(env, DISPATCH_ENGINE=engine.command))
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    try:
        yield engine, image
    finally:
        # The storage holds files of the subordinate ids and mounts of the
        # engine's namespace: the engine removes it (the image first: a reset
        # alone took three times as long here).
        engine("rmi", "--all", "--force", check=False)
        engine("system", "reset", "--force", check=False)
        shutil.rmtree(runroot, ignore_errors=True)


@pytest.fixture(scope="module")
def node(podman: tuple[Podman, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    engine, image = podman
    root = tmp_path_factory.mktemp("node")
    for name, path in image_podman.host_paths().items():
        # as the node's set-up makes them (daemonset.yaml's head)
        image_podman.node_path(root, path).mkdir(parents=True, mode=0o700 if name == "socket" else 0o750)
    env = dict(e.split("=", 1) for e in image_podman.env_flags()[1::2])
    paths = image_podman.host_paths()
    sock = image_podman.node_path(root, paths["socket"]) / os.path.basename(env["DISPATCH_SOCKET"])
    name = f"dispatchd-image-{os.getpid()}"
    pytest_site = sysconfig.get_paths()["purelib"]
    engine("run", "-d", "--name", name,
           *image_podman.security_flags(), *image_podman.volume_flags(root), *image_podman.env_flags(),
           # the test's own: the escape core's code and pytest, read-only
           "-v", f"{REPO / 'tests'}:{TESTS_IN_CONTAINER}/tests:ro", "-v", f"{pytest_site}:{pytest_site}:ro",
           image, *image_podman.args())
    try:
        deadline = time.monotonic() + 60
        while not _answers(sock):
            state = engine("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
            assert state == "running" and time.monotonic() < deadline, (state, engine("logs", name).stderr[-3000:])
            time.sleep(0.1)
        yield Node(engine, name, root, sock, image_podman.node_path(root, paths["worktrees"]))
    finally:
        engine("stop", "-t", "15", name, check=False)
        code = engine("inspect", "--format", "{{.State.ExitCode}}", name, check=False).stdout.strip()
        logs = engine("logs", name, check=False)
        engine("rm", "-f", name, check=False)
    assert code == "0", f"dispatchd exited with {code}:\n{logs.stdout[-2000:]}{logs.stderr[-3000:]}"


def _answers(sock: Path) -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _worktree(node: Node, name: str) -> str:
    """A worktree on the node's disk; its path as the daemon sees it."""
    wt = node.worktrees / name
    wt.mkdir()
    (wt / "README.md").write_text("hello\nworld\n")
    return f"/work/{name}"


def test_the_daemon_runs_as_the_manifest_says_in_full_mode(node: Node) -> None:
    status = node.podman("exec", node.name, "cat", "/proc/1/status").stdout
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["Name"].strip() in ("dispatchd", "python3")  # the entry point, pid 1
    assert fields["Uid"].split()[:2] == ["1000", "1000"] and fields["Gid"].split()[:2] == ["1000", "1000"]
    assert fields["CapEff"].strip() == fields["CapBnd"].strip() == "0000000000000000"  # drop: ALL
    assert fields["NoNewPrivs"].strip() == "1"  # allowPrivilegeEscalation: false
    assert fields["Seccomp"].strip() == "2"  # a filter: the profile given
    # the manifest's readiness probe, as the kubelet would run it
    ready = node.podman("exec", node.name, *image_podman.readiness_probe(), check=False)
    assert ready.returncode == 0, (ready.stdout, ready.stderr)
    check = node.podman("exec", node.name, "dispatchd", "check").stdout
    assert check.startswith("support row A (docs/support.md): full;"), check
    assert "network modes: off, on, ports, domains" in check and "podman" in check
    # The socket's directory on the node: the node's user's (idmapped there,
    # the user's own here), private, as dispatchd demands.
    st = node.socket.parent.stat()
    assert (st.st_uid, st.st_mode & 0o777) == (os.getuid(), 0o700)
    assert node.socket.stat().st_uid == os.getuid()


def test_the_escape_core_holds_in_a_session_inside_and_the_network_stack_works(node: Node) -> None:
    worktree = _worktree(node, "wt-core")
    # HOME is the worktrees' directory: the secret and the planted file are
    # beside the worktree, where other sessions' worktrees are on a node.
    done = node.podman("exec", "-e", "HOME=/work", node.name, "/opt/dispatchd/bin/python3", "-P",
                       f"{TESTS_IN_CONTAINER}/tests/container_inner.py", "--escape-core",
                       "/run/dispatchd/dispatchd.sock", worktree, TESTS_IN_CONTAINER,
                       sysconfig.get_paths()["purelib"], timeout=180)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in found, found["error"]
    assert found["client"].startswith("/opt/dispatchd/")  # the image's client, not the checkout's
    # network off reached nothing outside the session (the core, above); on,
    # through slirp4netns (confined inside the container as outside) and the
    # container's /dev/net/tun, reaches its loopback
    assert found == {"client": found["client"], "mode": "full", "escape_core": "held",
                     "network_on": "slirp4netns connected"}
    assert (node.worktrees / "wt-core" / "written.txt").read_text() == "ok\n"


def test_a_client_on_the_host_reaches_it_through_the_sockets_host_path(node: Node) -> None:
    worktree = _worktree(node, "wt-host")
    with dispatch.connect(str(node.socket)) as client:
        assert client.status()["kernel"]["container"].startswith("podman")
        with client.open_session(worktree) as session:
            assert session.status()["protections"]["mode"] == "full"
            r = session.registry.get("shell_exec").call({"command": "cat README.md && echo ok > written.txt && id -u"})
            assert r.metadata["stdout"] == "hello\nworld\n1000\n", r
    # Written by the pod's uid 1000, the node's user's on the node's disk.
    written = node.worktrees / "wt-host" / "written.txt"
    assert written.read_text() == "ok\n" and written.stat().st_uid == os.getuid()


def test_a_worktree_path_is_the_daemons_not_the_hosts(node: Node) -> None:
    _worktree(node, "wt-path")
    host_path = str(node.worktrees / "wt-path")  # exists here, not in the container
    with dispatch.connect(str(node.socket)) as client:
        with pytest.raises(dispatch.RequestFailed) as refused:
            client.open_session(host_path)
        assert refused.value.code == "bad_worktree" and host_path in str(refused.value), refused.value
        with client.open_session("/work/wt-path") as session:  # the allowed twin
            assert session.registry.get("shell_exec").call({"command": "cat README.md"}).metadata["stdout"] \
                == "hello\nworld\n"


def test_dispatch_bridge_through_podman_exec(node: Node) -> None:
    worktree = _worktree(node, "wt-bridge")
    cli = str(Path(sys.executable).parent / "dispatch")
    host_command = f"{node.podman.command} exec -i {node.name} dispatch bridge"
    done = subprocess.run([cli, "--host-command", host_command, "exec", "--worktree", worktree, "--",
                           "sh", "-c", "cat README.md && echo bridged > written.txt"],
                          capture_output=True, text=True, timeout=120, env=node.podman.env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert done.stdout == "hello\nworld\n"
    assert (node.worktrees / "wt-bridge" / "written.txt").read_text() == "bridged\n"
    # The denied twin: a bridge in a container that runs no daemon answers
    # nothing, and the client says which command and why.
    refused = subprocess.run([cli, "--host-command", f"{node.podman.command} exec -i no-such-{node.name} "
                              "dispatch bridge", "status"], capture_output=True, text=True, timeout=120,
                             env=node.podman.env)
    assert refused.returncode != 0
    assert "no such container" in refused.stderr and "dispatch bridge" in refused.stderr, refused.stderr


def _subordinate_uid_of(uid_in_container: int) -> int:
    """The host uid that rootless Podman's default map gives a container uid
    other than 0 (the user's first subordinate id is the container's 1)."""
    import pwd

    user = pwd.getpwuid(os.getuid()).pw_name
    for line in Path("/etc/subuid").read_text().splitlines():
        name, start, _count = line.split(":")
        if name in (user, str(os.getuid())):
            return int(start) + uid_in_container - 1
    raise AssertionError(f"no subordinate ids for {user} in /etc/subuid")


def test_where_the_pods_uid_is_not_the_node_users_the_socket_is_refused(node: Node, tmp_path: Path) -> None:
    """The denied twin of the host client above, and what a node's process
    meets with hostUsers: false: the container's uid 1000 is a subordinate id
    of the host (the kubelet's range, on a node), so the socket's directory
    is not the host user's and the client refuses it before sending a byte."""
    run_dir = tmp_path / "run-dispatchd"
    run_dir.mkdir(mode=0o700)
    node.podman("unshare", "chown", "1000:1000", str(run_dir))  # as the node's set-up would, for that uid
    flags = [f for setting, fs in image_podman.SECURITY.items() if setting[0] != "spec.hostUsers" for f in fs]
    name = f"{node.name}-mapped"
    engine, image = node.podman, node.podman.image
    engine("run", "-d", "--name", name, *flags, "-v", f"{run_dir}:/run/dispatchd", *image_podman.env_flags(),
           image, *image_podman.args())
    try:
        deadline = time.monotonic() + 60
        while "dispatchd.sock" not in engine("exec", name, "ls", "/run/dispatchd", check=False).stdout:
            assert time.monotonic() < deadline, engine("logs", name).stderr[-3000:]
            time.sleep(0.2)
        with pytest.raises(dispatch.UntrustedSocket) as refused:
            dispatch.connect(str(run_dir / "dispatchd.sock"))
        assert f"it belongs to uid {_subordinate_uid_of(1000)}, not to you (uid {os.getuid()})" in str(refused.value)
        assert "refused before anything was sent" in str(refused.value)
        # inside the pod's user namespace (a sidecar, or dispatch bridge) it serves
        assert engine("exec", name, "dispatch", "--no-autostart", "status", check=False).returncode == 0
    finally:
        engine("rm", "-f", "-t", "5", name, check=False)
        engine("unshare", "rm", "-rf", str(run_dir), check=False)
