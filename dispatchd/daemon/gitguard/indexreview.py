"""The index a session wrote, made to show the user what the worktree holds.

Git trusts its index to say which files changed: an entry whose cached
``stat`` data still match the file is taken as unchanged, without reading
it; an entry marked assume-unchanged or skip-worktree is not looked at; the
cache-tree extension names the trees a commit writes for the directories it
covers, the untracked cache and the fsmonitor bitmap what ``git status``
skips. A session writes the index as it likes (``git add``, or bytes of
its own): one that edited a file, added it, and then set the entry's object
id back to the committed one had ``git status`` and ``git diff`` say
"clean" over the session's edit, and ``git commit -a`` leave it out.

So at the part's check, when the worktree's own index (``own_gitdir/index``)
changed since the baseline's look, it is read, and written again (through
git's own ``index.lock``, renamed over it) only where it says what it must
not:

- an entry of a file changed since the look (its ``ctime``, which no
  session can set back; within ``_RACY_NS`` before it too) that git would
  take as unchanged without reading it (marked assume-unchanged or
  skip-worktree, or its cached size and mtime the file's) and whose object
  is not the file's bytes hashed as a blob (or that is flagged, or past the
  hashing budget) gets a cached size of 0, which git reads as "never
  looked at": its next look compares the file's content with the entry's
  object; its flags are cleared. Those that hid a change are reported;
- the cache-tree (``cachetree.agrees``: each valid directory's tree hashed
  from the entries), unless it says what the entries say, the untracked
  cache and the fsmonitor bitmap (which can hide a file whatever the
  entries say) are left out, with the offset tables over them; git makes
  them again;
- the checksum is computed again (SHA-1 or SHA-256, the index's own).

An honest session's index (``git add``, ``git commit``: each entry the
file's blob, the cache-tree the entries' trees) is left byte for byte.
Nothing is lost: the entries' objects and stages stay the session's, as
git would have them. Not done (logged, left as it is): a split index
(``link``), an index git could not read either, one over ``_MAX_BYTES``,
one a running git holds locked; submodules' and other worktrees' indexes.

The review holds git's ``index.lock`` from before it reads the index to its
rename (or until it finds nothing to change): a git that wrote the index
meanwhile would have its write undone. Taken as ``lockfile`` takes every
lock of git's, so that one a killed daemon left is removed by the next
review (``gitlock.sweep``), never left to refuse the user's git. An entry
git reads anyway (racily clean: its mtime not before the index's) is not
one that hides; made so by
a rewrite, it gets the cached size 0 too, as git's own writes do. The
domain's checks review the index only where no other session of the domain
runs (``parts.check_part``'s ``index``): a live one's git would race it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat

from dispatchd.daemon.gitguard import cachetree, configs, fs, gitlock, indexfile, lockfile, replaced
from dispatchd.tools import native

log = logging.getLogger("dispatchd.baselines")

_MAX_BYTES = 256 * 1024 * 1024
_RACY_NS = 50_000_000
_ASSUME_VALID = 0x8000
_SKIP_WORKTREE = 0x4000  # of the extended flags
_DIR_MODE = 0o040000  # a sparse index's directory entry
_PATH_MAX = 4096  # the kernel's: no file has a longer path, and git checks none out
_MAX_DIRS = 500_000  # directories of an index's names looked at (a large monorepo has some 100,000)
_MAX_DIR_BYTES = 32 * 1024 * 1024  # their names, in all
# Caches git makes again, which can hide a file from git status whatever the
# entries say: the untracked cache, the fsmonitor bitmap (entries it marks are not looked at).
_CACHES = {b"UNTR", b"FSMN"}
_OFFSETS = {b"EOIE", b"IEOT"}  # offset tables over the entries and extensions, for reading in threads
WAIT_S = 0.5  # a running git holds index.lock for milliseconds; longer is one that stopped, or a plant
_HASH_BUDGET = 64 * 1024 * 1024  # bytes of changed files hashed at one review, to tell what an entry hid


class Review:
    """What ``review`` did: whether the index was written again, why not
    when it could not be, and the files whose entries hid a change (git
    would have taken them as unchanged)."""

    def __init__(self) -> None:
        self.rewritten = False
        self.why_not = ""
        self.hid: list[str] = []
        self.dropped: list[str] = []  # the extensions left out
        self.moved_aside = ""  # where an index not to be read went (a split or sparse index, a symlink)


def review(gitdir: str, worktree: str, since_ns: int, common: str = "", always: bool = False) -> Review:
    """Rewrite ``gitdir/index`` as the module says when it changed since
    ``since_ns`` (or ``always``: the user's git trusts less than a file's
    ctime, ``configs.weak_stat``, so an edit hides without the index
    written) and says something it must not. ``common``: the repository's
    common git directory, whose configuration says its ids' length (read as
    git reads it) and whether the user asks for a split or a sparse index."""
    done = Review()
    path = os.path.join(gitdir, "index")
    try:
        st = os.lstat(path)
    except OSError:
        return done
    if not stat.S_ISREG(st.st_mode):
        # A symlink git would follow to an index of the session's choosing, a FIFO it would wait on:
        # not one to read here, so not one to leave.
        try:
            done.moved_aside = fs.move_aside(path)
        except OSError as exc:
            done.why_not = f"not a regular file, and cannot be moved aside ({exc.strerror})"
        return done
    if st.st_ctime_ns < since_ns - _RACY_NS and not always:
        return done  # the usual end: nothing read, not even the configuration
    # Git's lock first, then the index read under it: a git that wrote it
    # after a read without the lock would have its write undone by the
    # rename (a user's `git add` at the end of a session's close).
    held = _lock(gitdir, stat.S_IMODE(st.st_mode))
    if isinstance(held, str):
        done.why_not = held
        return done
    try:
        done.rewritten, done.why_not = _look_and_write(done, gitdir, worktree, since_ns, common, held,
                                                       trust_ctime=not always)
    finally:
        held.release()  # renamed over the index already, or let go unchanged
    return done


def _look_and_write(done: Review, gitdir: str, worktree: str, since_ns: int, common: str,
                    held: lockfile.Held, trust_ctime: bool) -> tuple[bool, str]:
    """``review``'s look and rewrite, ``index.lock`` held: the index
    renamed over by the lock, or why not."""
    path = os.path.join(gitdir, "index")
    try:
        st = os.lstat(path)  # under the lock: its time is what git's next read compares entries with
    except OSError:
        return False, ""
    if not stat.S_ISREG(st.st_mode):
        return False, "not a regular file any more"
    hash_size = configs.object_id_size(common) if common else 20
    splits = bool(common) and configs.repo_flag(common, "core", "splitindex")
    sparse = bool(common) and configs.repo_flag(common, "index", "sparse")
    read = fs.read_regular(path, limit=_MAX_BYTES, whole=True)
    found = indexfile.layout(read[0], hash_size) if read is not None else None
    signatures = {sig for sig, _, _ in found.extensions} if found is not None else set()
    if found is not None and (b"link" in signatures and not splits or b"sdir" in signatures and not sparse):
        # A split index (``git update-index --split-index``) or a sparse one the user's configuration
        # does not ask for: a split one's entries are a shared index's, changed by bitmaps; a sparse
        # one's directory entry stands for every file below it, each skip-worktree (git expands it, and
        # never looks at those files). Not read here, so not kept.
        try:
            done.moved_aside = fs.move_aside(path)
        except OSError as exc:
            return False, f"a split index a session made, which cannot be moved aside ({exc.strerror})"
        return False, ""
    if read is None or found is None or b"link" in signatures or b"sdir" in signatures:
        return False, ("over its bounds or unreadable" if read is None else "not an index git reads"
                       if found is None else "a split index (core.splitIndex)" if b"link" in signatures
                       else "a sparse index (index.sparse)")
    data = bytearray(read[0])
    changed, racy = _distrust_entries(data, found, worktree, since_ns, done.hid, st.st_mtime_ns, trust_ctime)
    dropped = {sig for sig, a, b in found.extensions
               if sig in _CACHES or sig == b"TREE" and not cachetree.agrees(read[0], found.entries, found.hash_size,
                                                                           a, b)}
    if dropped:
        dropped |= _OFFSETS  # their tables cover the extensions: made again by git
    if not changed and not dropped:
        return False, ""
    for entry in racy:  # no longer racy in an index written now: git would trust them
        _smudge(data, entry)
    kept = [(sig, a, b) for sig, a, b in found.extensions if sig not in dropped]
    # Fewer than 8 bytes after the extensions, which git passes over, are left out too.
    body = bytes(data[:found.entries_end]) + b"".join(bytes(data[a:b]) for _, a, b in kept)
    digest = hashlib.sha256(body) if found.hash_size == 32 else hashlib.sha1(body)
    done.dropped = sorted(sig.decode("ascii", "replace") for sig in dropped if sig in {e[0] for e in found.extensions})
    return _replace(held, body + digest.digest(), stat.S_IMODE(st.st_mode))


def _distrust_entries(data: bytearray, found: indexfile.Layout, worktree: str, since_ns: int,
                      hid: list[str], index_ns: int, trust_ctime: bool) -> tuple[int, list[indexfile.Entry]]:
    """Each entry of a file changed since ``since_ns`` that git would take
    as unchanged without reading it, unless the file is the object it names:
    cached size 0, its assume-unchanged and skip-worktree flags cleared.
    How many, and the entries git reads anyway as long as the index is not
    written again (racily clean: their file's mtime not before the index's,
    ``index_ns``); ``hid`` gets the files that are not what their entry names."""
    changed = 0
    racy: list[indexfile.Entry] = []
    budget = [_HASH_BUDGET]
    recent = _recent(worktree, found.entries, since_ns - _RACY_NS)
    for entry in found.entries:
        if entry.name not in recent:
            continue
        name = os.fsdecode(entry.name)
        try:
            st = os.lstat(os.path.join(worktree, name))
        except OSError:
            continue  # gone: git shows it deleted whatever the entry says
        verdict = _verdict(data, entry, found.hash_size, worktree, name, st, budget, index_ns, trust_ctime)
        if verdict == "true":
            continue
        if verdict == "racy":
            racy.append(entry)
            continue
        if verdict == "hides":
            hid.append(name)
        _smudge(data, entry)
        changed += 1
    return changed, racy


def _smudge(data: bytearray, entry: indexfile.Entry) -> None:
    """The entry's cached size 0 ("never looked at": git compares the file's
    content with its object at its next look), its assume-unchanged and
    skip-worktree flags cleared."""
    data[entry.start + 36:entry.start + 40] = b"\0\0\0\0"
    flags = int.from_bytes(data[entry.flags_at:entry.flags_at + 2], "big")
    data[entry.flags_at:entry.flags_at + 2] = (flags & ~_ASSUME_VALID).to_bytes(2, "big")
    if entry.extended_at >= 0:
        extended = int.from_bytes(data[entry.extended_at:entry.extended_at + 2], "big")
        data[entry.extended_at:entry.extended_at + 2] = (extended & ~_SKIP_WORKTREE).to_bytes(2, "big")


def _recent(worktree: str, entries: list[indexfile.Entry], since_ns: int) -> set[bytes]:
    """The entries' names whose file changed since ``since_ns`` (or cannot
    be looked at), or lies in a directory that did: a directory renamed
    into place changes its own ctime, not its files' (a copy made before
    the open, edited, swapped in for ``src``). An ``fstatat`` a file and a
    directory, in C where the helper is built (``recent_named``, the
    interpreter's lock let go: ~1 µs each); only names git would check out
    (not absolute, no ``..``, not a split index's placeholder or a sparse
    directory). Bounded: a name no file can have (``PATH_MAX`` or longer)
    counts as changed, and past ``_MAX_DIRS`` directories (or their names'
    ``_MAX_DIR_BYTES``) every name does, unlooked at: every prefix of every
    name of a planted index of deep names took gigabytes."""
    names = [e.name for e in entries if e.name and not e.name.startswith(b"/") and b".." not in e.name.split(b"/")
             and b"\0" not in e.name and e.mode & 0o170000 != _DIR_MODE]
    long = {name for name in names if len(name) >= _PATH_MAX}
    names = [name for name in names if name not in long]
    dirs = _dirs_of(names)
    if dirs is None:
        return set(names) | long
    try:
        fd = os.open(worktree, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return long
    try:
        look = getattr(native.lines, "recent_named", None) or replaced.recent_named
        recent = {os.fsencode(n) for n in look(fd, b"".join(n + b"\0" for n in names), since_ns, since_ns)}
        moved = {os.fsencode(n) for n in look(fd, b"".join(d + b"\0" for d in sorted(dirs)), since_ns, since_ns)}
    finally:
        os.close(fd)
    if moved:
        below = _below_moved(dirs, moved)
        recent |= {name for name in names if below.get(name[:max(name.rfind(b"/"), 0)], False)}
    return recent | long


def _dirs_of(names: list[bytes]) -> set[bytes] | None:
    """Every directory the names lie in (each prefix ending before a ``/``),
    each made once: a name's walk up stops at a directory already found.
    None past ``_MAX_DIRS`` directories or ``_MAX_DIR_BYTES`` of their names."""
    dirs: set[bytes] = set()
    size = 0
    for name in names:
        i = name.rfind(b"/")
        while i > 0:
            d = name[:i]
            if d in dirs:
                break
            dirs.add(d)
            size += i
            if len(dirs) > _MAX_DIRS or size > _MAX_DIR_BYTES:
                return None
            i = name.rfind(b"/", 0, i)
    return dirs


def _below_moved(dirs: set[bytes], moved: set[bytes]) -> dict[bytes, bool]:
    """Each of ``dirs`` -> whether it, or a directory above it, is in ``moved``
    (parents before children: each decided from its parent, once)."""
    below: dict[bytes, bool] = {}
    for d in sorted(dirs, key=len):
        cut = d.rfind(b"/")
        below[d] = d in moved or (cut > 0 and below.get(d[:cut], False))
    return below


def _read_anyway(data: bytearray, entry: indexfile.Entry, st: os.stat_result, index_ns: int) -> bool:
    """Whether git reads a file whose cached size and whole-second mtime
    match, in its whole-second build and its nanosecond build alike: racily
    clean in the first (the entry's mtime not before the index's, whose own
    time is ``index_ns``), and in the second racily clean too or its cached
    nanoseconds not the file's."""
    mtime = int.from_bytes(data[entry.start + 8:entry.start + 12], "big")
    mtime_sub = int.from_bytes(data[entry.start + 12:entry.start + 16], "big")
    index_s, index_sub = divmod(index_ns, 1_000_000_000)
    index_s &= 0xFFFFFFFF
    if index_s > mtime:
        return False  # trusted by the whole-second build
    return index_s < mtime or index_sub <= mtime_sub or mtime_sub != st.st_mtime_ns % 1_000_000_000


def _verdict(data: bytearray, entry: indexfile.Entry, hash_size: int, worktree: str, name: str,
             st: os.stat_result, budget: list[int], index_ns: int, trust_ctime: bool) -> str:
    """"true": git reads the file (its stat data differ from the entry's),
    or takes it as unchanged and it is the object the entry names (hashed
    as a blob; with ``trust_ctime``, the user's git compares the cached
    ctime too); "racy": its stat data match, but git reads it all the same
    (``_read_anyway``) for as long as the index is not written again;
    "hides": git would take it as unchanged (the entry marked assume-unchanged or skip-worktree, or
    its cached size and mtime the file's) and it is not (a clean filter
    such as Git LFS's also makes them differ); "unknown": not a regular
    file, or past the hashing ``budget``."""
    flags = int.from_bytes(data[entry.flags_at:entry.flags_at + 2], "big")
    extended = int.from_bytes(data[entry.extended_at:entry.extended_at + 2], "big") if entry.extended_at >= 0 else 0
    size = int.from_bytes(data[entry.start + 36:entry.start + 40], "big")
    mtime = int.from_bytes(data[entry.start + 8:entry.start + 12], "big")
    flagged = flags & _ASSUME_VALID or extended & _SKIP_WORKTREE
    if not flagged and (size != st.st_size & 0xFFFFFFFF or mtime != int(st.st_mtime) & 0xFFFFFFFF or size == 0):
        return "true"  # git compares the stat data it cached, sees them differ, and reads the file
    if not flagged and trust_ctime and int.from_bytes(data[entry.start:entry.start + 4], "big") != \
            int(st.st_ctime) & 0xFFFFFFFF:
        return "true"  # git compares the ctime it cached too (core.trustctime), and reads the file
    if not flagged and _read_anyway(data, entry, st, index_ns):
        return "racy"
    if not stat.S_ISREG(st.st_mode) or st.st_size > budget[0]:
        return "unknown"
    read = fs.read_regular(os.path.join(worktree, name), limit=st.st_size, whole=True)
    if read is None:
        return "unknown"
    budget[0] -= len(read[0])
    blob = b"blob %d\0" % len(read[0]) + read[0]
    digest = (hashlib.sha256(blob) if hash_size == 32 else hashlib.sha1(blob)).digest()
    if digest != bytes(data[entry.start + 40:entry.start + 40 + hash_size]):
        return "hides"
    return "hides" if flagged else "true"  # a flag on a changed file hides its next change


def _lock(gitdir: str, mode: int) -> lockfile.Held | str:
    """Git's ``index.lock``, taken as the daemon takes every lock of git's
    (``lockfile``: a temporary of ours, hard-linked to the lock), a killed
    daemon's left before removed (``gitlock.sweep``), a running git's waited
    for ``WAIT_S``, then left: held, or why not."""
    try:
        dir_fd = os.open(gitdir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return f"its directory cannot be opened ({exc.strerror})"
    try:
        gitlock.sweep(dir_fd, gitdir, {"index"})
    except BaseException:
        os.close(dir_fd)
        raise
    try:
        return lockfile.take_in(dir_fd, "index", lockfile.Policy(WAIT_S), mode, lend=False)
    except lockfile.Refused:
        return "locked by a running git (index.lock)"
    except OSError as exc:
        return f"its lock cannot be made ({exc.strerror})"


def _replace(held: lockfile.Held, data: bytes, mode: int) -> tuple[bool, str]:
    """``data`` as the index: written into the lock (durable), renamed over."""
    try:
        held.commit(data, mode)
    except OSError as exc:
        return False, f"cannot be written ({exc.strerror})"
    return True, ""
