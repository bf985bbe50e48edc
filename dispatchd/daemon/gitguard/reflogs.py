"""The user's reflogs kept at the baseline: ``logs/HEAD``, each branch's,
tag's and remote-tracking ref's, and each linked worktree's ``HEAD``
(``worktrees/NAME/logs/...``). They are the user's undo history
(``git reflog``, ``@{1}``, ``main@{yesterday}``), and the only names of the
commits an amend, a reset, a rebase or a deleted branch left behind: a
session's ``git reflog expire --expire=now --all`` took those names, the
end put the object files and refs back, and the user's next ``git gc``
deleted the commits two weeks later. ``reflogsback.py`` puts the lost
lines back at the last end; the stash's log is ``stashlog``'s, not here.

Guarantees of ``record``:
- each reflog (a regular file; a symlink, FIFO or the like is not read) is
  kept as a copy of its own in the repository's keep (``.logs/REL``, REL
  its path below the common directory), never a hard link: a session's
  ``: > .git/logs/HEAD`` truncates the user's file in place, and a link
  with it. Walked by descriptor, no symlink followed;
- incrementally: ``.logs.index`` in the keep holds each reflog's
  ``(inode, size, mtime, ctime)`` at its last copy. A reflog whose stat is
  the same (and whose ctime was settled then: ``treewalk.settled``) is not
  read: a back-to-back open of an unchanged repository lists and stats;
- a reflog only appended to since its copy (git's own use) has its copy
  appended to: the bytes a record names (its size and digest of the copy's
  first bytes) stay the copy's first bytes. A copy whose reflog was
  rewritten (the user's own ``reflog expire``) or removed is replaced or
  removed only when no record on disk names the keep (``keeps.named``); else
  it is moved to ``.logs-old/`` first, for that record's end, and goes at a
  later record that finds none naming it. A record's bytes are thus
  there until its end has run;
- bounded (``MAX_FILES`` reflogs, ``MAX_DIRS`` directories, ``MAX_FILE``
  bytes a reflog, ``MAX_BYTES`` in all; ``logs/HEAD`` and the branches'
  first): what is past a bound is not kept, and said (``History.note``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import stat
import time
from collections import deque
from collections.abc import Collection, Iterator

import msgspec

from dispatchd import recordjson, treewalk
from dispatchd.daemon.gitguard import fs, keeps

log = logging.getLogger("dispatchd.reflogs")

MAX_FILES = 2_000  # reflogs kept (a clone with thousands of remote-tracking refs: HEAD and the branches first)
MAX_DIRS = 1_000  # directories listed
MAX_FILE = 16 << 20  # bytes of one reflog (~100,000 lines); a larger one is not kept
MAX_BYTES = 64 << 20  # bytes of all
COPIES = ".logs"  # in a keep: each reflog's copy, at its path below the common directory
INDEX = ".logs.index"  # in a keep: the index of the copies
OLD = ".logs-old"  # in a keep: copies replaced while a record on disk may still need them
STASH = "logs/refs/stash"  # stashlog's
_RACY_NS = 50_000_000  # a reflog changed this close before a look is read again whatever its stat says
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Log(msgspec.Struct, frozen=True, array_like=True):
    size: int  # bytes kept: the copy's first ``size``
    digest: str  # their sha256 (hex, the first 32)
    st: tuple[int, int, int, int] = (0, 0, 0, 0)  # the user's file then: (inode, size, mtime_ns, ctime_ns)


class Kept(msgspec.Struct, frozen=True):
    keep: str  # the keep the copies are in
    logs: dict[str, Log] = {}  # REL (``logs/HEAD``, ``worktrees/w/logs/HEAD``) -> what is kept of it


class _Index(msgspec.Struct):
    ns: int = 0  # when the look that wrote it began
    logs: dict[str, Log] = {}  # REL -> the copy (its size and digest whole) and the user's file's stat then


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:32]


def refname(rel: str) -> str:
    """The ref whose log ``rel`` is (``logs/X`` -> ``X``; ``worktrees/N/logs/X`` -> ``worktrees/N/X``):
    git's lock of that ref is the one a write of its log takes."""
    head, _, tail = rel.partition("logs/")
    return head + tail


def _wanted(rel: str, refs: Collection[str] | None) -> bool:
    """A reflog worth keeping: ``HEAD``'s (the common directory's, a linked
    worktree's), or one of a ref that exists (``refs``; None: any). A
    session's files of no ref (2,000 of one byte, named to sort first) took
    the bound's places from the user's own."""
    return refs is None or rel == "logs/HEAD" or (rel.startswith("worktrees/") and rel.endswith("/logs/HEAD")) \
        or refname(rel) in refs


