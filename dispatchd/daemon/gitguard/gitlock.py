"""A file of git's replaced the way git replaces it: under git's own lock.

The end puts the user's config, hooks and review files back by bytes
(``keptfiles``) while the user's own git may run beside it: a ``git
config`` at the very moment of a close. Renaming the file aside and a copy
into place later left the name absent in between (a git of the user's read
no repository config at all: no remotes, no identity, no hooks path), and a
``git config`` landing in between was overwritten, or landed after and
replaced the whole config with its one key. Here, as git's ``lockfile.c``:

1. the new bytes go to a temporary name of our own beside the file
   (``lockfile.temporary``: ``<file>.dispatchd-<16 hex>.lock``, ``O_EXCL |
   O_NOFOLLOW``), ``flock``ed for as long as this runs, and fsynced;
2. git's lock ``<file>.lock`` is taken by hard-linking that file to it
   (``lockfile.Lock.take``): ``link`` fails with EEXIST where a lock
   stands, as git's ``O_CREAT | O_EXCL`` does where ours stands. A lock
   another holds (the user's git) is waited for, ``WAIT_S`` at most, then
   ``LockHeld``: nothing is ever written around it, and none is taken
   over here (the policy: wait, then fail);
3. under the lock, what stands at the name is compared (the same bytes and
   mode: nothing to do) and kept under an aside name (``fs.aside_name``) by
   a hard link (a directory, which has none: renamed aside), so that the
   version it replaces stays for the user to look at;
4. the lock is renamed over the file. The name never stops naming a whole
   file, and a git of the user's either finished before (its version is the
   one kept aside) or finds the lock taken (``git config``: "could not lock
   config file", loud, nothing lost).

A daemon killed at any step leaves at most the temporary name, with
``<file>.lock`` as a second name of that same inode. ``sweep`` (at each
put-back, before any lock is taken; ``reftemp.sweep_names``, the start's
rule too) removes such a lock only when it is that inode, and a temporary
name only when nobody holds its ``flock`` (a live daemon's is left alone). A lock of the user's git is a file of its
own, never that inode, and is never removed.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable

from dispatchd.daemon.gitguard import fs, lockfile, noroom, reftemp

__all__ = ["WAIT_S", "LockHeld", "left_held", "replace", "sweep"]

log = logging.getLogger("dispatchd.gitguard")

WAIT_S = 1.0  # git holds a config lock for milliseconds; longer is a git that stopped, or a plant

# Called with each step's name as it is done ("written", "locked", "kept",
# "replaced"): tests look at the file between steps, or stop there as a
# killed daemon would.
_step: Callable[[str], None] = lambda name: None
# The aside link (tests stand in for a directory with no room for the name).
_link = os.link


class LockHeld(OSError):
    """``<file>.lock`` stayed held by someone else for ``WAIT_S``."""


def replace(dir_fd: int, leaf: str, data: bytes, mode: int | None = None, *,
            wait_s: float | None = None, inode: tuple[int, int] | None = None,
            move_left: bool = False, fill: Callable[[int], None] | None = None) -> str | None:
    """``leaf`` in ``dir_fd`` made to hold ``data`` (``mode``: its
    permission bits; None: 0644 less the umask), as the module says. Returns
    None when it held them already (nothing done), else the aside name of
    what stood there ("" when nothing did). ``inode``: a file made one of
    its own instead (``hardlinks.detach``): replaced only while ``leaf`` is
    still that (device, inode), its other names keeping the old one, nothing
    aside. ``move_left``: a lock still there past the wait is moved aside
    beside it, once, and the file written (a file a session could write while
    it ran, beside which it could leave a lock of its own: never one git
    takes for long). ``fill``: the bytes written by it in place of ``data``
    (``lockfile.temporary``; with ``inode`` only: nothing compares them).
    Raises ``LockHeld``, or the OSError of a step, or what ``fill`` raises
    (every name of ours is removed again first)."""
    lock = lockfile.temporary(dir_fd, leaf, data, mode, fill=fill)
    try:
        _step("written")
        try:
            # No lock of two names taken over: a put-back runs at every end,
            # other sessions perhaps still running (one's process can give a
            # lock of the user's git a second name); ``sweep`` has removed a
            # killed daemon's before, its flock telling a live one.
            # Moved by a path through the descriptor's own link: the very directory reached, no name looked up again.
            lock.take(lockfile.Policy(WAIT_S if wait_s is None else wait_s,
                                      aside_to=f"/proc/self/fd/{dir_fd}" if move_left else ""))
        except lockfile.Refused as exc:
            raise LockHeld(errno.EEXIST, f"git's lock {exc.lock} is held") from None
        _step("locked")
        st = _lstat(dir_fd, leaf)
        if inode is not None:
            if st is None or (st.st_dev, st.st_ino) != inode:
                return None  # replaced meanwhile (a git of the user's): a file of its own already
            aside = ""
        elif st is not None and stat.S_ISREG(st.st_mode) and \
                (mode is None or stat.S_IMODE(st.st_mode) == mode) and _same(dir_fd, leaf, data):
            return None
        else:
            aside = "" if st is None else _keep_aside(dir_fd, leaf, st)
        _step("kept")
        lock.commit()
        _step("replaced")
        return aside
    finally:
        lock.release()  # the lock while still ours (not renamed), and the temporary's name; its flock goes


def left_held(path: str, dir_fd: int | None = None) -> str:
    """What stands at ``path``, whose lock stayed held (``LockHeld``), made
    unreadable where it is (``noroom.disarm_at``; a session can leave a
    ``config.lock`` of its own beside a config it wrote, and git stops on a
    config it cannot read, saying so); a chmod, not a write, so a git of the
    user's that holds the lock still renames its file over it. Returns what
    to say of it. ``dir_fd``: ``path``'s directory, as the write reached it
    (its leaf is looked up there): by path, a directory a session swapped
    for a symlink meanwhile led the chmod to a file of the user's elsewhere."""
    held = f"git's lock {path}.lock is held (a git command of yours, or one that stopped without removing it)"
    try:
        links = noroom.disarm_at(dir_fd, path if dir_fd is None else os.path.basename(path))
    except FileNotFoundError:
        return f"{held}; nothing stands there; a restart's check puts yours back once the lock is gone"
    except OSError as exc:
        return f"{held}; what stands there is left as it is ({exc.strerror}): look before you run git there"
    if links is None:
        return f"{held}; what stands there (no regular file) is left as it is: look before you run git there"
    return (f"{held}; what stands there is left in place, made unreadable (mode 000); once no git of yours runs, "
            "remove the lock if it is still there, and a restart's check puts yours back")


