"""Escapes through other processes: the worker, the daemon, the user's programs, other sessions.

The worker (the tool server, the parent of every command's bash) holds the
channel to the client and was forked from the daemon, so its memory,
descriptors and environment are the prize; it is not dumpable, and seccomp
refuses ptrace and process_vm_*. Processes outside the session are invisible
in full mode (its own pid namespace: ESRCH, ENOENT) and out of Landlock's
signal and ptrace scope in degraded mode (EPERM, EACCES).
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import dispatch
from tests.conftest import made_each, shell
from tests.escape.attempts import (
    EACCES, EINVAL, ENOENT, ENOSYS, EPERM, ESRCH, SYS, attempt, attempt_outside, background, wait_for,
)
from tests.escape.conftest import Sandbox, Victim

# PTRACE_SEIZE rather than ATTACH: the tracee is not stopped, so the control
# outside can simply kill and reap it.
_PTRACE_SEIZE = 0x4206
_SEIZE = "result = syscall({nr}, {req}, {{pid}}, 0, 0)".format(nr=SYS["ptrace"], req=_PTRACE_SEIZE)
_OWN_CHILD = """
p = subprocess.Popen(["sleep", "30"])
try:
    pid = p.pid
    {body}
finally:
    p.kill()
    p.wait()
"""


def _on_own_child(body: str) -> str:
    return _OWN_CHILD.format(body=body.replace("\n", "\n    "))


def test_ptrace_is_refused_even_on_the_sessions_own_processes(session: dispatch.Session) -> None:
    seize_child = _on_own_child(_SEIZE.format(pid="pid"))
    assert attempt_outside(seize_child) == "OK 0"
    assert attempt(session, seize_child) == EPERM  # seccomp
    assert attempt(session, _SEIZE.format(pid="worker_pid()")) == EPERM


def test_process_vm_readv_is_refused(session: dispatch.Session) -> None:
    read = """
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
theirs, mine = ctypes.create_string_buffer(b"memory"), ctypes.create_string_buffer(8)
local, remote = iovec(ctypes.addressof(mine), 6), iovec(ctypes.addressof(theirs), 6)
result = syscall({nr}, {{pid}}, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
""".format(nr=SYS["process_vm_readv"])
    assert attempt_outside(read.format(pid="os.getpid()")) == "OK 6"
    assert attempt(session, read.format(pid="os.getpid()")) == EPERM  # seccomp, even on itself
    assert attempt(session, read.format(pid="worker_pid()")) == EPERM


def test_the_probe_finds_the_worker(session: dispatch.Session) -> None:
    """What the worker attempts below aim at: the tool server, a dispatchd process."""
    out = attempt(session, "result = b'dispatchd' in open(f'/proc/{worker_pid()}/cmdline', 'rb').read()")
    assert out == "OK True"


# How each /proc entry is read: a file opened, a directory listed, a link read.
_PROC_READ = {"mem": "bool(open(path, 'rb'))", "environ": "bool(open(path, 'rb'))", "maps": "bool(open(path, 'rb'))",
              "fd": "len(os.listdir(path)) > 0", "cwd": "bool(os.readlink(path))", "root": "bool(os.readlink(path))"}


@pytest.mark.parametrize("entry", _PROC_READ)
def test_the_workers_proc_entries_are_refused(session: dispatch.Session, entry: str) -> None:
    def read(pid: str) -> str:
        return f"path = '/proc/' + str({pid}) + '/{entry}'\nresult = {_PROC_READ[entry]}"

    assert attempt(session, read("os.getpid()")) == "OK True"
    assert attempt(session, read("worker_pid()")) == EACCES  # not dumpable (and Landlock's ptrace scope)


def test_the_workers_descriptors_cannot_be_taken(session: dispatch.Session) -> None:
    """pidfd_getfd: fd 0 of a process, the way to the worker's client channel."""
    take = "pidfd = syscall({open}, {{pid}}, 0)\nresult = syscall({get}, pidfd, 0, 0) >= 0".format(
        open=SYS["pidfd_open"], get=SYS["pidfd_getfd"])
    assert attempt(session, _on_own_child(take.format(pid="pid"))) == "OK True"
    assert attempt(session, take.format(pid="worker_pid()")) == EPERM


def test_another_sessions_descriptors_cannot_be_taken(
    sandbox: Sandbox, client: dispatch.Client, session: dispatch.Session, make_worktree: Callable[[str], Path],
) -> None:
    """No descriptor passes between two sessions running at once: not by a
    Unix socket (test_ipc.py), nor by ``pidfd_getfd`` on the other's
    process (a file of its worktree open for writing; a TCP socket of a
    session with the network on). Full mode: its pid is not in this
    session's pid namespace (ESRCH); degraded mode: the host's pids are
    shared, and Landlock refuses a process outside the session's own
    domain (EPERM). The twin: the same on the session's own child works."""
    take = "pidfd = syscall({open}, {{pid}}, 0)\nresult = syscall({get}, pidfd, 0, 0) >= 0".format(
        open=SYS["pidfd_open"], get=SYS["pidfd_getfd"])
    assert attempt(session, _on_own_child(take.format(pid="pid"))) == "OK True"
    marker = f"dispatch-escape-holder-{secrets.token_hex(4)}"
    elsewhere = make_worktree("other")
    with client.open_session(str(elsewhere)) as other:
        background(other, f"import time\nf = open('held', 'w')\ntime.sleep(20)  # {marker}", 25)
        assert wait_for(lambda: bool(_pids_of(marker)), 10)
        for pid in _pids_of(marker):
            assert attempt(session, take.format(pid=pid)) == sandbox.expect(full=ESRCH, degraded=EPERM), pid


def _pids_of(marker: str) -> list[int]:
    """The host's pids of the processes whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


_KILL = "result = os.kill({pid}, signal.{sig})"


def test_the_daemon_cannot_be_signalled(sandbox: Sandbox, session: dispatch.Session) -> None:
    assert attempt(session, _on_own_child(_KILL.format(pid="pid", sig="SIGTERM"))) == "OK None"
    daemon = sandbox.client.status()["pid"]
    out = attempt(session, _KILL.format(pid=daemon, sig="SIGTERM"))
    assert out == sandbox.expect(full=ESRCH, degraded=EPERM)  # another pid namespace; Landlock's signal scope
    assert sandbox.daemon.proc.poll() is None and sandbox.client.status()["pid"] == daemon


@pytest.fixture
def victims() -> Iterator[Callable[[], Victim]]:
    yield from made_each(Victim, _end_victim)


def _end_victim(v: Victim) -> None:
    if v.proc.returncode is None:
        v.proc.kill()
        v.proc.communicate()


def test_the_users_other_processes_cannot_be_signalled(
    sandbox: Sandbox, session: dispatch.Session, victims: Callable[[], Victim],
) -> None:
    inside, outside = victims(), victims()
    assert attempt(session, _KILL.format(pid=inside.pid, sig="SIGKILL")) == sandbox.expect(full=ESRCH, degraded=EPERM)
    assert attempt(session, _KILL.format(pid=inside.pid, sig="SIGWINCH")) == sandbox.expect(full=ESRCH, degraded=EPERM)
    assert attempt_outside(_KILL.format(pid=outside.pid, sig="SIGWINCH")) == "OK None"
    assert inside.alive()
    assert inside.finish() == ""
    assert "GOT SIGWINCH" in outside.finish()


# Calls that set another process's limits, priority, scheduling or I/O
# class: the kernel asks only that it be the same user's (no ptrace check).
_ON_PID = {
    "a resource limit": "import resource\nresource.prlimit({pid}, resource.RLIMIT_NOFILE, (64, 64))\nresult = 'set'",
    "a priority": "os.setpriority(os.PRIO_PROCESS, {pid}, 10)\nresult = 'set'",
    "a scheduling policy": "os.sched_setscheduler({pid}, os.SCHED_IDLE, os.sched_param(0))\nresult = 'set'",
    "a CPU affinity": "os.sched_setaffinity({pid}, {{0}})\nresult = 'set'",
    "an I/O class": "result = syscall(251, 1, {pid}, 3 << 13)",  # ioprio_set(IOPRIO_WHO_PROCESS, pid, IDLE)
}
_PRIO_USER = "os.setpriority(os.PRIO_USER, 0, 10)\nresult = 'set'"


def _limits(pid: int) -> tuple[str, str]:
    lines = Path(f"/proc/{pid}/limits").read_text().splitlines()
    return next(line for line in lines if line.startswith("Max open files")), Path(f"/proc/{pid}/stat").read_text()


@pytest.mark.parametrize("what", sorted(_ON_PID))
def test_the_users_other_processes_keep_their_limits_and_priority(
    sandbox: Sandbox, session: dispatch.Session, victims: Callable[[], Victim], what: str,
) -> None:
    """Without a pid namespace (degraded mode) a session named the daemon by
    pid and set its RLIMIT_NOFILE to 3: it accepted no client again. Full
    mode: no such pid (ESRCH); degraded: EPERM (seccomp). The twins: the same
    call on the session's own process (pid 0) works inside, and outside
    on the same kind of process it goes through."""
    inside, outside = victims(), victims()
    nofile, stat_before = _limits(inside.pid)
    assert attempt(session, _ON_PID[what].format(pid=inside.pid)) == sandbox.expect(full=ESRCH, degraded=EPERM)
    assert _limits(inside.pid)[0] == nofile and _limits(inside.pid)[1].split()[17:19] == stat_before.split()[17:19]
    assert attempt(session, _ON_PID[what].format(pid=0)) in ("OK 'set'", "OK 0")  # its own
    assert attempt_outside(_ON_PID[what].format(pid=outside.pid)) in ("OK 'set'", "OK 0")
    assert inside.alive() and inside.finish() == ""


def test_the_tool_server_keeps_its_limits_and_every_process_of_the_user_its_priority(
    session: dispatch.Session,
) -> None:
    """pid 1 of a full-mode session is its tool server: a command that set its
    RLIMIT_NOFILE to 5 broke every call after. ``PRIO_USER`` names every
    process of the user at once (in degraded mode, all of the machine's).
    Reading a limit stays (``/proc`` shows it anyway); the twin: ``nice``."""
    limit = "import resource\nresult = resource.prlimit(worker_pid(), resource.RLIMIT_NOFILE{new})"
    assert attempt(session, limit.format(new=", (5, 5)")) == EPERM
    assert attempt(session, limit.format(new="")).startswith("OK (")
    assert attempt(session, _PRIO_USER) == EPERM
    assert attempt(session, "result = os.nice(1)") == "OK 1"
    assert shell(session, "cat a-file-that-is-not-there 2>/dev/null; echo served").output == "served\n"


_SIGIO = """
r, w = os.pipe()
fcntl.fcntl(r, fcntl.F_SETOWN, {pid})
fcntl.fcntl(r, 10, signal.SIGWINCH)  # F_SETSIG
fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC)
os.write(w, b"x")  # the kernel now signals the owner
time.sleep(0.2)
result = "written"
"""


def test_sigio_cannot_be_aimed_at_the_users_other_processes(
    sandbox: Sandbox, session: dispatch.Session, victims: Callable[[], Victim],
) -> None:
    """F_SETOWN names another process as the owner of a pipe; writing to it has
    the kernel signal that owner. Full mode: no such pid. Degraded mode: the
    owner is accepted, and Landlock's signal scope drops the signal."""
    inside, outside = victims(), victims()
    assert attempt(session, _SIGIO.format(pid=inside.pid)) == sandbox.expect(full=ESRCH, degraded="OK 'written'")
    assert attempt_outside(_SIGIO.format(pid=outside.pid)) == "OK 'written'"
    assert inside.finish() == ""
    assert "GOT SIGWINCH" in outside.finish()


def _sleepers(cwd: Path) -> list[int]:
    """The host pids of the ``sleep`` processes running in ``cwd`` (another session's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.readlink(f"/proc/{pid}/cwd") == str(cwd) and Path(f"/proc/{pid}/comm").read_text() == "sleep\n":
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_another_sessions_processes_are_out_of_reach(
    sandbox: Sandbox, client: dispatch.Client, session: dispatch.Session, make_worktree: Callable[[str], Path],
) -> None:
    other = make_worktree("other")
    with client.open_session(str(other)) as theirs:
        assert shell(theirs, "sleep 60 >/dev/null 2>&1", background=True).is_success
        assert wait_for(lambda: bool(_sleepers(other)))
        pid = _sleepers(other)[0]
        environ = f"result = b'DISPATCH_SESSION={theirs.id}' in open('/proc/{pid}/environ', 'rb').read()"
        assert attempt_outside(environ) == "OK True"
        assert attempt(session, environ) == sandbox.expect(full=ENOENT, degraded=EACCES)
        assert attempt(session, _KILL.format(pid=pid, sig="SIGKILL")) == sandbox.expect(full=ESRCH, degraded=EPERM)
        os.kill(pid, 0)  # still there


def test_the_daemons_environment_stays_outside(sandbox: Sandbox, session: dispatch.Session) -> None:
    r = shell(session, "env")
    assert f"DISPATCH_SESSION={session.id}\n" in r.metadata["stdout"]
    assert sandbox.canary not in r.metadata["stdout"] + r.metadata["stderr"]
    environ = f"result = {sandbox.canary!r}.encode() in open('/proc/' + str({{pid}}) + '/environ', 'rb').read()"
    daemon = sandbox.client.status()["pid"]
    assert attempt_outside(environ.format(pid=daemon)) == "OK True"
    assert attempt(session, environ.format(pid="os.getpid()")) == "OK False"
    assert attempt(session, environ.format(pid=daemon)) == sandbox.expect(full=ENOENT, degraded=EACCES)
    # The worker is a fork of the daemon: its environment block is the daemon's.
    assert attempt(session, environ.format(pid="worker_pid()")) == EACCES


def test_commands_inherit_only_the_standard_descriptors(session: dispatch.Session) -> None:
    def fds(command: str) -> list[str]:
        r = shell(session, command)
        assert r.metadata["exit_code"] == 0, r.metadata["stderr"]
        return sorted(line.split()[8] for line in r.metadata["stdout"].splitlines()[1:])

    assert "7" in fds("exec 7</dev/null; ls -l /proc/self/fd")  # the listing shows an inherited fd
    assert fds("ls -l /proc/self/fd") == ["0", "1", "2", "3"]  # 3: the directory ls itself reads


def test_setuid_binaries_grant_nothing(session: dispatch.Session) -> None:
    r = shell(session, "grep -E '^(NoNewPrivs|CapEff)' /proc/self/status; su -c id root")
    assert r.metadata["stdout"] == "CapEff:\t0000000000000000\nNoNewPrivs:\t1\n"
    # Outside, su runs as root and asks for a password; here it runs as the
    # user (no_new_privs ignores the setuid bit) and cannot even start.
    assert r.metadata["stderr"].endswith("su: System error\n") and r.metadata["exit_code"] == 1
    out = subprocess.run(["bash", "-c", "grep '^NoNewPrivs' /proc/self/status; su -c id root"],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=30)
    assert out.stdout == "NoNewPrivs:\t0\n"
    assert out.stderr.endswith("su: Authentication failure\n")


def test_unshare_is_refused(session: dispatch.Session) -> None:
    r = shell(session, "unshare -U true")
    assert r.metadata["exit_code"] == 1
    assert r.metadata["stderr"] == "unshare: unshare failed: Operation not permitted\n"
    assert subprocess.run(["unshare", "-U", "true"], timeout=30).returncode == 0
    body = f"result = syscall({SYS['unshare']}, 0x10000000)"  # CLONE_NEWUSER
    assert attempt_outside(body) == "OK 0"
    assert attempt(session, body) == EPERM


_CLONE_NEWUSER = 0x10000000
_NAMESPACES = {"user": 0, "mount": 0x00020000, "pid": 0x20000000, "net": 0x40000000,
               "ipc": 0x08000000, "uts": 0x04000000, "cgroup": 0x02000000}


@pytest.mark.parametrize("namespace", _NAMESPACES)
def test_clone_into_new_namespaces_is_refused(session: dispatch.Session, namespace: str) -> None:
    flags = _CLONE_NEWUSER | _NAMESPACES[namespace] | signal.SIGCHLD
    body = f"""
pid = syscall({SYS['clone']}, {flags}, 0, 0, 0, 0)
if pid == 0:
    os._exit(0)
result = os.waitpid(pid, 0)[1]
"""
    assert attempt_outside(body) == "OK 0"
    assert attempt(session, body) == EPERM


def test_clone3_answers_enosys(session: dispatch.Session) -> None:
    body = f"result = syscall({SYS['clone3']}, 0, 0)"
    assert attempt_outside(body) == EINVAL  # the kernel has it: it reads the (empty) arguments
    assert attempt(session, body) == ENOSYS  # so that libc falls back to clone, which the filter can read


def test_setns_is_refused(session: dispatch.Session) -> None:
    body = f"fd = os.open('/proc/self/ns/user', os.O_RDONLY)\nresult = syscall({SYS['setns']}, fd, 0)"
    assert attempt_outside(body) == EINVAL  # joining one's own namespace: refused, but by the kernel
    assert attempt(session, body) == EPERM
