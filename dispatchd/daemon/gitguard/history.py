"""A repository's history kept across sessions: the refs the user had, and
every object file, put back when a session deletes or rewinds them.

At a baseline (``record``) the daemon reads the repository's branches and
tags (``packed-refs`` and loose refs, no git run) and keeps every object
file (loose objects and packs) in its own state directory: a reflink clone
where the file system has them (btrfs, XFS), else a hard link, else a copy
(another file system) within a size budget. Kept files are added and
dropped incrementally, so a later baseline costs a listing.

When the sessions end (``restore``), with their processes gone:
- an object file kept and now missing is put back (a session's ``rm -rf
  .git/objects`` loses nothing); a loose one that a pack index names now
  (git packed it meanwhile: ``packed.py``) is put back too, but not
  reported as deleted by a session; one a session replaced by another file
  is put back, the session's moved aside (``replaced.py``);
- a branch or tag the user had that is gone, or that no longer leads back to
  where it was (a fast-forward is kept: the user's own commits in another
  worktree meanwhile look the same), is written back as a loose ref; the
  value it was moved to is kept as ``refs/dispatchd/displaced/TIME/NAME``
  so nothing is lost either way;
- the branches checked out in the worktrees the sessions worked in are
  theirs to move (``own``), remote-tracking refs are left alone.

What it does not protect: an object file rewritten in place (a session must
make it writable first; a hard-linked keep shares its inode: git's objects
are content-addressed, so ``git fsck`` finds it); reflogs; other
worktrees' HEADs (the user's own checkouts there look the same).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import time

import msgspec

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, keeps, objectstore, packed, reftemp, replacerefs, replaced, shown, viewfiles
from dispatchd.tools import native

_log = logging.getLogger("dispatchd.history")

_OID = re.compile(r"^[0-9a-f]{40}(?:[0-9a-f]{24})?$")
_MAX_REFS = 100_000
_MAX_OBJECT_FILES = 2_000_000
_COPY_BUDGET = 512 * 1024 * 1024  # bytes copied (not linked: another file system) at one baseline
_FICLONE = 0x40049409
PROTECTED_PREFIXES = ("refs/heads/", "refs/tags/")


class History(msgspec.Struct, frozen=True):
    common: str  # the repository's common git directory
    refs: dict[str, str] = {}  # branches and tags at the baseline -> object id
    own: list[str] = []  # branches a session may move (checked out where it works)
    head: str = ""  # the common directory's HEAD, as it was
    keep: str = ""  # where its object files are kept ("" when not kept)
    note: str = ""  # what is not kept, and why
    # Each object directory (fan-out and pack) -> its ctime (ns) at the look,
    # and when the look began: a directory whose ctime is unchanged has the
    # same entries (a session can set an mtime, never a ctime), so only the
    # changed ones, and those changed too close to the look, are listed again.
    stamps: dict[str, int] = {}
    stamped_ns: int = 0
    replaces: dict[str, str] | None = None  # ``git replace`` refs (None: an older record): replacerefs.py
    replaces_packed: list[str] = []
    views: dict[str, str | None] | None = None  # shallow and alternates as they were (viewfiles.py)
    view_stamps: dict[str, list[int] | None] | None = None  # the commit-graph and the like (viewfiles.py)


_RACY_NS = 50_000_000  # a directory changed this close before a look is listed whatever its ctime says
try:  # the coarse clock's tick, which file times follow (1-10 ms); 50 ms where it cannot be asked
    _TICK_NS = max(1_000_000, int(time.clock_getres(5) * 1e9))  # CLOCK_REALTIME_COARSE
except OSError:
    _TICK_NS = _RACY_NS
_STAMPS = ".stamps"  # in a keep: the stamps it was last brought up to date with


_MAX_REF_DIRS = 100_000  # directories of loose refs looked at


def _real_dirs(common: str, rel: str) -> bool:
    """Whether every component of ``rel`` below ``common`` is a directory,
    not a symlink to one (``.git/refs/heads -> /`` walked the whole disk)."""
    path = common
    for part in rel.split("/"):
        path = os.path.join(path, part)
        if not fs.is_dir(path):
            return False
    return True


def read_refs(common: str) -> dict[str, str]:
    """Branches and tags: ``packed-refs``, then loose refs (which win); loose
    ones only below real directories, at most ``_MAX_REF_DIRS`` of them."""
    refs: dict[str, str] = {}
    dirs = 0
    packed_text = fs.read_small(os.path.join(common, "packed-refs"), 64 * 1024 * 1024)
    for line in (packed_text or "").splitlines():
        if not line or line[0] in "#^":
            continue
        oid, _, name = line.partition(" ")
        if _OID.match(oid) and name.startswith(PROTECTED_PREFIXES):
            refs[name] = oid
            if len(refs) >= _MAX_REFS:
                break
    for prefix in PROTECTED_PREFIXES:
        if not _real_dirs(common, prefix.rstrip("/")):
            continue
        top = os.path.join(common, prefix.rstrip("/"))
        pending = [(top, prefix.rstrip("/"))]
        while pending and len(refs) < _MAX_REFS and dirs < _MAX_REF_DIRS:
            path, name = pending.pop()
            dirs += 1
            try:
                entries = fs.scanned(path)
            except OSError:
                continue
            for entry in entries:
                full = f"{name}/{entry.name}"
                if entry.is_dir(follow_symlinks=False):
                    pending.append((entry.path, full))
                elif entry.is_file(follow_symlinks=False):
                    value = (fs.read_small(entry.path, 256) or "").strip()
                    if _OID.match(value):
                        refs[full] = value
    return refs


def checked_out(gitdir: str) -> str:
    """The branch a git directory's HEAD names (``refs/heads/...``), or ""."""
    text = (fs.read_small(os.path.join(gitdir, "HEAD"), 4096) or "").strip()
    return text[5:].strip() if text.startswith("ref: refs/heads/") else ""


