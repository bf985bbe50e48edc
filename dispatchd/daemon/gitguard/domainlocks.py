"""The lock files of the baselines' domains (``baselines/ID.lock``), and the
few kept for domains to come.

A domain's lock is an ``flock`` on ``ID.lock``, held by the daemon for as
long as the domain lives; a start of another daemon checks only records
whose lock it can take (``Baselines.recover``, ``pending.remove_strays``).

Guarantees:
- a new domain's lock is held before its name exists: made (or kept, below)
  under a temporary name ``.X.lock.Y``, locked, then renamed to ``ID.lock``;
- a domain dropped gives its lock file back to a few kept here, still
  locked, under a temporary name again (``give``): its name ``ID.lock`` is
  gone as it went by ``unlink`` before, and the next new domain renames it
  into place rather than making a file. Sessions opened back to back then
  make and free no inode for their lock (on ext4 without a journal every
  new inode skips all those freed in the last 30 s: docs/performance.md,
  "Scratch directories kept");
- a kept one is held locked under a temporary name, which a start's
  ``remove_strays`` leaves alone while held, and removes once its daemon
  is dead and a minute has passed (its mtime is its making's: a rename does
  not change it).
"""

from __future__ import annotations

import fcntl
import os
import secrets
import threading

KEEP = 4


class DomainLocks:
    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._kept: list[tuple[str, int]] = []  # (temporary name, its descriptor, locked)
        self._lock = threading.Lock()

    def take(self, did: str, blocking: bool = False) -> int | None:
        """The lock of domain ``did``: held (its descriptor), or None when a
        live daemon holds it. ``blocking``: a new domain's, which nobody else
        can hold (see the module)."""
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        path = os.path.join(self.dir, f"{did}.lock")
        if not blocking:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            return fd
        with self._lock:
            kept = self._kept.pop() if self._kept else None
        if kept is not None:
            name, fd = kept
            try:
                os.rename(os.path.join(self.dir, name), path)
                return fd
            except OSError:
                os.close(fd)  # gone: a new one below
        tmp = os.path.join(self.dir, f".{did}.lock.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(tmp, path)
        return fd

    def give(self, did: str, fd: int) -> None:
        """Domain ``did``'s lock file gone from its name (its record removed
        first by the caller); its descriptor ``fd`` closed, or kept, still
        locked, for a new domain."""
        path = os.path.join(self.dir, f"{did}.lock")
        with self._lock:
            keep = fd >= 0 and len(self._kept) < KEEP
        if keep:
            name = f".{secrets.token_hex(8)}.lock.{secrets.token_hex(4)}"
            try:
                os.rename(path, os.path.join(self.dir, name))
            except OSError:
                keep = False
            else:
                with self._lock:
                    self._kept.append((name, fd))
                return
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if fd >= 0:
            os.close(fd)
