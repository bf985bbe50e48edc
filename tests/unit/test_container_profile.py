"""packaging/containers/seccomp.json: a container engine's seccomp profile
for dispatchd's full mode. Every name it refuses is a system call libseccomp
knows (a typo would be skipped by the engine, silently), and none of the
calls the daemon's full mode is made of is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
PROFILE = json.loads((REPO / "packaging" / "containers" / "seccomp.json").read_text())
# What full mode is made of (confine/namespaces.py, mounts.py, landlock.py,
# seccomp.py, the network stack's setns).
NEEDED = ["unshare", "clone", "clone3", "setns", "mount", "umount2", "pivot_root", "open_tree", "move_mount",
          "mount_setattr", "fsopen", "fsconfig", "fsmount", "landlock_create_ruleset", "landlock_add_rule",
          "landlock_restrict_self", "seccomp", "prctl", "pidfd_open", "pidfd_send_signal"]


def _denied() -> list[str]:
    return [name for rule in PROFILE["syscalls"] for name in rule["names"]]


def test_it_allows_by_default_and_refuses_with_eperm() -> None:
    assert PROFILE["defaultAction"] == "SCMP_ACT_ALLOW"
    assert {(r["action"], r["errnoRet"]) for r in PROFILE["syscalls"]} == {("SCMP_ACT_ERRNO", 1)}


@pytest.mark.parametrize("name", NEEDED)
def test_full_mode_is_not_refused(name: str) -> None:
    assert name not in _denied()


@pytest.mark.process  # loading libseccomp: ctypes.util.find_library runs ldconfig
def test_every_refused_name_is_a_system_call() -> None:
    import pyseccomp as sc

    filt = sc.SyscallFilter(sc.ALLOW)
    for name in _denied():
        filt.add_rule(sc.ERRNO(1), name)  # raises on a name libseccomp does not know
    with pytest.raises(Exception):
        filt.add_rule(sc.ERRNO(1), "no_such_call")  # the twin: a wrong name is caught
