"""Whether a process holds a lock file: ``held(path)``.

Daemons mark what is theirs with a file they keep flock'ed ``LOCK_EX`` (a
session's scratch directory, a baseline's domain): the kernel drops the lock
with the process, so a lock nobody holds is a daemon that has died. The probe
takes a shared lock of its own, let go at once, and never makes the file.
"""

from __future__ import annotations

import fcntl
import os

from dispatchd.statemodes import retried


def held(path: str) -> bool:
    """Whether a process holds ``path``'s flock (False: none, or no such file)."""
    try:
        # A lock whose mode was changed (chmod 000) would read as nobody's:
        # its mode is set back first (statemodes.py), its holder's lock stays.
        fd = retried(lambda: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), path, 0o600)
    except OSError:
        return False
    return _held(fd)


def held_at(dir_fd: int, name: str) -> bool:
    """``held`` of ``name`` below ``dir_fd``, not through a symlink, its
    mode left as it is (a file of ours in a directory of the user's)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    return _held(fd)


def _held(fd: int) -> bool:
    """Whether another process holds ``fd``'s file's flock; ``fd`` closed."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
