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
  puts refs back (the last one). It is moved aside out of ``refs/`` to the
  git directory's top (kept, never deleted: ``Lock.moved`` names where, for
  the report) and the lock taken, since a lock left in the way would
  otherwise keep whatever move of the ref a session made (a session plants
  ``main.lock``, and its commit stays the user's ``main``). Where it cannot be moved, ``Held`` is raised and the
  ref is left as it is. A ref is never written without its lock;
- the caller reads the ref again once the lock is its (``refsback``): what
  it replaces is the value git has at that moment, not one read before;
- the lock itself is ``lockfile``'s (a temporary of ours hard-linked to
  ``<ref>.lock``); this module gives it the end's policy (take over a
  killed daemon's, wait, move aside) and makes the ref's directories;
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
from collections.abc import Iterator

from dispatchd.daemon.gitguard import fs, lockfile, reftemp

WAIT_S = 1.0  # git's own wait for a ref's lock is 100 ms (core.filesRefLockTimeout); a commit holds it for less


class Held(OSError):
    """The lock of a ref is someone else's (the user's git), past ``WAIT_S``."""

    def __init__(self, name: str) -> None:
        super().__init__(errno.EEXIST, f"git's lock {name}.lock is held (your git is writing the ref, or left it)")
        self.name = name


class Lock:
    """A ref's lock, ours while the ``held`` block runs."""

    def __init__(self, common: str, name: str, taken: lockfile.Lock) -> None:
        self.common, self.name = common, name
        self.path = os.path.join(common, name)
        self.leaf = os.path.basename(self.path)
        self._taken = taken
        self.done = False  # the lock file renamed over the ref: nothing to remove

    @property
    def moved(self) -> str:
        """Where a lock left in the way was moved aside, if one was."""
        return self._taken.moved

    def commit(self) -> None:
        """The ref made to hold the value the lock was taken with."""
        if fs.is_dir(self.path):  # a directory in the way (a session's): moved aside, never deleted
            fs.move_aside(self.path)
        self._taken.commit()
        self.done = True

    def rewrite(self, data: bytes, mode: int) -> None:
        """The lock file (ours, both its names) made to hold ``data`` with
        ``mode``, durable: what ``commit`` then puts in place of a whole file
        read under the lock (``packed-refs``)."""
        self._taken.rewrite(data, mode)

    def remove(self) -> None:
        """The loose ref unlinked (its value kept by the caller first); none there is no error."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.leaf, dir_fd=self._taken.dir_fd)


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

    The lock is ``lockfile``'s: made whole under a name of our own, then
    hard-linked to ``<name>.lock``. One found with two names is what a
    daemon killed there left (its other name is swept at the next start),
    and is taken over, not waited for, so that the ref is not left for good:
    the end that puts refs back runs when no session does."""
    path = reftemp.make_room(common, name)
    dir_fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        taken = lockfile.temporary(dir_fd, os.path.basename(path),
                                   (value + "\n").encode("utf-8", "surrogateescape") if value else b"")
        lock = Lock(common, name, taken)
        policy = lockfile.Policy(WAIT_S if wait_s is None else wait_s, take_over=True,
                                 aside_to=common if move_left else "")
        # Released when the block ends, or on an error; a BaseException (a
        # test's stand-in for the daemon's death) leaves both names, as a
        # death does (the descriptor closed all the same: its flock goes).
        try:
            _take(taken, name, policy)
            yield lock
        except Exception:
            taken.release()
            raise
        except BaseException:
            taken.close()
            raise
        taken.release()  # after a commit, the lock's second name only
    finally:
        os.close(dir_fd)


def _take(taken: lockfile.Lock, name: str, policy: lockfile.Policy) -> None:
    """The lock made (see ``held``), ``Held`` when the policy gives up."""
    try:
        taken.take(policy)
    except lockfile.Refused:
        raise Held(name) from None
