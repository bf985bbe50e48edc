"""Every process one command started, found and ended, however it detached.

Guarantees:
- ``spawn_env`` gives a command a marker, ``DISPATCH_CALL_ID=<random token>``,
  that every process it starts inherits through fork and exec.
- ``kill_tree(leader, token)`` SIGKILLs, in rounds until none is left (or a
  bounded time passed), every process that is in the leader's process group
  or session, holds the marker in its environment, or descends from one of
  those. ``setsid cmd &``, ``(cmd &)`` and ``nohup cmd &`` all keep the marker,
  so a timeout or a cancel ends them; a fork bomb is ended in a few rounds
  (a killed process forks no more).
- ``spawn`` records every command it starts until its ``Popen`` has reaped
  it: ``owns(pid)`` tells the session's orphan reaper (the tool server is pid
  1 of the session in full mode) which zombies to leave to their ``Popen``,
  whose exit status it would otherwise steal;
- ``spawn`` gives a new command an RLIMIT_NPROC (soft and hard, set in the
  child before its exec: in force from the command's first instruction)
  that leaves the tool server a reserve: commands that hit the session's
  process limit hit it ``PROCESS_RESERVE`` (or a quarter of a smaller
  budget) below the server, which keeps its threads and can still spawn,
  answer and kill. Likewise an RLIMIT_NOFILE ``FD_PASSING_RESERVE`` below
  the server's (``confine/limits.py``): descriptors the commands put in
  flight cannot stop the session's own sends.

- ``start_command`` starts a call's bash as a child subreaper
  (``_spawn.c``): every process the call starts stays in bash's tree while
  bash lives, whatever it does (``setsid``, a double fork, ``env -i``), and
  ``kill_subtree`` ends that tree exactly: bash is stopped (it can then
  neither exit nor reap, so nothing leaves its tree), its live descendants
  are killed in rounds until none is left (orphans of the killed come back
  to bash, and a killed process forks no more), then bash. ``kill_tree``
  then ends what left before (processes of a bash that had already exited).

- what a call's bash leaves running when it exits by itself is ended by
  the tool server before the call returns (``orphans.py``).

Why bash as well as the tool server: while a call runs, the server cannot
tell which call an orphan came from (several calls run at once); bash's
own attribute keeps each call's tree apart until the call ends, so that a
timeout or a cancel ends the tree of one call exactly. A subreaper per call
made by Python is a fork of the server (``preexec_fn``: +1.5 ms a call,
measured), a wrapper program an exec (+2 ms); ``_spawn.c`` sets the
attribute between vfork and exec, for no measurable cost. Without the C
helper, ``preexec_fn`` does it. The marker costs nothing at spawn; it is read from
``/proc/PID/environ`` only when something is to be killed. The kill reaches
only processes we may signal: the session's own (pid namespace, or
Landlock's signal scope).
"""

from __future__ import annotations

import ctypes
import os
import resource
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol, TypeVar

from dispatchd import procfs
from dispatchd.procfs import live_stat
from dispatchd.confine.limits import FD_PASSING_RESERVE


class _Child(Protocol):
    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...


T = TypeVar("T", bound=_Child)

__all__ = ["CHILD_BORN", "MARKER", "PROCESS_RESERVE", "SPAWNED", "Command", "Limits", "Started", "after_first_spawn",
           "apply_limits", "before_spawn", "command_limits", "kill_subtree", "KILL_BUDGET_S", "kill_tree", "live_stat",
           "new_token", "owns", "set_subreaper", "spawn", "spawn_env", "start_command"]

MARKER = "DISPATCH_CALL_ID"
PROCESS_RESERVE = 64  # processes and threads the tool server keeps for itself (at most a quarter of the session's budget)
KILL_BUDGET_S = 3.0


def new_token() -> str:
    return secrets.token_hex(8)


def spawn_env(base: Mapping[str, str], token: str) -> dict[str, str]:
    env = dict(base)
    env[MARKER] = token
    return env


_SPAWN_LOCK = threading.Lock()
_CHILDREN: dict[int, _Child] = {}  # commands spawned here, until their Popen has reaped them
CHILD_BORN = threading.Event()  # set at every spawn: the reaper waits on it when it has no child
SPAWNED = threading.Event()  # set at every spawn too: the System V watch waits on it (worker/ipcwatch.py)
_FIRST_SPAWN_LOCK = threading.Lock()
_first_spawn: list[Callable[[], bool]] = []  # see after_first_spawn


