"""Kept object files a session replaced: found, and put back.

The history's keep (``history.py``) puts back an object file a session
deleted. A session can also put another file at its name: ``mv -f garbage
.git/objects/ab/cdef...`` needs only the directory's write permission, which
git's own writes need, and leaves every name present, so nothing looked
missing and the user's history stayed broken (``git fsck``: "object corrupt").
The keep still holds the original (a hard link keeps the old inode, a clone
or a copy its bytes), so at the domain's last end (``put_back``):

- only the object directories whose ctime changed since the baseline are
  looked at (a rename into a directory changes it; ``history._changed``);
- a name is looked at only if it is kept (a loose object, a pack or its
  index: what git derives from them, ``.rev``, ``.bitmap``, the
  ``multi-pack-index``, it writes again at will) and now names another inode than
  the kept one, that changed since the baseline (its ctime is later: a
  rename or a link sets it, and no session can set it back); an untouched
  file, a hard link of the keep's, costs nothing past the two listings
  (the inode each name holds, from the directory), a clone's or a copy's
  two ``fstatat``;
- it was *replaced* unless it is a regular file with the kept bytes, or a
  loose object that is valid under its name (git recompressed it: the same
  object). Bytes are compared within ``_COMPARE_BUDGET`` a restore; past it,
  or for a loose object over ``_LOOSE_MAX``, a changed file counts as
  replaced (nothing is lost either way: the session's file is moved aside);
- a replaced file is moved aside (renamed beside, never deleted) and the
  kept one put back at its name.

A kept object file rewritten *in place* (a session makes it writable with
``chmod`` first, which neither Landlock nor a path-blind seccomp filter can
refuse for these files alone) keeps its inode and its directory's ctime,
so ``find_rewritten`` looks at the ctime of each file the keep holds (in C
where the helper is built: ``recent_named``, an ``fstatat`` each, the names
the keep's, its listings remembered while unchanged (``objectdirs.KeptNames``):
what a session adds is not counted) and hands those changed
since the baseline to the same test. The keep holds a loose object's bytes
in a file of its own (``clones.py``), which is put back; one it shares the
inode of (past the copy budget) is reported when it no longer holds a
valid object. A pack is bound read-only over itself in the session, or
kept as a copy of its own where it is not (``clones.py``).

"The kept bytes, compressed again" is decided by inflating both files, not
by hashing the new one: hashlib's SHA-1 has no collision detection, git's
has. A loose object file is inflated header first (``_inflate``): its
``kind size\\0`` checked after at most 28 bytes, the rest inflated only up
to the size it declares (and a byte more, which refuses it), so a stream
that inflates to 64 MiB of anything else costs a few bytes. ``Inflating``
gives the inflations of one look (``newloose``'s) a shared deadline and
decides each inode once.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, keepdirs, objectdirs, objectstore
from dispatchd.tools import native

_COMPARE_BUDGET = 256 * 1024 * 1024  # bytes read to compare a restore's changed files
_LOOSE_MAX = 64 * 1024 * 1024  # a loose object read (inflated) to check it against its name
_HEADER_MAX = 28  # a loose object's longest header: "commit", a space, 20 digits, the NUL
_RACY_NS = 50_000_000  # as history's: a file changed this close before the baseline's look is looked at
_CHUNK = 1 << 20
_MAX_LOOSE = 2_000_000  # entries of the fan-out directories looked at for in-place rewrites
_SPLIT_BYTES = 16 * 1024  # kept names (about 45 bytes each) past which two threads look, where there are two CPUs
KEPT = objectdirs.KeptNames()  # the keeps' names, remembered from one end to the next


def find(objects: str, keep: str, dirs: set[str], since_ns: int) -> list[str]:
    """The kept object files (``dir/name``) in ``dirs`` that a session
    replaced (see the module). ``since_ns``: when the baseline's look began."""
    found: list[str] = []
    budget = [_COMPARE_BUDGET]
    for d, kfd, ofd in _dir_pairs(keep, objects, dirs):
        # The inode each name holds, from the listings (no stat): a name
        # holding the keep's own inode (a hard link) is the kept file.
        same_dev = os.fstat(kfd).st_dev == os.fstat(ofd).st_dev
        kept, now = _inodes(kfd), _inodes(ofd)
        for name in sorted(kept.keys() & now.keys()):
            if same_dev and kept[name] == now[name]:
                continue
            if _replaced(kfd, ofd, name, d, since_ns, budget):
                found.append(f"{d}/{name}")
    return found


