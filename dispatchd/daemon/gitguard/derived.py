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
granted the write lock), each ``*.bitmap`` and ``*.rev`` in
``objects/pack`` whose ctime has not settled before the baseline's look
(made, linked, renamed there or rewritten since: each sets the ctime, which
no session can set back; ``treewalk.settled``) is

- kept when it is a pack's reverse index (``pack-<id>.rev``) holding
  exactly what its index gives (the index positions ordered by offset, the
  pack's checksum, its own SHA-1: ``expected_rev``) - git 2.41 and later
  write one with every pack;
- else moved aside (renamed beside, never deleted; a kept one of the
  user's is then put back from the keep). Git works without either (it
  walks, and orders the index in memory) and writes them again at the next
  repack that asks for them: what a bitmap says cannot be checked short of
  the walk it saves.
"""

from __future__ import annotations

import array
import hashlib
import os
import stat
import struct
import sys

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, packlinks

DERIVED = (".bitmap", ".rev")
_RACY_NS = 50_000_000  # as history's: a file changed this close before the baseline's look is looked at
MAX_OBJECTS = 1_000_000  # a reverse index checked up to this many objects (under a second); past it, aside
_IDX_MAGIC = b"\xfftOc\x00\x00\x00\x02"
_FANOUT_END = 8 + 256 * 4


def clear(objects: str, since_ns: int) -> tuple[list[str], list[str]]:
    """Move aside what the module says; returns the names moved (their new
    paths), and what could not be moved (with why)."""
    pack_dir = os.path.join(objects, "pack")
    try:
        fd = os.open(pack_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return [], []  # no pack directory (history.restore makes what it puts back)
    moved: list[str] = []
    failed: list[str] = []
    try:
        for name in sorted(n for n in os.listdir(fd) if n.endswith(DERIVED)):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if treewalk.settled(st.st_ctime_ns, since_ns, _RACY_NS):
                continue  # the user's, as it was at the baseline
            if name.endswith(".rev") and stat.S_ISREG(st.st_mode) and _rev_holds(fd, name):
                continue
            try:
                moved.append(os.path.join(pack_dir, fs.move_aside_at(fd, name)))
            except OSError as exc:
                failed.append(f"{os.path.join(pack_dir, name)}: made or changed by a session, and it cannot be "
                              f"moved aside ({exc.strerror}); git trusts it: remove it")
    finally:
        os.close(fd)
    return moved, failed


def _rev_holds(fd: int, name: str) -> bool:
    """Whether ``name`` is the reverse index of the pack beside it, byte for byte."""
    if not packlinks.is_pack_file(name):
        return False  # a multi-pack-index's, or a name of the session's: git's order is not checked here
    idx = _read(fd, name[:-4] + ".idx", _FANOUT_END + 28 * MAX_OBJECTS + 8 * MAX_OBJECTS + 40)
    if idx is None:
        return False
    expected = expected_rev(idx)
    return expected is not None and _read(fd, name, len(expected)) == expected


def expected_rev(idx: bytes) -> bytes | None:
    """The reverse index git writes for the (SHA-1, version 2) pack index
    ``idx``; None for an index it cannot be computed from (another version or
    hash, malformed, over ``MAX_OBJECTS``)."""
    if len(idx) < _FANOUT_END + 40 or idx[:8] != _IDX_MAGIC:
        return None
    (count,) = struct.unpack_from(">I", idx, _FANOUT_END - 4)
    at = _FANOUT_END + 24 * count  # past the names (20 bytes each) and the CRCs (4)
    if count > MAX_OBJECTS or len(idx) < at + 4 * count + 40:
        return None
    small = array.array("I", idx[at:at + 4 * count])
    if sys.byteorder == "little":
        small.byteswap()
    large_at = at + 4 * count
    large_count = (len(idx) - 40 - large_at) // 8
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
    body = b"RIDX" + struct.pack(">II", 1, 1) + order.tobytes() + idx[-40:-20]  # version 1, SHA-1; the pack's checksum
    return body + hashlib.sha1(body).digest()


def _read(fd: int, name: str, limit: int) -> bytes | None:
    """A regular file's bytes, ``limit`` at most (else None), not followed."""
    try:
        opened = fs.open_regular(name, fd)
    except OSError:
        return None
    if opened is None:
        return None
    own, st = opened
    try:
        if st.st_size > limit:
            return None
        with os.fdopen(own, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(own)
    return data if len(data) <= limit else None
