"""What git derives from a pack and then trusts, made or changed by a
session: a pack's reachability bitmap (``.bitmap``) and reverse index
(``.rev``), looked at when the domain's last session ends.

A bitmap tells git, for some commits, every object they reach, so that it
need not walk: ``git push``, ``git bundle create``, a clone served from the
repository and ``rev-list --use-bitmap-index`` take it at its word. A
session that leaves one (for a pack of its own, or for one of the user's
that had none) saying a commit reaches what an older one reaches makes the
user's ``git push`` fail ("missing necessary objects") and ``git bundle
create --all`` write, exit status 0, a bundle without the newest commits: a
backup that cannot be restored (tests/escape/test_pack_bitmaps.py shows both
on git itself). A reverse index (the pack's objects in the pack's order)
maps a bitmap's bits to objects: a forged one does the same to the user's
own bitmap.

So at the end (``history.restore``, when a session of the domain was
granted the write lock, before anything is put back), each ``*.bitmap`` and
``*.rev`` in ``objects/pack`` whose ctime has not settled before the
baseline's look (made, linked, renamed there or rewritten since: each sets
the ctime, which no session can set back; ``treewalk.settled``) is

- of a name ``objects/pack`` had at the baseline, kept when the keep
  holds it as a link, the same inode (held read-only in the session, or
  past the copy budget, where a pack is not protected either; its ctime is
  that link's; a reverse index so held is checked below where it can be),
  or holds the same bytes in a copy of its own (the user's: put back by an
  earlier end, or rewritten the same);
- kept when it is a pack's reverse index (``pack-<id>.rev``) holding
  exactly what its pack's index gives (the index positions ordered by
  offset, the pack's checksum, its own SHA-1: ``expected_rev``), the index
  as the keep holds it where it does (a session can rewrite the
  repository's, which the end puts back only later) - git 2.41 and later
  write one with every pack;
- else moved aside (renamed beside, never deleted), and the user's kept one
  put back by the restore; a reverse index the keep held as a link, and
  any file the keep took since the baseline (a checkpoint), goes from the
  keep too: it holds the session's bytes. Git
  works without either (it walks, and orders the index in memory) and
  writes them again at the next repack that asks for them: what a bitmap
  says cannot be checked short of the walk it saves.

Bounded: ``READ_BUDGET`` bytes read at one end (past it, moved aside
unread), and past ``packlinks.MAX_FILES`` names the check fails, saying so,
rather than rename a session's junk one by one under the domain's lock.
"""

from __future__ import annotations

import array
import hashlib
import os
import stat
import struct
import sys

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, keepdirs, objectstore, packlinks

DERIVED = (".bitmap", ".rev")
_RACY_NS = 50_000_000  # as history's: a file changed this close before the baseline's look is looked at
MAX_OBJECTS = 1_000_000  # a reverse index checked up to this many objects (under a second); past it, aside
READ_BUDGET = 256 * 1024 * 1024  # bytes read at one end to check them; past it, the rest aside unread
_IDX_MAGIC = b"\xfftOc\x00\x00\x00\x02"
_FANOUT_END = 8 + 256 * 4


