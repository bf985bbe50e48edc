"""Attacks on the sandboxes made ahead (dispatchd/daemon/pool.py), with a real daemon.

What can happen to a sandbox while it waits in the pool, and what an open
gets afterwards: a pool can make an open faster, never different.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import REPO, Daemon, fork_server_of, _refuse_root, shell, wait_for_pool


@pytest.fixture
def pooled(tmp_path: Path) -> Iterator[Daemon]:
    _refuse_root()
    (tmp_path / "d").mkdir()
    policies = tmp_path / "policies"
    shutil.copytree(REPO / "policies", policies)
    d = Daemon(tmp_path / "d", "--cgroup", "off", "--policies", str(policies))
    yield d
    assert d.stop() == 0, d.log()


def _stacks(d: Daemon) -> list[psutil.Process]:
    """The network stacks the fork server runs; one that ends while looked at
    (the closed session's, exiting) is not among them."""
    def name(p: psutil.Process) -> str:
        try:
            return str(p.name())
        except psutil.NoSuchProcess:
            return ""
    return [p for p in fork_server_of(d.proc.pid).children() if name(p).startswith(("pass", "slirp4netns"))]


def _way_out(session: dispatch.Session) -> str:
    """The session's interfaces and whether it has a default route."""
    r = shell(session, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ' '; "
                       "awk '$2 == \"00000000\" {print \"default-route\"}' /proc/net/route")
    assert r.is_success, r.error
    return str(r.output).strip()


def test_a_sandbox_whose_network_stack_died_while_waiting_is_not_given(pooled: Daemon, worktree: Path) -> None:
    """Network "on": the stack of a sandbox made ahead is started with
    it. Were it to end while the sandbox waits (killed, crashed), a session
    given that sandbox would have no way out at all, where one made at open
    has its interface and route (the twin, first). The pool checks the stack
    as it checks the sandbox's own process: such a sandbox is let go and the
    session's made at open."""
    with pooled.connect() as client:
        with client.open_session(str(worktree), network="on") as fresh:
            assert _way_out(fresh) == "eth0 lo default-route"
        wait_for_pool(client, "default/on", 2)
        stacks = _stacks(pooled)
        assert len(stacks) >= 2, pooled.log()[-2000:]
        for p in stacks:  # those of the sandboxes waiting (the session above is closed)
            with contextlib.suppress(psutil.NoSuchProcess):  # the closed session's, ending meanwhile
                p.kill()
        psutil.wait_procs(stacks, timeout=5)
        with client.open_session(str(worktree), network="on") as s:
            assert _way_out(s) == "eth0 lo default-route", (s.status()["protections"].get("made_ahead"),
                                                            pooled.log()[-2000:])


def test_a_policys_ports_in_any_order_are_served_by_the_pool(pooled: Daemon, worktree: Path) -> None:
    """A policy listing its ports unsorted (or twice): the session's plan
    names them sorted, once (``_ports_for``); the sandbox made ahead must
    too, or no "ports" session of that policy is ever given one (every open
    let one go: pool_mismatch). The twin: a policy listing them sorted."""
    policies = Path(re.search(r"--policies (\S+)", " ".join(pooled.proc.args)).group(1))  # type: ignore[union-attr,arg-type]
    text = (policies / "default.toml").read_text().replace('default = "off"', 'default = "off"\nconnect_ports = {}')
    (policies / "sorted.toml").write_text(text.format("[80, 443]"))
    (policies / "unsorted.toml").write_text(text.format("[443, 80, 443]"))
    with pooled.connect() as client:
        for policy in ("sorted", "unsorted"):
            with client.open_session(str(worktree), policy=policy, network="ports"):
                pass
            wait_for_pool(client, f"{policy}/ports", 1)
            with client.open_session(str(worktree), policy=policy, network="ports") as s:
                assert s.status()["protections"].get("made_ahead") is True, (policy, pooled.log()[-1500:])
                assert s.status()["protections"]["network"]["connect_ports"] == [80, 443]
    assert "event=pool_mismatch" not in pooled.log()


def _footprint(d: Daemon) -> tuple[int, int, list[str]]:
    """The daemon's descriptors, the fork server's children (sandboxes and
    stacks), and what is in its sessions directory."""
    proc = psutil.Process(d.proc.pid)
    fork_server = fork_server_of(d.proc.pid)
    sessions = d.state / "dispatchd" / "sessions"
    return proc.num_fds(), len(fork_server.children()), sorted(os.listdir(sessions)) if sessions.exists() else []


def test_many_opens_at_once_some_failing_at_adoption_leave_nothing_behind(pooled: Daemon, worktree: Path,
                                                                          tmp_path: Path) -> None:
    """60 opens at once, a third of them of a policy whose sessions fail at
    adoption (a read-write path through a symlink: ELOOP, in the second
    half of the confinement), a third of network "on": every good one
    opens, every bad one fails with the worker's step, and once the pool
    is refilled the daemon holds what it held before (descriptors, sandboxes
    and stacks, scratch directories)."""
    import concurrent.futures

    policies = Path(re.search(r"--policies (\S+)", " ".join(pooled.proc.args)).group(1))  # type: ignore[union-attr,arg-type]
    real = tmp_path / "real"
    (real / "x").mkdir(parents=True)
    (tmp_path / "link").symlink_to(real)
    text = (policies / "default.toml").read_text()
    (policies / "bad.toml").write_text(text.replace("read_write = []", f'read_write = ["{tmp_path}/link/x"]'))
    with pooled.connect() as client:
        for policy in ("bad", "default"):
            for network in ("off", "on"):
                try:
                    client.open_session(str(worktree), policy=policy, network=network).close()
                except dispatch.DispatchError:
                    pass
        for kind in ("bad/off", "default/off", "default/on"):
            wait_for_pool(client, kind, 2)
        time.sleep(0.5)
        before = _footprint(pooled)
        trees = []
        for i in range(60):
            wt = tmp_path / f"wt{i}"
            wt.mkdir()
            trees.append(wt)

        def one(i: int) -> str:
            policy = "bad" if i % 3 == 0 else "default"
            network = "on" if i % 3 == 1 else "off"
            with pooled.connect() as c:
                try:
                    with c.open_session(str(trees[i]), policy=policy, network=network) as s:
                        return "ok " + str(shell(s, "echo hi").output).strip()
                except dispatch.DispatchError as exc:
                    return f"{policy}: {exc}"

        with concurrent.futures.ThreadPoolExecutor(60) as ex:
            results = list(ex.map(one, range(60)))
        assert results.count("ok hi") == 40, results
        assert all("ELOOP" in r or "symbolic link" in r or "symlink" in r for r in results if r != "ok hi"), results
        for kind in ("bad/off", "default/off", "default/on"):
            wait_for_pool(client, kind, 2)
        deadline = time.monotonic() + 10
        while _footprint(pooled) != before and time.monotonic() < deadline:
            time.sleep(0.1)
        after = _footprint(pooled)
        assert after[:2] == before[:2] and len(after[2]) == len(before[2]), (before, after)


def test_what_sandboxes_made_ahead_hold_goes_after_a_stop_and_after_sigkill(tmp_path: Path, worktree: Path) -> None:
    """Their cgroups, scratch directories and lock files: gone when the
    daemon stops; after SIGKILL (the processes die with the fork server),
    removed by the next daemon at its start."""
    from tests.conftest import CGROUP_BASE

    _refuse_root()
    if not CGROUP_BASE:
        pytest.skip("no delegated cgroup v2 subtree: DISPATCHD_TEST_CGROUP is set by ./scripts/test run as root")
    cgroup = f"{CGROUP_BASE}/pool-{os.getpid()}"
    state = tmp_path / "state"
    sessions = state / "dispatchd" / "sessions"
    locks = state / "dispatchd" / "session-locks"

    def held() -> tuple[list[str], list[str], list[str]]:
        cgroups = sorted(e for e in os.listdir(cgroup) if e.startswith("session-")) if os.path.isdir(cgroup) else []
        return (cgroups, sorted(os.listdir(sessions)) if sessions.exists() else [],
                sorted(os.listdir(locks)) if locks.exists() else [])

    for how in ("stop", "kill"):
        (tmp_path / how).mkdir()
        d = Daemon(tmp_path / how, "--cgroup", cgroup, state=state)
        with d.connect() as client:
            with client.open_session(str(worktree), network="on"):
                pass
            wait_for_pool(client, "default/off", 2)
            wait_for_pool(client, "default/on", 2)
            deadline = time.monotonic() + 5
            while [len(x) for x in held()] != [4, 4, 4] and time.monotonic() < deadline:
                time.sleep(0.05)  # a lock file is made under a temporary name first
            assert [len(x) for x in held()] == [4, 4, 4], held()
        if how == "stop":
            assert d.stop() == 0, d.log()
            assert held() == ([], [], []), held()
        else:
            os.kill(d.proc.pid, signal.SIGKILL)
            d.proc.wait()
            d.stop()
            assert len(held()[1]) == 4, held()  # left until the next start
            (tmp_path / "again").mkdir()
            again = Daemon(tmp_path / "again", "--cgroup", cgroup, "--pool", "0", state=state)
            try:
                assert held() == ([], [], []), held()
            finally:
                assert again.stop() == 0, again.log()
    os.rmdir(f"{cgroup}/daemon")
    os.rmdir(cgroup)


_MOUNT_IN = """
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
pid, how, target = sys.argv[1], sys.argv[2], sys.argv[3]
for ns, flag in (("user", 0x10000000), ("mnt", 0x00020000)):  # we own its user namespace: every capability there
    if libc.setns(os.open(f"/proc/{pid}/ns/{ns}", os.O_RDONLY), flag) != 0:
        sys.exit(f"setns {ns}: " + os.strerror(ctypes.get_errno()))
if how == "mount":
    ok = libc.mount(b"tmpfs", target.encode(), b"tmpfs", 0, None) == 0
    if ok:
        open(target + "/on-the-mount", "w").close()
else:
    ok = libc.umount2(target.encode(), 0) == 0
sys.exit(0 if ok else how + ": " + os.strerror(ctypes.get_errno()))
"""


@pytest.fixture
def daemon_in_its_own_mounts(tmp_path: Path) -> Iterator[Daemon]:
    """A pooled daemon in a mount namespace of its own (and a user namespace
    mapping the test user to itself), where this unprivileged test can mount
    and unmount as the user's administrator would on the host."""
    _refuse_root()
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--cgroup", "off",
               prefix=("unshare", "--map-current-user", "--mount", "--propagation", "private"))
    yield d
    assert d.stop() == 0, d.log()


