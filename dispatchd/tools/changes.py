"""What commands changed in the worktree, from inotify: ``Watcher``.

Worker side. The tool server makes one ``Watcher`` at the session's first
``shell_exec`` and keeps it: one inotify instance, one watch per directory of
the worktree (``.git`` left out: its churn is git's, and the git protection
reports on it), and a watch added for each directory created later.

Guarantees:
- ``since(t)`` lists the worktree-relative paths (bytes that are not UTF-8
  as ``\\xNN``) created, written (closed
  after writing), deleted or moved (both names) that were read from the
  kernel at or after ``t``, oldest first, each once, at most ``MAX_CHANGED``
  (then ``truncated``); a directory that appears is listed with everything
  found in it when its watch is added;
- what it cannot vouch for is said, never hidden: a kernel queue overflow,
  or watches refused (the session's ``max_inotify_watches``), make
  ``since`` report ``unknown`` from then on until the next call;
- a tree with more than ``max_dirs`` directories is not watched at all
  (``TooLarge``): the calls then carry no ``changed``.

The first build lists only the directories that can hold one: on a file
system whose directory link counts are exact (ext2/3/4, xfs, tmpfs: 2 plus
the subdirectories), a directory with a link count of 2, read after its watch
is added, has no subdirectory then, and any made later is an event of that
watch. Elsewhere (btrfs, overlayfs, network file systems, another file system
mounted below the root) every directory is listed. On a worktree of 2,000
files in 40 directories the build took 1.3-1.8 ms, 1.1 of it listing 2,000
names; 0.5-0.8 ms so.

Not caught: a change to a file's attributes only (``chmod``, ``touch`` of
an existing file), writes through ``mmap`` without a close, and changes made
below a mount point inside the worktree. Attribution is by time window: two
calls running at once both get what either changed.
"""

from __future__ import annotations

import collections
import ctypes
import os
import struct
import threading
import time

__all__ = ["MAX_CHANGED", "TooLarge", "Watcher"]

MAX_CHANGED = 1000
_LOG = 20_000  # changes remembered, oldest dropped

IN_MODIFY = 0x2
IN_CLOSE_WRITE = 0x8
IN_MOVED_FROM = 0x40
IN_MOVED_TO = 0x80
IN_CREATE = 0x100
IN_DELETE = 0x200
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_ONLYDIR = 0x01000000
IN_DONT_FOLLOW = 0x02000000
IN_EXCL_UNLINK = 0x04000000
IN_ISDIR = 0x40000000
_IN_NONBLOCK = os.O_NONBLOCK
_IN_CLOEXEC = os.O_CLOEXEC
# IN_CLOSE_WRITE rather than IN_MODIFY: one event per file written, not one per write().
_MASK = (IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
         | IN_ONLYDIR | IN_DONT_FOLLOW | IN_EXCL_UNLINK)
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len
# statfs f_type of the file systems whose directories' link count is exactly
# 2 + their subdirectories (ext4 with dir_nlink says 1 past 65,000 of them,
# which is not 2): a directory with st_nlink 2 there has no subdirectory.
_EXACT_NLINK = frozenset({0xEF53, 0x58465342, 0x01021994})  # ext2/3/4, xfs, tmpfs

_libc = ctypes.CDLL(None, use_errno=True)


def _fs_type(path: str) -> int | None:
    """statfs's f_type of ``path`` (None if it cannot be read)."""
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc.statfs(os.fsencode(path), buf) != 0:
        return None
    return int(struct.unpack_from("l", buf)[0]) & 0xFFFFFFFF  # f_type: the first field, a long


def _shown(rel: str) -> str:
    """A path as a reply can carry it: bytes that are not UTF-8 (kept by
    ``os.fsdecode`` as lone surrogates, which no UTF-8 encoder takes) written
    as ``\\xNN``."""
    return rel.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


class TooLarge(Exception):
    """The worktree has more directories than the watcher may watch."""