def _dir_pairs(keep: str, objects: str, dirs: Iterable[str]) -> Iterator[tuple[str, int, int]]:
    """Each of ``dirs`` that both the keep and the repository have, opened in
    both (not followed), closed once the next is asked for."""
    for d in sorted(dirs):
        kfd = keepdirs.open_dir(os.path.join(keep, d))  # its mode set back, else keepdirs.Unreadable
        if kfd is None:
            continue
        try:
            ofd = _open_dir(objects, d)
            if ofd is None:
                continue
            try:
                yield d, kfd, ofd
            finally:
                os.close(ofd)
        finally:
            os.close(kfd)


def find_rewritten(objects: str, keep: str, since_ns: int,
                   looked: set[str]) -> tuple[list[str], list[str], str]:
    """The kept object files outside the directories ``looked`` at by
    ``find`` that a session changed in place (see the module); those it
    changed that cannot be put back (a loose object the keep shares its
    inode with, past the copy budget: no longer a valid object of its name);
    and what cut the look short ("": nothing). The names are the keep's: a
    session's own files are not looked at, nor counted."""
    # Every file whose ctime is not settled (``_replaced``'s rule: treewalk.settled).
    recent, cut = _walk(keep, objects, since_ns - _RACY_NS, since_ns - treewalk.COARSE_SETTLE_NS)
    by_dir: dict[str, list[str]] = {}
    for rel in recent:
        d, _, name = rel.partition("/")
        if d not in looked:
            by_dir.setdefault(d, []).append(name)
    found: list[str] = []
    lost: list[str] = []
    budget = [_COMPARE_BUDGET]
    for d, kfd, ofd in _dir_pairs(keep, objects, by_dir):
        for name in sorted(by_dir[d]):
            if _replaced(kfd, ofd, name, d, since_ns, budget):
                found.append(f"{d}/{name}")
            elif d != "pack" and _shared_and_broken(kfd, ofd, name, d + name):
                lost.append(f"{d}/{name}")
    return found, lost, cut


def _walk(keep: str, objects: str, since: int, coarse: int) -> tuple[list[str], str]:
    """``recent_named`` over the keep's names (``KEPT``): in C, the names
    split between this thread and another where there are two CPUs (the
    system calls are most of it, and run without the interpreter's lock:
    3.9 ms -> 2.2 for 2,042 objects, the keep listed then); else in Python."""
    try:
        kfd = keepdirs.open_dir(keep)
    except keepdirs.Unreadable as exc:
        return [], str(exc)
    ofd = _open_dir(objects, ".")
    try:
        if kfd is None or ofd is None:
            return [], ""
        names, cut = KEPT.names(kfd, _MAX_LOOSE, keep)
        look = getattr(native.lines, "recent_named", None)  # None too for a helper built before it
        if look is None:
            return recent_named(ofd, names, since, coarse), cut
        parts = 2 if (os.cpu_count() or 1) > 1 and len(names) > _SPLIT_BYTES else 1
        results: list[list[str] | BaseException | None] = [None] * parts

        def run(part: int) -> None:
            try:
                results[part] = look(ofd, names, since, coarse, part, parts)
            except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
                results[part] = exc
        helpers = [threading.Thread(target=run, args=(part,), name="dispatchd-rewritten") for part in range(1, parts)]
        for t in helpers:
            t.start()
        run(0)
        for t in helpers:
            t.join()
        found: list[str] = []
        for result in results:
            if not isinstance(result, list):
                raise result if isinstance(result, BaseException) else RuntimeError("a part of the look did not run")
            found += result
        return found, cut
    finally:
        for fd in (kfd, ofd):
            if fd is not None:
                os.close(fd)


def _shared_and_broken(kfd: int, ofd: int, name: str, oid: str) -> bool:
    """Whether the kept file is the repository's own inode (a hard link, past
    the copy budget) and no longer a valid object of its name."""
    try:
        kept = os.stat(name, dir_fd=kfd, follow_symlinks=False)
        now = os.stat(name, dir_fd=ofd, follow_symlinks=False)
    except OSError:
        return False
    return (kept.st_dev, kept.st_ino) == (now.st_dev, now.st_ino) and not _valid_loose(ofd, name, oid)


