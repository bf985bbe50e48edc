"""Sandboxes made ahead (dispatchd/daemon/pool.py) as an attacker meets them.

A sandbox made ahead holds the host's root below its own until it is given
its session; after that it must be exactly what a sandbox made at open is:
the same mounts, nothing of the host's root. While it waits, nothing of a
session's reaches it: a session in a pid namespace cannot name it, one
without (degraded mode) cannot signal it (Landlock's signal scope). Every
other escape test in full mode runs in a sandbox made ahead (the escape
conftest's ``session``). In woken mode the same tests compare a session
made ahead that slept and woke with one made at open. The tests of a
sandbox still waiting in the pool (``pooled_daemon``) have no woken variant:
such a sandbox has no session yet, so nothing of it can sleep.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import Daemon, daemon_with_nons, wait_for_pool
from tests.escape.attempts import ENOENT, EPERM, ESRCH, attempt, attempt_outside
from tests.escape.conftest import Sandbox

_MOUNTS = """
fields = [line.split(" - ")[0].split() for line in open("/proc/self/mountinfo")]
result = sorted(f[4] for f in fields)
"""


def _mount_points(session: dispatch.Session, scratch_of: str) -> list[str]:
    out = attempt(session, _MOUNTS)
    assert out.startswith("OK "), out
    points = eval(out[3:])  # noqa: S307 (our own probe's repr of a list of str)
    # The scratch directory's path names the session: the same place in both.
    return [p.replace(scratch_of, "<scratch>") for p in points]


def _scratch(session: dispatch.Session) -> str:
    rows = session.status()["protections"]["root"]
    return next(r["path"] for r in rows if "the session's scratch: HOME" in r["how"])


def test_a_sandbox_made_ahead_is_the_same_view_as_one_made_at_open(
    sandbox: Sandbox, client: dispatch.Client, worktree: Path, tmp_path: Path,
) -> None:
    """Full mode: the session's mount table, once adopted, lists exactly what
    a sandbox made at open lists (nothing of the host's root left below, no
    ``/.host``); the twin is a daemon without a pool, on the same worktree.
    Woken: the same, read after the session slept and woke (a fresh
    ``/proc`` of its new pid namespace, nothing stacked or left over).
    Degraded mode has nothing to make ahead, and says so."""
    if sandbox.mode == "degraded":
        deadline = time.monotonic() + 10  # the pool's first try comes just after the daemon's start
        while "not made ahead" not in client.status()["daemon"]["pool"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "not made ahead: its sessions have no root of their own" in client.status()["daemon"]["pool"]
        with client.open_session(str(worktree)) as s:
            assert s.status()["protections"].get("made_ahead", False) is False
        return
    wait_for_pool(client)
    with client.open_session(str(worktree)) as ahead:
        assert ahead.status()["protections"]["made_ahead"] is True
        made_ahead = _mount_points(ahead, _scratch(ahead))
        assert attempt(ahead, "result = os.stat('/.host')") == ENOENT
    (tmp_path / "plain").mkdir()
    plain = Daemon(tmp_path / "plain", "--pool", "0")
    try:
        with plain.connect() as other, other.open_session(str(worktree)) as fresh:
            assert fresh.status()["protections"].get("made_ahead", False) is False
            at_open = _mount_points(fresh, _scratch(fresh))
    finally:
        assert plain.stop() == 0, plain.log()
    assert made_ahead == at_open
    assert "/.host" not in made_ahead and "/" in made_ahead
    assert not any(p.startswith("/.host") for p in made_ahead)


@pytest.fixture(scope="module")
def pooled_daemon(tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    """A full-mode daemon with a pool, and a policy whose sessions run
    without namespaces (degraded) beside the pool's sandboxes."""
    d = daemon_with_nons(tmp_path_factory.mktemp("pooled"))
    yield d  # type: ignore[misc]
    assert d.stop() == 0, d.log()


