"""Process hygiene for a worker: what it inherits and what it can become.

Guarantees, step by step (each raises ``ConfinementError`` naming itself):
- ``lead_session`` (the fork server's, once): a session of its own, which has
  no controlling terminal and never gets one (its leader opens no terminal);
  checked, so a terminal found there is an error, not a silent gap;
- ``new_group`` (each worker's): a process group of its own, in the fork
  server's session: no controlling terminal (so TIOCSTI has no terminal to
  push into), and signals to our group stay ours. Every worker sharing that
  one session puts them all in one scheduler group (the kernel's autogroup
  is made per session): a session each made each tool server a group of its
  own, and on a loaded machine the clients, one group for them all, got a
  share of the CPUs a ninth of the servers' (docs/performance.md). Where the
  session has a terminal after all (a process forked some other way), it
  falls back to ``new_session``: a session of its own, as before;
- ``die_with_parent``: SIGKILL when the parent dies (checked for the race);
- ``close_inherited_fds``: every descriptor but the ones named is closed;
- ``no_new_privs``: setuid binaries and file capabilities grant nothing;
- ``drop_bounding_set`` then ``drop_capabilities``: the bounding, ambient,
  effective, permitted and inheritable sets are emptied (a user-namespace
  owner has them all otherwise);
- ``not_dumpable``: /proc/<pid>/mem, environ and ptrace of the worker are refused
  to the session's commands, which run with the same uid;
- ``session_env`` (pure, planned in the daemon): the commands' environment is
  an allowlist, never the daemon's: a fixed base, the names the policy passes
  through, the policy's own settings; nothing else of the user's (no
  ``SSH_AUTH_SOCK``, no tokens) unless the policy names it.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Iterable, Mapping

from dispatchd.confine import _sys
from dispatchd.errors import ConfinementError


def _cap_last() -> int:
    """The highest capability this kernel knows (read once, at import: the fork
    server has it before it forks), so that dropping the bounding set makes no
    call the kernel refuses; 63 (every bit) when it cannot be read."""
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as f:
            return min(int(f.read()), 63)
    except (OSError, ValueError):
        return 63


_CAP_LAST = _cap_last()

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def session_env(base_env: Mapping[str, str], *, session: str, home: str, tmpdir: str,
                pass_through: Iterable[str], set_env: Mapping[str, str],
                git_identity: Mapping[str, str] | None = None,
                proxy: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a session's commands start with, in order of precedence
    (later wins): the fixed base, ``USER``/``LOGNAME`` and the policy's
    ``pass_through`` names taken from ``base_env`` (the daemon's), the git
    identity, the policy's ``set``, and the filtering proxy's variables."""
    env = {
        "PATH": DEFAULT_PATH,
        "HOME": home,
        "TMPDIR": tmpdir,
        "SHELL": "/bin/bash",
        "TERM": "dumb",
        "LANG": "C.UTF-8",
        "DISPATCH_SESSION": session,
    }
    for name in [*pass_through, "USER", "LOGNAME"]:
        if name in base_env:
            env[name] = base_env[name]
    env.update(git_identity or {})
    env.update(set_env)
    env.update(proxy or {})
    return env


def new_session() -> None:
    try:
        os.setsid()
    except OSError as exc:
        raise ConfinementError("hygiene: setsid", exc.errno) from exc


def lead_session() -> None:
    """A session of its own for the fork server, the one its workers share;
    raises if it has a controlling terminal all the same."""
    new_session()
    tty = controlling_terminal()
    if tty != 0:
        why = (f"a new session has a terminal (device {tty:#x})" if tty > 0 else
               "cannot tell whether a new session has a terminal (/proc/self/stat unreadable, /dev/tty not ENXIO)")
        raise ConfinementError("hygiene: controlling terminal", detail=f"{why}: its workers would share it")


def new_group() -> None:
    """A process group of its own, in a session with no controlling terminal:
    the fork server's, else (a terminal found) a session of its own."""
    if controlling_terminal() != 0:
        new_session()  # a session and a group of its own, no terminal
        return
    try:
        os.setpgid(0, 0)
    except OSError as exc:
        raise ConfinementError("hygiene: setpgid", exc.errno) from exc


def controlling_terminal() -> int:
    """The controlling terminal's device number (0: none), as the kernel
    keeps it (``tty_nr`` of /proc/self/stat). Where /proc/self cannot be read
    (a woken worker before its /proc is mounted), asked of /dev/tty: ENXIO
    is no terminal; anything else counts as one (the safe answer)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[4])  # after "pid (comm) ": state ppid pgrp session tty_nr
    except (OSError, ValueError, IndexError):
        pass
    try:
        fd = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        return 0 if exc.errno == errno.ENXIO else -1
    os.close(fd)
    return -1


def die_with_parent(expected_parent: int, sig: int = signal.SIGKILL) -> None:
    try:
        _sys.prctl(_sys.PR_SET_PDEATHSIG, sig)
    except OSError as exc:
        raise ConfinementError("hygiene: die with parent", exc.errno) from exc
    if os.getppid() != expected_parent:  # the parent died before the prctl
        os._exit(1)


def close_inherited_fds(keep: list[int]) -> None:
    low = 3
    for fd in sorted(keep) + [1 << 20]:
        if fd >= low:
            os.closerange(low, min(fd, 1 << 20))
        low = max(low, fd + 1)
    # stdin/stdout/stderr point at /dev/null: a worker has no terminal to talk to.
    try:
        null = os.open("/dev/null", os.O_RDWR)
    except OSError as exc:
        raise ConfinementError("hygiene: stdio to /dev/null", exc.errno, "/dev/null") from exc
    for fd in (0, 1, 2):
        if fd not in keep:
            os.dup2(null, fd)
    if null not in (0, 1, 2) and null not in keep:
        os.close(null)


def _prctl(step: str, option: int, value: int) -> None:
    """One prctl that is a whole step: refused, the step is named."""
    try:
        _sys.prctl(option, value)
    except OSError as exc:
        raise ConfinementError(f"hygiene: {step}", exc.errno) from exc


def no_new_privs() -> None:
    _prctl("no_new_privs", _sys.PR_SET_NO_NEW_PRIVS, 1)


def drop_bounding_set() -> None:
    """Empty the bounding set: no exec can gain a capability from here on. The
    capabilities in effect stay (the mounts still need them): a first step,
    ahead of ``drop_capabilities`` (about 40 calls, so it is done with the
    part of a sandbox that can be made ahead)."""
    try:
        for cap in range(_CAP_LAST + 1):
            try:
                _sys.prctl(_sys.PR_CAPBSET_DROP, cap)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # no such capability on this kernel
                    raise
    except OSError as exc:
        raise ConfinementError("hygiene: drop the bounding set", exc.errno) from exc


def drop_capabilities() -> None:
    """Every capability gone: ambient, effective, permitted, inheritable (the
    bounding set is emptied before, by ``drop_bounding_set``)."""
    try:
        _sys.prctl(_sys.PR_CAP_AMBIENT, _sys.PR_CAP_AMBIENT_CLEAR_ALL)
        _sys.clear_capabilities()
    except OSError as exc:
        raise ConfinementError("hygiene: drop capabilities", exc.errno) from exc


def not_dumpable() -> None:
    _prctl("not dumpable", _sys.PR_SET_DUMPABLE, 0)


def child_subreaper() -> None:
    _prctl("child subreaper", _sys.PR_SET_CHILD_SUBREAPER, 1)