def after_first_spawn(hook: Callable[[], bool]) -> None:
    """Call ``hook`` after the next spawn, in the spawning thread, and after
    each later one until it returns True (once). The tool server starts its
    orphan reaper and its System V watch this way: before the first command
    there is no process to reap or to make a segment, and an idle session
    keeps those threads (and their stacks) fewer."""
    with _FIRST_SPAWN_LOCK:
        _first_spawn.append(hook)


_BEFORE_SPAWN: list[Callable[[], None]] = []


def before_spawn(check: Callable[[], None]) -> None:
    """Call ``check`` before every spawn, in the spawning thread; an
    ``OSError`` it raises refuses the command (the System V watch, which no
    command may run without: worker/ipcwatch.py)."""
    _BEFORE_SPAWN.append(check)


def _run_first_spawn() -> None:
    if not _first_spawn:  # the common case: done, or never asked
        return
    with _FIRST_SPAWN_LOCK:  # two calls spawning at once run each once
        _first_spawn[:] = [hook for hook in _first_spawn if not hook()]


def _command_limit(hard: int, budget: int) -> int | None:
    """The RLIMIT_NPROC commands get, or None when ours (``hard``) is unlimited.

    ``budget`` is the session's own process budget (the policy's
    ``max_processes``): the reserve is taken from it, not from the hard
    limit, which without a user namespace also counts the user's other
    processes."""
    if hard == resource.RLIM_INFINITY:
        return None
    value = hard - min(PROCESS_RESERVE, min(budget, hard) // 4)  # hard: at most all sessions' bound
    return value if 0 < value < hard else None


class Limits(NamedTuple):
    """The resource limits a command is started under (soft = hard), each
    None to leave it the tool server's."""

    processes: int | None
    files: int | None


def spawn(start: Callable[[Limits], T], budget: int) -> T:
    """``start(limits)`` (``start_command``, or a ``subprocess.Popen`` that
    applies ``limits`` in its child), its child under the command limits.

    The limits are set in the child, before its exec, never by us after the
    spawn: set after, a command that forked at once, or raised its soft limit
    back to the hard one first, kept ours. The fork itself is counted
    against our own limit, so a command starts while commands hold theirs
    (a bomb), and cannot fork past it.
    """
    for check in _BEFORE_SPAWN:
        check()
    with _SPAWN_LOCK:  # held until the child is recorded: owns() waits for it
        child = start(command_limits(budget))
        for pid in [pid for pid, c in _CHILDREN.items() if c.returncode is not None]:
            del _CHILDREN[pid]  # reaped by their Popen: their pids may be anyone's now
        _CHILDREN[child.pid] = child
    CHILD_BORN.set()
    SPAWNED.set()
    _run_first_spawn()
    return child


def command_limits(budget: int) -> Limits:
    """The limits a command gets, from ours now and the session's process
    budget (the policy's ``max_processes``)."""
    _, processes = resource.getrlimit(resource.RLIMIT_NPROC)
    _, files = resource.getrlimit(resource.RLIMIT_NOFILE)
    return Limits(_command_limit(processes, budget), _files_limit(files))


def _files_limit(hard: int) -> int | None:
    """The RLIMIT_NOFILE commands get, or None to leave them ours: ours less
    the reserve the session's own processes keep (``limits.py``)."""
    if hard == resource.RLIM_INFINITY or hard <= FD_PASSING_RESERVE:
        return None
    return hard - FD_PASSING_RESERVE


def apply_limits(limits: Limits) -> None:
    """In a command's child before its exec (``preexec_fn``): ``limits``, soft and hard."""
    for which, value in ((resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_NOFILE, limits.files)):
        if value is not None:
            resource.setrlimit(which, (value, value))


def owns(pid: int) -> bool:
    """Whether ``pid`` is a command ``spawn`` started whose ``Popen`` has not
    reaped it yet (its exit status is that Popen's). Waits for a spawn in
    progress, so a child that exits before its Popen returns is still ours."""
    with _SPAWN_LOCK:
        child = _CHILDREN.get(pid)
        return child is not None and child.returncode is None


def _has_marker(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or not ours to read (another user's, not dumpable)
        return False
    return (b"\0" + env).find(needle) >= 0


def _table() -> dict[int, tuple[int, int, int]]:
    """(ppid, pgrp, session) of every live process in our /proc."""
    table: dict[int, tuple[int, int, int]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if name.isdigit():
            st = live_stat(name)
            if st is not None:
                table[int(name)] = st
    return table


def members(leader: int | None, token: str | None) -> list[int]:
    """Live processes of the command led by ``leader`` (see the module docstring);
    ``leader`` None once it was reaped (its pid may be another's now)."""
    needle = f"\0{MARKER}={token}\0".encode() if token else None
    me = os.getpid()
    table = _table()
    found = set()
    for pid, (_ppid, pgrp, sid) in table.items():
        if pid == me:
            continue
        if leader is not None and (pgrp == leader or sid == leader or pid == leader):
            found.add(pid)
        elif needle is not None and _has_marker(str(pid), needle):
            found.add(pid)
    # Descendants of those found, whatever their environment.
    grew = True
    while grew:
        grew = False
        for pid, (ppid, _pgrp, _sid) in table.items():
            if ppid in found and pid not in found and pid != me:
                found.add(pid)
                grew = True
    return sorted(found)


def kill_tree(leader: int | None, token: str | None, budget_s: float = KILL_BUDGET_S) -> int:
    """SIGKILL everything of the command; returns how many processes were signalled.

    Call it before the leader is reaped: while its zombie holds the pid, no
    other process can take that pid as a group or session id.
    """
    if leader is not None:
        try:
            os.killpg(leader, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return _kill_rounds(lambda: members(leader, token), budget_s, 0.005)


def _kill_rounds(find: Callable[[], list[int]], budget_s: float, pause_s: float) -> int:
    """SIGKILL what ``find()`` lists, again and again until it lists none (or
    ``budget_s`` passed); how many signals were sent."""
    killed = 0
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        found = find()
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(pause_s)  # let the killed ones die, so the next look sees who is left
    return killed


class Command:
    """A command ``start_command`` started: what the tools use of a ``Popen``
    (``pid``, ``returncode``, ``poll``, ``wait``)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, flags)
                except ChildProcessError:  # reaped by someone else: as Popen, call it 0
                    pid, status = self.pid, 0
                if pid == self.pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            code = self._reap(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        while (code := self._reap(os.WNOHANG)) is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return code


def set_subreaper() -> None:  # preexec_fn, without the C helper; and the tool server (orphans.py)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


_PR_SET_CHILD_SUBREAPER = 36


Started = Command | subprocess.Popen[bytes]  # what start_command gives


def start_command(argv: list[str], env: Mapping[str, str], cwd: str, stdin: int, stdout: int,
                  stderr: int, limits: Limits = Limits(None, None)) -> Started:
    """``argv`` started in a session of its own, a child subreaper (see the
    module docstring), with these descriptors as its stdio and no other, and
    ``limits`` set in the child before its exec."""
    from dispatchd.tools import native  # the C helper, when it was built

    if native.lines is not None and min(stdin, stdout, stderr) >= 3:
        envp = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
        pid = native.lines.spawn_subreaper(
            os.fsencode(argv[0]), [os.fsencode(a) for a in argv], envp, os.fsencode(cwd), stdin, stdout, stderr,
            -1 if limits.processes is None else limits.processes, -1 if limits.files is None else limits.files)
        return Command(pid, argv)

    def before_exec() -> None:
        set_subreaper()
        apply_limits(limits)

    return subprocess.Popen(argv, cwd=cwd, env=dict(env), stdin=stdin, stdout=stdout, stderr=stderr, close_fds=True,
                            start_new_session=True, preexec_fn=before_exec)


def _live_descendants(leader: int) -> list[int]:
    """The processes below ``leader``, zombies left out."""
    return [pid for pid in procfs.descendants(leader)[1:] if live_stat(str(pid)) is not None]


def kill_subtree(leader: int, budget_s: float = KILL_BUDGET_S) -> int:
    """End every process below ``leader`` (a child subreaper, not reaped yet),
    then ``leader``; returns how many were signalled. See the module docstring."""
    try:
        os.kill(leader, signal.SIGSTOP)  # no exit, no reaping: nothing leaves its tree now
    except ProcessLookupError:
        return 0
    # A short pause: the killed exit, and hand their children to the leader.
    killed = _kill_rounds(lambda: _live_descendants(leader), budget_s, 0.001)
    try:
        os.kill(leader, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return killed

