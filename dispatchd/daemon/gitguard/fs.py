"""How the daemon reads and moves git's metadata in a worktree: as hostile
content a session wrote.

Guarantees, for what goes through here:
- a file is opened with ``O_NOFOLLOW | O_NONBLOCK`` (no symlink as the last
  component, no FIFO to hang on), read only if ``fstat`` says it is a
  regular file, and read with a bound (a pointer file 4 KiB, an index
  256 MiB; not past its header when that counts more entries than it can
  hold); an index that does not parse is remembered as one that does, so
  that one planted file hard-linked everywhere is parsed once;
- a path taken from content a session controls (a submodule an index
  records) is walked from the worktree one component at a time, each an
  ``O_PATH | O_NOFOLLOW`` descriptor (``open_dir_below``): no such name and
  no symlink planted on the way can lead outside the worktree; a name git
  itself would refuse (``..``, empty, absolute) is not walked at all;
- what is moved aside is renamed within its own directory to an unguessable
  name (``move_aside``, ``move_aside_at``, ``move_below_aside``), never
  deleted; a directory a
  session made read-only is made writable for its owner first (it is the
  user's, so the daemon's); a rename that finds no room (ENOSPC, EDQUOT)
  is tried again once the daemon's ballast is freed, and what still cannot
  move is made unreadable where it is and reported as not moved
  (``noroom``).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Iterator

from dispatchd import statemodes, treewalk
from dispatchd.confine import _sys
from dispatchd.daemon.gitguard import indexfile, noroom

_MAX_POINTER = 4096  # a .git pointer file, a gitdir or commondir file
_MAX_INDEX = 256 * 1024 * 1024
QUARANTINED = ".quarantined-by-dispatchd-"

# What makes a submodule path plainly absent for git too: nothing there, a
# file on the way, or a symlink (git does not follow one into a submodule).
ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
# git's fan-out directories of loose objects (``ab``: lowercase, as git names
# them and looks them up). Any other name a session makes in ``objects`` is
# nothing git reads: not kept, not looked at (and, being plain content, in a
# checkpoint: checkpoints/reading.py leaves out these alone).
FANOUT = frozenset(f"{i:02x}" for i in range(256))


def open_regular(name: str, dir_fd: int | None = None) -> tuple[int, os.stat_result] | None:
    """``name`` (below ``dir_fd``) opened for reading as every read here is:
    ``O_NOFOLLOW | O_NONBLOCK`` (no symlink followed, no FIFO waited on);
    ``(fd, its fstat)`` when it is a regular file, the descriptor the
    caller's to close, else None (closed here). Raises ``OSError`` when it
    cannot be opened."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def read_all(fd: int, size: int) -> bytes:
    """Up to ``size`` bytes of ``fd``, read in chunks of 16 MiB (one
    ``read`` returns less past 2 GiB); fewer when the file ends first."""
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_regular(name: str, dir_fd: int | None = None, limit: int = _MAX_POINTER, *,
                 whole: bool = False) -> tuple[bytes, int] | None:
    """A regular file's first ``limit`` bytes and its size (``open_regular``:
    no symlink followed, no FIFO waited on), or None: absent, not a regular
    file, unreadable, or (``whole``) larger than ``limit``, then not read."""
    try:
        opened = open_regular(name, dir_fd)
        if opened is None:
            return None
    except OSError:
        return None
    fd, st = opened
    try:
        if whole and st.st_size > limit:
            return None
        return read_all(fd, limit), st.st_size
    except OSError:
        return None
    finally:
        os.close(fd)


def read_small(path: str, limit: int = _MAX_POINTER) -> str | None:
    """A small file's text (at most ``limit`` bytes, 4 KiB by default), or
    None: absent, a symlink, not a regular file, unreadable."""
    read = read_regular(path, limit=limit)
    return read[0].decode("utf-8", "replace") if read is not None else None


def scanned(path: str) -> list[os.DirEntry[str]]:
    """The entries of the directory at ``path``, sorted by name; the scan is
    closed however it ends (an error half way leaves no descriptor open)."""
    with os.scandir(path) as scan:
        return sorted(scan, key=lambda e: e.name)


def is_file(path: str) -> bool:
    """A regular file, not a symlink to one (``lstat``)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def is_dir(path: str) -> bool:
    """A directory, not a symlink to one (``lstat``)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


