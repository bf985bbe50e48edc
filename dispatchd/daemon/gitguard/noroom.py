"""What a move aside does when the file system has no room for it.

The end's check moves what a session left aside by renaming it, within its
own directory, to a longer name (``fs.aside_name``). On ext4 a longer name
can need a new directory block: a session that fills the disk, then the
plant's directory with empty files until that fails too, makes the rename
fail with ENOSPC (EDQUOT over a quota). The session's processes are gone
by then, so what is freed now stays free for the daemon. In order, steps
that need no room:

1. the ballast (``Ballast``: a few MiB in the daemon's state directory,
   allocated at start and again at an open, each time only beside enough
   free room) is removed, its removal committed (an fsync of its directory:
   ext4 reuses blocks freed in its running journal transaction only once
   that commits), and the rename tried again. Only where the ballast lies
   on the plant's file system: elsewhere its room is no help, and it stays.
   Once removed, every later move on that file system tries again too,
   until an open makes the ballast anew;
2. the plant made unreadable where it is (``disarm_at``: mode 000, through
   an ``O_PATH | O_NOFOLLOW`` descriptor, ``statemodes.set_mode``): a file
   nobody but root can read or run (git stops on a config it cannot read,
   saying so; a hook without its execute bit is passed over, and git says
   that too; direnv and an agent's settings are not loaded), a directory
   whose entries nobody can reach. A symlink (it has no mode of its own) or
   another kind of file is left as it is;
3. either way the move failed, and the caller says so (the worktree is
   refused until a restart's check, with room again, moves it aside):
   ``Disarmed`` (``MADE_UNREADABLE``) when step 2 held, else the rename's
   own error.

Nothing is deleted: a mode is the one thing changed, and the report names
the path, so the user can give it back after a look.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import stat
import threading
from collections.abc import Callable

from dispatchd import statemodes
from dispatchd.durable import fsync_directory

__all__ = ["BALLAST_BYTES", "Ballast", "Disarmed", "MADE_UNREADABLE", "NO_ROOM", "disarm_at", "ensure", "moved",
           "use"]

log = logging.getLogger("dispatchd.baselines")

NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
MADE_UNREADABLE = "left in place, made unreadable (mode 000): no room to move it aside"
BALLAST_BYTES = 4 << 20  # a new directory block per plant: 1,024 of 4 KiB, 4,096 of 1 KiB
# Free room the ballast is made beside, no less: it never takes the last of
# a disk the user is filling.
BALLAST_MARGIN = 64 << 20


class Disarmed(OSError):
    """A move aside that found no room; what was to move is unreadable
    where it is (mode 000). ``strerror`` says so, for the caller's report."""


class Ballast:
    """Room kept for the end's renames: a file of ``size`` allocated bytes
    at ``path``, made whole or not at all (a temporary name, renamed)."""

    def __init__(self, path: str, size: int = BALLAST_BYTES, margin: int = BALLAST_MARGIN) -> None:
        self.path, self.size, self.margin = path, size, margin
        self._lock = threading.Lock()

    def ensure(self) -> bool:
        """Made if it is not there and the file system has its size and the
        margin free; whether it is there now. Never raises: a ballast that
        cannot be made leaves the end with step 2 (see the module)."""
        with self._lock:
            try:
                os.lstat(self.path)
                return True
            except FileNotFoundError:
                pass
            except OSError:
                return False
            try:
                st = os.statvfs(os.path.dirname(self.path))
                if st.f_bavail * st.f_frsize < self.size + self.margin:
                    return False
                self._make()
            except OSError as exc:
                log.info("event=ballast_not_made path=%s error=%r", self.path, exc.strerror)
                return False
            log.info("event=ballast_made path=%s bytes=%d", self.path, self.size)
            return True

    def _make(self) -> None:
        tmp = f"{self.path}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, self.size)  # blocks taken, none written
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                chunk = bytes(1 << 20)  # a file system without fallocate: written out
                for _ in range(0, self.size, len(chunk)):
                    os.write(fd, chunk)
            os.rename(tmp, self.path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        finally:
            os.close(fd)

    def release(self, dev: int) -> bool:
        """For a move on the file system ``dev`` that found no room: the
        ballast removed, if there, and its removal committed. True when it
        lies on that file system (removed now or by an earlier move since
        it was made): the move is worth trying again."""
        with self._lock:
            directory = os.path.dirname(self.path)
            try:
                if os.stat(directory).st_dev != dev:
                    return False
                os.unlink(self.path)
            except FileNotFoundError:
                return True
            except OSError as exc:
                log.warning("event=ballast_not_released path=%s error=%r", self.path, exc.strerror)
                return False
            try:
                fsync_directory(directory)
            except OSError:
                pass  # the rename is tried all the same
            log.warning("event=ballast_released path=%s", self.path)
            return True


_ballast: list[Ballast] = []  # the daemon's (``use``); none: a move that finds no room frees nothing


def use(ballast: Ballast | None) -> None:
    """The ballast moves free from now on (None: none), made now if it can be."""
    _ballast[:] = [ballast] if ballast is not None else []
    ensure()


def ensure() -> None:
    """The ballast made again if a move freed it and there is room (an open)."""
    for ballast in _ballast:
        ballast.ensure()


def disarm_at(dir_fd: int | None, name: str) -> int | None:
    """``name`` (below ``dir_fd``; a path when None) made mode 000, never
    through a symlink; its number of names (a hard link's other names are
    the same file: unreadable too), or None when it was left as it is (a
    symlink, another kind, another uid's)."""
    fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        changed = statemodes.set_mode(fd, 0, statemodes.FILES_AND_DIRS)
        if changed is None:
            return None
        # Debug: one a plant, and a session can leave thousands; the check's failure line names each.
        log.debug("event=no_room_made_unreadable name=%s was=%s", name, oct(changed[0]))
        st = os.fstat(fd)
        return st.st_nlink if stat.S_ISREG(st.st_mode) else 1
    finally:
        os.close(fd)


def moved(rename: Callable[[], str], device: Callable[[], int], disarm: Callable[[], int | None]) -> str:
    """``rename()``'s new name; when it finds no room, the steps of the
    module: the ballast released and ``rename()`` again, then ``disarm()``
    and ``Disarmed`` raised. Any other error is raised as it is; so is the
    first one when nothing could be made unreadable."""
    first = _tried(rename)
    if isinstance(first, str):
        return first
    try:
        dev = device()
    except OSError:
        dev = -1
    if dev >= 0 and any(b.release(dev) for b in _ballast):
        again = _tried(rename)
        if isinstance(again, str):
            return again
        first = again
    try:
        links = disarm()
    except OSError as exc:
        log.debug("event=no_room_not_made_unreadable error=%r", exc.strerror)
        raise first from None
    if links is None:
        raise first
    others = "" if links < 2 else ("; its other name is the same file, unreadable too" if links == 2 else
                                   f"; its {links - 1} other names are the same file, unreadable too")
    raise Disarmed(first.errno, MADE_UNREADABLE + others) from first


def _tried(rename: Callable[[], str]) -> str | OSError:
    """``rename()``'s new name, or the error that says it found no room
    (any other is raised)."""
    try:
        return rename()
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        return exc