# git's object directories: the fan-out ones (``ab``: lowercase, as git names
# them and looks them up) and ``pack``. Any other name a session makes in
# ``objects`` is nothing git reads: not kept, not looked at (and, being plain
# content, in a checkpoint: checkpoints/reading.py leaves out these alone).
_FANOUT = frozenset(f"{i:02x}" for i in range(256))


def is_object_dir(name: str) -> bool:
    """A directory of ``objects`` whose files are git's objects."""
    return name in _FANOUT or name == "pack"


def _stamps(objects: str) -> dict[str, int]:
    """Each object directory (``is_object_dir``) -> its ctime in ns. Each is
    looked at below a descriptor of ``objects`` (no path walked again: a
    third less time for git's 257 directories); by the C helper where it is
    built (``tools/_ctimes.c``: the same entries, 0.41 -> 0.26 ms for 256
    directories, on every open and close)."""
    try:
        # Never through a symlink: the callers refuse a symlinked objects, and
        # one swapped in after their look is not followed here either.
        fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        if native.lines is not None:
            return native.lines.subdir_ctimes(fd, 2, ("pack",))
        return _stamps_below(fd)
    finally:
        os.close(fd)


def _stamps_below(fd: int) -> dict[str, int]:
    """``_stamps`` in Python: the C helper's twin (tests/unit/test_ctimes.py)."""
    found: dict[str, int] = {}
    for name in os.listdir(fd):
        if is_object_dir(name):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                found[name] = st.st_ctime_ns
    return found


def _changed(then: dict[str, int], then_ns: int, now: dict[str, int], margin_ns: int = _RACY_NS) -> set[str]:
    """The object directories to list again: new, gone, changed since, or
    changed too close before the look to trust their ctime (``margin_ns``)."""
    if then == now:  # the usual case, compared in C: only the racy ones
        return {d for d, ns in then.items() if not treewalk.settled(ns, then_ns, margin_ns)}
    return {d for d in then.keys() | now.keys()
            if then.get(d) != now.get(d) or not treewalk.settled(then[d], then_ns, margin_ns)}


def _files_in(objects: str, dirs: set[str]) -> set[str]:
    found: set[str] = set()
    for name in dirs:
        try:
            found.update(f"{name}/{n}" for n in os.listdir(os.path.join(objects, name)) if not n.startswith("tmp"))
        except OSError:
            continue
    return found


# What FICLONE answers where the file system has no reflinks (ext4: EOPNOTSUPP),
# or the two files are on different ones (EXDEV). Not EINVAL: on btrfs it is
# one file's answer (no checksums: chattr +C), and a session could plant such
# a file first in the batch to have the rest hard-linked (sharing inodes).
_NO_REFLINK = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.ENOSYS})