# An index's submodules (None: it does not parse) by its (device, inode),
# reused while its ctime, mtime and size are those it had when it was parsed
# and its ctime was older than _SETTLE_NS before the read began (a later
# write always gets a later ctime, and no process can set a ctime back;
# runnables.SETTLE_NS). The verdict "does not parse" too: one planted index
# hard-linked under thousands of submodules is parsed once, not once each.
# Never written to disk.
_SETTLE_NS = 50_000_000
_LINKS_KEPT = 10_000
_Seen = tuple[int, int, int, frozenset[str] | None]
_links_seen: dict[tuple[int, int], _Seen] = {}


def _read_index(path: str, known: bool = False) -> tuple[bytes | None, os.stat_result | None, _Seen | None]:
    """The index's bytes (None: absent, not a regular file, too large,
    unreadable; empty: its header counts more entries than it can hold, so
    the rest is not read) and its ``fstat``; with ``known``, instead of the
    bytes, what was parsed from it before when its stamps are unchanged."""
    try:
        opened = open_regular(path)
    except OSError:
        return None, None, None
    if opened is None:
        return None, None, None
    fd, st = opened
    try:
        if st.st_size > _MAX_INDEX:
            return None, None, None
        if known and not treewalk.fine_local_ctime(fd, st.st_dev):
            known = False  # a ctime this kernel does not keep (NFS, FUSE): parsed every time
        if known:
            seen = _links_seen.get((st.st_dev, st.st_ino))
            if seen is not None and seen[:3] == (st.st_ctime_ns, st.st_mtime_ns, st.st_size):
                return None, st, seen
        if not indexfile.could_fit(os.pread(fd, 12, 0), st.st_size):
            return b"", st, None  # no parse of the whole could succeed: 256 MiB not read for nothing
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks), st, None
    finally:
        os.close(fd)


def index_gitlinks(index: str) -> set[str] | None:
    """The submodules an index file records, a split index's shared part
    included; an empty set when there is no index, None when it cannot be read."""
    if not os.path.lexists(index):
        return set()
    began = time.time_ns()
    data, st, seen = _read_index(index, known=True)
    if seen is not None:
        return set(seen[3]) if seen[3] is not None else None
    parsed = indexfile.parse_index(data) if data is not None else None
    if parsed is None:
        if data is not None and st is not None:
            _remember(st, began, None)
        return None
    links, shared = parsed.links, parsed.shared
    if st is not None and not shared and not parsed.replaced_gitlink:
        _remember(st, began, frozenset(links))
    if shared and shared != "0" * len(shared):
        shared_data = _read_index(os.path.join(os.path.dirname(index), f"sharedindex.{shared}"))[0]
        shared_parsed = indexfile.parse_index(shared_data, all_names=parsed.replaced_gitlink) if shared_data else None
        if shared_parsed is None:
            return None
        # A superset (the split part may delete entries of the shared one):
        # each candidate is only checked, never trusted. A submodule that
        # replaces a shared entry takes that entry's name, which only the
        # replace bitmap tells: then every shared path is a candidate.
        links = links | shared_parsed.links | shared_parsed.names
    elif parsed.replaced_gitlink:
        return None
    return links


def _remember(st: os.stat_result, began: int, links: frozenset[str] | None) -> None:
    """Keep what the index ``st`` gave (None: it does not parse) for
    ``_read_index``, when its ctime had settled before the read ``began``."""
    if treewalk.settled(st.st_ctime_ns, began, _SETTLE_NS):
        if len(_links_seen) >= _LINKS_KEPT:
            _links_seen.clear()
        _links_seen[(st.st_dev, st.st_ino)] = (st.st_ctime_ns, st.st_mtime_ns, st.st_size, links)


def safe_link(link: str) -> bool:
    """A submodule path as git itself would accept it: relative, no empty,
    ``.`` or ``..`` component (git's verify_path refuses the same)."""
    parts = link.split("/")
    return bool(link) and not link.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def open_dir_below(worktree: str, link: str, *, searchable: bool = False) -> int | None:
    """A descriptor of the submodule's directory, reached from the worktree one
    component at a time without following a symlink, or None when there is
    none (see ``ABSENT``). The daemon acts on what the index names only
    through it, so a name or a planted symlink can never make it touch a path
    outside the worktree. Raises OSError when the path cannot be looked at
    (a directory the session made unsearchable): absent for now, but not for
    the user who makes it searchable again. With ``searchable``, each
    directory on the way that a session made unsearchable gets its owner's
    rights back first (the user's, so the daemon's): what lies below one is
    reached all the same."""
    if not safe_link(link):
        return None
    try:
        fd = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    for part in link.split("/"):
        try:
            if searchable:
                lend(fd)  # not given back: on the way to a quarantine (see above)
            nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno in ABSENT:
                return None
            raise
        os.close(fd)
        fd = nxt
    return fd