def _walk(top: int, note: list[str], refs: Collection[str] | None = None,
          first: Collection[str] = ()) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """Each reflog below the common directory ``top``: ``(REL, its
    directory's descriptor, its name, its lstat)``, breadth first (``HEAD``,
    then ``refs/heads`` before the other kinds of ref), each directory
    opened below its parent with ``O_NOFOLLOW``. Past ``MAX_FILES`` or
    ``MAX_DIRS``, stops, and says so in ``note``."""
    roots = ["logs"]
    with contextlib.suppress(OSError):
        wt = os.open("worktrees", _DIR, dir_fd=top)
        try:
            roots += sorted(f"worktrees/{e.name}/logs" for e in os.scandir(wt) if e.is_dir(follow_symlinks=False))
        finally:
            os.close(wt)
    queue = deque(roots)
    files = dirs = 0
    while queue:
        rel = queue.popleft()
        dirs += 1
        if dirs > MAX_DIRS:
            note.append(f"reflogs past {MAX_DIRS} directories not kept (from {rel} on)")
            return
        try:
            fd = os.open(rel, _DIR, dir_fd=top)  # a symlink anywhere on the way: ELOOP or ENOTDIR, not entered
        except OSError:
            continue
        try:
            with os.scandir(fd) as scan:
                # HEAD's and the checked-out branch's first (``first``), then refs/heads before the rest.
                entries = sorted(scan, key=lambda e: (f"{rel}/{e.name}" not in first and e.name != "HEAD",
                                                      e.name != "heads", e.name))
            below = []
            for e in entries:
                name = f"{rel}/{e.name}"
                if e.is_dir(follow_symlinks=False):
                    below.append(name)
                    continue
                if name == STASH or e.name.endswith(".lock") or not _wanted(name, refs):
                    continue  # stashlog's; a lock (git's, or ours left by a killed daemon); of no ref
                st = e.stat(follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode) or not st.st_size:
                    continue  # an empty one has no line to keep, and counts for no bound (2,000 planted)
                files += 1
                if files > MAX_FILES:
                    note.append(f"reflogs past {MAX_FILES} not kept (from {name} on)")
                    return
                yield name, fd, e.name, st
            queue.extend(below)
        finally:
            os.close(fd)


