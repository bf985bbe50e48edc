"""A session against its own cgroup: leaving it, loosening it, outliving it.

Where the daemon has a delegated cgroup v2 subtree (``cgroup_daemon`` in
tests/conftest.py), every process of a session is born in the session's
cgroup. These attempts try to get out of it, raise its limits, or survive the
session's end; each has its allowed twin. Where the subtree offers no ``pids``
controller (a hybrid hierarchy keeps it in cgroup v1), the fork bomb is held
by the rlimit, and the daemon says so (tests/integration/test_cgroups.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import dispatch
from tests.conftest import CGROUP_BASE, cgroup_controllers, gone, shell, sleepers, wait_until


def _session_cgroup(session: dispatch.Session) -> str:
    return session.status()["protections"]["limits"]["cgroup"]


@pytest.mark.parametrize("target", ["own cgroup.procs", "parent's cgroup.procs", "own cgroup.max.descendants"])
def test_a_session_cannot_leave_or_loosen_its_cgroup(cgroup_daemon: tuple[dispatch.Client, str], worktree: Path,
                                                     target: str) -> None:
    client, cgroup = cgroup_daemon
    with client.open_session(str(worktree)) as s:
        path = _session_cgroup(s)
        file = {"own cgroup.procs": f"{path}/cgroup.procs",
                "parent's cgroup.procs": f"{cgroup}/daemon/cgroup.procs",
                "own cgroup.max.descendants": f"{path}/cgroup.max.descendants"}[target]
        value = "max" if target.endswith("descendants") else "0"
        full = s.status()["protections"]["namespaces"]["mount"]
        denied = shell(s, f"echo {value} > {file}")
        # Full mode: the cgroup filesystem is not in the session's root at all;
        # degraded mode: Landlock refuses it.
        reason = "No such file or directory" if full else "Permission denied"
        assert denied.metadata["exit_code"] == 1 and f"{file}: {reason}" in denied.metadata["stderr"]
        if target.endswith("descendants"):
            # The twin: the same user outside the session may write it, so the
            # refusal above is the sandbox's, not the file's mode.
            Path(file).write_text("max")
            assert Path(file).read_text() == "max\n"
        else:
            assert os.access(file, os.W_OK)


def test_closing_a_session_ends_whatever_left_its_process_tree(cgroup_daemon: tuple[dispatch.Client, str],
                                                                worktree: Path) -> None:
    client, _ = cgroup_daemon
    s = client.open_session(str(worktree))
    path = _session_cgroup(s)
    # Double fork and a new session: no longer below the command that started it.
    shell(s, "setsid sh -c 'sleep 317 &' </dev/null >/dev/null 2>&1", background=True)
    assert wait_until(lambda: len(sleepers("317")) == 1), sleepers("317")  # the control: it runs
    s.close()
    assert not os.path.exists(path)
    assert gone(lambda: sleepers("317"))


def test_a_fork_bomb_stops_at_pids_max_or_the_rlimit(cgroup_daemon: tuple[dispatch.Client, str], worktree: Path,
                                                     tmp_path: Path) -> None:
    client, _ = cgroup_daemon
    with client.open_session(str(worktree), policy="tight") as s:
        path = _session_cgroup(s)
        control = shell(s, "for i in $(seq 10); do sleep 0.2 & done; wait; echo ten")
        assert control.metadata.get("stdout") == "ten\n", control
        bomb = shell(s, "bomb() { bomb | bomb & }; bomb; sleep 2; echo survived", timeout=8)
        assert "fork: Resource temporarily unavailable" in bomb.metadata["stderr"] or \
               "fork: retry" in bomb.metadata["stderr"], bomb.metadata["stderr"][-500:]
        if "pids" in cgroup_controllers(CGROUP_BASE):
            events = Path(f"{path}/pids.events").read_text()
            assert events.startswith("max ") and events.split()[1] != "0", events
        other = tmp_path / "other"
        other.mkdir()
        with client.open_session(str(other)) as t:
            assert shell(t, "echo alive").output == "alive\n"
