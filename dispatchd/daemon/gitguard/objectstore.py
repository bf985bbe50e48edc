"""Reading a repository's objects without running git: loose objects and
packs (version 2 indexes, deltas applied), for two questions: is one commit
an ancestor of another (``is_ancestor``), and does a pack hold an object,
read back and hashed to its id (``Store.packed``: a loose object file that
git packed while a session ran is not lost).

The repository is hostile content: every read is bounded (an object's size,
a delta chain's length, the commits visited), a malformed object is "not
known" (never an exception past ``is_ancestor``), and nothing is written.
Object ids are SHA-1 (a SHA-256 repository's answer is "not known").
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import zlib

from dispatchd.daemon.gitguard.indexfile import decode_varint

_MAX_OBJECT = 64 * 1024 * 1024
_MAX_CHAIN = 64
_MAX_COMMITS = 20_000


class _Pack:
    def __init__(self, idx_path: str, pack_path: str) -> None:
        with open(idx_path, "rb") as f:
            self.idx = f.read()
        if self.idx[:8] != b"\377tOc\0\0\0\2":
            raise ValueError("not a version 2 pack index")
        self.count = struct.unpack(">I", self.idx[8 + 255 * 4:8 + 256 * 4])[0]
        fd = os.open(pack_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self.data = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def offset(self, oid: bytes) -> int | None:
        first = oid[0]
        lo = struct.unpack(">I", self.idx[8 + (first - 1) * 4:8 + first * 4])[0] if first else 0
        hi = struct.unpack(">I", self.idx[8 + first * 4:12 + first * 4])[0]
        names = 8 + 256 * 4
        while lo < hi:
            mid = (lo + hi) // 2
            name = self.idx[names + mid * 20:names + mid * 20 + 20]
            if name == oid:
                offsets = names + self.count * 24
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
        cached = store.cached(self, off)
        if cached is not None:
            return cached
        found = self._read(off, store, depth)
        store.keep(self, off, found)
        return found

    def _read(self, off: int, store: Store, depth: int) -> tuple[int, bytes]:
        data = self.data
        c = data[off]
        kind, size, shift, pos = (c >> 4) & 7, c & 15, 4, off + 1
        while c & 0x80:
            c = data[pos]
            pos += 1
            size |= (c & 0x7F) << shift
            shift += 7
        if size > _MAX_OBJECT:
            raise ValueError("object too large")
        if kind == 6:  # a delta against an object earlier in this pack
            back, pos = decode_varint(data, pos)
            base_kind, base = self.read(off - back, store, depth + 1)
            return base_kind, _apply(base, _inflate(data, pos, size))
        if kind == 7:  # a delta against an object named by id
            found = store.read(bytes(data[pos:pos + 20]), depth + 1)
            if found is None:
                raise ValueError("delta base missing")
            return found[0], _apply(found[1], _inflate(data, pos + 20, size))
        return kind, _inflate(data, pos, size)


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


def _apply(base: bytes, delta: bytes) -> bytes:
    src, pos = _varint(delta, 0)
    dst, pos = _varint(delta, pos)
    if src != len(base) or dst > _MAX_OBJECT:
        raise ValueError("delta does not fit its base")
    out = bytearray()
    while pos < len(delta):
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
            out += base[start:start + length]
        elif op:
            out += delta[pos:pos + op]
            pos += op
        else:
            raise ValueError("delta opcode 0")
    if len(out) != dst:
        raise ValueError("delta result size mismatch")
    return bytes(out)


class Store:
    """The objects of one ``objects`` directory. ``cache_bytes``: how much of
    the objects read from packs is kept, for delta chains read again (a
    pack's objects read one after the other share their bases)."""

    _KINDS = {b"commit": 1, b"tree": 2, b"blob": 3, b"tag": 4}
    _NAMES = {v: k for k, v in _KINDS.items()}

    def __init__(self, objects: str, cache_bytes: int = 0) -> None:
        self.objects = objects
        self._packs: list[_Pack] | None = None
        self._cache: dict[tuple[int, int], tuple[int, bytes]] = {}
        self._cache_left = cache_bytes

    def cached(self, pack: _Pack, off: int) -> tuple[int, bytes] | None:
        return self._cache.get((id(pack), off)) if self._cache else None

    def keep(self, pack: _Pack, off: int, found: tuple[int, bytes]) -> None:
        if len(found[1]) <= self._cache_left:
            self._cache[(id(pack), off)] = found
            self._cache_left -= len(found[1])

    def packed(self, oid: bytes) -> bool:
        """Whether a pack of this directory holds object ``oid`` (SHA-1): read
        out of it, deltas applied, and hashed to that id. A pack index that
        names the object but does not hold it (made by a session, or damaged)
        says no; so does anything malformed."""
        if len(oid) != 20:
            return False
        try:
            for pack in self._load_packs():
                off = pack.offset(oid)
                if off is None:
                    continue
                kind, body = pack.read(off, self)
                name = self._NAMES.get(kind)
                if name is not None and hashlib.sha1(name + b" %d\0" % len(body) + body).digest() == oid:
                    return True
        except (ValueError, IndexError, zlib.error, OSError, struct.error, MemoryError):
            return False
        return False

    def _load_packs(self) -> list[_Pack]:
        if self._packs is None:
            self._packs = []
            pack_dir = os.path.join(self.objects, "pack")
            try:
                names = sorted(os.listdir(pack_dir))
            except OSError:
                names = []
            for name in names:
                if name.endswith(".idx"):
                    try:
                        self._packs.append(_Pack(os.path.join(pack_dir, name),
                                                 os.path.join(pack_dir, name[:-4] + ".pack")))
                    except (OSError, ValueError):
                        continue
        return self._packs

    def read(self, oid: bytes, depth: int = 0) -> tuple[int, bytes] | None:
        hexid = oid.hex()
        try:
            fd = os.open(os.path.join(self.objects, hexid[:2], hexid[2:]), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                raw = os.read(fd, _MAX_OBJECT)
            finally:
                os.close(fd)
            d = zlib.decompressobj()
            body = d.decompress(raw, _MAX_OBJECT + 64)
            head, _, rest = body.partition(b"\0")
            kind, _, _ = head.partition(b" ")
            return self._KINDS.get(kind, 0), rest
        for pack in self._load_packs():
            off = pack.offset(oid)
            if off is not None:
                return pack.read(off, self, depth)
        return None

    def parents(self, oid: bytes) -> list[bytes] | None:
        found = self.read(oid)
        if found is None or found[0] != 1:
            return None
        parents = []
        for line in found[1].split(b"\n"):
            if not line:
                break
            if line.startswith(b"parent "):
                parents.append(bytes.fromhex(line[7:47].decode("ascii")))
        return parents


def is_ancestor(objects: str, old: str, new: str) -> bool | None:
    """Whether commit ``old`` is ``new`` or one of its ancestors; None when
    it cannot be told (an object missing or malformed, a SHA-256 id, more
    than ``_MAX_COMMITS`` commits to look at)."""
    if old == new:
        return True
    if len(old) != 40 or len(new) != 40:
        return None
    store = Store(objects)
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
    except (ValueError, IndexError, zlib.error, OSError, struct.error):
        return None
    return False