def _mount_in(d: Daemon, how: str, target: Path) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _MOUNT_IN, str(d.proc.pid), how, str(target)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("change", ["mounted since", "unmounted since"])
def test_a_sandbox_made_ahead_sees_the_mounts_of_the_moment_of_the_open(daemon_in_its_own_mounts: Daemon,
                                                                        worktree: Path, change: str) -> None:
    """A sandbox made ahead copied the host's mount table when it was made.
    A call's read-only path (here a toolchain directory in the home
    directory) mounted, or unmounted, since the pool filled must be what a
    sandbox made at open binds: the mounted filesystem, or the directory
    under it; never the view of up to 30 s before (which also kept an
    unmounted filesystem busy). The twin: before the change, the session
    sees the view of that moment."""
    d = daemon_in_its_own_mounts
    tools = Path.home() / f".pool-mounts-{os.getpid()}"
    tools.mkdir()
    (tools / "under-the-mount").write_text("")
    before, after = ["under-the-mount"], ["on-the-mount"]
    try:
        if change == "unmounted since":
            _mount_in(d, "mount", tools)
            before, after = after, before
        with d.connect() as client:
            wait_for_pool(client, "default/off", 2)
            for _ in range(2):  # those made before the line above: the pool's are made after it
                client.open_session(str(worktree)).close()
            wait_for_pool(client, "default/off", 2)
            # The twin: made at open (no sandbox of network "on" is made ahead yet).
            with client.open_session(str(worktree), network="on", read_only=[str(tools)]) as s:
                assert s.status()["protections"].get("made_ahead", False) is False
                assert shell(s, f"ls {tools}").output.split() == before
            _mount_in(d, "umount" if change == "unmounted since" else "mount", tools)
            with client.open_session(str(worktree), read_only=[str(tools)]) as s:
                made_ahead = s.status()["protections"].get("made_ahead", False)
                assert shell(s, f"ls {tools}").output.split() == after, f"made ahead: {made_ahead}"
    finally:
        if change == "mounted since":
            _mount_in(d, "umount", tools)
        shutil.rmtree(tools)