def _a_waiting_sandbox(d: Daemon) -> int:
    """The pid of a sandbox made ahead that no session has taken."""
    made = [int(p) for p in re.findall(r"event=pool_made kind=default/off session=\w+ pid=(\d+)", d.log())]
    taken = {int(p) for p in re.findall(r"event=worker_ready session=\w+ pid=(\d+) made_ahead=1", d.log())}
    waiting = [p for p in made if p not in taken and psutil.pid_exists(p)]
    assert waiting, d.log()[-3000:]
    return waiting[-1]


@pytest.mark.parametrize("policy, denied", [("default", ESRCH), ("nons", EPERM)])
def test_a_sandbox_waiting_in_the_pool_cannot_be_reached_from_a_session(
    pooled_daemon: Daemon, worktree: Path, policy: str, denied: str,
) -> None:
    """From a session in its own pid namespace the waiting sandbox has no
    pid (ESRCH); from one without (policy ``nons``, degraded mode) Landlock's
    signal scope refuses SIGKILL (EPERM). The twin: the same kill from
    outside any sandbox is allowed (signal 0, so it stays alive), and the
    sandbox then serves a session."""
    with pooled_daemon.connect() as client:
        wait_for_pool(client, n=2)
        pid = _a_waiting_sandbox(pooled_daemon)
        with client.open_session(str(worktree), policy=policy) as s:
            assert s.status()["protections"]["mode"] == ("full" if policy == "default" else "degraded")
            assert attempt(s, f"result = os.kill({pid}, signal.SIGKILL)") == denied
        assert attempt_outside(f"result = os.kill({pid}, 0)") == "OK None"
        assert psutil.pid_exists(pid)
        # Still whole: the pool hands it to a session, which works.
        served = False
        for _ in range(4):
            with client.open_session(str(worktree)) as s:
                served = served or pooled_daemon.worker_pid(s.id) == pid
                assert s.registry.get("shell_exec").call({"command": "echo hi"}).output == "hi\n"
            if served:
                break
        assert served, pooled_daemon.log()[-3000:]


_DESCRIPTORS = """
named = []
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink("/proc/self/fd/" + fd)
    except OSError:
        continue
    if target.startswith("/") and not target.startswith(("/dev/", "/proc/")):
        named.append(target)
init = set()
for fd in range(64):
    try:
        os.close(os.open(f"/proc/1/fd/{fd}", os.O_PATH))
        init.add("opened")
    except OSError as exc:
        init.add(errno.errorcode[exc.errno])
result = (sorted(named), sorted(init))
"""


def test_the_host_root_a_sandbox_held_is_out_of_its_sessions_reach(
    sandbox: Sandbox, session: dispatch.Session,
) -> None:
    """A sandbox made ahead holds the host's root until its session's binds:
    as a detached copy of the mount tree, by one descriptor
    (``mounts._hold_host``), closed before any of the session's code runs.
    From the session: no descriptor of its processes names a path of the
    host's (a held tree would read as ``/``), pid 1's descriptors cannot be
    opened (not dumpable: EACCES), nothing is left at ``/.host``, and a copy
    of its own tree cannot be taken (``open_tree``: seccomp, EPERM). The
    twin: the same descriptor walk outside opens its own process's."""
    out = attempt(session, _DESCRIPTORS)
    assert out.startswith("OK "), out
    named, init = eval(out[3:])  # noqa: S307 (our own probe's repr)
    assert named == [], named
    assert "opened" not in init and set(init) <= {"EACCES", "ENOENT"}, init
    if sandbox.mode == "full":
        assert attempt(session, "result = os.stat('/.host')") == ENOENT
        assert attempt(session, "result = syscall(428, -100, b'/', 1 | 0x8000)") == EPERM  # open_tree(CLONE|RECURSIVE)
    outside = attempt_outside(_DESCRIPTORS.replace("/proc/1/", "/proc/self/"))
    assert outside.startswith("OK ") and "opened" in outside, outside
