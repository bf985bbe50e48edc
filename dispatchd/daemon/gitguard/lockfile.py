"""Git's own lock on a file (``NAME.lock``), taken the way the daemon takes
it for every write of git's files: the end's refs and ``packed-refs``
(``reflock``), the kept files (config, hooks: ``gitlock``) and a restore's
refs (``checkpoints/reflock``), each with its ``Policy``.

Git takes its lock by making ``NAME.lock`` with ``O_CREAT | O_EXCL``,
writes the new bytes into it and renames it over ``NAME``. The daemon makes
the lock whole before it appears, and makes it tell itself from git's:

1. ``temporary``: a file of ours beside ``NAME`` (``reftemp.temp_name``:
   ``NAME.dispatchd-<16 hex>.lock``, made ``O_EXCL | O_NOFOLLOW``: a name
   nobody can plant first), holding the bytes, fsynced, and ``flock``ed for
   as long as its ``Lock`` is open: a live daemon's, which no sweep removes
   (``reftemp.sweep_names``, the one sweep of what a killed daemon left);
2. ``Lock.take``: hard-linked to ``NAME.lock``. ``link`` fails on an
   existing name as ``O_EXCL`` does, so the lock is taken only where no git
   holds it, and git's ``O_EXCL`` fails where ours stands. Ours then has
   two names where git's has one: a lock found with two names (a regular
   file) is what a killed daemon left;
3. what is done with a lock that is still there is the caller's ``Policy``
   (``choose`` decides, a pure function): a killed daemon's (two names)
   taken over, removed and made anew, only with ``take_over`` (where no
   session runs: a session's process can give a lock of the user's git a
   second name); any other waited for ``wait_s``, then moved aside once
   into ``aside_to`` (kept, never deleted) where the policy names a place,
   else refused (``Refused``): never written around;
4. ``Lock.commit`` renames the lock over ``NAME``; ``Lock.release`` removes
   the lock only while it is still this one (device and inode), and our
   temporary name; ``Lock.close`` lets the descriptor go and leaves both
   names, as a daemon's death does.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from dispatchd.daemon.gitguard import fs, ournames, reftemp

__all__ = ["Act", "Lock", "Policy", "Refused", "choose", "temporary"]

_POLL_S = 0.01  # between tries of a lock someone holds; git's own lock is held for milliseconds
_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Policy:
    """What ``Lock.take`` does with a ``NAME.lock`` that is still there."""

    wait_s: float  # how long a lock of someone else's is tried again before the policy's last word
    take_over: bool = False  # a lock of two names (a killed daemon's) removed and made anew: only where no session runs
    aside_to: str = ""  # past the wait, the directory (a path) a lock left is moved to, once; "": refused


class Act(enum.Enum):
    """``choose``'s answer: what is done next with a lock in the way."""

    AGAIN = "again"  # it went meanwhile: link again now
    TAKE_OVER = "take over"  # a killed daemon's: removed, then link again
    WAIT = "wait"  # someone's: tried again after a short sleep
    MOVE_ASIDE = "move aside"  # left past the wait: moved into ``Policy.aside_to``, then link again
    REFUSE = "refuse"  # left past the wait, and not to be moved (or one more in its place at once)


def choose(policy: Policy, there: os.stat_result | None, late: bool, moved: bool, left: bool = False) -> Act:
    """What to do with the lock found at ``NAME.lock`` (``there``: its
    ``lstat``, None when it went), ``late`` once ``policy.wait_s`` has
    passed, ``moved`` once one was moved aside already (another one in its
    place at once is someone's live git: never moved twice), ``left`` when
    its second name is a temporary of ours nobody holds
    (``reftemp.second_name_ours``: a killed daemon's; two names alone are
    anyone's to give)."""
    if there is None:
        return Act.AGAIN
    if policy.take_over and left:
        return Act.TAKE_OVER
    if not late:
        return Act.WAIT
    if policy.aside_to and not moved:
        return Act.MOVE_ASIDE
    return Act.REFUSE


class Refused(OSError):
    """``NAME.lock`` stayed someone else's past the policy's wait (and was
    not to be moved, or could not be)."""

    def __init__(self, lock: str) -> None:
        super().__init__(errno.EEXIST, f"git's lock {lock} is held")
        self.lock = lock


