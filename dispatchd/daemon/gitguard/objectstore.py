"""Reading a repository's objects without running git: loose objects and
packs (version 2 indexes, deltas applied), for two questions: is one commit
an ancestor of another (``is_ancestor``), and which object ids do the pack
indexes name (``indexed``).

The repository is hostile content: every read is bounded (an object's size,
a delta chain's length, the commits visited, the packs and their
indexes, 256 MiB in all from one directory, the time: ``Store.deadline``), every file is opened without
following a symlink, without blocking, and read only if it is a regular file
(a FIFO planted for an index or an object hung the read for good; a symlink
to /dev/zero read until memory ran out); a malformed object is "not known"
(never an exception past ``is_ancestor`` or ``indexed``), and nothing is
written. Object ids are SHA-1 or SHA-256: a pack index's size tells which
(``_Pack``: the two formats' sizes never meet for one count, so it is read as
git reads it whenever git reads it at all), and an id's length does elsewhere.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
import zlib

from dispatchd.daemon.gitguard import fs
from dispatchd.daemon.gitguard.indexfile import decode_varint

_MAX_OBJECT = 64 * 1024 * 1024
_MAX_CHAIN = 64
_MAX_COMMITS = 20_000
_MAX_PACKS = 1024  # pack indexes read from one objects directory
_MAX_INDEX = 256 * 1024 * 1024  # bytes of all the pack indexes read from one directory (about 9 million objects)
_LOOKUPS = 4096  # ids looked up one by one in ``indexed``; more: each index read as a set
_SET_MAX = 2_000_000  # names of one index read as a set (about 150 MiB); a bigger one is searched
BUDGET_S = 5.0  # is_ancestor's time, past which the answer is "not known"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


_MAX_ALTERNATES = 16


def alternates(objects: str, text: str | None) -> list[str]:
    """The object directories an ``objects/info/alternates`` text names
    (one a line, ``#`` comments, relative ones to ``objects``), as git reads
    them; only directories that exist."""
    found = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            path = os.path.normpath(os.path.join(objects, line))
            if os.path.isdir(path) and path != os.path.normpath(objects):
                found.append(path)
    return found[:_MAX_ALTERNATES]


def finder(objects: str, borrowed: list[str] | None) -> Store:
    """A store that tells whether an object is there (``Store.has``) for a
    value about to be kept: ``objects``, the baseline's alternates
    (``borrowed``) and the ones named now, so that a value of the user's
    in an alternate is never refused (a record without the baseline's, or
    one the user added since)."""
    now = alternates(objects, fs.read_small(os.path.join(objects, "info", "alternates"), 64 * 1024))
    return Store(objects, alternates=list(dict.fromkeys((borrowed or []) + now)))


class OutOfTime(ValueError):
    pass


def _open_regular(name: str, dir_fd: int, limit: int) -> tuple[int, int]:
    """``(fd, size)`` of the regular file ``name`` below ``dir_fd``, opened
    without following a symlink and without blocking (a FIFO answers at
    once), at most ``limit`` bytes. Raises ``OSError`` or ``ValueError``."""
    opened = fs.open_regular(name, dir_fd)
    if opened is None:
        raise ValueError(f"{name}: not a regular file")
    fd, st = opened
    try:
        if st.st_size > limit:
            raise ValueError(f"{name}: larger than {limit} bytes")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size



class _Pack:
    def __init__(self, pack_dir: int, idx_name: str, pack_name: str, *, with_data: bool = True,
                 limit: int = _MAX_INDEX) -> None:
        fd, size = _open_regular(idx_name, pack_dir, limit)
        try:
            self.idx = fs.read_all(fd, size)
        finally:
            os.close(fd)
        if self.idx[:8] != b"\377tOc\0\0\0\2" or len(self.idx) < 8 + 256 * 4:
            raise ValueError("not a version 2 pack index")
        self.count = struct.unpack(">I", self.idx[8 + 255 * 4:8 + 256 * 4])[0]
        self.hash_size = index_hash_size(len(self.idx), self.count)
        if not with_data:
            return
        fd, _ = _open_regular(pack_name, pack_dir, 1 << 62)
        try:
            self.data = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def offset(self, oid: bytes) -> int | None:
        h = self.hash_size
        if len(oid) != h:
            return None  # an id of the other format: this index names none
        first = oid[0]
        lo = struct.unpack(">I", self.idx[8 + (first - 1) * 4:8 + first * 4])[0] if first else 0
        hi = struct.unpack(">I", self.idx[8 + first * 4:12 + first * 4])[0]
        names = 8 + 256 * 4
        while lo < hi:
            mid = (lo + hi) // 2
            name = self.idx[names + mid * h:names + mid * h + h]
            if name == oid:
                offsets = names + self.count * (h + 4)
                off = struct.unpack(">I", self.idx[offsets + mid * 4:offsets + mid * 4 + 4])[0]
                if off & 0x80000000:
                    large = offsets + self.count * 4 + (off & 0x7FFFFFFF) * 8
                    off = struct.unpack(">Q", self.idx[large:large + 8])[0]
                return int(off)
            if name < oid:
                lo = mid + 1
            else:
                hi = mid
        return None

    def read(self, off: int, store: Store, depth: int = 0) -> tuple[int, bytes]:
        if depth > _MAX_CHAIN:
            raise ValueError("delta chain too long")
        store.in_time()
        data = self.data
        kind, size, pos = entry_header(data, off)
        if size > _MAX_OBJECT:
            raise ValueError("object too large")
        if kind == 6:  # a delta against an object earlier in this pack
            back, pos = decode_varint(data, pos)
            base_kind, base = self.read(off - back, store, depth + 1)
            return base_kind, _apply(base, _inflate(data, pos, size), store)
        if kind == 7:  # a delta against an object named by id
            h = self.hash_size
            found = store.read(bytes(data[pos:pos + h]), depth + 1)
            if found is None:
                raise ValueError("delta base missing")
            return found[0], _apply(found[1], _inflate(data, pos + h, size), store)
        return kind, _inflate(data, pos, size)

    def names(self) -> list[bytes]:
        """Every object id the index lists, in its order."""
        h, start = self.hash_size, 8 + 256 * 4
        return [self.idx[start + i * h:start + i * h + h] for i in range(self.count)]


def index_hash_size(size: int, count: int) -> int:
    """20 (SHA-1) or 32 (SHA-256): the id length a version 2 pack index of
    ``size`` bytes listing ``count`` objects has, as git checks it (the
    header and fan-out, the ids, a CRC and an offset each, at most one large
    offset per object but the first, the two trailing checksums). The two
    ranges never overlap for one ``count``; outside both, git reads no such
    index: raises ``ValueError``."""
    for h in (20, 32):
        least = 8 + 256 * 4 + count * (h + 8) + 2 * h
        if least <= size <= least + max(count - 1, 0) * 8:
            return h
    raise ValueError("a pack index whose size does not fit its count")


def entry_header(data: mmap.mmap, off: int) -> tuple[int, int, int]:
    """A pack entry's ``(kind, size, where its data begins)``."""
    c = data[off]
    kind, size, shift, pos = (c >> 4) & 7, c & 15, 4, off + 1
    while c & 0x80:
        c = data[pos]
        pos += 1
        size |= (c & 0x7F) << shift
        shift += 7
    return kind, size, pos


def _inflate(data: mmap.mmap, pos: int, size: int) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(data[pos:pos + size + 4096 + size // 2], size + 1)
    if len(out) != size:
        raise ValueError("object size mismatch")
    return out


def _varint(delta: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        c = delta[pos]
        pos += 1
        value |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return value, pos


def _apply(base: bytes, delta: bytes, store: Store | None = None) -> bytes:
    src, pos = _varint(delta, 0)
    dst, pos = _varint(delta, pos)
    if src != len(base) or dst > _MAX_OBJECT:
        raise ValueError("delta does not fit its base")
    out = bytearray()
    ops = 0
    while pos < len(delta):
        ops += 1
        if store is not None and not ops & 0xFFFF:
            store.in_time()  # a delta of millions of one-byte inserts takes seconds
        op = delta[pos]
        pos += 1
        if op & 0x80:
            start = length = 0
            for i in range(4):
                if op & (1 << i):
                    start |= delta[pos] << (8 * i)
                    pos += 1
            for i in range(3):
                if op & (0x10 << i):
                    length |= delta[pos] << (8 * i)
                    pos += 1
            length = length or 0x10000
            if start + length > len(base):
                raise ValueError("delta copies past its base")
            if len(out) + length > dst:  # checked as it grows: a one-byte op copies 64 KiB
                raise ValueError("delta result larger than it says")
            out += base[start:start + length]
        elif op:
            if len(out) + op > dst:
                raise ValueError("delta result larger than it says")
            out += delta[pos:pos + op]
            pos += op
        else:
            raise ValueError("delta opcode 0")
    if len(out) != dst:
        raise ValueError("delta result size mismatch")
    return bytes(out)


def _packs_in(objects: str, *, with_data: bool, left_out: list[str] | None = None) -> list[_Pack]:
    """The packs of ``objects`` whose index can be read (at most
    ``_MAX_PACKS``, their indexes ``_MAX_INDEX`` bytes in all: the rest are
    left out, as if absent, each named in ``left_out`` when given; neither
    ``objects`` nor ``pack`` followed if a symlink)."""
    left_out = [] if left_out is None else left_out
    packs: list[_Pack] = []
    left = _MAX_INDEX
    try:
        top = os.open(objects, _DIR)
    except OSError:
        return packs
    try:
        pack_dir = os.open("pack", _DIR, dir_fd=top)
    except OSError:
        os.close(top)
        return packs
    os.close(top)
    try:
        for name in sorted(os.listdir(pack_dir)):
            if name.endswith(".idx") and len(packs) >= _MAX_PACKS:
                left_out.append(name)
                break
            if name.endswith(".idx"):
                try:
                    pack = _Pack(pack_dir, name, name[:-4] + ".pack", with_data=with_data, limit=left)
                except (OSError, ValueError, struct.error):
                    left_out.append(name)
                    continue
                packs.append(pack)
                left -= len(pack.idx)
    except OSError:
        pass
    finally:
        os.close(pack_dir)
    return packs


def names_in_index(directory: str, name: str, limit: int) -> list[bytes] | None:
    """The object ids the pack index ``directory/name`` lists, or None (not a
    readable version 2 index, or more than ``limit`` of them); ``directory``
    and ``name`` not followed if symlinks."""
    try:
        fd = os.open(directory, _DIR)
    except OSError:
        return None
    try:
        pack = _Pack(fd, name, "", with_data=False)
    except (OSError, ValueError, struct.error):
        return None
    finally:
        os.close(fd)
    if pack.count > limit:
        return None
    return pack.names()


def indexed(objects: str, oids: list[bytes]) -> set[bytes]:
    """Which of ``oids`` a pack index of ``objects`` names, read from the
    indexes alone (bounded; no object read). Says what git may have packed:
    an index names an object without proving the pack holds it."""
    found: set[bytes] = set()
    packs = _packs_in(objects, with_data=False)
    if len(oids) > _LOOKUPS:
        # Many ids (an old pack's): each index's names as a set, once, where
        # a search each took ~10 us in Python (a million ids: 10 s).
        wanted = set(oids)
        for pack in packs:
            if pack.count > _SET_MAX:
                continue  # searched below, for what is still missing
            found |= wanted.intersection(pack.names())
        oids = [oid for oid in oids if oid not in found]
        packs = [pack for pack in packs if pack.count > _SET_MAX]
    for oid in oids:
        try:
            if any(pack.offset(oid) is not None for pack in packs):
                found.add(oid)
        except (ValueError, IndexError, struct.error):
            continue
    return found


class Store:
    """The objects of one ``objects`` directory, then of the ``alternates``
    given (the object stores a shared clone borrows from, as the user's
    ``objects/info/alternates`` named them at the baseline: never a session's;
    at most ``_MAX_ALTERNATES``, none of theirs followed further); past
    ``deadline`` (``time.monotonic``), every read raises ``OutOfTime``."""

    _KINDS = {b"commit": 1, b"tree": 2, b"blob": 3, b"tag": 4}

    def __init__(self, objects: str, deadline: float | None = None, alternates: list[str] | None = None) -> None:
        self.objects = objects
        self.deadline = deadline
        self._packs: list[_Pack] | None = None
        self.left_out: list[str] = []  # pack indexes not read (past a bound, unreadable): what they hold is not known
        self._others = [Store(a, deadline) for a in (alternates or [])[:_MAX_ALTERNATES]]

    def in_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime("out of time")

    def _load_packs(self) -> list[_Pack]:
        if self._packs is None:
            self._packs = _packs_in(self.objects, with_data=True, left_out=self.left_out)
        return self._packs

    def _loose(self, hexid: str) -> int:
        """A loose object's file, opened as ``_open_regular`` does (its
        fan-out directory not followed either), or -1."""
        try:
            top = os.open(self.objects, _DIR)
        except OSError:
            return -1
        try:
            fan = os.open(hexid[:2], _DIR, dir_fd=top)
        except OSError:
            return -1
        finally:
            os.close(top)
        try:
            return _open_regular(hexid[2:], fan, _MAX_OBJECT)[0]
        except (OSError, ValueError):
            return -1
        finally:
            os.close(fan)

    def read(self, oid: bytes, depth: int = 0) -> tuple[int, bytes] | None:
        """``(kind, body)`` of ``oid`` as git finds it: in the packs first
        (this store's, then its alternates'), then loose. A loose file a
        session planted at the id of a packed object is never what git
        reads, and so never what a check here trusts."""
        self.in_time()
        for store in (self, *self._others):
            for pack in store._load_packs():
                off = pack.offset(oid)
                if off is not None:
                    return pack.read(off, self, depth)
        for store in (self, *self._others):
            found = store._read_loose(oid.hex())
            if found is not None:
                return found
        return None

    def _read_loose(self, hexid: str) -> tuple[int, bytes] | None:
        fd = self._loose(hexid)
        if fd < 0:
            return None
        try:
            raw = os.read(fd, _MAX_OBJECT)
        finally:
            os.close(fd)
        d = zlib.decompressobj()
        body = d.decompress(raw, _MAX_OBJECT + 64)
        head, _, rest = body.partition(b"\0")
        kind, _, _ = head.partition(b" ")
        return self._KINDS.get(kind, 0), rest

    def has(self, hexid: str) -> bool:
        """Whether ``hexid`` may name an object git finds: a pack index names
        it, or a loose file there inflates to an object's header; in this
        store or an alternate's. Where that cannot be told (a pack index not
        read: past a bound, unreadable), True: a value is refused only when
        it surely names nothing. Index look-ups and a header's read: no deadline."""
        try:
            oid = bytes.fromhex(hexid)
        except ValueError:
            return False
        unknown = False
        for store in (self, *self._others):
            try:
                if any(pack.offset(oid) is not None for pack in store._load_packs()):
                    return True
            except (ValueError, IndexError, struct.error):
                unknown = True  # a broken index: it may name it
            unknown = unknown or bool(store.left_out)
            if store._loose_header(hexid):
                return True
        return unknown

    def _loose_header(self, hexid: str) -> bool:
        """Whether the loose file at ``hexid`` inflates to an object's header
        (``commit 241\0``...): junk at its name names nothing, and git's
        ``gc`` and ``for-each-ref`` fail on a ref to it."""
        fd = self._loose(hexid)
        if fd < 0:
            return False
        try:
            head = zlib.decompressobj().decompress(os.read(fd, 4096), 64)
        except (OSError, zlib.error):
            return False
        finally:
            os.close(fd)
        kind, _, rest = head.partition(b" ")
        size, nul, _ = rest.partition(b"\0")
        return kind in self._KINDS and bool(nul) and size.isdigit()

    def parents(self, oid: bytes) -> list[bytes] | None:
        found = self.read(oid)
        if found is None or found[0] != 1:
            return None
        parents = []
        for line in found[1].split(b"\n"):
            if not line:
                break
            if line.startswith(b"parent "):
                parents.append(bytes.fromhex(line[7:].decode("ascii")))  # 40 or 64 digits, as the repository's
        return parents


def is_ancestor(objects: str, old: str, new: str, store: Store | None = None) -> bool | None:
    """Whether commit ``old`` is ``new`` or one of its ancestors; None when
    it cannot be told (an object missing or malformed, ids of two lengths, more
    than ``_MAX_COMMITS`` commits to look at, past ``BUDGET_S``, or past the
    deadline of ``store``, one shared by a caller's many questions: its
    packs read once)."""
    if old == new:
        return True
    if len(old) != len(new) or len(old) not in (40, 64):
        return None
    if store is None:
        store = Store(objects, deadline=time.monotonic() + BUDGET_S)
    target = bytes.fromhex(old)
    seen = {bytes.fromhex(new)}
    todo = [bytes.fromhex(new)]
    try:
        while todo:
            if len(seen) > _MAX_COMMITS:
                return None
            parents = store.parents(todo.pop())
            if parents is None:
                return None
            for parent in parents:
                if parent == target:
                    return True
                if parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
    except (ValueError, IndexError, zlib.error, OSError, struct.error, MemoryError, RecursionError):
        return None
    return False