_ASIDE_KEPT = 150  # bytes of a name kept in its aside name: with the suffix, well under NAME_MAX (255)


def aside_name(name: str) -> str:
    # The time for the user who finds it; the random part so that a session
    # cannot take the name in advance (it can guess the time). A long name
    # (a session's) is cut, with a hash of the whole: renamed, it must fit.
    raw = os.fsencode(name)
    if len(raw) > _ASIDE_KEPT:
        name = os.fsdecode(raw[:_ASIDE_KEPT - 13]) + "-" + hashlib.sha256(raw).hexdigest()[:12]
    return f"{name}{QUARANTINED}{int(time.time())}-{secrets.token_hex(6)}"


def lend_path(path: str) -> None:
    """The directory at ``path`` (not a symlink: ``lstat``) given its owner's
    rights, and left so (as ``move_aside`` does): a session made it
    read-only or unsearchable, and the end writes in it. Never raises."""
    try:
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) & stat.S_IRWXU != stat.S_IRWXU:
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
    except OSError:
        pass


# The one rename of a move aside: tests stand in for a file system with no
# room left for the longer name (ENOSPC) here.
_rename = os.rename


def move_to_top(common: str, parent: int, leaf: str, called: str) -> str:
    """``leaf`` in the directory ``parent`` moved to the git directory
    ``common``'s top as ``called`` with an aside name's ending: out of
    ``refs/`` or ``logs/``, where git would read it as a ref or a reflog.
    ``common`` opened as that very directory (``parent_at``). Returns its name there."""
    top = parent_at(common)
    try:
        name = aside_name(called)
        os.rename(leaf, name, src_dir_fd=parent, dst_dir_fd=top)
        return name
    finally:
        os.close(top)


def move_aside_at(dir_fd: int, name: str) -> str:
    """``move_aside`` relative to a directory descriptor."""
    return noroom.moved(lambda: _rename_aside_at(dir_fd, name), lambda: os.fstat(dir_fd).st_dev,
                        lambda: noroom.disarm_at(dir_fd, name))


