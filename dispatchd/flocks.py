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
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
