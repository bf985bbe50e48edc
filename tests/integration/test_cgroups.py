"""Per-session cgroups: a real daemon managing a delegated cgroup v2 subtree.

``./scripts/test`` run as root (CI) gives the test user a subtree the way
systemd's ``Delegate=yes`` gives one to the service, and names it in
``DISPATCHD_TEST_CGROUP``; each daemon here manages a cgroup of its own under
it (``--cgroup``, the ``cgroup_daemon`` fixture). What a session can try
against its cgroup is in tests/escape/test_cgroups.py.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

import dispatch
from tests.conftest import CGROUP_BASE, Daemon, _refuse_root, cgroup_controllers, shell


def _session_cgroup(session: dispatch.Session) -> str:
    return session.status()["protections"]["limits"]["cgroup"]


def test_status_says_which_cgroup_and_controllers_hold(cgroup_daemon: tuple[dispatch.Client, str], worktree: Path) -> None:
    client, cgroup = cgroup_daemon
    report = client.status()["kernel"]["cgroup_delegation"]
    assert report.startswith(f"in use at {cgroup} (controllers: ")
    offered = [c for c in ("pids", "memory", "cpu") if c in cgroup_controllers(CGROUP_BASE)]
    for controller in ("pids", "memory", "cpu"):
        if controller not in offered:
            assert controller in report.split("not available in", 1)[0], report
    with client.open_session(str(worktree), policy="tight") as s:
        limits = s.status()["protections"]["limits"]
        assert limits["mechanism"] == "cgroup v2 and rlimits"
        assert limits["cgroup"] == f"{cgroup}/session-{s.id}"
        if "pids" in offered:
            assert limits["max_processes"] == "40 (pids.max over the session)"
        else:
            # Said, not hidden: the rlimit is what holds the process count.
            assert "pids" in limits["cgroups"] and "so their limits are rlimits" in limits["cgroups"]
            assert limits["max_processes"] in (40, "40 more than the user ran at open")


def test_every_process_of_the_session_is_in_its_cgroup(cgroup_daemon: tuple[dispatch.Client, str], worktree: Path) -> None:
    client, _ = cgroup_daemon
    with client.open_session(str(worktree)) as s:
        path = _session_cgroup(s)
        mount = client.status()["kernel"]["cgroup2"]
        assert shell(s, "sleep 30 >/dev/null 2>&1", background=True).is_success
        inside = shell(s, "grep '^0::' /proc/self/cgroup; sleep 0.2")
        assert inside.output == f"0::{path[len(mount):]}\n"
        with open(f"{path}/cgroup.procs", encoding="ascii") as f:
            procs = [int(p) for p in f.read().split()]
        # The worker's processes (the tool server, which is the session's pid 1
        # in full mode; the init and the tool server in degraded mode) and the
        # background job's sleep (and its keeper): all of them, all here.
        assert len(procs) >= 2
        assert any(Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"sleep\0") for p in procs)


def test_a_network_switch_keeps_the_cgroup_and_empties_it(cgroup_daemon: tuple[dispatch.Client, str], worktree: Path) -> None:
    client, _ = cgroup_daemon
    with client.open_session(str(worktree), network="on") as s:
        path = _session_cgroup(s)
        job = shell(s, "sleep 300 >/dev/null 2>&1 &", background=True).metadata["job"]
        # Once its command has exited: the job's keeper and the sleep are left.
        while s.registry.get("job_output").call({"job": job, "wait": 1}).metadata["running"]:
            pass
        before = Path(f"{path}/cgroup.procs").read_text().split()
        stack = {p for p in before if _comm(p) in ("slirp4netns", "pasta", "passt")}
        s.set_network(False)
        assert _session_cgroup(s) == path
        after = Path(f"{path}/cgroup.procs").read_text().split()
        if "switched in place" in s.status()["note"]:
            # Full mode: the sandbox stays, its processes (the sleep too) with
            # it; its network stack, which was in the session's cgroup, is gone.
            assert len(stack) == 1, before
            assert after and set(after) == set(before) - stack
        else:
            assert after and not set(before) & set(after)  # the new worker alone


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def test_the_network_stack_is_in_the_sessions_cgroup(cgroup_daemon: tuple[dispatch.Client, str],
                                                     worktree: Path) -> None:
    """Full mode: the session's network stack runs in the session's cgroup,
    so its limits (``pids.max``: a stack taken over cannot fork past them;
    ``memory.max``, ``cpu.weight``) hold it too. The twin: an offline
    session's cgroup holds no stack. Degraded mode has none."""
    client, _ = cgroup_daemon
    with client.open_session(str(worktree), network="on") as on, client.open_session(str(worktree)) as off:
        stacks_on = [p for p in Path(f"{_session_cgroup(on)}/cgroup.procs").read_text().split()
                     if _comm(p) == "slirp4netns"]
        stacks_off = [p for p in Path(f"{_session_cgroup(off)}/cgroup.procs").read_text().split()
                      if _comm(p) == "slirp4netns"]
        if on.status()["protections"]["mode"] == "full":
            assert len(stacks_on) == 1, stacks_on
            assert Path(f"/proc/{stacks_on[0]}/cgroup").read_text().strip().endswith(
                _session_cgroup(on).rsplit("/", 1)[1])
        else:
            assert stacks_on == []
        assert stacks_off == []