def _rename_aside_at(dir_fd: int, name: str) -> str:
    for _ in range(2):
        dst = aside_name(name)
        try:
            _rename(name, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return dst
        except PermissionError:
            # A directory the session made read-only: ours to make writable
            # (and left so: what it held was moved aside).
            lend(dir_fd)
    _rename(name, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return dst


def move_below_aside(root: str, rel: str) -> str | None:
    """Move ``rel`` (a path below ``root``, ``/``-separated) aside, its parent
    reached by descriptor (``open_dir_below``: no symlink followed); returns
    the new path, or None when it is gone. Raises OSError when it cannot."""
    parent, _, name = rel.rpartition("/")
    try:
        fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC) if not parent else open_dir_below(root, parent)
    except PermissionError:
        fd = open_dir_below(root, parent, searchable=True)
    if fd is None:
        return None
    try:
        return os.path.join(root, parent, move_aside_at(fd, name))
    except FileNotFoundError:
        return None
    finally:
        os.close(fd)


def move_all_below_aside(root: str, todo: list[str]) -> tuple[list[str], list[str]]:
    """``move_below_aside`` for each of ``todo``; returns the new paths, and
    what could not be moved, with why (the rest is still moved)."""
    moved: list[str] = []
    failed: list[str] = []
    for rel in todo:
        try:
            done = move_below_aside(root, rel)  # None: gone since the walk
        except OSError as exc:
            failed.append(f"{os.path.join(root, rel)}: {exc.strerror}")
            continue
        if done is not None:
            moved.append(done)
    return moved, failed


def move_aside(path: str) -> str:
    """Rename ``path`` to an unguessable name beside it and return that name.
    A parent the session made read-only (it is the user's, so ours) is made
    writable for us first. Raises OSError if it cannot be moved; the caller
    says so loudly (``noroom.Disarmed``: no room for the rename, and made
    unreadable where it is).

    The parent is opened once and must be the very directory ``path``
    names, no symlink on the way (``parent_at``): the rename, the chmod of a
    read-only parent and the mode 000 of no room all go through that
    descriptor. By path, a session that swapped a directory on the way for
    a symlink between the check's look and the move (another session of a
    repository shared with a linked worktree, at this one's end) had them
    land on a name of the same kind in a directory of the user's elsewhere.
    The paths given are the daemon's, built on resolved roots."""
    parent, name = os.path.split(path)
    fd = parent_at(parent)
    try:
        return os.path.join(parent, move_aside_at(fd, name))
    finally:
        os.close(fd)


def parent_at(parent: str) -> int:
    """An ``O_PATH`` descriptor of the directory ``parent`` (absolute), only
    when it is that very directory: a path through a symlink resolves to
    another, which the descriptor's own path then names, and is refused
    (ELOOP). Raises ``OSError``."""
    fd = os.open(parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if os.readlink(f"/proc/self/fd/{fd}") != os.path.normpath(parent):
            raise OSError(errno.ELOOP, "a symlink on the way to it (a directory swapped for one?)", parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


_CHUNK = 3000  # bytes of a path one openat2 resolves (PATH_MAX is 4096; a name at most 255)
_openat2 = [True]  # False once the kernel said it has none (before Linux 5.6)


def path_below(dir_fd: int, rel: str, *, lend: bool = False) -> int | None:
    """An ``O_PATH`` descriptor of the directory ``rel`` below ``dir_fd``, or
    None when there is none (absent, not a directory, or a symlink on the
    way, which is never followed). By ``openat2`` (RESOLVE_BENEATH,
    RESOLVE_NO_SYMLINKS) a few thousand bytes of the path at a time: reached
    from the worktree one component at a time in Python, a directory 3,000
    deep cost 3,000 opens, and a deep tree with many directories past
    ``runnables.MAX_OPEN`` took minutes a walk. Without ``openat2``, one component at a
    time all the same. ``lend``: a directory on the way the session made
    unsearchable is lent its owner's rights for the one open (``lent``);
    without, there is none below it."""
    parts = rel.split("/")
    sizes = [len(os.fsencode(part)) for part in parts]  # bytes: a name of 85 CJK characters is 255 of them
    fd = os.dup(dir_fd)
    i = 0
    while i < len(parts):
        j, size = i + 1, sizes[i]
        while j < len(parts) and size + 1 + sizes[j] <= _CHUNK:
            size += 1 + sizes[j]
            j += 1
        try:
            nxt = _chunk_below(fd, parts[i:j], lend)
        finally:
            os.close(fd)
        if nxt is None:
            return None
        fd, i = nxt, j
    return fd


def _chunk_below(dir_fd: int, parts: list[str], lend: bool) -> int | None:
    flags = os.O_PATH | os.O_DIRECTORY
    if _openat2[0]:
        try:
            return _sys.open_beneath(dir_fd, "/".join(parts), flags)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EXDEV):
                return None
            if exc.errno == errno.ENOSYS:
                _openat2[0] = False
            # EAGAIN: a rename raced the lookup; ENAMETOOLONG: not expected (the
            # chunks are short enough), but one component at a time goes all the
            # same; EACCES: a directory on the way the session made unsearchable.
            elif exc.errno not in (errno.EAGAIN, errno.ENAMETOOLONG, errno.EACCES):
                raise
    fd = os.dup(dir_fd)
    for part in parts:
        try:
            try:
                nxt = os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except PermissionError:
                if not lend:
                    return None
                with lent(fd):
                    nxt = os.open(part, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None
            raise
        finally:
            os.close(fd)
        fd = nxt
    return fd


def lend(fd: int) -> int:
    """The directory ``fd`` (an ``O_PATH`` descriptor will do:
    ``statemodes.set_mode``) given its owner's rights, read, write and
    search (the user's, so the daemon's: a session made it unsearchable or
    read-only); returns its mode before, for ``give_back``."""
    changed = statemodes.set_mode(fd, lambda mode: mode | stat.S_IRWXU, statemodes.DIRS)
    if changed is None:  # not this uid's directory: refused, as the kernel's chmod refuses another uid's
        raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))
    return changed[0]


def give_back(fd: int, mode: int) -> None:
    """The directory ``fd``'s mode as ``lend`` found it."""
    statemodes.set_mode(fd, mode, statemodes.DIRS)


@contextlib.contextmanager
def lent(dir_fd: int) -> Iterator[None]:
    """The directory ``dir_fd``, which the session made unsearchable, given
    its owner's rights (the user's, so the daemon's) for what is done inside,
    its mode put back right after, as the worktree walk lends them to a
    directory it lists (``runnables._Walk.open_dir``): the directories it
    reaches again by name are walked below one too, not the walk refused."""
    mode = lend(dir_fd)
    try:
        yield
    finally:
        give_back(dir_fd, mode)