class Lock:
    """Our temporary beside ``leaf`` in the directory ``dir_fd`` (the
    caller's, left open), and once ``take`` returned, ``<leaf>.lock``."""

    def __init__(self, dir_fd: int, leaf: str, temp: str, fd: int) -> None:
        self.dir_fd, self.leaf, self.temp = dir_fd, leaf, temp
        self.lock_leaf = f"{leaf}.lock"
        self._fd = fd  # the temporary's descriptor: its flock says a live daemon holds it
        st = os.fstat(fd)
        self.ident = (st.st_dev, st.st_ino)
        self.moved = ""  # where a lock left in the way was moved aside, if one was

    def take(self, policy: Policy) -> None:
        """``<leaf>.lock`` made a second name of the temporary, as the
        module says; ``Refused`` when the policy gives up."""
        deadline = time.monotonic() + policy.wait_s
        while True:
            try:
                os.link(self.temp, self.lock_leaf, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd,
                        follow_symlinks=False)
                return
            except FileExistsError:
                pass
            try:
                there: os.stat_result | None = os.stat(self.lock_leaf, dir_fd=self.dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                there = None
            left = policy.take_over and there is not None and \
                reftemp.second_name_ours(self.dir_fd, self.lock_leaf, there)
            act = choose(policy, there, time.monotonic() >= deadline, bool(self.moved), left)
            if act is Act.TAKE_OVER:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.lock_leaf, dir_fd=self.dir_fd)
            elif act is Act.WAIT:
                time.sleep(_POLL_S)
            elif act is Act.MOVE_ASIDE:
                # Out of the directory (in refs/, a name is a ref to git: a
                # broken one, or a branch holding what a session wrote).
                moved = os.path.join(policy.aside_to, fs.aside_name(self.lock_leaf))
                try:
                    os.rename(self.lock_leaf, moved, src_dir_fd=self.dir_fd)
                except OSError:
                    raise Refused(self.lock_leaf) from None
                self.moved = moved
            elif act is Act.REFUSE:
                raise Refused(self.lock_leaf)

    def mine(self) -> bool:
        """Whether ``<leaf>.lock`` is still this lock (its device and inode)."""
        try:
            st = os.stat(self.lock_leaf, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return (st.st_dev, st.st_ino) == self.ident

    def rewrite(self, data: bytes, mode: int | None = None) -> None:
        """The lock made to hold ``data`` (``mode``: its permission bits),
        durable: what ``commit`` then puts in place. ESTALE where the lock
        is no longer this one (removed and made anew by another)."""
        # Emptied only once it is known to be this one (O_TRUNC at the open
        # emptied another's lock before the look).
        fd = os.open(self.lock_leaf, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dir_fd)
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.ident:
                raise OSError(errno.ESTALE, "the lock file was replaced by another", self.lock_leaf)
            os.ftruncate(fd, 0)
            reftemp.write_whole(fd, data, mode)
        finally:
            os.close(fd)

    def commit(self) -> None:
        """The lock renamed over ``leaf`` (which lets it go, as git's commit
        of a lock does); the temporary's name stays until ``release``."""
        os.rename(self.lock_leaf, self.leaf, src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)

    def release(self) -> None:
        """The lock removed while it is still this one, the temporary's
        name removed, the descriptor closed (``leaf`` as it was, unless
        ``commit`` ran)."""
        try:
            with contextlib.suppress(FileNotFoundError):
                if self.mine():
                    os.unlink(self.lock_leaf, dir_fd=self.dir_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp, dir_fd=self.dir_fd)
            # Gone, whoever removed it: its inode may be anyone's next. A name
            # that could not be removed (a session took back the write
            # permission lent to its directory) stays known as ours: the next
            # sweep removes it, where it was taken for a session's new file.
            ournames.forget(self.ident)
        finally:
            self.close()

    def close(self) -> None:
        """The descriptor (and its flock) let go, every name left: what a
        daemon's death leaves, for the next take over or sweep."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class Held:
    """A ``Lock`` taken in a directory opened for it (``take_in``): the lock
    and the directory let go together, once."""

    def __init__(self, dir_fd: int, lock: Lock) -> None:
        self.dir_fd, self.lock = dir_fd, lock

    def commit(self, data: bytes, mode: int | None = None) -> None:
        """``data`` (``mode``: its permission bits) written into the lock,
        durable, and renamed over the file: it holds the old bytes or these,
        never neither. The lock let go either way."""
        try:
            self.lock.rewrite(data, mode)
            self.lock.commit()
        finally:
            self.release()

    def release(self) -> None:
        """The lock removed unless committed, the temporary's name with it,
        the directory closed; a second call does nothing."""
        if self.dir_fd < 0:
            return
        try:
            self.lock.release()
        finally:
            os.close(self.dir_fd)
            self.dir_fd = -1


def take_in(dir_fd: int, leaf: str, policy: Policy, mode: int | None = None, *, lend: bool = True) -> Held:
    """``leaf``'s lock in ``dir_fd`` (empty; ``mode`` as ``temporary``'s),
    taken by ``policy``. The ``Held`` owns ``dir_fd`` from here: closed here
    when this raises (``Refused`` when the policy gives up)."""
    try:
        lock = temporary(dir_fd, leaf, b"", mode, lend=lend)
        try:
            lock.take(policy)
        except BaseException:
            lock.release()
            raise
    except BaseException:
        os.close(dir_fd)
        raise
    return Held(dir_fd, lock)


def temporary(dir_fd: int, leaf: str, data: bytes, mode: int | None = None, *, lend: bool = True,
              fill: Callable[[int], None] | None = None) -> Lock:
    """A ``Lock`` not taken yet: ``data`` in a new file of ours beside
    ``leaf`` in ``dir_fd``, fsynced, flocked; ``mode``: its permission bits
    (None: 0644 less the umask, as git's). ``lend``: a directory a session
    made read-only given its owner's rights (``reftemp.open_temp``).
    ``fill``: writes the bytes itself, given the new file's descriptor, in
    place of ``data`` (a copy streamed from another file); what it raises
    removes the file again."""
    temp, fd = reftemp.open_temp(dir_fd, leaf, _CREATE, 0o644 if mode is None else 0o600, lend=lend)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a new file nobody else has open: never waits
        if fill is not None:
            fill(fd)
            reftemp.write_whole(fd, b"", mode)  # its mode, and durable
        elif data or mode is not None:  # an empty file has nothing to make durable (a restore's: written at commit)
            reftemp.write_whole(fd, data, mode)
        return Lock(dir_fd, leaf, temp, fd)
    except BaseException:
        reftemp.discard(dir_fd, temp, fd)
        raise