def test_a_cgroup_outside_the_hierarchy_stops_the_daemon(tmp_path: Path) -> None:
    _refuse_root()
    proc = subprocess.run([sys.executable, "-m", "dispatchd", "--socket", str(tmp_path / "s.sock"),
                           "--cgroup", str(tmp_path / "not-a-cgroup")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "dispatchd: --cgroup: cannot apply cgroup (" in proc.stderr
    assert "is not inside the cgroup v2 hierarchy at" in proc.stderr


def test_auto_uses_no_cgroup_that_is_not_the_daemons_alone(daemon: Daemon, client: dispatch.Client) -> None:
    # Started by pytest, the daemon shares pytest's cgroup: not its to divide.
    report = client.status()["kernel"]["cgroup_delegation"]
    assert report.startswith("no: ")
    assert "holds other processes than the daemon" in report or "is not delegated to this user" in report


def test_off_says_so(tmp_path: Path, worktree: Path) -> None:
    _refuse_root()
    d = Daemon(tmp_path, "--cgroup", "off")
    try:
        with d.connect() as c:
            assert c.status()["kernel"]["cgroup_delegation"] == "no: not used (--cgroup off)"
            with c.open_session(str(worktree)) as s:
                limits = s.status()["protections"]["limits"]
                assert limits["mechanism"] == "rlimits" and limits["cgroup"] == ""
    finally:
        assert d.stop() == 0, d.log()


def test_auto_takes_a_delegated_cgroup_it_is_alone_in(tmp_path: Path, worktree: Path) -> None:
    """What the systemd service gets: started alone in a cgroup it may write,
    the daemon divides it without being told to."""
    _refuse_root()
    if not CGROUP_BASE:
        pytest.skip("no delegated cgroup v2 subtree: DISPATCHD_TEST_CGROUP is set by ./scripts/test run as root")
    service = f"{CGROUP_BASE}/service-{secrets.token_hex(4)}"
    os.mkdir(service)
    # Like systemd starting the unit: the process enters the cgroup, then execs.
    enter = ("sh", "-c", f'echo $$ > {service}/cgroup.procs && exec "$0" "$@"')
    d = Daemon(tmp_path, prefix=enter)
    try:
        with d.connect() as c:
            assert c.status()["kernel"]["cgroup_delegation"].startswith(f"in use at {service} (controllers: ")
            with c.open_session(str(worktree)) as s:
                assert s.status()["protections"]["limits"]["cgroup"] == f"{service}/session-{s.id}"
                assert shell(s, "grep -c . /proc/self/cgroup >/dev/null && echo ok").output == "ok\n"
            # Its cgroup gone; any other is a sandbox's made ahead (daemon/pool.py) ...
            left = sorted(e for e in os.listdir(service) if os.path.isdir(f"{service}/{e}"))
            assert f"session-{s.id}" not in left and "daemon" in left
            assert all(e.startswith("session-") for e in left if e != "daemon"), left
            daemon_procs = Path(f"{service}/daemon/cgroup.procs").read_text().split()
            assert str(d.proc.pid) in daemon_procs  # moved itself (and its fork server) to the leaf
        # ... and those go with the daemon's stop.
        assert d.stop() == 0, d.log()
        assert sorted(e for e in os.listdir(service) if os.path.isdir(f"{service}/{e}")) == ["daemon"]
    finally:
        assert d.stop() == 0, d.log()
        os.rmdir(f"{service}/daemon")
        os.rmdir(service)