def _key(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _read(dir_fd: int, name: str) -> tuple[bytes, os.stat_result] | None:
    """A reflog's bytes and its fstat; None: not a regular file now, or gone."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE:
            return None
        data = fs.read_all(fd, MAX_FILE + 1)  # grown meanwhile past the bound: not kept
        return (data, st) if len(data) <= MAX_FILE else None
    finally:
        os.close(fd)


def record(common: str, keep: str, refs: Collection[str] | None = None,
           first: Collection[str] = ()) -> tuple[Kept | None, str]:
    """The reflogs kept in ``keep`` (see the module), and what is not (or
    ""). ``refs``: the refs there are (a reflog of none is not kept, nor
    counted); ``first``: reflogs kept before the others (the checked-out
    branch's)."""
    note: list[str] = []
    try:
        top = os.open(common, _DIR)
    except OSError:
        return None, ""
    look_ns = time.time_ns()  # before the look: what changes during it counts as racy
    try:
        with keeps.hold(keep, common):
            index = _read_index(keep)
            copies = _Copies(keep, common)
            fresh: dict[str, Log] = {}  # what this record keeps, and the index it leaves
            total = 0
            for rel, dir_fd, name, st in _walk(top, note, refs, first):
                if st.st_size == 0:
                    continue  # nothing to lose
                if st.st_size > MAX_FILE or total + st.st_size > MAX_BYTES:
                    note.append(f"{rel} not kept: {'larger than' if st.st_size > MAX_FILE else 'past'} "
                                f"{(MAX_FILE if st.st_size > MAX_FILE else MAX_BYTES) >> 20} MiB"
                                + ("" if st.st_size > MAX_FILE else " of reflogs in all"))
                    continue
                was = index.logs.get(rel)
                if was is not None and was.st == _key(st) and treewalk.settled(st.st_ctime_ns, index.ns, _RACY_NS):
                    fresh[rel] = was  # as copied: not read
                    total += was.size
                    continue
                read = _read(dir_fd, name)
                if read is None:
                    continue
                data, fst = read
                try:
                    fresh[rel] = copies.bring(rel, data, was, _key(fst))
                except OSError as exc:  # one reflog's (a branch foo become foo/bar in the keep): the rest kept
                    note.append(f"{rel} not kept: {exc.strerror}")
                    continue
                total += len(data)
            for rel in sorted(index.logs.keys() - fresh.keys()):
                copies.retire(rel)  # gone (a branch deleted), or past a bound now
            if fresh != index.logs or any(not treewalk.settled(v.st[3], index.ns, _RACY_NS) for v in fresh.values()):
                try:
                    _write_index(keep, _Index(ns=look_ns, logs=fresh))
                except ValueError as exc:  # content no record can hold: the next record copies them all again
                    log.error("event=reflog_index_unwritten keep=%s error=%r", keep, exc)
            copies.sweep_old()
    except OSError as exc:
        return None, f"reflogs not kept: {exc.strerror}"
    finally:
        os.close(top)
    return Kept(keep=keep, logs=fresh), "; ".join(note)


def _read_index(keep: str) -> _Index:
    try:
        with open(os.path.join(keep, INDEX), "rb") as f:
            return recordjson.decode(f.read(), _Index)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return _Index()  # every reflog read and copied again


def _write_index(keep: str, index: _Index) -> None:
    tmp = os.path.join(keep, f"{INDEX}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(recordjson.encode(index))
    os.replace(tmp, os.path.join(keep, INDEX))


class _Copies:
    """The keep's copies of one record's reflogs (see the module)."""

    def __init__(self, keep: str, common: str) -> None:
        self.keep, self.common = keep, common
        self._needed: bool | None = None  # whether a record on disk names the keep (asked once, when needed)

    def _path(self, rel: str) -> str:
        return os.path.join(self.keep, COPIES, rel)

    def bring(self, rel: str, data: bytes, was: Log | None, st: tuple[int, int, int, int]) -> Log:
        """The copy of ``rel`` made to hold ``data``: appended to where
        ``data`` only adds to what it holds, else replaced. Returns its index entry."""
        path = self._path(rel)
        if was is not None and was.size <= len(data) and digest(data[:was.size]) == was.digest:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    # A copy of another size (a killed daemon's append half made) is written whole instead.
                    if os.fstat(fd).st_size == was.size:
                        _write_all(fd, data[was.size:])
                        return Log(len(data), digest(data), st)
                finally:
                    os.close(fd)
        self.retire(rel)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # Not synced (as the object files' copies are not): a first baseline copies every reflog.
        tmp = f"{path}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, data)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, path)
        return Log(len(data), digest(data), st)

    def retire(self, rel: str) -> None:
        """The copy of ``rel`` taken out: to ``OLD`` while a record may need it, else removed."""
        path = self._path(rel)
        if not os.path.lexists(path):
            return
        if self._needed is None:
            names = keeps.named(os.path.dirname(os.path.dirname(self.keep)))  # STATE/keep/HASH -> STATE
            self._needed = "*" in names or os.path.basename(self.keep) in names
        if self._needed:
            os.makedirs(os.path.join(self.keep, OLD), mode=0o700, exist_ok=True)
            os.rename(path, os.path.join(self.keep, OLD, f"{old_prefix(rel)}{secrets.token_hex(6)}"))
        else:
            os.unlink(path)

    def sweep_old(self) -> None:
        """The replaced copies removed once no record on disk names the keep."""
        old = os.path.join(self.keep, OLD)
        if not os.path.lexists(old):
            return  # the usual case: one lstat
        names = keeps.named(os.path.dirname(os.path.dirname(self.keep)))
        if "*" not in names and os.path.basename(self.keep) not in names:
            treewalk.remove_tree(old)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def old_prefix(rel: str) -> str:
    """How the replaced copies of ``rel`` in ``OLD`` begin."""
    return hashlib.sha256(os.fsencode(rel)).hexdigest()[:16] + "-"


def kept_bytes(kept: Kept, rel: str, log: Log) -> bytes | None:
    """The bytes kept of ``rel`` at the baseline: the first ``log.size`` of
    its copy, or of a replaced one in ``OLD``, whose digest is the record's;
    None: none is."""
    candidates = [os.path.join(kept.keep, COPIES, rel)]
    with contextlib.suppress(OSError):
        candidates += [os.path.join(kept.keep, OLD, n) for n in sorted(os.listdir(os.path.join(kept.keep, OLD)))
                       if n.startswith(old_prefix(rel))]
    for path in candidates:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            data = fs.read_all(fd, log.size)
        except OSError:
            continue
        finally:
            os.close(fd)
        if len(data) == log.size and digest(data) == log.digest:
            return data
    return None
