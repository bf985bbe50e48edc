"""Files of the baselines' directory kept for the next domain: its lock
file (``ID.lock``) and its record's (``ID.json``).

Sessions opened back to back each make a new domain, whose lock and record
were two new inodes, freed at its end. On ext4 without a journal every new
inode skips all those freed in the last 30 s (docs/performance.md,
"Scratch directories kept"), so each was dearer than the last; a file kept
and renamed costs none.

A domain's lock is an ``flock`` on ``ID.lock``, held by the daemon for as
long as the domain lives; a start of another daemon checks only records
whose lock it can take (``Baselines.recover``, ``pending.remove_strays``).

Guarantees:
- a new domain's lock is held before its name exists: made (or kept, below)
  under a temporary name ``.X.lock.Y``, locked, then renamed to ``ID.lock``;
- a domain dropped gives its lock file back (``DomainLocks.give``), still
  locked, under a temporary name again: its name ``ID.lock`` is gone as by
  ``unlink`` before, and the next new domain renames it into place. A start
  of another daemon leaves a held one alone (``remove_strays``), and removes
  it once its daemon is dead and a minute has passed;
- a dropped domain's record is renamed, not unlinked, to a temporary record
  name of this daemon's own *keeper* (``kept-K.json.X.tmp``, ``kept-K.lock`` held for
  the daemon's life, never a domain), and used again only once the caller
  has made that rename durable (``RecordFiles.kept``, after the directory's
  fsync): its old name can never come back over another domain's bytes. Its
  next use renames it to the new record's temporary name (whose domain's
  lock is held), empties it and writes it, as a new file was: the record
  takes its name only once written and synced (``pending.Durable``). A
  start of another daemon removes a dead keeper's files (a lone lock, a
  temporary record whose lock nobody holds);
- at most ``KEEP`` of each.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import stat
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


class RecordFiles:
    """Record files kept for the next domain's first record (see the module)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._keeper_fd = -1
        self._keeper = ""
        self._kept: list[str] = []  # names of kept files, their renames durable
        self._lock = threading.Lock()

    def open(self, path: str) -> tuple[str, int]:
        """A temporary file for the record ``path`` (``path.X.tmp``) and its
        descriptor, open for writing and empty: a kept one, else made."""
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        with self._lock:
            kept = self._kept.pop() if self._kept else None
        if kept is not None:
            try:
                os.rename(os.path.join(self.dir, kept), tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                pass  # gone meanwhile: a new one
            else:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.getuid():
                    os.ftruncate(fd, 0)
                    return tmp, fd
                os.close(fd)
                os.unlink(tmp)
        return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)

    def give(self, path: str, keep: bool = True) -> str | None:
        """The record ``path`` gone from its name: renamed to a name of the
        keeper's (returned: give it to ``kept`` once the directory's fsync
        made the rename durable), or unlinked (None; always, without ``keep``)."""
        with self._lock:
            keep = keep and len(self._kept) < KEEP
        name = self._keeper_name() if keep else None
        if name is not None:
            try:
                os.rename(path, os.path.join(self.dir, name))
                return name
            except FileNotFoundError:
                return None
            except OSError:
                pass
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return None

    def reuse(self, tmp: str) -> None:
        """A record's temporary file that never took the record's name (its
        domain ended first): kept at once, else unlinked."""
        with self._lock:
            full = len(self._kept) >= KEEP
        name = None if full else self._keeper_name()
        try:
            if name is None:
                os.unlink(tmp)
                return
            os.rename(tmp, os.path.join(self.dir, name))
        except OSError:
            return  # gone already
        self.kept(name)

    def kept(self, name: str | None) -> None:
        """``give``'s rename is durable: the file may serve a new record."""
        if name is not None:
            with self._lock:
                self._kept.append(name)

    def _keeper_name(self) -> str | None:
        with self._lock:
            if self._keeper_fd < 0:
                # Its lock, held before its name exists (as a domain's).
                keeper = f"kept-{secrets.token_hex(8)}"  # never a domain's id (16 hex digits)
                tmp = os.path.join(self.dir, f".{keeper}.lock.{secrets.token_hex(4)}")
                try:
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                except OSError:
                    return None
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.rename(tmp, os.path.join(self.dir, f"{keeper}.lock"))
                except OSError:
                    os.close(fd)
                    return None
                self._keeper_fd, self._keeper = fd, keeper
            return f"{self._keeper}.json.{secrets.token_hex(4)}.tmp"