def clear(objects: str, keep: str, since_ns: int, baseline: set[str] | None) -> tuple[list[str], list[str]]:
    """Move aside what the module says; returns the names moved (their new
    paths), and what could not be done (with why). ``keep``: the history's
    keep ("" when there is none), whose files tell the user's own of the
    names in ``baseline`` (``objects/pack`` at the baseline; None: past its
    bound, none told). Another name's file in the keep is a session's (a
    checkpoint keeps what the session made): never taken for the user's."""
    pack_dir = os.path.join(objects, "pack")
    try:
        fd = os.open(pack_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return [], []  # no pack directory (history.restore makes what it puts back)
    try:
        kfd = keepdirs.open_dir(os.path.join(keep, "pack")) if keep else None  # its mode set back, if changed
    except keepdirs.Unreadable:
        kfd = None  # looked at as when the keep has no pack directory
    moved: list[str] = []
    failed: list[str] = []
    budget = [READ_BUDGET]
    try:
        names = sorted(n for n in os.listdir(fd) if n.endswith(DERIVED))
        if len(names) > packlinks.MAX_FILES:  # a session's junk: a rename each would hold the domain's lock
            return [], [f"{pack_dir}: more than {packlinks.MAX_FILES} pack bitmaps and reverse indexes, not looked "
                        "at; git trusts them: remove those you did not make"]
        for name in names:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if treewalk.settled(st.st_ctime_ns, since_ns, _RACY_NS):
                continue  # the user's, as it was at the baseline
            told = baseline is None or name in baseline  # else the keep's file is a checkpoint's: the session's
            kept = _stat(name, kfd) if told else None
            shared = kept is not None and (kept.st_dev, kept.st_ino) == (st.st_dev, st.st_ino)
            is_rev = name.endswith(".rev") and stat.S_ISREG(st.st_mode)
            holds = _rev_holds(fd, kfd, name, budget) if is_rev else None
            if shared and holds is not False:
                continue  # the keep's own link (its ctime is that link's): held read-only, or past the copy budget
            if not shared and kept is not None and kept.st_size == st.st_size and _same(fd, kfd, name, budget):
                continue  # the user's bytes, as kept (a put-back's copy, an identical rewrite)
            if holds:
                continue
            if kfd is not None and (shared or not told) and _stat(name, kfd) is not None:
                # Kept as a link (past the copy budget), or kept since the baseline (a checkpoint): the
                # session's bytes, never to be put back. First: a daemon killed after the move below
                # would have the restore's next run put them back from the keep.
                try:
                    os.unlink(name, dir_fd=kfd)
                except OSError as exc:
                    failed.append(f"{os.path.join(keep, 'pack', name)}: the keep's link to a file a session "
                                  f"changed cannot be removed ({exc.strerror})")
                    continue
            try:
                moved.append(os.path.join(pack_dir, fs.move_aside_at(fd, name)))
            except OSError as exc:
                failed.append(f"{os.path.join(pack_dir, name)}: made or changed by a session, and it cannot be "
                              f"moved aside ({exc.strerror}); git trusts it: remove it")
    finally:
        os.close(fd)
        if kfd is not None:
            os.close(kfd)
    return moved, failed


def _rev_holds(fd: int, kfd: int | None, name: str, budget: list[int]) -> bool | None:
    """Whether ``name`` is the reverse index of its pack, byte for byte: the
    pack's index as the keep holds it (a session can rewrite the
    repository's, which the end puts back after this look), else the
    repository's (a pack new since the baseline); None when that cannot be
    told (no such index, another kind, over ``MAX_OBJECTS`` or the budget)."""
    if not packlinks.is_pack_file(name):
        return None  # a multi-pack-index's, or a name of the session's: git's order is not checked here
    idx_name = name[:-4] + ".idx"
    limit = _FANOUT_END + 48 * MAX_OBJECTS + 64  # SHA-256 ids, and a large offset each
    idx = _read(kfd if _stat(idx_name, kfd) is not None else fd, idx_name, budget, limit)
    expected = expected_rev(idx) if idx is not None else None
    if expected is None:
        return None
    return _read(fd, name, budget, len(expected)) == expected


def expected_rev(idx: bytes) -> bytes | None:
    """The reverse index git writes for the (version 2, SHA-1 or SHA-256)
    pack index ``idx``; None for an index it cannot be computed from
    (another version, malformed, over ``MAX_OBJECTS``)."""
    if len(idx) < _FANOUT_END + 40 or idx[:8] != _IDX_MAGIC:
        return None
    (count,) = struct.unpack_from(">I", idx, _FANOUT_END - 4)
    try:
        h = objectstore.index_hash_size(len(idx), count)
    except ValueError:
        return None
    at = _FANOUT_END + (h + 4) * count  # past the names and the CRCs (4 bytes each)
    if count > MAX_OBJECTS:
        return None
    small = array.array("I", idx[at:at + 4 * count])
    if sys.byteorder == "little":
        small.byteswap()
    large_at = at + 4 * count
    large_count = (len(idx) - 2 * h - large_at) // 8
    offsets: list[int] = []
    for value in small:
        if value & 0x80000000:
            i = value & 0x7FFFFFFF
            if i >= large_count:
                return None
            value = struct.unpack_from(">Q", idx, large_at + 8 * i)[0]
        offsets.append(value)
    order = array.array("I", sorted(range(count), key=offsets.__getitem__))
    if sys.byteorder == "little":
        order.byteswap()
    # Version 1, the hash's id (1 SHA-1, 2 SHA-256); the pack's checksum; its own.
    body = b"RIDX" + struct.pack(">II", 1, 1 if h == 20 else 2) + order.tobytes() + idx[-2 * h:-h]
    return body + (hashlib.sha1(body) if h == 20 else hashlib.sha256(body)).digest()


def _same(fd: int, kfd: int | None, name: str, budget: list[int]) -> bool:
    """Whether the repository's ``name`` holds the keep's bytes (both regular files)."""
    ours = _read(fd, name, budget)
    return ours is not None and ours == _read(kfd, name, budget)


def _open_dir(path: str) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def _stat(name: str, fd: int | None) -> os.stat_result | None:
    if fd is None:
        return None
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None


def _read(fd: int | None, name: str, budget: list[int], limit: int = READ_BUDGET) -> bytes | None:
    """A regular file's bytes (not followed), taken from ``budget``; None
    when it is not one, is over ``limit`` or the budget, or cannot be read."""
    read = fs.read_regular(name, fd, min(limit, budget[0]), whole=True) if fd is not None else None
    if read is None:
        return None
    data, size = read
    budget[0] -= len(data)
    return data if len(data) == size else None
