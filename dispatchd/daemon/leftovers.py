"""What sessions leave behind in the daemon's state directory, and removing it.

A session's scratch directory (``STATE/sessions/ID``: its /tmp and home) is
removed when the session ends. A daemon killed with SIGKILL cannot do that,
so ownership is kept where the next daemon can read it:
- before making ``sessions/ID`` the daemon holds an exclusive ``flock`` on
  ``session-locks/ID.lock`` for as long as the session lives (the lock file is
  made under a temporary name, locked, then renamed into place, so nobody
  ever sees it unlocked while its daemon lives);
- at start, ``remove_stale`` removes every scratch directory whose lock it can
  take (its daemon is dead: the kernel drops a dead process's locks) and every
  directory with no lock file at all (left by a version before this one); a
  directory whose lock another live daemon holds is left alone;
- removal never follows a symlink, works by descriptor and gets through
  directories the session made unsearchable (``treewalk.remove_tree``:
  iterative, any depth, bounded in entries); what it cannot remove is logged
  and left, and the start goes on: a session's tree never stops a daemon.

``EndedSessions`` keeps why recent sessions ended, for their clients' errors.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import re
import secrets
import threading

from dispatchd import treewalk
from dispatchd.statemodes import retried

log = logging.getLogger("dispatchd.leftovers")
_SID = re.compile(r"^[0-9a-f]{12}$")  # secrets.token_hex(6), as opening.py and pooling.py name them
_ENDED_KEPT = 1024


class EndedSessions:
    """Why the last ``_ENDED_KEPT`` sessions ended (a bounded table)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._why: collections.OrderedDict[str, str] = collections.OrderedDict()

    def record(self, sid: str, why: str) -> None:
        with self._lock:
            self._why.setdefault(sid, why)  # the first cause is the one that counts
            while len(self._why) > _ENDED_KEPT:
                self._why.popitem(last=False)

    def get(self, sid: str) -> str:
        with self._lock:
            return self._why.get(sid, "")


def locks_dir(sessions_dir: str) -> str:
    """Beside ``sessions/`` (whose listing is the sessions' own business)."""
    return os.path.join(os.path.dirname(sessions_dir), "session-locks")


class ScratchLocks:
    """The daemon's flock on each live session's scratch directory."""

    def __init__(self, sessions_dir: str) -> None:
        self.dir = locks_dir(sessions_dir)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, sid: str) -> None:
        # Made, or reached, with the modes on its way set back (statemodes.py): a
        # state directory a session made 000 would refuse every open otherwise.
        retried(lambda: os.makedirs(self.dir, mode=0o700, exist_ok=True), self.dir, None)
        tmp = os.path.join(self.dir, f".{sid}.lock.{secrets.token_hex(4)}")
        fd = retried(lambda: os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                     tmp, 0o600)  # the directory's mode set back, if changed (statemodes.py)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(tmp, os.path.join(self.dir, f"{sid}.lock"))
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        with self._lock:
            self._fds[sid] = fd

    def release(self, sid: str) -> None:
        """After the scratch directory is gone: the lock file goes, then the lock."""
        with self._lock:
            fd = self._fds.pop(sid, None)
        if fd is None:
            return
        try:
            os.unlink(os.path.join(self.dir, f"{sid}.lock"))
        except OSError:
            pass
        os.close(fd)


def remove_tree(path: str) -> None:
    """Remove a scratch directory, whatever the session did to it (any depth,
    unreadable directories): never raises; what it leaves is logged."""
    left = treewalk.remove_tree(path)
    if left.skipped:
        log.error("event=scratch_not_removed path=%s entries=%d left=%r", path, left.entries, left.describe())


def plan_stale(entries: list[str], lock_entries: list[str]) -> list[str]:
    """Session ids with a scratch directory or a lock file to look at. Pure."""
    dirs = {e for e in entries if _SID.match(e)}
    locks = {e[:-5] for e in lock_entries if e.endswith(".lock") and _SID.match(e[:-5])}
    return sorted(dirs | locks)


def remove_stale(sessions_dir: str) -> int:
    """At start: remove what dead daemons' sessions left. Returns how many."""
    lock_dir = locks_dir(sessions_dir)
    try:
        entries = os.listdir(sessions_dir)
    except FileNotFoundError:
        return 0
    except OSError as exc:  # reported, and the daemon starts anyway
        log.error("event=scratch_not_removed path=%s error=%r", sessions_dir, exc.strerror)
        return 0
    try:
        lock_entries = os.listdir(lock_dir)
    except OSError:
        lock_entries = []
    removed = 0
    for sid in plan_stale(entries, lock_entries):
        lock_path = os.path.join(lock_dir, f"{sid}.lock")
        try:
            fd = os.open(lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1  # no owner recorded: a version before this one left it
        except OSError:
            continue
        try:
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live daemon's session
            scratch = os.path.join(sessions_dir, sid)
            if os.path.lexists(scratch):
                remove_tree(scratch)
                removed += 1
            if fd >= 0:
                try:
                    os.unlink(lock_path)
                except OSError:
                    pass
        finally:
            if fd >= 0:
                os.close(fd)
    # Temporary lock names of a daemon killed between open and rename.
    for entry in lock_entries:
        if entry.startswith(".") and ".lock." in entry:
            try:
                fd = os.open(os.path.join(lock_dir, entry), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(os.path.join(lock_dir, entry))
            except OSError:
                pass
            finally:
                os.close(fd)
    return removed