class Ways:
    """The ways of copying a file one batch of ``_clone`` found refused, by
    (source device, destination device): asked once each, not once a
    file. On a file system without reflinks each attempt made the
    destination, asked, then removed it: a repository's first baseline
    (every object file) took 30-40x a plain hard link's time (ext4, 2,042
    files: 1.0-1.3 s against 32 ms)."""

    def __init__(self) -> None:
        self.no_reflink: set[tuple[int, int]] = set()
        self._devices: dict[str, int] = {}

    def between(self, src_dev: int, dst: str) -> tuple[int, int]:
        """(source device, device of ``dst``'s directory), the latter looked up once a directory."""
        folder = os.path.dirname(dst)
        dev = self._devices.get(folder)
        if dev is None:
            dev = self._devices[folder] = os.stat(folder).st_dev
        return src_dev, dev


def _clone(src: str, dst: str, budget: list[int], ways: Ways | None = None) -> None:
    """``dst`` as a copy of ``src`` that costs as little as the file system
    allows: a reflink, else a hard link, else a copy within ``budget``.
    ``ways``: what this batch found refused (one per batch; none: ask).
    ``src`` is opened without blocking and copied through that descriptor:
    a FIFO a session planted among the object files (a blocking open waits
    for a writer for good, holding its domain's lock) is not a regular
    file, and is left."""
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(sfd)
        if not stat.S_ISREG(st.st_mode):
            return
        where = ways.between(st.st_dev, dst) if ways is not None else (st.st_dev, 0)
        if ways is None or where not in ways.no_reflink:
            dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
            try:
                try:
                    fcntl.ioctl(dfd, _FICLONE, sfd)
                    return
                except OSError as exc:
                    if ways is not None and exc.errno in _NO_REFLINK:
                        ways.no_reflink.add(where)
            finally:
                os.close(dfd)
            os.unlink(dst)
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        else:
            # Linked by path: kept only if it is the inode opened and looked at
            # (a session swapping a FIFO in meanwhile would have it in the keep).
            linked = os.stat(dst, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):
                os.unlink(dst)
            return
        if st.st_size > budget[0]:
            raise OSError(errno.EFBIG, "over the copy budget")
        budget[0] -= st.st_size
        dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
        try:
            left = st.st_size
            while left > 0:  # no further: a file that grows meanwhile is kept as it was when looked at
                n = os.sendfile(dfd, sfd, None, min(left, 1 << 30))
                if n == 0:
                    break
                left -= n
        except BaseException:
            os.close(dfd)
            os.unlink(dst)
            raise
        os.close(dfd)
    finally:
        os.close(sfd)


def keep_for(keep_dir: str, common: str) -> str:
    """The keep of a repository's object files, under the daemon's ``keep_dir``."""
    return os.path.join(keep_dir, hashlib.sha256(os.fsencode(os.path.realpath(common))).hexdigest()[:16])


def keep_more(objects_fd: int, keep: str, common: str, budget: list[int]) -> set[str]:
    """Add the object files of the ``objects`` directory held by
    ``objects_fd`` that the keep lacks, dropping none (a checkpoint's,
    daemon/checkpoints/: what a session deleted stays kept for the end's
    ``restore``); returns every object file present. Each directory is
    opened below ``objects_fd`` with ``O_NOFOLLOW`` and read through its
    descriptor: a symlink a session planted there leads nowhere. ``budget``:
    bytes it may copy (not clone or link), lowered as it goes; over it,
    OSError EFBIG. Leaves the stamps alone: the next ``record`` lists again
    what changed since its own look, these additions included."""
    present: set[str] = set()
    ways = Ways()
    with keeps.hold(keep, common):
        for name in os.listdir(objects_fd):
            if not is_object_dir(name):
                continue
            try:
                fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=objects_fd)
            except OSError:
                continue  # not a directory (a symlink included): not git's
            try:
                here = {n for n in os.listdir(fd) if not n.startswith("tmp")}
                present.update(f"{name}/{n}" for n in here)
                kept_dir = os.path.join(keep, name)
                try:
                    kept = set(os.listdir(kept_dir))
                except FileNotFoundError:
                    kept = set()
                missing = sorted(here - kept)
                if missing:
                    os.makedirs(kept_dir, mode=0o700, exist_ok=True)
                for n in missing:
                    try:
                        _clone(f"/proc/self/fd/{fd}/{n}", os.path.join(kept_dir, n), budget, ways)
                    except (FileNotFoundError, FileExistsError):
                        continue  # gone meanwhile (a repack), or kept meanwhile
            finally:
                os.close(fd)
    return present


