"""Git's own lock on one ref, taken as git takes it, for every ref the end
writes back or takes out: the user's git, committing or packing refs in
the same repository at that moment, and the end never write one ref over
the other.

Git updates a loose ref by making ``<ref>.lock`` with ``O_CREAT | O_EXCL``,
reading the ref under it, writing the new value into the lock file and
renaming it over the ref; its ``git pack-refs`` takes the same lock before
it prunes a loose file. ``held`` does the same:

- the lock is made ``O_EXCL | O_NOFOLLOW`` (a symlink or a file in its
  place is the user's git's lock, or one it left): while it is there, it is
  tried again for up to ``WAIT_S`` (git itself waits 100 ms, and holds a
  ref's lock for less). One still there then was left: by a git that was
  killed, or by a session, whose processes are all gone at the end that
  puts refs back (the last one). It is moved aside (kept, never deleted:
  ``Lock.moved`` names where, for the report) and the lock taken, since a
  lock left in the way would otherwise keep whatever move of the ref a
  session made (a session plants ``main.lock``, and its commit stays the
  user's ``main``). Where it cannot be moved, ``Held`` is raised and the
  ref is left as it is. A ref is never written without its lock;
- the caller reads the ref again once the lock is its (``refsback``): what
  it replaces is the value git has at that moment, not one read before;
- ``Lock.commit`` renames the lock file, which holds the value, over the
  ref (a directory in the way, a session's, moved aside first);
  ``Lock.remove`` unlinks the loose ref (its value kept by the caller);
  the lock file is removed however the block ends otherwise.

A daemon killed between the lock's making and its rename leaves
``<ref>.lock`` with a second name of ours (``held`` says how): the next
start's check removes that lock and writes the ref, and its sweep the other
name (``reftemp.sweep``). Git's own stale lock (a git killed) is git's: the
end leaves that ref and says so (``Held``), as git refuses to update it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterator

from dispatchd.daemon.gitguard import fs, reftemp

WAIT_S = 1.0  # git's own wait for a ref's lock is 100 ms (core.filesRefLockTimeout); a commit holds it for less
_POLL_S = 0.01


class Held(OSError):
    """The lock of a ref is someone else's (the user's git), past ``WAIT_S``."""

    def __init__(self, name: str) -> None:
        super().__init__(errno.EEXIST, f"git's lock {name}.lock is held (your git is writing the ref, or left it)")
        self.name = name


class Lock:
    """A ref's lock, ours while the ``held`` block runs."""

    def __init__(self, common: str, name: str, dir_fd: int) -> None:
        self.common, self.name = common, name
        self.path = os.path.join(common, name)
        self.leaf = os.path.basename(self.path)
        self._dir_fd = dir_fd
        self.done = False  # the lock file renamed over the ref: nothing to remove
        self.moved = ""  # where a lock left in the way was moved aside, if one was

    def commit(self) -> None:
        """The ref made to hold the value the lock was taken with."""
        if fs.is_dir(self.path):  # a directory in the way (a session's): moved aside, never deleted
            fs.move_aside(self.path)
        os.rename(self.leaf + ".lock", self.leaf, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self.done = True

    def rewrite(self, data: bytes, mode: int) -> None:
        """The lock file (ours, both its names) made to hold ``data`` with
        ``mode``, durable: what ``commit`` then puts in place of a whole file
        read under the lock (``packed-refs``)."""
        fd = os.open(self.leaf + ".lock", os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=self._dir_fd)
        try:
            reftemp.write_whole(fd, data, mode)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """The loose ref unlinked (its value kept by the caller first); none there is no error."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.leaf, dir_fd=self._dir_fd)


@contextlib.contextmanager
def held(common: str, name: str, value: str = "", wait_s: float | None = None, *,
         move_left: bool = True) -> Iterator[Lock]:
    """``name``'s lock (``<common>/<name>.lock``) for the block, holding
    ``value`` (what ``Lock.commit`` makes the ref; "" for a lock taken to
    remove it); its directories made first (a file of a session's in the
    way moved aside, ``reftemp.make_room``). Raises ``Held`` when the lock
    stays someone else's for ``wait_s`` (None: ``WAIT_S``) and cannot be
    moved aside, or ``move_left`` is False: ``packed-refs.lock`` (git's
    ``pack-refs`` of many refs holds it for seconds, and its rename after a
    takeover put back what the end took out) and a loose ref's lock taken
    only to remove a ref a session made are waited for, never moved.

    The lock is made whole before it appears: the value is written and
    fsynced under a name of our own (``reftemp.temp_name``), which is then
    hard-linked to ``<name>.lock`` (``link`` fails on an existing name, as
    ``O_EXCL`` does). A lock so made has two names until it is renamed
    over the ref, where git's own lock has one: one found with two is what
    a daemon killed there left (its other name is swept at the next start),
    and is removed, not waited for, so that the ref is not left for good."""
    path = reftemp.make_room(common, name)
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    leaf = os.path.basename(path)
    try:
        tmp = reftemp.write_temp(dir_fd, leaf, (value + "\n").encode("utf-8", "surrogateescape") if value else b"")
        lock = Lock(common, name, dir_fd)
        # Removed when the block ends, or on an error; a BaseException (a test's
        # stand-in for the daemon's death) leaves both names, as a death does.
        try:
            lock.moved = _take(dir_fd, tmp, leaf + ".lock", name, WAIT_S if wait_s is None else wait_s,
                               path + ".lock", common if move_left else "")
            try:
                yield lock
            except Exception:
                _unlink(dir_fd, leaf + ".lock")
                raise
            if not lock.done:
                _unlink(dir_fd, leaf + ".lock")
        except Exception:
            _unlink(dir_fd, tmp)
            raise
        _unlink(dir_fd, tmp)  # the lock's second name, kept until then (above)
    finally:
        os.close(dir_fd)


def _unlink(dir_fd: int, leaf: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(leaf, dir_fd=dir_fd)


def _take(dir_fd: int, tmp: str, lock: str, name: str, wait_s: float, path: str, common: str) -> str:
    """The lock made (see ``held``); returns where a lock left in the way
    was moved aside, or ""."""
    deadline = time.monotonic() + wait_s
    moved = ""
    while True:
        try:
            os.link(tmp, lock, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            return moved
        except FileExistsError:
            try:
                st = os.stat(lock, dir_fd=dir_fd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:  # ours, from a daemon killed holding it
                    os.unlink(lock, dir_fd=dir_fd)
                    continue
            except FileNotFoundError:
                continue  # released meanwhile
            if time.monotonic() >= deadline:
                if moved or not common:  # one more in its place at once (someone's live git), or not ours to move
                    raise Held(name) from None
                # Left: by a git killed, or a session (see the module). Out of
                # refs/ (a name there is a ref to git: a broken one, or a branch
                # holding what the session wrote), to the git directory's top.
                moved = os.path.join(common, fs.aside_name(os.path.basename(path)))
                try:
                    os.rename(lock, moved, src_dir_fd=dir_fd)
                except OSError:
                    raise Held(name) from None
                continue
            time.sleep(_POLL_S)