def _keep_aside(dir_fd: int, leaf: str, st: os.stat_result) -> str:
    """What stands at ``leaf`` kept under an aside name, ``leaf`` still
    naming it: a second hard link (no symlink followed: a symlink is kept as
    itself). A directory (no hard link to one) is renamed aside: nothing a
    git reads as a file stood there anyway."""
    if stat.S_ISDIR(st.st_mode):
        return fs.move_aside_at(dir_fd, leaf)
    while True:
        aside = fs.aside_name(leaf)
        try:
            _link(leaf, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
            return aside
        except FileExistsError:
            continue


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _same(dir_fd: int, leaf: str, data: bytes) -> bool:
    got = fs.read_regular(leaf, dir_fd, limit=len(data) + 1)
    return got is not None and got[0] == data


def sweep(dir_fd: int, path: str, leaves: set[str]) -> list[str]:
    """What a killed ``replace`` of one of ``leaves`` left in ``dir_fd``
    (``path``, for the log), removed; returns the paths removed. Only our
    temporary names nobody holds, and a ``<leaf>.lock`` that is the same
    inode as one of them (``reftemp.sweep_names``, the start's rule too)."""
    try:
        names = os.listdir(dir_fd)
    except OSError:
        return []
    removed = reftemp.sweep_names(dir_fd, path, names, leaves)
    for gone in removed:
        log.info("event=git_lock_leftover_removed path=%s", gone)
    return removed
