"""dispatchd inside a rootless Podman container (the engine's defaults, and
the flags packaging/containers/README.md gives for full mode): the mode it
chooses, what it says, and the escape core in that mode.

The container is made from this machine's own files, no image pulled: a root
of a few directories, with /usr and /etc of the host bound read-only, and
this checkout and its venv at their own paths. It runs as the test user
(``--userns=keep-id``: dispatchd refuses root, and the container's root is
the test user anyway). runc, not crun: crun refuses a hybrid cgroup
hierarchy, which this machine kind has. tests/container_inner.py runs inside.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, _refuse_root

RUNC = shutil.which("runc") or "/usr/sbin/runc"
FULL_MODE_FLAGS = ["--security-opt", "unmask=ALL",
                   "--security-opt", f"seccomp={REPO / 'packaging' / 'containers' / 'seccomp.json'}"]


def _rootfs(base: Path) -> Path:
    root = base / "rootfs"
    for d in ("usr", "etc", "proc", "dev", "sys", "run", "tmp", "var", "home/u"):
        (root / d).mkdir(parents=True)
    for link in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink(f"/{link}"):
            (root / link).symlink_to(os.readlink(f"/{link}"))
    return root


def _run(tmp_path: Path, flags: list[str]) -> dict[str, object]:
    _refuse_root()
    venv = Path(sys.prefix).resolve()
    runtime = tmp_path / "xdg-run"
    runtime.mkdir(mode=0o700)
    env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
    mounts = ["-v", "/usr:/usr:ro", "-v", "/etc:/etc:ro", "-v", f"{REPO}:{REPO}:ro"]
    if not str(venv).startswith(str(REPO) + "/"):
        mounts += ["-v", f"{venv}:{venv}:ro"]
    root = _rootfs(tmp_path)
    for target in mounts[1::2]:
        # The mount points, made here as the test user: the runtime would make
        # them as the container's root, a subordinate id, which the test's
        # clean-up could not remove.
        (root / target.split(":")[1].lstrip("/")).mkdir(parents=True, exist_ok=True)
    command = ["podman", "--runtime", RUNC, "run", "--rm", "--userns=keep-id", *flags, *mounts,
               "-e", "HOME=/home/u", "-e", "PYTHONDONTWRITEBYTECODE=1", "-w", str(REPO),
               "--rootfs", str(root), sys.executable, "-P", str(REPO / "tests" / "container_inner.py")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "error" not in found, found
    return found


def test_the_engines_defaults_give_degraded_mode_and_say_why(tmp_path: Path) -> None:
    found = _run(tmp_path, [])
    assert found["container"].startswith("podman")
    # A user namespace can be made there, but /proc/sys is read-only in it: the
    # probe says so (an open would otherwise be refused at the budgets' step).
    assert "/proc/sys is read-only" in found["user_namespaces_note"] and "unmask=ALL" in found["user_namespaces_note"]
    assert found["mode"] == "degraded"
    assert found["worktree"] == "hello\nok\n"  # the allowed twin
    assert found["home"] == "cat: /home/u/secret.txt: Permission denied\n"
    assert found["outside"] == "/bin/bash: line 1: /home/u/planted: Permission denied\n" and not found["planted"]
    assert found["network"] == "errno 1\n"  # EPERM: seccomp refuses the socket itself


def test_the_documented_flags_give_full_mode(tmp_path: Path) -> None:
    found = _run(tmp_path, FULL_MODE_FLAGS)
    assert found["user_namespaces_note"] == "available"
    assert found["mode"] == "full"
    assert found["worktree"] == "hello\nok\n"
    assert found["home"] == "cat: /home/u/secret.txt: No such file or directory\n"
    # The home directory is on the way to the worktree (made below it here):
    # an empty read-only directory in the session's root, as in escape/conftest.py.
    assert found["outside"] == "/bin/bash: line 1: /home/u/planted: Read-only file system\n"
    assert not found["planted"]
    assert found["network"] == "errno 101\n"  # ENETUNREACH: a network namespace with nothing in it


@pytest.fixture(autouse=True)
def _podman() -> None:
    if shutil.which("podman") is None or not os.path.exists(RUNC):
        pytest.fail("podman and runc are installed by scripts/_common.sh (as root): run ./scripts/test as root once",
                    pytrace=False)
