"""Whether a process holds a lock file: ``held(path)``.

Daemons mark what is theirs with a file they keep flock'ed ``LOCK_EX`` (a
session's scratch directory, a baseline's domain): the kernel drops the lock
with the process, so a lock nobody holds is a daemon that has died. The probe
takes a shared lock of its own, let go at once, and never makes the file.
"""

from __future__ import annotations

import fcntl
import os


def held(path: str) -> bool:
    """Whether a process holds ``path``'s flock (False: none, or no such file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
