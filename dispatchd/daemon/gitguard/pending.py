"""A baseline record written but not yet durable (daemon side).

A domain's first record is written to a temporary file at the join, and
made durable - fsync, rename into place, fsync of the directory - by
``Durable.settle``, once, by whichever caller comes first (a thread of the
open, the write lock's grant, the domain's next write); every other caller
waits for that one and gets its outcome. Nothing that can change the
worktree runs before ``settle`` has returned None (docs/git-protection.md,
"When the baseline is on disk"). ``abandon`` drops a record whose domain
ended first: no session of it wrote (``settle`` comes before any write).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time

from dispatchd import flocks
from dispatchd.durable import fsync_directory

log = logging.getLogger("dispatchd.baselines")


class Durable:
    """A domain's first record, written to a temporary file, to be made
    durable: fsync, rename into place, fsync of the directory. ``settle``
    does it once (its first caller; the others wait for that one) and
    returns None once the record is on disk, else why not (no second try:
    the domain's next write writes the record whole, durably, and drops
    this one)."""

    def __init__(self, fd: int, tmp: str, path: str, directory: str, delay_s: float = 0.0) -> None:
        self._fd, self._tmp, self._path, self._dir = fd, tmp, path, directory
        self._delay_s = delay_s  # testing only (dispatchd --baseline-sync-delay-for-testing)
        self._lock = threading.Lock()
        self._done = False
        self._why: str | None = None

    def settle(self) -> str | None:
        with self._lock:
            if not self._done:
                self._done = True
                try:
                    if self._delay_s:
                        time.sleep(self._delay_s)
                    os.fsync(self._fd)
                    os.rename(self._tmp, self._path)
                    fsync_directory(self._dir)
                except OSError as exc:
                    self._why = f"its baseline could not be made durable in {self._dir} ({exc.strerror or exc})"
                    log.error("event=baseline_not_durable path=%s error=%r", self._path, str(exc))
                    try:
                        os.unlink(self._tmp)
                    except OSError:
                        pass  # renamed already, or gone: the start's recover drops a .tmp
                finally:
                    os.close(self._fd)
            return self._why

    def abandon(self) -> None:
        """The domain ends before its record was made durable: no session of
        it can have written (``settle`` comes first), so it goes unsynced.
        A no-op once settled."""
        with self._lock:
            if self._done:
                return
            self._done = True
            self._why = "its session has ended"
            os.close(self._fd)
            try:
                os.unlink(self._tmp)
            except OSError:
                pass


def held_elsewhere(directory: str, did: str) -> bool:
    """Whether a daemon holds ``did``'s lock (``ID.lock`` in ``directory``):
    its temporary record (``ID.json.X.tmp``) is then one being made durable
    here, or by another daemon on the state directory, not one a killed
    daemon left."""
    return flocks.held(os.path.join(directory, f"{did}.lock"))


_TEMP_LOCK_AGE_S = 60.0  # a lock under its temporary name this old is no live daemon's rename to come


def remove_strays(directory: str, names: list[str], now: float | None = None) -> list[str]:
    """What killed daemons left beside the records, none of it a live
    daemon's (the start's and a related open's ``recover``): a temporary
    record (``ID.json.X.tmp``) whose lock nobody holds; a lock without its
    record (``ID.lock``: killed between a record's removal and its lock's,
    or before its first record was made durable), removed under its own
    flock, taken at once or not at all; a lock still under its temporary
    name (``.ID.lock.X``), only once older than a minute (a live daemon
    makes, locks and renames one within microseconds). Returns the names
    removed."""
    present, removed = set(names), []
    now = time.time() if now is None else now
    for name in names:
        did = name.lstrip(".").partition(".")[0]
        path = os.path.join(directory, name)
        try:
            if name.endswith(".tmp"):
                gone = not held_elsewhere(directory, did) and _unlink(path)
            elif name.startswith(".") and ".lock." in name:
                gone = now - os.lstat(path).st_mtime >= _TEMP_LOCK_AGE_S and not flocks.held(path) and _unlink(path)
            elif name == f"{did}.lock" and f"{did}.json" not in present:
                gone = _unlink_unheld(directory, did)
            else:
                gone = False
        except OSError:
            gone = False  # gone meanwhile, or not ours to remove: looked at again at the next recover
        if gone:
            removed.append(name)
    return removed


def _unlink(path: str) -> bool:
    os.unlink(path)
    return True


def _unlink_unheld(directory: str, did: str) -> bool:
    """``ID.lock`` removed if nobody holds it and ``ID.json`` is absent,
    both looked at under the lock (only its holder writes the record)."""
    path = os.path.join(directory, f"{did}.lock")
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        if os.path.lexists(os.path.join(directory, f"{did}.json")):
            return False
        os.unlink(path)
        return True
    finally:
        os.close(fd)