def recent_named(objects_fd: int, names: bytes, since_ns: int, coarse_since_ns: int) -> list[str]:
    """The C helper's ``recent_named`` in Python, its twin (tests/unit/test_ctimes.py)."""
    found: list[str] = []
    for raw in names.split(b"\0"):
        if not raw:
            continue
        rel = os.fsdecode(raw)
        try:
            ns = os.stat(rel, dir_fd=objects_fd, follow_symlinks=False).st_ctime_ns
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError:
            found.append(rel)  # there, and not to be looked at: the caller decides
            continue
        if ns >= (coarse_since_ns if ns % 1_000_000_000 == 0 else since_ns):
            found.append(rel)
    return found


def put_back(objects: str, keep: str, found: list[str],
             clone: Callable[[str, str], None]) -> tuple[list[str], list[str]]:
    """Each of ``found`` moved aside and the kept file put back at its name
    (``clone``: the history's way, a reflink, link or copy). Returns the
    session's files as moved aside, and what could not be done (with why)."""
    aside: list[str] = []
    failed: list[str] = []
    for rel in found:
        path = os.path.join(objects, rel)
        try:
            aside.append(fs.move_aside(path))
            clone(os.path.join(keep, rel), path)
        except OSError as exc:
            failed.append(f"{path}: replaced by a session, and the kept file cannot be put back ({exc.strerror})")
    return aside, failed


def _inodes(dir_fd: int) -> dict[str, int]:
    with os.scandir(dir_fd) as scan:
        return {e.name: e.inode() for e in scan}


