"""The worktrees every daemon of the user has sessions on: ``InUse``.

Daemons of one user may run side by side (the systemd service and one
started by hand on a socket of its own), on one state directory or on
several (another ``XDG_STATE_HOME``). Each keeps its own trusted baseline
of a worktree and its own keep of the repository's objects (``gitguard/``),
so their sessions must not use one worktree, one inside the other, or two
worktrees of one repository at the same time (``claims.py`` says why, and
refuses the open); this is where each daemon says which it uses.

On disk, in one directory of the user's whatever the state directory
(``inusedir.py``: ``~/.local/state/dispatchd/inuse/`` of the passwd entry's
home, 0700; ``STATE/inuse/`` when that cannot be used): entries
(``TOKEN.N.uses``), each flock'ed ``LOCK_EX`` by its daemon from when it is
made, of ``SIZE`` bytes: a session's use (its session, daemon pid,
worktree, repository's common directory, time, and the daemon's state
directory, where its baseline records are, in JSON, padded with spaces) from the open until the
session's end, else spaces (a spare). A claim writes a spare in place, one
page in one ``pwrite``, under the mutex every reader holds (a page written
while it is read may be read half old, half new), as a release does: making a
file on an open's path waited behind the file system's journal, which the
baselines' fsyncs keep busy (0.9 ms p50 back to back, against 0.02 written
in place). ``prepare`` makes the spares (the start), and a release keeps
its entry as one up to ``SPARES``. ``.mutex``: every claim and look holds
its flock.

Guarantees:
- an entry counts only while its file is locked: the kernel drops a killed
  daemon's locks with it, at any step; such an entry stays on disk, listed
  to the claims it relates to, until ``forget_dead`` (its daemon's baselines
  are checked first, in the state directory the entry names: ``claims.py``);
- a claim is decided and recorded under the mutex, which every look holds:
  two daemons never both claim related worktrees, and no entry is seen half
  made (one a killed daemon left half made is unlocked: dead);
- an entry that is locked and cannot be read relates to every worktree
  (fail closed); one of spaces only is a spare (nothing; removed when dead);
- what cannot be written or read (the state directory full, unwritable)
  raises ``OSError``: the caller refuses the open;
- a daemon's entries are many daemons' reading (every daemon of the user):
  one that is made and given back stays one page written in place.

This daemon's own entries are not consulted: its baselines' domains are exact
for its own sessions.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import os
import stat
import secrets
import threading
import time
from dataclasses import dataclass

from dispatchd.inside import worktrees_relate
from dispatchd.statemodes import retried

__all__ = ["MUTEX_WAIT_S", "InUse", "Use"]

MUTEX_WAIT_S = 2.0  # each step under the mutex takes well under a millisecond
SIZE = 4096  # an entry: one page (a longer use gets a file of its own)
SPARES = 4  # entries kept ready: back to back, a claim takes one and its release gives it back
_SUFFIX = ".uses"


@dataclass(frozen=True)
class Use:
    """Another daemon's session on ``worktree`` (of the repository whose
    common git directory is ``common``, "" without one)."""

    session: str
    pid: int
    worktree: str
    since: float
    common: str = ""
    state: str = ""  # its daemon's state directory (its baselines' records); "": not known (unreadable)

    def relates(self, worktree: str, common: str) -> bool:
        """Whether ``worktree`` relates to this one (``worktrees_relate``)."""
        return worktrees_relate(worktree, common, self.worktree, self.common)


_UNREADABLE = Use("?", 0, "/", 0.0)  # "/" overlaps every worktree


class InUse:
    """This daemon's entries in ``directory``, and its looks at the others'."""

    def __init__(self, directory: str, pid: int | None = None, state: str = "") -> None:
        self.dir = directory
        self.state = state  # this daemon's state directory, in each entry, for a recovery after its death
        self.pid = os.getpid() if pid is None else pid
        self.token = f"{self.pid}-{secrets.token_hex(4)}"  # a pid is reused; this daemon is not
        self._fds: dict[str, tuple[str, int]] = {}  # session -> its entry's name and locked descriptor
        self._spares: list[tuple[str, int]] = []  # entries of spaces, locked, ready for a claim
        self.unreadable: set[str] = set()  # dead entries seen that could not be read (they relate to all)
        self._made = itertools.count()
        self._lock = threading.Lock()
        self._mutex = _Mutex(directory)

    def prepare(self) -> None:
        """Spare entries made ahead, up to ``SPARES`` (off an open's path)."""
        with self._lock, self._mutex:
            while len(self._spares) < SPARES:
                name = f"{self.token}.{next(self._made)}{_SUFFIX}"
                self._spares.append((name, self._make(name, b" " * SIZE)))

    def claim(self, session: str, worktree: str, common: str) -> tuple[Use | None, list[tuple[str, Use]]]:
        """Record that ``session`` uses ``worktree`` (of the repository whose
        common directory is ``common``), or return the other daemon's session
        that uses a related one (nothing recorded then). With the claim: the
        entries of related sessions of daemons that have died, by name with
        what they say, as ``dead`` reads them (``forget_dead`` takes their
        names once their baselines are checked)."""
        dead: list[tuple[str, Use]] = []
        with self._lock, self._mutex:
            for use in self._live(dead):
                if use.relates(worktree, common):
                    return use, []
            self._put(session, worktree, common)
        return None, [(name, use) for name, use in dead if use.relates(worktree, common)]

    def look(self, worktree: str, common: str) -> tuple[Use | None, list[tuple[str, Use]]]:
        """What ``claim`` would find, recording nothing (no file made: an
        open's look, its record made beside the sandbox's start)."""
        dead: list[tuple[str, Use]] = []
        with self._lock, self._mutex:
            for use in self._live(dead):
                if use.relates(worktree, common):
                    return use, []
        return None, [(name, use) for name, use in dead if use.relates(worktree, common)]

    def release(self, session: str) -> None:
        """``session``'s entry given back (at its end): spaces again, kept as
        a spare (up to ``SPARES``), or removed, then unlocked."""
        with self._lock:
            entry = self._fds.pop(session, None)
            if entry is not None:
                self._give_back(*entry)

    def _give_back(self, name: str, fd: int, mutex_held: bool = False) -> None:
        """Under ``_lock``: the entry rewritten to spaces under the mutex (a
        page written while another daemon reads it may be read half old, half
        new: what it reads is written only under the mutex it reads under),
        kept as a spare; or, past ``SPARES``, or that failing, removed (it
        was never readable half made: removed, then unlocked)."""
        st = os.fstat(fd)
        if len(self._spares) < SPARES and st.st_size == SIZE and st.st_nlink > 0:
            try:
                if mutex_held:
                    _write_whole(fd, b" " * SIZE)
                else:
                    with self._mutex:
                        _write_whole(fd, b" " * SIZE)
                self._spares.append((name, fd))
                return
            except OSError:
                pass
        try:
            _unlink(os.path.join(self.dir, name))
        except OSError:
            pass  # left unlocked: dead, for the others' next claim
        os.close(fd)

    def dead(self) -> list[tuple[str, Use]]:
        """The entries of daemons that have died, by name (a start's: noted
        before it finishes what they left, forgotten after)."""
        found: list[tuple[str, Use]] = []
        with self._lock, self._mutex:
            self._live(found)
        return found

    def forget_dead(self, names: list[str]) -> None:
        """Remove these entries, if their daemon is gone."""
        with self._lock, self._mutex:
            for name in names:
                if name.endswith(_SUFFIX) and not name.startswith(self.token + "."):
                    path = os.path.join(self.dir, name)
                    read = self._read(path)
                    if read is not None and not read[1]:  # nobody holds it: never locked again (its name is
                        _unlink(path)  # its daemon's alone)

    # --- under the mutex -----------------------------------------------------

    def _live(self, dead: list[tuple[str, Use]]) -> list[Use]:
        """The other daemons' entries whose files are locked; ``dead``: those
        that are not (left on disk)."""
        found: list[Use] = []
        try:
            names = retried(lambda: os.listdir(self.dir), self.dir, None)  # its mode set back (statemodes.py)
        except FileNotFoundError:
            return found
        for name in names:
            if not name.endswith(_SUFFIX) or name.startswith(self.token + "."):
                continue
            read = self._read(os.path.join(self.dir, name))
            if read is None:
                continue
            text, live = read
            if not text.strip():  # a spare: nothing; a dead daemon's, removed
                if not live:
                    _unlink(os.path.join(self.dir, name))
                continue
            try:
                e = json.loads(text)
                # An entry that names no state directory was made by a daemon that kept the
                # table in its state directory: the table's parent.
                use = Use(str(e["session"]), int(e["pid"]), str(e["worktree"]), float(e["since"]),
                          str(e.get("common", "")), str(e.get("state", "")) or os.path.dirname(self.dir))
            except (ValueError, KeyError, TypeError):
                use = _UNREADABLE
                if not live:
                    self.unreadable.add(name)
            if live:
                found.append(use)
            else:
                dead.append((name, use))
        return found

    @staticmethod
    def _read(path: str) -> tuple[bytes, bool] | None:
        """An entry's text, and whether its daemon holds it; None: gone."""
        try:
            fd = retried(lambda: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), path,
                         0o600)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
                return None  # another user's (made while others could write here: inusedir.py), or no file: never read
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return os.pread(fd, 65536, 0), True
            if os.fstat(fd).st_nlink == 0:
                return None  # released meanwhile (removed, then unlocked, outside the mutex): gone, not dead
            return os.pread(fd, 65536, 0), False
        finally:
            os.close(fd)

    def _put(self, session: str, worktree: str, common: str) -> None:
        """This daemon's entry (under the mutex: nobody looks before it is
        whole): a spare written in place, or a file made now."""
        if session in self._fds:
            return
        entry: dict[str, object] = {"session": session, "pid": self.pid, "worktree": worktree, "since": time.time()}
        if common:
            entry["common"] = common
        if self.state:
            entry["state"] = self.state
        data = json.dumps(entry).encode()
        while self._spares and os.fstat(self._spares[-1][1]).st_nlink == 0:
            os.close(self._spares.pop()[1])  # removed meanwhile (the directory with it): no one would read it
        if self._spares and len(data) <= SIZE:
            name, fd = self._spares.pop()
            try:
                _write_whole(fd, data.ljust(SIZE))
            except BaseException:
                self._give_back(name, fd, mutex_held=True)  # spaces again, or gone: never a page half written
                raise
            self._fds[session] = (name, fd)
            return
        name = f"{self.token}.{next(self._made)}{_SUFFIX}"
        self._fds[session] = (name, self._make(name, data.ljust(SIZE) if len(data) <= SIZE else data))

    def _make(self, name: str, data: bytes) -> int:
        """A new entry holding ``data``, locked (under the mutex)."""
        path = os.path.join(self.dir, name)
        _unlink(path)  # one this daemon could not remove before (its name is ours alone, and unlocked)
        fd = retried(lambda: os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                     path, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it
            _write_whole(fd, data)
        except BaseException:
            _unlink(path)
            os.close(fd)
            raise
        return fd


class _Mutex:
    """``.mutex``'s flock, waited for at most ``MUTEX_WAIT_S`` (a daemon
    stopped while holding it is said, not waited for for ever). Opened at
    each use (the daemon keeps no descriptor between claims), and again when
    the file locked is not the one at its path any more (the directory
    removed and made again meanwhile): every daemon locks the same. Used
    under ``InUse._lock``: one thread at a time."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.path = os.path.join(directory, ".mutex")
        self.fd = -1

    def __enter__(self) -> _Mutex:
        deadline = time.monotonic() + MUTEX_WAIT_S
        while True:
            if self.fd < 0:
                # The directory above may be the one made 000 (the table's, or the state
                # directory): made or reached with the modes on its way set back too.
                retried(lambda: os.makedirs(self.dir, mode=0o700, exist_ok=True), self.dir, None)
                self.fd = retried(lambda: os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                                  0o600), self.path, 0o600)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self.fd)
                    self.fd = -1
                    raise OSError(errno.EWOULDBLOCK, f"the table of worktrees in use {self.dir} is held by "
                                                     f"another daemon for over {MUTEX_WAIT_S:g} s") from None
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
    if os.pwrite(fd, data, 0) != len(data):
        raise OSError(errno.ENOSPC, "a short write")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
