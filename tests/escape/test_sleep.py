"""A session that slept and woke, as an attacker inside meets it.

Asleep, a session has no process: its pid namespace died with its tool
server. The call that wakes it runs in a new tool server, forked by the fork
server outside, that joins the session's namespaces, makes a new pid
namespace and a fresh ``/proc``, and confines itself again (capabilities,
``no_new_privs``, the same Landlock ruleset, seccomp). Each test here runs
in full mode (a session that never slept: the twin) and in woken mode (the
session comes asleep, and ``_rest`` puts it to sleep again mid-test, so the
attempt runs in a second woken tool server too), and must give the same
verdicts in both. The whole escape suite runs woken as well (conftest.py);
these are the attempts that aim at the wake itself: the new pid 1, the new
``/proc``, and what the confinement redone must still refuse.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import dispatch
from tests.conftest import credential_dir, shell
from tests.escape.attempts import (
    EACCES, EBUSY, ECONNREFUSED, ENETUNREACH, EPERM, EROFS, SYS, TcpListener, attempt, attempt_outside, wait_for,
)
from tests.escape.conftest import Sandbox
from tests.sleeping import is_asleep, wait_until_asleep

pytestmark = pytest.mark.parametrize("sandbox", ["full", "woken"], indirect=True)


def _rest(sandbox: Sandbox, session: dispatch.Session) -> int:
    """Woken: wait until the session is asleep again (its next call wakes a
    new tool server) and check that its tool server is gone. Either mode:
    the host pid of its tool server at this point (the last one)."""
    pid = sandbox.daemon.worker_pid(session.id)
    if sandbox.woken:
        wait_until_asleep(sandbox.client, session.id, log=sandbox.daemon.log()[-3000:])
        assert wait_for(lambda: _gone(pid)), f"session {session.id} is asleep and its tool server {pid} still runs"
    return pid


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited, its parent not yet told
    except psutil.NoSuchProcess:
        return True


def _woke(sandbox: Sandbox, session: dispatch.Session, before: int) -> None:
    """After a call: woken, the session is awake in a new tool server; full,
    the same one as before."""
    now = sandbox.daemon.worker_pid(session.id)
    if sandbox.woken:
        assert now != before, sandbox.daemon.log()[-3000:]
    else:
        assert now == before and is_asleep(sandbox.client, session.id) is False


_KILL_PID_1 = """
os.kill(1, signal.SIGKILL)
time.sleep(0.3)  # had pid 1 died, the kernel would have killed this probe with its namespace
result = (os.kill(1, signal.SIGKILL), worker_pid())
"""
_KILL_A_CHILD = """
p = subprocess.Popen(["sleep", "30"])
os.kill(p.pid, signal.SIGKILL)
result = p.wait()
"""
_PID_1 = "result = (worker_pid(), b'dispatchd' in open('/proc/1/cmdline', 'rb').read())"


def test_pid_1_is_the_tool_server_and_cannot_be_killed_from_inside(sandbox: Sandbox, session: dispatch.Session) -> None:
    """SIGKILL to pid 1 from inside its own pid namespace: the kernel drops it
    (pid 1 of a namespace takes only the signals it has a handler for, and
    SIGKILL from inside never): the call and pid 1 go on. The twin: a child
    of the session's is killed by the same call (-9)."""
    for _ in range(2):
        before = _rest(sandbox, session)
        assert attempt(session, _PID_1) == "OK (1, True)"  # the commands' parent is pid 1, a dispatchd process
        _woke(sandbox, session, before)
        pid_1 = sandbox.daemon.worker_pid(session.id)
        assert attempt(session, _KILL_A_CHILD) == "OK -9"
        assert attempt(session, _KILL_PID_1) == "OK (None, 1)"
        assert psutil.pid_exists(pid_1) and psutil.Process(pid_1).status() != psutil.STATUS_ZOMBIE
        assert shell(session, "echo alive").output == "alive\n"


_PROC = """
pids = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
proc_mounts = [line.split()[4] for line in open("/proc/self/mountinfo")].count("/proc")
result = (os.readlink("/proc/self") == str(os.getpid()), pids[0], os.getpid() in pids, len(pids) <= 4,
          all(os.path.exists(f"/proc/{p}/stat") for p in pids), proc_mounts)
"""


def test_proc_shows_only_the_new_pid_namespace(sandbox: Sandbox, session: dispatch.Session) -> None:
    """After a wake ``/proc`` is the new pid namespace's own: ``/proc/self``
    names the reader, pid 1 is there, nothing else than the call's few
    processes is listed, and one ``/proc`` is mounted (none left over from
    the namespace that died, none stacked by a wake). The twin: outside, the
    same probe lists the host's many processes."""
    for _ in range(2):
        before = _rest(sandbox, session)
        assert attempt(session, _PROC) == "OK (True, 1, True, True, True, 1)"
        _woke(sandbox, session, before)
    outside = attempt_outside(_PROC)
    assert outside.startswith("OK (True, 1, True, False, "), outside


# Writes to /proc, and what the same write gives outside.
_PROC_WRITES = {
    "comm": ("result = open('/proc/self/comm', 'w').write('renamed')", "OK 7"),
    "oom_score_adj": ("result = open('/proc/self/oom_score_adj', 'w').write('500')", "OK 3"),
    "clear_refs": ("result = open('/proc/self/clear_refs', 'w').write('1')", "OK 1"),
    "max_inotify_instances": ("result = open('/proc/sys/user/max_inotify_instances', 'w').write('128')", EACCES),
}


