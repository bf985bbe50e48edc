"""Walks of trees a session made: iterative, by descriptor, bounded (daemon and worker side).

A session decides the shape of its scratch directory and of its worktree:
1,500 nested directories made ``shutil.rmtree`` and ``os.fwalk`` (both
recursive in Python 3.11) raise ``RecursionError``, so a close failed and
every later start of the daemon died removing what was left. Every walk of
such a tree goes through this module.

Guarantees:
- no recursion: a loop over an explicit stack, whatever the depth;
- by descriptor, never following a symlink (``O_NOFOLLOW``, ``dir_fd``): a
  directory swapped for a symlink mid-walk sends nothing outside the tree;
- bounded: at most ``max_entries`` entries listed and at most ``max_depth``
  directory descriptors held at once. Over budget the walk stops (or skips
  that subtree), says so in its ``Budget`` report, and never raises;
- ``remove_tree`` removes trees of any depth with at most ``max_depth``
  descriptors: a directory at that depth is moved up to the top of the tree
  being removed (a rename within it, by descriptor) and removed from there.
  It gets through directories made unreadable or unwritable (their owner's
  rights are restored on the way, by descriptor). What it cannot remove it
  reports and leaves.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import stat
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from dispatchd import statemodes

__all__ = ["Budget", "Listings", "MAX_DEPTH", "MAX_ENTRIES", "remove_tree", "remove_tree_at", "walk"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]

# A scratch directory or a worktree deeper than this is walked in parts
# (removal) or not below it (other walks): one descriptor per level is held.
MAX_DEPTH = 256
# Entries listed per walk: a removal of ten million files takes minutes, and a
# walk at a close must not hold the daemon that long.
MAX_ENTRIES = 2_000_000

_FS_ENCODING = sys.getfilesystemencoding()
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Budget:
    """What a walk may take, and what it took."""

    max_entries: int = MAX_ENTRIES
    max_depth: int = MAX_DEPTH
    entries: int = 0
    skipped: list[str] = field(default_factory=list)  # what was left, and why (at most a few)
    over: bool = False  # the entry budget ran out: the walk stopped

    def take(self, n: int) -> bool:
        """Count ``n`` more entries; False once over the budget."""
        self.entries += n
        if self.entries > self.max_entries:
            if not self.over:
                self.note(f"stopped after {self.max_entries} entries (its budget)")
            self.over = True
        return not self.over

    def note(self, what: str) -> None:
        if len(self.skipped) < 20:
            self.skipped.append(what)

    def describe(self) -> str:
        return "; ".join(self.skipped)


def _open_dir(name: str, dir_fd: int | None) -> int:
    """Open a directory (not through a symlink); one its owner made
    unsearchable gets ``u+rwx`` back first (by an O_PATH descriptor)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        _restore_rights(name, dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def _restore_rights(name: str, dir_fd: int | None) -> None:
    """A directory's owner's rights back (0700); anything else left alone."""
    statemodes.set_mode_at(dir_fd, name, stat.S_IRWXU, statemodes.DIRS)


def _listdir(fd: int) -> list[str]:
    try:
        return os.listdir(fd)
    except PermissionError:
        os.fchmod(fd, stat.S_IRWXU)
        return os.listdir(fd)


def _unlink(name: str, fd: int) -> bool:
    """Unlink a non-directory entry; False when it is a directory."""
    try:
        os.unlink(name, dir_fd=fd)
    except IsADirectoryError:
        return False
    except PermissionError:  # on Linux, also what unlink says of a directory in some file systems
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            return False
        os.fchmod(fd, stat.S_IRWXU)  # the directory it is in was made unwritable
        os.unlink(name, dir_fd=fd)
    return True


def _rmdir(name: str, fd: int) -> None:
    try:
        os.rmdir(name, dir_fd=fd)
    except PermissionError:
        os.fchmod(fd, stat.S_IRWXU)
        os.rmdir(name, dir_fd=fd)


def _move_up(name: str, fd: int, top: int) -> str:
    """Rename directory ``name`` of ``fd`` into ``top``; its new name. A
    directory moved to another parent must be writable (its ``..`` changes),
    and so must the one it leaves: their owner's rights come back first."""
    moved = f".deep-{secrets.token_hex(8)}"
    try:
        os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=top)
    except PermissionError:
        os.fchmod(fd, stat.S_IRWXU)
        _restore_rights(name, fd)
        os.rename(name, moved, src_dir_fd=fd, dst_dir_fd=top)
    return moved