def test_sigterm_while_many_sessions_open_and_close_abandons_none(tmp_path: Path) -> None:
    """SIGTERM while 80 clients open, use and close sessions at once: the
    daemon waits for the opens in flight and for the closes in progress, and
    ends every session it registered (its processes, its git check, its
    scratch directory and lock file) before it exits. Before, a session
    whose open finished after the stop had looked at the table, or whose
    close was under way, was abandoned half way when the daemon exited:
    scratch directories and lock files were left (118 of 150 in one run)
    and those sessions' git was never checked."""
    import concurrent.futures

    _refuse_root()
    (tmp_path / "d").mkdir()
    d = Daemon(tmp_path / "d", "--cgroup", "off")
    trees = []
    for i in range(80):
        (tmp_path / f"wt{i}").mkdir()
        trees.append(tmp_path / f"wt{i}")

    def one(i: int) -> str:
        try:
            with d.connect() as c, c.open_session(str(trees[i]), network="on" if i % 2 else None) as s:
                shell(s, "echo hi")
            return "ok"
        except (dispatch.DispatchError, OSError) as exc:
            return type(exc).__name__

    with concurrent.futures.ThreadPoolExecutor(80) as ex:
        futures = [ex.submit(one, i) for i in range(80)]
        time.sleep(0.4)
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 0, d.log()[-3000:]
        [f.result() for f in futures]
    d.stop()
    sessions = d.state / "dispatchd" / "sessions"
    locks = d.state / "dispatchd" / "session-locks"
    opened = len(re.findall(r"event=session_open ", d.log()))
    left = sorted(os.listdir(sessions)) if sessions.exists() else []
    assert left == [], f"{len(left)} scratch directories left ({opened} sessions opened)"
    assert (sorted(os.listdir(locks)) if locks.exists() else []) == []