@pytest.mark.parametrize("target", _PROC_WRITES)
def test_the_fresh_proc_is_read_only_too(sandbox: Sandbox, session: dispatch.Session, target: str) -> None:
    """A fresh session's ``/proc`` is mounted read-only (EROFS to any write,
    before Landlock is asked); the ``/proc`` a wake mounts for the new pid
    namespace must be too. The twin: the same write outside goes through
    (the process's own ``comm``, ``oom_score_adj`` raised, ``clear_refs``),
    or, for the per-user sysctl, is refused by its permissions (EACCES: the
    user is not root), not by a mount."""
    write, outside = _PROC_WRITES[target]
    assert attempt_outside(write) == outside
    for _ in range(2):
        before = _rest(sandbox, session)
        assert attempt(session, write) == EROFS
        _woke(sandbox, session, before)


_UNSHARE = f"result = syscall({SYS['unshare']}, 0x10000000)"  # CLONE_NEWUSER
_MOUNT = f"result = syscall({SYS['mount']}, b'none', b'/tmp', b'tmpfs', 0, 0)"


def test_unshare_and_mount_stay_refused(sandbox: Sandbox, session: dispatch.Session) -> None:
    """Seccomp is installed again by every tool server that wakes: unshare and
    mount are EPERM. The twin: outside, the same unshare makes a namespace."""
    assert attempt_outside(_UNSHARE) == "OK 0"
    for _ in range(2):
        before = _rest(sandbox, session)
        assert (attempt(session, _UNSHARE), attempt(session, _MOUNT)) == (EPERM, EPERM)
        _woke(sandbox, session, before)
        r = shell(session, "unshare -U true")
        assert (r.metadata["exit_code"], r.metadata["stderr"]) == (1, "unshare: unshare failed: Operation not permitted\n")


@pytest.fixture
def ssh_key() -> Iterator[Path]:
    """A key file in the user's ~/.ssh (made for the test if absent)."""
    key = credential_dir(".ssh") / f"dispatch-escape-key-{secrets.token_hex(4)}"
    key.write_text("PRIVATE KEY\n")
    try:
        yield key
    finally:
        key.unlink()


def test_the_users_ssh_stays_unreachable(sandbox: Sandbox, session: dispatch.Session, ssh_key: Path,
                                         own_file: Path) -> None:
    """The woken tool server joins the session's mount namespace: the home
    directory is still absent there, and Landlock still grants nothing of it.
    The twin: the same read outside gets the key, and inside gets the
    worktree's file."""
    read = "result = open({path!r}).read()"
    assert attempt_outside(read.format(path=str(ssh_key))) == "OK 'PRIVATE KEY\\n'"
    for _ in range(2):
        before = _rest(sandbox, session)
        assert attempt(session, read.format(path=str(ssh_key))) == sandbox.unreachable(ssh_key)
        _woke(sandbox, session, before)
        assert attempt(session, "result = os.listdir({path!r})".format(path=str(ssh_key.parent))) == \
            sandbox.unreachable(ssh_key.parent)
        assert attempt(session, read.format(path=str(own_file))) == f"OK {own_file.read_text()!r}"


_REPLACE_DOT_GIT = """
os.rename(".git", ".git-aside")
os.mkdir(".git")
result = "replaced"
"""


def test_git_metadata_stays_read_only(sandbox: Sandbox, client: dispatch.Client, worktree: Path) -> None:
    """.git/config and .git/hooks stay read-only binds, and .git a mount point
    of its own, across a sleep (they live in the mount namespace, which the
    woken tool server joins). The twin: git's own writes to .git work."""
    subprocess.run(["git", "init", "-q", str(worktree)], check=True, timeout=30)
    with client.open_session(str(worktree)) as s:
        for _ in range(2):
            before = _rest(sandbox, s)
            assert attempt(s, "result = open('.git/description', 'w').write('mine')") == "OK 4"
            _woke(sandbox, s, before)
            assert attempt(s, "result = open('.git/config', 'a').write('[core]\\n')") == EROFS
            assert attempt(s, "result = open('.git/hooks/pre-commit', 'w').write('#!/bin/sh\\n')") == EROFS
            assert attempt(s, _REPLACE_DOT_GIT) == EBUSY


_CONNECT = """
s = socket.create_connection(({host!r}, {port}), timeout=5)
result = s.recv(100)
"""


def test_network_off_stays_off(sandbox: Sandbox, client: dispatch.Client, session: dispatch.Session,
                               worktree: Path, tmp_path: Path) -> None:
    """The network namespace outlives the sleep, and so does "off": the host's
    loopback, reached at the gateway address by a session with the network on,
    has no route from an off session; its own loopback has nobody. The twin:
    a session with the network on (woken too) reaches the listener."""
    with TcpListener() as listener:
        gateway = _CONNECT.format(host="10.0.2.2", port=listener.port)
        for _ in range(2):
            before = _rest(sandbox, session)
            assert attempt(session, gateway) == ENETUNREACH
            _woke(sandbox, session, before)
            assert attempt(session, _CONNECT.format(host="127.0.0.1", port=listener.port)) == ECONNREFUSED
        other = tmp_path / "other"
        other.mkdir()
        with client.open_session(str(other), network=True) as on:
            before = _rest(sandbox, on)
            assert attempt(on, gateway) == f"OK {TcpListener.BANNER!r}"
            _woke(sandbox, on, before)
        assert len(listener.received) == 1  # the twin's connection only
