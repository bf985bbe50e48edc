"""The temporary files a ref is written through, and what a killed daemon
left of them.

A ref put back (``write_ref``, for ``history.restore``) is written to a temporary file
beside it, then renamed over it. A daemon killed between the two leaves the
temporary file. Its name ends in ``.lock``: git refuses a ref name whose
component ends so (``git check-ref-format``), so it lists no such file as a
branch or tag, packs none, and takes none for its own lock (git's lock of
``main`` is ``main.lock``; ours is ``main.dispatchd-<16 hex>.lock``).

Guarantees:
- ``temp_name`` gives a name nobody can guess (a session cannot plant a
  symlink or a FIFO there first; the caller opens it ``O_EXCL |
  O_NOFOLLOW``);
- ``sweep`` removes only regular files whose whole name is ours
  (``<name>.dispatchd-<16 hex>.lock``), and only in the directories a put
  back writes in: never a ref git reads, never git's own lock, never a
  directory, nothing through a symlink;
- ``sweep_names``, the one rule for what a killed daemon left of a write
  of ours (the start's ``sweep`` of the refs, and ``gitlock.sweep`` before
  each put-back of the kept files): a temporary name is removed only while
  nobody holds its ``flock`` (a live ``lockfile.Lock`` holds it; taken
  while it is removed), and a ``NAME.lock`` only where it is that very
  inode with no third name (the lock ``lockfile`` made of it): git's own
  lock is a file of its own, and is never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import stat
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dispatchd import flocks
from dispatchd.daemon.gitguard import fs, ournames
from dispatchd.daemon.gitguard.refvalues import is_id
from dispatchd.logtext import Bounded

if TYPE_CHECKING:
    from dispatchd.daemon.gitguard import objectstore

log = logging.getLogger("dispatchd.gitguard")

_MAX_DIRS = 10_000  # refs/dispatchd/displaced is ours, but a session may have filled it
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_PROBE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


_MAX_SAME_SECOND = 1000  # kept names tried for one WHEN (keep_displaced)
DISPLACED = "refs/dispatchd/displaced/"  # a moved ref's value kept as DISPLACED + TIME/NAME: git log finds it


def stamp() -> str:
    """The TIME of the values one put back or one restore keeps (local time, to the second)."""
    return time.strftime("%Y%m%dT%H%M%S")


def keep_displaced(common: str, when: str, name: str, value: str, store: objectstore.Store | None = None,
                   known: dict[str, str] | None = None) -> str:
    """``value`` (an id, or a symbolic ref), which ``name`` held before the
    daemon moved or deleted it, kept as ``refs/dispatchd/displaced/WHEN/NAME``:
    what it names stays reachable (``git gc`` keeps it, ``git log`` shows it).
    Returns the name it is kept under. The one writer of such refs: the
    end's put back and a checkpoint's restore name them alike.

    ``store``: the repository's objects, given where the value may be a
    session's: an id that names no object there is not kept, and "" is
    returned. A ref of ours naming a missing object made the user's
    ``git gc``, ``git log --all`` and ``git for-each-ref`` fail for good
    (a session wrote random ids into ``refs/stash`` or its log).
    ``known``: the refs below ``refs/dispatchd/displaced/`` as read once by
    the caller, kept up to date here, where each name was otherwise looked
    up in the whole ``packed-refs`` again (a session's 17 MB of it, times a
    thousand values: minutes of a close).

    WHEN is to the second: where that name already keeps another value (two
    restores, or a restore and an end, in the same second), ``WHEN.2``,
    ``WHEN.3``, ... are taken instead, so that no kept value is ever written
    over; where it keeps this very value (a restore finished again after a
    daemon's death, under its record's WHEN), the same name is written."""
    # Here, not at the top: refsback writes through this module.
    from dispatchd.daemon.gitguard.refsback import read_refs
    if store is not None and is_id(value) and not store.has(value):
        return ""
    for n in range(1, _MAX_SAME_SECOND + 1):
        kept = f"{DISPLACED}{when if n == 1 else f'{when}.{n}'}/{name}"
        # packed-refs too: git gc packs them
        held = known.get(kept) if known is not None else read_refs(common, (kept,)).get(kept)
        if held is None or held == value:
            break
    else:
        kept = f"{DISPLACED}{when}.{secrets.token_hex(4)}/{name}"  # past the bound: a name nobody holds
    write_ref(common, kept, value)
    if known is not None:
        known[kept] = value
    return kept


def temp_name(path: str) -> str:
    """A temporary name beside ``path`` for writing it (``ournames``: one
    made by ``open_temp`` is written down as the daemon's)."""
    return ournames.make(path)


def second_name_ours(dir_fd: int, leaf: str, st: os.stat_result) -> bool:
    """Whether ``st`` (a regular file of two names at ``leaf`` in ``dir_fd``:
    a lock) has its other name as a temporary of ours beside it, whose flock
    nobody holds: a killed daemon's lock, not one of the user's git a session
    gave a second name, nor a live daemon's."""
    if not (stat.S_ISREG(st.st_mode) and st.st_nlink == 2):
        return False
    base = leaf[:-len(".lock")] if leaf.endswith(".lock") else leaf
    try:
        listing = os.open(".", _DIR, dir_fd=dir_fd)  # a listable descriptor (the caller's may be O_PATH)
    except OSError:
        return False
    try:
        with os.scandir(listing) as scan:
            names = [e.name for e in scan if e.name.startswith(f"{base}.dispatchd-")]
        for name in names:
            if ournames.shaped(name) == base:
                got = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                if (got.st_dev, got.st_ino) == (st.st_dev, st.st_ino) and ournames.ours(name, got):
                    return not flocks.held_at(dir_fd, name)  # a live daemon's holds its flock
    except OSError:
        return False
    finally:
        os.close(listing)
    return False


def make_room(common: str, name: str) -> str:
    """The path of the ref ``name``, its directories made; a file in the way
    of one (a session's) moved aside first. Returns the path."""
    path = os.path.join(common, name)
    parent = os.path.dirname(path)
    probe = common
    for part in os.path.relpath(parent, common).split(os.sep):
        probe = os.path.join(probe, part)
        if os.path.lexists(probe) and not fs.is_dir(probe):
            fs.move_aside(probe)
    os.makedirs(parent, exist_ok=True)
    return path


def write_ref(common: str, name: str, value: str) -> None:
    """A loose ref, written atomically; a file or directory in the way (a
    session's) is moved aside first. Not under git's lock: the end's put
    back of the user's refs writes through ``reflock``, which is."""
    path = make_room(common, name)
    if fs.is_dir(path):
        fs.move_aside(path)
    # A name of our own, made here (O_EXCL, O_NOFOLLOW): a name that could be
    # guessed (the daemon's pid) let a session plant a symlink there, to a file
    # of the user's the ref's value was written into, or a FIFO the write
    # waited on for good. Its ".lock" end: left by a daemon killed before the
    # rename, git lists it as no branch (reftemp.py), and the next start removes it.
    write_file(path, (value + "\n").encode("utf-8", "surrogateescape"))  # a target not UTF-8: its bytes, as read


def write_file(path: str, data: bytes, mode: int | None = None) -> None:
    """``path`` holding ``data``, whole or not at all: written to a temporary
    name of our own beside it (``O_EXCL | O_NOFOLLOW``), fsynced, renamed over
    it. ``mode``: its permission bits (None: 0644 less the umask, as git's)."""
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_at(fd, os.path.basename(path), data, mode)
    finally:
        os.close(fd)


def write_at(dir_fd: int, leaf: str, data: bytes, mode: int | None = None) -> None:
    """``write_file`` in the directory ``dir_fd`` (reached by descriptor:
    nothing looked up by path again). A directory the session made
    read-only is given its owner's rights, and left so (the user's, so ours;
    as ``fs.move_aside`` does)."""
    tmp = write_temp(dir_fd, leaf, data, mode)
    st = os.stat(tmp, dir_fd=dir_fd, follow_symlinks=False)
    try:
        os.rename(tmp, leaf, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        ournames.forget((st.st_dev, st.st_ino))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    ournames.forget((st.st_dev, st.st_ino))  # its name gone: the inode is the file it wrote now


def write_whole(fd: int, data: bytes, mode: int | None = None) -> None:
    """All of ``data`` written to ``fd``, its mode set (when given), and
    made durable (fsync): a file of ours that a rename or a link then shows."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    if mode is not None:
        os.fchmod(fd, mode)
    os.fsync(fd)


def open_temp(dir_fd: int, leaf: str, flags: int, mode: int, *, lend: bool = True) -> tuple[str, int]:
    """A new file of ours beside ``leaf`` (``temp_name``), made with
    ``flags`` (``O_CREAT | O_EXCL`` among them) and ``mode``: its name and
    descriptor. With ``lend``, a directory the session made read-only is
    lent its owner's rights once (the user's, so ours: ``fs.lend``)."""
    lent = not lend
    while True:
        # A name of our own, made here (write_ref says why).
        tmp = os.path.basename(temp_name(leaf))
        path = ournames.plan(dir_fd, tmp)  # first: a death right after the open leaves a file only this tells
        try:
            fd = os.open(tmp, flags, mode, dir_fd=dir_fd)
        except BaseException as e:
            ournames.unplan(path)
            if isinstance(e, FileExistsError):
                continue
            if isinstance(e, PermissionError) and not lent:
                fs.lend(dir_fd)
                lent = True
                continue
            raise
        ournames.note(path, os.fstat(fd))  # before it can get a second name (ournames says why)
        return tmp, fd


def write_temp(dir_fd: int, leaf: str, data: bytes, mode: int | None = None) -> str:
    """``data`` in a new file of ours beside ``leaf`` (``temp_name``),
    fsynced; returns its name, for the caller to rename or link."""
    tmp, out = open_temp(dir_fd, leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o644 if mode is None else 0o600)
    try:
        write_whole(out, data, mode)
    except BaseException:
        discard(dir_fd, tmp, out)
        raise
    os.close(out)
    return tmp


def discard(dir_fd: int, tmp: str, fd: int) -> None:
    """A temporary of ours (``open_temp``'s ``tmp`` and ``fd``) given up:
    closed, removed, forgotten as ours (``ournames``) once its name is gone;
    one that cannot be removed stays ours, for the next sweep (``Lock.release``)."""
    st = os.fstat(fd)
    os.close(fd)
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError:
        return
    ournames.forget((st.st_dev, st.st_ino))


def sweep(common: str, refs: list[str]) -> list[str]:
    """Remove what an interrupted write of ``refs`` (names below ``common``,
    ``HEAD`` included), of any ref below ``refs/`` or of a displaced ref
    left; returns the paths removed.
    Every directory is reached from ``common`` without following a symlink
    (``fs.path_below``): one a session left anywhere on the way (``refs``,
    ``refs/dispatchd/displaced``, a directory below) is not entered."""
    try:
        top = os.open(common, _DIR | os.O_NOFOLLOW)
    except OSError:
        return []
    removed: list[str] = []
    try:
        dirs = {os.path.dirname(name) for name in refs if "/" in name} | {""}
        # The whole refs tree, each directory listed once: swept, and its
        # subdirectories taken from the same listing; the displaced refs'
        # first (ours alone), then every other (a restore's or an end's
        # write of a ref the session made, a tag, a new namespace, leaves
        # its lock where no ref of ``refs`` lies).
        pending, seen, listed = ["refs", "refs/dispatchd/displaced"], 0, set()
        while pending and seen < _MAX_DIRS:
            rel = pending.pop()
            if rel in listed:
                continue
            listed.add(rel)
            fd = _below(top, rel)
            if fd is None:
                continue
            seen += 1
            dirs.discard(rel)
            swept, below = _sweep_dir(fd, os.path.join(common, rel), subdirs=True)
            removed += swept
            pending += [f"{rel}/{name}" for name in below]
        for rel in sorted(dirs):
            fd = _below(top, rel)
            if fd is not None:
                removed += _sweep_dir(fd, os.path.join(common, rel) if rel else common)[0]
    finally:
        os.close(top)
    removed.sort()
    said = Bounded(level=logging.INFO)  # a session can leave thousands of names of that shape
    for gone in removed:
        said.say(log, "event=ref_temporary_removed path=%s", gone)
    said.end(log, "temporary ref files removed, not logged one by one")
    return removed


def _below(top: int, rel: str) -> int | None:
    """The directory ``rel`` below ``top``, for listing, never through a symlink."""
    at = fs.path_below(top, rel) if rel else os.dup(top)
    if at is None:
        return None
    try:
        return os.open(".", _DIR, dir_fd=at)
    except OSError:
        return None
    finally:
        os.close(at)


def _sweep_dir(fd: int, path: str, subdirs: bool = False) -> tuple[list[str], list[str]]:
    """Our leftovers in the directory ``fd`` (``path``, for the log), which is
    closed, removed (``sweep_names``); and with ``subdirs``, the names of its
    subdirectories (not a symlink), from the same listing."""
    names: list[str] = []
    below: list[str] = []
    try:
        with os.scandir(fd) as scan:
            for e in scan:
                (below if subdirs and e.is_dir(follow_symlinks=False) else names).append(e.name)
        return sweep_names(fd, path, names), below
    except OSError:
        return [], []
    finally:
        os.close(fd)


def sweep_names(dir_fd: int, path: str, names: Iterable[str], leaves: set[str] | None = None) -> list[str]:
    """Of ``names`` (listed in ``dir_fd``; ``path`` for what is returned),
    what a killed daemon's write left, removed: our temporary names (of a
    leaf in ``leaves``, when given) nobody holds, and the ``NAME.lock`` that
    is a second name of one; returns the paths removed."""
    removed: list[str] = []
    for name in names:
        of = ournames.shaped(name)
        if of is None or (leaves is not None and of not in leaves):
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        # The shape alone is anyone's to give a file (a link to the user's live lock): ours only if written down.
        if not stat.S_ISREG(st.st_mode) or not ournames.ours(name, st):
            continue
        probe = _hold(dir_fd, name, st)
        if probe is None:
            continue  # a live daemon's, mid-way
        try:
            lock = f"{of}.lock"
            try:
                there: os.stat_result | None = os.stat(lock, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                there = None
            # Ours only if the very inode, and no third name (not our dance's).
            if there is not None and (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino) and st.st_nlink == 2:
                os.unlink(lock, dir_fd=dir_fd)  # first: once the temporary name is gone, nothing says it is ours
                removed.append(os.path.join(path, lock))
            os.unlink(name, dir_fd=dir_fd)
            ournames.forget((st.st_dev, st.st_ino))
            removed.append(os.path.join(path, name))
        except OSError:
            continue
        finally:
            if probe >= 0:
                os.close(probe)
    return removed


def _hold(dir_fd: int, name: str, st: os.stat_result) -> int | None:
    """``name``'s flock taken (its descriptor, kept open while it is
    removed), -1 where it cannot be opened (a mode a session set: nobody's
    flock is seen, as ``flocks.held_at``), None where another holds it."""
    try:
        fd = os.open(name, _PROBE, dir_fd=dir_fd)
    except OSError:
        return -1
    try:
        got = os.fstat(fd)
        if (got.st_dev, got.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)
            return None  # replaced since the look: left for the next sweep
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        os.close(fd)
        return -1
    return fd