def _open_dir(top: str, d: str) -> int | None:
    try:
        return os.open(os.path.join(top, d), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None  # not there, or not a directory: history.restore puts a directory back first


def _replaced(kfd: int, ofd: int, name: str, d: str, since_ns: int, budget: list[int]) -> bool:
    if d == "pack" and not name.endswith((".pack", ".idx")):
        return False  # what git derives from a pack and writes again at will (.rev, .bitmap, multi-pack-index)
    try:
        kept = os.stat(name, dir_fd=kfd, follow_symlinks=False)
    except OSError:
        return False  # nothing the keep can put back
    try:
        now = os.stat(name, dir_fd=ofd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return False  # gone meanwhile: a missing file is history's to put back
    except OSError:
        return True  # there, and not to be looked at (its directory made unsearchable): not the kept file
    if not stat.S_ISREG(kept.st_mode) or (kept.st_dev, kept.st_ino) == (now.st_dev, now.st_ino):
        return False  # the kept file itself (a hard link); or nothing the keep can put back
    if treewalk.settled(now.st_ctime_ns, since_ns, _RACY_NS):
        return False  # unchanged since before the baseline: the repository's own copy (a clone's or copy's keep)
    if not stat.S_ISREG(now.st_mode):
        return True  # a directory, symlink or FIFO where an object file was
    try:
        # A pack's bytes compared whole, whatever the budget: git freshens a pack (utime, a new
        # ctime) when it writes an object the pack holds, and a pack taken for replaced is copied.
        if now.st_size == kept.st_size and _same_bytes(kfd, ofd, name, now.st_size,
                                                       budget if d != "pack" else [1 << 62]):
            return False
        return not (d != "pack" and _same_object(kfd, ofd, name, d + name))
    except OSError:
        return True  # unreadable (a mode the session set): not the kept file


def _same_bytes(kfd: int, ofd: int, name: str, size: int, budget: list[int]) -> bool:
    """Whether both files hold the same bytes; False past the budget."""
    if size > budget[0]:
        return False
    budget[0] -= size
    a = fs.open_regular(name, kfd)
    if a is None:
        return False
    try:
        b = fs.open_regular(name, ofd)
        if b is None:
            return False
        try:
            while True:
                x, y = os.read(a[0], _CHUNK), os.read(b[0], _CHUNK)
                if x != y:
                    return False
                if not x:
                    return True
        finally:
            os.close(b[0])
    finally:
        os.close(a[0])


def _same_object(kfd: int, ofd: int, name: str, oid: str) -> bool:
    """Whether the loose object file ``name`` holds the kept object, compressed
    again: both inflate to the same bytes. Not a hash of the new one alone: a
    session holding a chosen-prefix SHA-1 collision twin of an object it wrote
    would pass that (git's own SHA-1 detects such collisions; hashlib's does
    not). A kept file that cannot be inflated: the hash of the new one."""
    kept = _inflated(kfd, name)
    if kept is None:
        return _valid_loose(ofd, name, oid)
    return _inflated(ofd, name) == kept


def _valid_loose(ofd: int, name: str, oid: str, look: Inflating | None = None) -> bool:
    """Whether the loose object file ``name`` inflates to an object whose
    hash (SHA-1 or SHA-256, by the name's length) is ``oid``. With ``look``:
    within its deadline (``OutOfTime`` past it), an inode it decided before
    (unchanged since) not inflated again."""
    algorithm = {40: "sha1", 64: "sha256"}.get(len(oid))
    if algorithm is None:
        return False
    opened = fs.open_regular(name, ofd)
    if opened is None:
        return False
    fd, st = opened
    try:
        # Not the ctime: moving a link aside sets it (nothing of the session runs while the end looks).
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, algorithm)
        if look is not None and key in look.digests:
            return look.digests[key] == oid
        body = _inflate(fd, st.st_size, look)
        digest = None if body is None else hashlib.new(algorithm, body).hexdigest()
        if look is not None:
            look.digests[key] = digest
        return digest == oid
    finally:
        os.close(fd)


def _inflated(dir_fd: int, name: str) -> bytearray | None:
    """The object a loose object file holds, header included, inflated; None
    when it is not one git would read."""
    opened = fs.open_regular(name, dir_fd)
    if opened is None:
        return None
    fd, st = opened
    try:
        return _inflate(fd, st.st_size, None)
    finally:
        os.close(fd)


class Inflating:
    """One look's inflations of loose object files: a deadline they share
    (``objectstore.OutOfTime`` past it), each inode's digest decided once
    (a file hard-linked at many names is inflated once), and what was done
    (``files`` inflated, ``bytes`` out of them)."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.files = 0
        self.bytes = 0
        self.digests: dict[tuple[int, int, int, int, str], str | None] = {}

    def in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise objectstore.OutOfTime("out of time")


def _inflate(fd: int, size: int, look: Inflating | None) -> bytearray | None:
    """The object loose object file ``fd`` (``size`` bytes, as fstat said)
    holds, header included; None when it is not one git would read. The
    header (``kind size\\0``) is inflated first and checked, then the rest
    only up to the size it declares and a byte more: a stream that inflates
    past it is refused there, whatever it would inflate to."""
    if size > _LOOSE_MAX:
        return None
    if look is not None:
        look.in_time()
        look.files += 1
    inflater = zlib.decompressobj()
    body = bytearray()
    limit = _HEADER_MAX  # inflated bytes wanted so far: the header's, then the object's and one more
    declared = -1  # the header's length (with the NUL) and the size it declares, once read
    left = size + 1  # compressed bytes read at most (a file grown meanwhile is cut short, as git's read)
    feed = b""
    ended = False  # the file read to its end
    while True:
        if declared < 0:
            nul = body.find(b"\0", 0, _HEADER_MAX)
            if nul >= 0:
                kind, _, digits = bytes(body[:nul]).partition(b" ")
                if kind not in (b"blob", b"tree", b"commit", b"tag") or not digits.isdigit() or len(digits) > 20 or \
                        nul + 1 + int(digits) > _LOOSE_MAX:
                    return None
                declared = nul + 1 + int(digits)
                limit = declared + 1
            elif len(body) >= _HEADER_MAX or inflater.eof:
                return None  # no header git reads
        if 0 <= declared < len(body):
            return None  # longer than its header says
        if inflater.eof:
            break
        if not feed and not ended:
            feed = os.read(fd, min(_CHUNK, left)) if left > 0 else b""
            left -= len(feed)
            ended = not feed
        if look is not None:
            look.in_time()
        before = len(feed)
        try:
            out = inflater.decompress(feed, min(limit - len(body), _CHUNK))
        except zlib.error:
            return None
        feed = inflater.unconsumed_tail
        if not out and not inflater.eof and (ended or len(feed) == before):
            return None  # cut short: the file ends inside the stream
        body += out
        if look is not None:
            look.bytes += len(out)
    if inflater.unused_data or feed or (left > 0 and os.read(fd, 1)):
        return None  # bytes after the stream (git: "garbage at end of loose object")
    return body if len(body) == declared else None