def record(common: str, keep: str, own: list[str]) -> History:
    """Read the refs and bring the keep of the object files up to date."""
    refs = read_refs(common)
    replacing = replacerefs.read(common)
    head = fs.read_small(os.path.join(common, "HEAD"), 4096) or ""
    objects = os.path.join(common, "objects")
    note = ""
    stamped_ns = time.time_ns()  # before the look: what changes during it counts as racy
    if not fs.is_dir(objects):
        # A symlink (a session's): its target's two-letter directories would be
        # linked into the keep, and put back into the repository from there.
        return History(common=common, refs=refs, own=sorted(set(own)), head=head, keep="",
                       note="object files not kept: objects is not a directory (a symlink?)",
                       replaces=replacing.loose, replaces_packed=replacing.packed, views=viewfiles.read(common),
                       view_stamps=viewfiles.read_stamps(common))
    stamps = _stamps(objects)
    try:
        with keeps.hold(keep, common):  # named, and spared by a sweep while this works
            index = fs.read_small(os.path.join(keep, _STAMPS), 1 << 20)
            try:
                last = msgspec.json.decode(index or "", type=tuple[dict[str, int], int]) if index else ({}, 0)
            except (msgspec.ValidationError, msgspec.DecodeError):
                last = ({}, 0)
            # An older daemon stamped any two-character directory: only git's are looked at.
            last = ({d: ns for d, ns in last[0].items() if is_object_dir(d)}, last[1])
            # Without a record of the last look, every directory is listed.
            dirs = _changed(last[0], last[1], stamps) if last[0] else set(stamps) | set(_stamps(keep))
            present = _files_in(objects, dirs)
            kept = _files_in(keep, dirs)
            budget = [_COPY_BUDGET]
            ways = Ways()
            made: set[str] = set()  # each fan-out directory made once, not once a file
            for rel in sorted(present - kept):
                folder = os.path.dirname(rel)
                if folder not in made:
                    os.makedirs(os.path.join(keep, folder), mode=0o700, exist_ok=True)
                    made.add(folder)
                try:
                    _clone(os.path.join(objects, rel), os.path.join(keep, rel), budget, ways)
                except FileNotFoundError:
                    continue  # git removed it meanwhile (a repack)
            for rel in kept - present:  # the user's own gc: theirs to drop
                try:
                    os.unlink(os.path.join(keep, rel))
                except OSError:
                    pass
            if not (last[0] == stamps and not dirs):
                # Written only when it says something new: a keep whose stamps
                # are those of the last look, none of them racy then, is as
                # up to date as that look said (the back-to-back open's case).
                tmp = os.path.join(keep, f"{_STAMPS}.{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    f.write(msgspec.json.encode((stamps, stamped_ns)))
                os.replace(tmp, os.path.join(keep, _STAMPS))
    except OSError as exc:
        note = f"object files not kept: {exc.strerror}"
        keep = ""
    return History(common=common, refs=refs, own=sorted(set(own)), head=head, keep=keep, note=note,
                   stamps=stamps, stamped_ns=stamped_ns, replaces=replacing.loose,
                   replaces_packed=replacing.packed, views=viewfiles.read(common),
                   view_stamps=viewfiles.read_stamps(common))


def restore(history: History) -> tuple[list[tuple[str, str]], list[str]]:
    """Put back what the module says; returns ``(path or ref, why)`` for each
    thing put back, and what could not be (with why)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    common = history.common
    if not fs.is_dir(common):
        return done, [f"{common}: the repository's git directory is gone"]
    objects = os.path.join(common, "objects")
    # Nothing read or written through a symlink a session left for a directory (shown.py).
    done, failed = shown.clear(common)
    if failed:
        return done, failed
    now_stamps = _stamps(objects)
    dirs = _changed(history.stamps, history.stamped_ns, now_stamps) if history.stamped_ns else set()
    # What a session did shows in a ctime (it began after the baseline's look), but for
    # a change within the coarse clock's tick of it: only those are looked at for FIFOs
    # and replacements, not every one the keep lists again (changed within 50 ms).
    touched = _changed(history.stamps, history.stamped_ns, now_stamps, _TICK_NS) if history.stamped_ns else set()
    moved, bad = shown.after(common, {d for d in touched if d != "pack"}, history.replaces,
                             history.replaces_packed, history.views, history.view_stamps)
    done += moved
    failed += bad
    if history.keep:
        os.makedirs(objects, exist_ok=True)
        if not history.stamped_ns:
            dirs = set(_stamps(history.keep))
        missing = sorted(_files_in(history.keep, dirs) - _files_in(objects, dirs))
        by_git = packed.packed_meanwhile(objects, missing, history.keep)
        ways = Ways()
        put: list[str] = []
        made: set[str] = set()
        for rel in missing:
            try:
                folder = os.path.join(objects, os.path.dirname(rel))
                if folder not in made:
                    # A fan-out or pack directory a session replaced by a symlink
                    # goes aside: put back through it, a file landed outside.
                    if os.path.lexists(folder) and not fs.is_dir(folder):
                        fs.move_aside(folder)
                    os.makedirs(folder, exist_ok=True)
                    made.add(folder)
                _clone(os.path.join(history.keep, rel), os.path.join(objects, rel), [_COPY_BUDGET], ways)
                put.append(rel)
            except OSError as exc:
                failed.append(f"{os.path.join(objects, rel)}: {exc.strerror}")
        deleted = [rel for rel in put if rel not in by_git]
        if deleted:
            done.append((objects, f"{len(deleted)} object files deleted by a session put back"))
        # Another file at a kept name (``mv -f garbage .git/objects/ab/...``): the kept one put back.
        try:
            swapped = replaced.find(objects, history.keep, touched, history.stamped_ns) if history.stamped_ns else []
        except Exception as exc:  # noqa: BLE001 - reported; the refs are still put back below
            swapped, failed = [], failed + [f"{objects}: the look for replaced files failed: {exc!r}"]
        aside, bad = replaced.put_back(objects, history.keep, swapped,
                                       lambda src, dst: _clone(src, dst, [_COPY_BUDGET], ways))
        failed += bad
        if aside:
            done.append((objects, f"{len(aside)} object files a session replaced put back (its files moved aside: "
                                  f"{', '.join(os.path.relpath(a, objects) for a in aside[:5])}"
                                  f"{', ...' if len(aside) > 5 else ''})"))
        if len(deleted) < len(put):
            _log.info("event=history_packed_meanwhile objects=%s count=%d (loose copies put back)", objects,
                      len(put) - len(deleted))
    try:
        for sub in ("refs/heads", "refs/tags"):
            os.makedirs(os.path.join(common, sub), exist_ok=True)
        if history.head and not os.path.lexists(os.path.join(common, "HEAD")):
            reftemp.write_ref(common, "HEAD", history.head.strip())
            done.append((os.path.join(common, "HEAD"), "deleted by a session; put back"))
    except OSError as exc:
        failed.append(f"{common}: refs or HEAD cannot be made again ({exc.strerror})")
    # One store for every moved branch (its packs' indexes read once) and one
    # deadline for all of them: past it, a branch is put back without asking
    # whether it was fast-forwarded (is_ancestor says "not known").
    borrowed = objectstore.alternates(objects, (history.views or {}).get("objects/info/alternates"))  # the user's
    store = objectstore.Store(objects, deadline=time.monotonic() + objectstore.BUDGET_S * 2, alternates=borrowed)
    now = read_refs(common)
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name, old in sorted(history.refs.items()):
        if name in history.own:
            continue
        new = now.get(name)
        if new == old:
            continue
        if new is not None and name.startswith("refs/heads/") and \
                objectstore.is_ancestor(objects, old, new, store):
            continue  # a fast-forward: history kept
        try:
            if new is not None:
                reftemp.write_ref(common, f"refs/dispatchd/displaced/{stamp}/{name}", new)
            reftemp.write_ref(common, name, old)
        except OSError as exc:
            failed.append(f"{name}: {exc.strerror}")
            continue
        done.append((name, f"{'deleted' if new is None else 'moved to ' + new[:12]} by a session; "
                           f"put back at {old[:12]}"))
    return done, failed