def remove_tree(path: str, budget: Budget | None = None) -> Budget:
    """Remove ``path`` and everything under it (see the module's guarantees).
    Never raises: the report says what was left, and why."""
    budget = budget or Budget()
    parent, base = os.path.split(os.path.abspath(path))
    try:
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return budget
    except OSError as exc:
        budget.note(f"{parent}: {exc.strerror}")
        return budget
    try:
        return remove_tree_at(parent_fd, base, budget, shown=path)
    finally:
        os.close(parent_fd)


def remove_tree_at(parent_fd: int, name: bytes | str, budget: Budget | None = None, shown: str = "") -> Budget:
    """``remove_tree`` of ``name`` in the directory ``parent_fd``: nothing on
    the way to it is looked up by path (a caller that reached ``parent_fd``
    by descriptor keeps every guarantee). ``shown``: its name in the notes.
    Never raises."""
    budget = budget or Budget()
    base = os.fsdecode(name)
    shown = shown or base
    try:
        if _unlink(base, parent_fd):
            return budget  # a file or a symlink: nothing below it
    except FileNotFoundError:
        return budget
    except OSError as exc:
        budget.note(f"{shown}: {exc.strerror}")
        return budget
    _remove_dir(base, parent_fd, shown, budget)
    return budget


def _remove_dir(base: str, parent_fd: int, path: str, budget: Budget) -> None:
    """Empty and remove directory ``base`` of ``parent_fd``."""
    try:
        top = _open_dir(base, parent_fd)
    except OSError as exc:
        budget.note(f"{path}: {exc.strerror}")
        return
    # (descriptor, its name in the one above, the names left to look at)
    stack: list[tuple[int, str, list[str]]] = []
    try:
        names = _listdir(top)
        if not budget.take(len(names)):
            return
        stack.append((top, base, names))
        while stack:
            fd, name, left = stack[-1]
            if not left:
                stack.pop()
                above = stack[-1][0] if stack else parent_fd
                if fd != top:
                    os.close(fd)
                try:
                    _rmdir(name, above)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    budget.note(f"{path}: a directory could not be removed: {exc.strerror}")
                continue
            child = left.pop()
            try:
                if _unlink(child, fd):
                    continue
                if len(stack) >= budget.max_depth:
                    # Deeper than the descriptors we hold: moved up to the top
                    # (within the tree, by descriptor) and emptied from there.
                    stack[0][2].append(_move_up(child, fd, top))
                    continue
                cfd = _open_dir(child, fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                budget.note(f"{path}: {child}: {exc.strerror}")
                continue
            try:
                names = _listdir(cfd)
            except OSError as exc:
                os.close(cfd)
                budget.note(f"{path}: {child}: {exc.strerror}")
                continue
            stack.append((cfd, child, names))
            if not budget.take(len(names)):
                return
    finally:
        for fd, _, _ in stack:
            if fd != top:
                os.close(fd)
        os.close(top)


class Listings:
    """Listings a walk may reuse: a directory whose non-directories hold
    nothing its caller looks for (``plain``) is remembered by device and
    inode with its ctime, mtime and size, and while all four are unchanged a
    later walk takes its subdirectories from here and yields no
    non-directory for it. Sound because every change of a directory's
    entries (create, unlink, rename, replace) sets its ctime, which no
    process can set back, on the local file systems of ``FINE_CTIME_FS``
    (elsewhere nothing is remembered); a directory is remembered only when its ctime is
    ``SETTLE_NS`` older than the walk's start (the kernel's clock for it lags
    by up to a tick, so a change after that start cannot keep it). In
    memory only; at most ``limit`` directories (then forgotten)."""

    SETTLE_NS = 50_000_000

    def __init__(self, plain: Callable[[list[bytes]], bool], limit: int = 200_000) -> None:
        self.plain = plain
        self.limit = limit
        self.seen: dict[tuple[int, int], tuple[int, int, int, int, tuple[bytes, ...]]] = {}
        self.reused = 0

    def entries(self, fd: int, budget: Budget, settled_before: int,
                fine: dict[int, bool] | None = None) -> tuple[list[bytes], list[bytes]]:
        """Directory ``fd``'s (non-directories, directories), or its
        directories alone when remembered. ``fine``: one walk's answers of
        ``fine_local_ctime`` for block devices (asked once a walk, not once a
        directory: a third of a remembered directory's time, 5,200 of them)."""
        st = os.fstat(fd)
        if fine is not None and os.major(st.st_dev) != 0:
            # A block device is one file system for as long as the walk
            # lasts; an anonymous one (tmpfs, btrfs, FUSE) is asked each time.
            ok = fine.get(st.st_dev)
            if ok is None:
                ok = fine[st.st_dev] = fine_local_ctime(fd, st.st_dev)
        else:
            ok = fine_local_ctime(fd, st.st_dev)
        if not ok:
            return _entries(fd, budget)  # nothing remembered: every walk lists it
        key = (st.st_dev, st.st_ino)
        seen = self.seen.get(key)
        if seen is not None and seen[:3] == (st.st_ctime_ns, st.st_mtime_ns, st.st_size):
            self.reused += 1
            budget.take(seen[3])
            return [], list(seen[4])
        files, dirs = _entries(fd, budget)
        if not budget.over and settled(st.st_ctime_ns, settled_before + self.SETTLE_NS, self.SETTLE_NS) \
                and self.plain(files):
            if len(self.seen) >= self.limit:
                self.seen.clear()
            self.seen[key] = (st.st_ctime_ns, st.st_mtime_ns, st.st_size, len(files) + len(dirs), tuple(dirs))
        return files, dirs


# File systems whose ctime the local kernel sets at every change of a
# directory's entries, to the tick (statfs f_type, linux/magic.h). Others -
# NFS and FUSE (attributes cached, or set by a server or a user's process),
# FAT and SMB (ctime of seconds, or none) - are listed at every walk.
FINE_CTIME_FS = frozenset({
    0xEF53,      # ext2/3/4
    0x58465342,  # XFS
    0x9123683E,  # btrfs
    0x01021994,  # tmpfs
    0x794C7630,  # overlayfs (the upper layer's, a local file system's)
    0xF2F52010,  # f2fs
})


# A ctime in whole seconds comes from a file system that keeps seconds only
# (ext2, ext3, ext4 with 128-byte inodes, which report the ext4 magic): a
# change later in the same second keeps the same ctime. Trusted only once it
# is older than this (a fine one, by chance a whole second, a billion to one,
# is only trusted later).
COARSE_SETTLE_NS = 2_000_000_000


def settled(ctime_ns: int, look_ns: int, margin_ns: int) -> bool:
    """Whether a ctime seen at ``look_ns`` is old enough that any change
    since sets another: older than ``margin_ns`` (the clock's tick), or two
    seconds for one in whole seconds (``COARSE_SETTLE_NS``)."""
    return ctime_ns < look_ns - (COARSE_SETTLE_NS if ctime_ns % 1_000_000_000 == 0 else margin_ns)


def fine_local_ctime(fd: int, dev: int) -> bool:
    """Whether the file system of ``fd`` is one of ``FINE_CTIME_FS``; False
    when that cannot be told. Asked at every directory (one ``fstatfs``, about
    a microsecond), not remembered by device: an anonymous device number
    (tmpfs, overlayfs) is given again to the next such mount, a FUSE one
    among them. ``dev`` is the caller's ``st_dev`` of ``fd``, for the record."""
    buf = ctypes.create_string_buffer(256)  # struct statfs: 120 bytes on x86_64 and aarch64
    return _libc.fstatfs(fd, buf) == 0 and int.from_bytes(buf.raw[:8], sys.byteorder) in FINE_CTIME_FS


def walk(root: str, budget: Budget, prune: Callable[[bytes, int], bool] = lambda name, dirfd: False,
         listings: Listings | None = None, *, root_fd: int = -1) -> Iterator[tuple[bytes, list[bytes], int]]:
    """Top-down, as ``os.fwalk(root, follow_symlinks=False)`` but iterative
    and bounded: ``(dirpath, names of its non-directories, dirfd)`` for
    every directory, ``dirfd`` valid until the next step. A directory for
    which ``prune(name, parent_fd)`` is true is not entered; one deeper than
    ``budget.max_depth`` is skipped (noted); the walk stops once over
    ``budget.max_entries``. Directories it cannot read are skipped. Holds
    one descriptor per level of the directory it is in, no more. With
    ``listings``, a directory it remembers yields no non-directory (see
    ``Listings``). With ``root_fd``, the directory that descriptor holds is
    walked (reopened through it, never by the path, which only names it in
    what is yielded)."""
    if listings is None:
        entries = _entries
    else:
        settled_before = time.time_ns() - Listings.SETTLE_NS
        fine: dict[int, bool] = {}  # this walk's fine_local_ctime, by block device

        def entries(fd: int, budget: Budget) -> tuple[list[bytes], list[bytes]]:
            return listings.entries(fd, budget, settled_before, fine)
    try:
        top = os.open(root, _DIR_FLAGS) if root_fd < 0 else os.open(".", _DIR_FLAGS, dir_fd=root_fd)
    except OSError as exc:
        budget.note(f"{root}: {exc.strerror}")
        return
    stack: list[tuple[int, bytes, list[bytes]]] = []
    try:
        files, dirs = entries(top, budget)
        stack.append((top, os.fsencode(root), dirs))
        yield os.fsencode(root), files, top
        while stack and not budget.over:
            fd, dirpath, dirs = stack[-1]
            if not dirs:
                os.close(fd)
                stack.pop()
                continue
            name = dirs.pop()
            if prune(name, fd):
                continue
            path = os.path.join(dirpath, name)
            if len(stack) >= budget.max_depth:
                budget.note(f"{os.fsdecode(path)}: deeper than {budget.max_depth} levels, not walked")
                continue
            try:
                cfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                continue
            try:
                files, subdirs = entries(cfd, budget)
            except OSError:
                os.close(cfd)
                continue
            stack.append((cfd, path, subdirs))
            yield path, files, cfd
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _entries(fd: int, budget: Budget) -> tuple[list[bytes], list[bytes]]:
    """(non-directories, directories) of directory ``fd``, counted against
    ``budget`` (a partial listing once it is over). Directories come out
    reversed, so that popping them walks them in listing order."""
    files: list[bytes] = []
    dirs: list[bytes] = []
    # Counted a listing at a time, and names encoded as os.fsencode does, without
    # its checks: a third of a sweep's walk was these calls per entry (2,000 files).
    left = budget.max_entries - budget.entries
    listed = 0
    with os.scandir(fd) as it:  # on a descriptor, scandir reads a duplicate of it
        for entry in it:
            listed += 1
            if listed > left:
                break
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                continue
            (dirs if is_dir else files).append(entry.name.encode(_FS_ENCODING, "surrogateescape"))
    budget.take(listed)
    dirs.reverse()
    return files, dirs