class Watcher:
    def __init__(self, root: str, max_dirs: int) -> None:
        self.root = root
        self.max_dirs = max_dirs
        self._lock = threading.Lock()
        self._wds: dict[int, str] = {}  # watch descriptor -> directory, relative ("" for the root)
        self._log: collections.deque[tuple[float, str | None]] = collections.deque(maxlen=_LOG)
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"inotify_init1: {os.strerror(err)}")
        self.fd = fd
        try:
            # The device whose directories' link counts tell a leaf (see the
            # module docstring); None: every directory is listed.
            self._exact_dev = os.stat(root).st_dev if _fs_type(root) in _EXACT_NLINK else None
            self._watch_tree("", record=False)
        except BaseException:
            os.close(fd)
            raise

    def close(self) -> None:
        os.close(self.fd)

    def _watch_tree(self, rel: str, *, record: bool) -> None:
        """Watch ``rel`` and every directory below it; with ``record``, log
        each entry found (a directory that appeared, with what it holds)."""
        stack = [rel]
        while stack:
            d = stack.pop()
            if len(self._wds) >= self.max_dirs:
                if not record:
                    raise TooLarge(f"more than {self.max_dirs} directories")
                self._log.append((time.monotonic(), None))
                return
            path = os.path.join(self.root, d) if d else self.root
            wd = _libc.inotify_add_watch(self.fd, os.fsencode(path), _MASK)
            if wd < 0:  # gone already, or out of watches
                if ctypes.get_errno() == 28:  # ENOSPC: the session's watches are spent
                    self._log.append((time.monotonic(), None))
                continue
            self._wds[wd] = d
            if not record and self._exact_dev is not None:
                # Read after the watch is added: a subdirectory made before
                # shows in the count, one made after is an event of the watch.
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if st.st_nlink == 2 and st.st_dev == self._exact_dev:
                    continue  # no subdirectory: nothing to list (2,000 names of a 2,000-file tree not read)
            try:
                with os.scandir(path) as found:
                    if not record:
                        # The first build logs nothing: only the directories
                        # matter, in any order (a sort and a join per file were
                        # most of a first shell_exec's watch: 3.0 -> 1.8 ms, 2,000 files).
                        subdirs = [e.name for e in found if e.is_dir(follow_symlinks=False)]
                        stack.extend(os.path.join(d, name) if d else name for name in subdirs
                                     if d or name != ".git")
                        continue
                    entries = sorted(found, key=lambda e: e.name)  # a stable order
            except OSError:
                continue
            for entry in entries:
                if not d and entry.name == ".git":
                    continue
                child = os.path.join(d, entry.name) if d else entry.name
                if record:
                    self._log.append((time.monotonic(), _shown(child)))
                if entry.is_dir(follow_symlinks=False):
                    stack.append(child)

    def drain(self) -> None:
        """Read what the kernel has queued (never blocks)."""
        with self._lock:
            while True:
                try:
                    data = os.read(self.fd, 65536)
                except BlockingIOError:
                    return
                if not data:
                    return
                self._parse(data)

    def _parse(self, data: bytes) -> None:
        now = time.monotonic()
        at = 0
        while at + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size: at + _EVENT.size + length].split(b"\0", 1)[0]
            at += _EVENT.size + length
            if mask & IN_Q_OVERFLOW:
                self._log.append((now, None))
                continue
            if mask & IN_IGNORED:
                self._wds.pop(wd, None)
                continue
            parent = self._wds.get(wd)
            if parent is None or not name:
                continue
            rel = os.path.join(parent, os.fsdecode(name)) if parent else os.fsdecode(name)
            if not parent and rel == ".git":
                continue
            self._log.append((now, _shown(rel)))
            if mask & IN_ISDIR and mask & (IN_CREATE | IN_MOVED_TO):
                self._watch_tree(rel, record=True)

    def since(self, started: float) -> tuple[list[str], bool, bool]:
        """(paths changed since ``started``, truncated, unknown): see the module."""
        self.drain()
        seen: dict[str, None] = {}
        unknown = False
        entries: list[str | None] = []
        with self._lock:
            for t, rel in reversed(self._log):  # oldest first in the log: read back to ``started`` only
                if t < started:
                    break
                entries.append(rel)
        entries.reverse()
        for rel in entries:
            if rel is None:
                unknown = True
            else:
                seen[rel] = None
        paths = list(seen)
        return paths[:MAX_CHANGED], len(paths) > MAX_CHANGED, unknown
