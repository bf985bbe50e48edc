"""The writers every daemon on one state directory sees: ``Writers``.

Daemons of one user may share a state directory (the systemd service and one
started by hand on a socket of its own). Each keeps its own sessions' write
locks in memory (``writelock.py``); this is what makes "one writer per
worktree" hold across them, so that a checkpoint's restore, a writer's sweep
of temporary files and the git protection's end-of-session check never meet
a second daemon's session writing the same files.

On disk, in ``STATE/writers/`` (0700):
- an entry per session of this daemon that holds a worktree's lock
  (``TOKEN.SID.held``) or gave one back while its processes may still write
  (``TOKEN.SID.loose``): its session, daemon pid, worktree and time, in JSON,
  the file flock'ed ``LOCK_EX`` by its daemon for as long as it stands;
- ``grants``: the count of grants (with the log's own random epoch), and the
  last ``LOG`` of them (which daemon, which worktree), for the swept marks of
  ``writelock.py``;
- ``.mutex``: every grant, give-back and look holds its flock (a removal only
  unlinks this daemon's own entry, then unlocks it).

Guarantees:
- an entry counts only while its file is locked: the kernel drops a killed
  daemon's locks with it (at any step), and the next look removes its files;
- an entry is made, locked and written under the mutex, which every look
  holds: none is seen half made; one a killed daemon left half made is
  unlocked, and removed as any other;
- a grant is decided and recorded under the mutex: two daemons never both
  grant overlapping worktrees (``inside.overlap``, the rule within one
  daemon); one held by another daemon's session, or one inside or around it,
  is refused, naming that session and its daemon's pid;
- a grant also says whether a ``mark`` (taken when this daemon swept the
  worktree) still stands: it does only when the log shows no other daemon's
  grant of an overlapping worktree since, and not when that cannot be known
  (the log no longer reaches back, was replaced, or cannot be read);
- what cannot be written or read (the state directory full, unwritable)
  raises ``OSError``: the caller refuses the grant (fail closed).

This daemon's own entries are not consulted here: its in-memory table is
exact for its sessions, and answers first.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass

from dispatchd.inside import overlap

__all__ = ["LOG", "MUTEX_WAIT_S", "Foreign", "Mark", "Writers"]

LOG = 64  # the grants remembered: a swept mark older than that is not trusted
MUTEX_WAIT_S = 2.0  # each step under the mutex takes well under a millisecond
_KINDS = ("held", "loose")
Mark = tuple[str, int]  # the grants log's epoch, and its count of grants then
_Log = tuple[str, int, list[tuple[int, str, str]]]  # epoch, count, the last grants (count, daemon, worktree)


@dataclass(frozen=True)
class Foreign:
    """Another daemon's session that holds (or, ``loose``, gave back while its
    processes live) the lock of ``worktree``."""

    session: str
    pid: int
    worktree: str
    since: float
    loose: bool = False


class Writers:
    """This daemon's entries in ``directory``, and its looks at the others'."""

    def __init__(self, directory: str, pid: int | None = None) -> None:
        self.dir = directory
        self.pid = os.getpid() if pid is None else pid
        self.token = f"{self.pid}-{secrets.token_hex(4)}"  # a pid is reused; this daemon is not
        self._fds: dict[tuple[str, str], int] = {}  # (session, kind) -> its entry's locked descriptor
        self._lock = threading.Lock()
        self._mutex = _Mutex(directory)

    # --- what the write locks ask --------------------------------------------

    def grant(self, session: str, worktree: str, mark: Mark | None = None) -> tuple[Foreign | None, bool]:
        """Record ``session`` as ``worktree``'s writer, or the other daemon's
        session that holds it or an overlapping one (nothing recorded then);
        and whether ``mark`` stands: no other daemon granted an overlapping
        worktree since it was taken (False without one)."""
        with self._lock, self._mutex:
            for entry in self._live():
                if not entry.loose and overlap(entry.worktree, worktree):
                    return entry, False
            log = self._read_log()
            stands = mark is not None and log is not None and self._stands(mark, log, worktree)
            # The log first: a grant logged whose entry then fails only keeps
            # a mark from standing; an entry left whose grant failed would
            # hold the worktree for a session that holds nothing.
            self._log_grant(log, worktree)
            self._put(session, "held", worktree)
        return None, stands

    def give_back(self, session: str) -> None:
        """``session`` gives its locks back while its processes may still write:
        its entry becomes loose (no grant is refused for it, no sweep trusted)."""
        with self._lock:
            fd = self._fds.get((session, "held"))
            if fd is None:
                return
            with self._mutex:
                worktree = json.loads(os.pread(fd, 65536, 0))["worktree"]
                if (session, "loose") not in self._fds:
                    self._put(session, "loose", worktree)
            self._drop(session, "held")

    def release(self, session: str) -> None:
        """``session``'s entries gone (its processes are): removed, then unlocked."""
        with self._lock:
            for kind in _KINDS:
                self._drop(session, kind)

    def mark(self) -> Mark | None:
        """Where the grants log stands (any daemon's grants): what a swept
        mark remembers; None when it cannot be read (no mark then)."""
        with self._lock, self._mutex:
            log = self._read_log()
        return None if log is None else (log[0], log[1])

    def _stands(self, mark: Mark, log: _Log, worktree: str) -> bool:
        epoch, count, last = log
        if epoch != mark[0] or count < mark[1] or count - mark[1] > len(last):
            return False  # another log since, or one that no longer reaches back that far
        return not any(n > mark[1] and daemon != self.token and overlap(w, worktree) for n, daemon, w in last)

    def foreign_loose(self, worktree: str) -> Foreign | None:
        """Another daemon's session that gave back an overlapping worktree's
        lock and may still be writing it."""
        with self._lock, self._mutex:
            return next((e for e in self._live() if e.loose and overlap(e.worktree, worktree)), None)

    # --- under the mutex -----------------------------------------------------

    def _live(self) -> list[Foreign]:
        """The other daemons' entries whose files are locked; those that are
        not (their daemon is gone) removed."""
        found: list[Foreign] = []
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return found
        for name in names:
            token, _, rest = name.partition(".")
            kind = rest.rpartition(".")[2]
            if kind not in _KINDS or token == self.token:
                continue
            text = self._read_if_locked(name)
            if text is None:
                continue
            try:
                e = json.loads(text)
                found.append(Foreign(str(e["session"]), int(e["pid"]), str(e["worktree"]), float(e["since"]),
                                     kind == "loose"))
            except (ValueError, KeyError, TypeError):
                # Locked, so live, but unreadable: counted as holding everything (fail closed).
                found.append(Foreign("?", 0, "/", 0.0, kind == "loose"))
        return found

    def _read_if_locked(self, name: str) -> bytes | None:
        """An entry's text while its daemon holds it; None (and the file
        removed) once nobody does."""
        path = os.path.join(self.dir, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 65536, 0)
            # Nobody holds it: its daemon has gone. Entries are never locked
            # again once released (their names are their daemon's alone).
            _unlink(path)
            return None
        finally:
            os.close(fd)

    def _put(self, session: str, kind: str, worktree: str) -> None:
        """This daemon's entry (under the mutex: nobody looks before it is whole);
        one it has already (a give-back that could not record its loose entry
        kept the held one) is kept."""
        if (session, kind) in self._fds:
            return
        data = json.dumps({"session": session, "pid": self.pid, "worktree": worktree, "since": time.time()}).encode()
        path = os.path.join(self.dir, f"{self.token}.{session}.{kind}")
        _unlink(path)  # one this daemon could not remove before (its name is ours alone, and unlocked)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
            _write_whole(fd, data)
        except BaseException:
            _unlink(path)
            os.close(fd)
            raise
        self._fds[(session, kind)] = fd

    def _drop(self, session: str, kind: str) -> None:
        fd = self._fds.pop((session, kind), None)
        if fd is not None:
            try:
                _unlink(os.path.join(self.dir, f"{self.token}.{session}.{kind}"))  # gone before unlocked
            except OSError:
                pass  # left unlocked: the other daemons' next look removes it, this one's next _put
            os.close(fd)

    def _read_log(self) -> _Log | None:
        """The grants log; None when there is none, or it cannot be read
        (the next grant starts another, under a new epoch)."""
        try:
            with open(os.path.join(self.dir, "grants"), "rb") as f:
                data = json.loads(f.read())
            return (str(data["epoch"]), int(data["count"]),
                    [(int(n), str(d), str(w)) for n, d, w in data["last"]])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError):
            return None

    def _log_grant(self, log: _Log | None, worktree: str) -> None:
        """Written in place, under the mutex (a rename costs an ext4 journal
        entry more): a daemon killed half way leaves it unreadable, and so
        trusted by no mark, and the next grant starts another."""
        epoch, count, last = log if log is not None else (secrets.token_hex(8), 0, [])
        count += 1
        text = json.dumps({"epoch": epoch, "count": count, "last": (last + [(count, self.token, worktree)])[-LOG:]})
        data = text.encode()
        fd = os.open(os.path.join(self.dir, "grants"), os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            _write_whole(fd, data)
            os.ftruncate(fd, len(data))
        finally:
            os.close(fd)


class _Mutex:
    """``.mutex``'s flock, waited for at most ``MUTEX_WAIT_S`` (a daemon
    stopped while holding it is said, not waited for for ever). Opened at
    each use (the daemon keeps no descriptor between grants), and again when
    the file locked is not the one at its path any more (the directory
    removed and made again meanwhile): every daemon locks the same. Used
    under ``Writers._lock``: one thread at a time."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.path = os.path.join(directory, ".mutex")
        self.fd = -1

    def __enter__(self) -> _Mutex:
        deadline = time.monotonic() + MUTEX_WAIT_S
        while True:
            if self.fd < 0:
                os.makedirs(self.dir, mode=0o700, exist_ok=True)
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    raise OSError(errno.EWOULDBLOCK, f"the writers' table {self.dir} is held by another "
                                                     f"daemon for over {MUTEX_WAIT_S:g} s") from None
                time.sleep(0.001)
                continue
            mine = os.fstat(self.fd)
            try:
                there = os.stat(self.path, follow_symlinks=False)
                if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                    return self
            except FileNotFoundError:
                pass
            os.close(self.fd)  # not the file the others lock: theirs, from the start
            self.fd = -1

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)
        self.fd = -1


def _write_whole(fd: int, data: bytes) -> None:
    """``data`` at the file's start, all of it, or OSError (a short write:
    the file system full)."""
    if os.pwrite(fd, data, 0) != len(data):
        raise OSError(errno.ENOSPC, "a short write")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
