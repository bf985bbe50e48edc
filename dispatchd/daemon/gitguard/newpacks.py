"""Packs a session made that name the user's objects: each such object read
from the new pack and hashed, at the domain's last end; a forged pack moved
aside, one that cannot be verified reported.

Git looks an object up in the packs before the loose objects, in the
newest pack first and then the one it last found something in, so a pack a
session writes whose index names one of the user's object ids at bytes of
its own has the user's ``git show`` and ``git checkout`` read the session's
bytes (only ``git fsck`` tells). The keep holds the user's objects, but
nothing was missing, so nothing was put back. Honest new packs name the
user's objects too (a session's ``git gc``, ``git repack``, a fetch of what
the user has), so a pack is not refused for naming them: each object it
names that the user had (the keep's pack indexes and loose names, and the
object stores the user's ``objects/info/alternates`` named at the
baseline) is read from the new pack as git reads it (``objectstore``:
deltas applied, a delta's base looked up *in the same pack* only, as git
does) and hashed against its id.

A pack with an object of the user's that, read as git reads it, hashes to
another id has its files moved aside (its ``.idx`` first: git reads any
``*.idx`` of ``objects/pack`` as a pack, and a name ending otherwise as
none). One the end cannot verify is reported and left where it is: past the
bounds (``BUDGET_S`` of reading at one end, ``MAX_OBJECTS`` of the user's
objects, ``MAX_NAMES`` names in the new indexes, ``MAX_PACKS`` new
indexes), with a delta chain deeper than 64 or a delta larger than 64 MiB,
or an object git could not read either (git then reads the user's own copy:
it marks the packed entry bad and looks again). Moving it aside would lose
what a session's honest ``git gc`` left there alone (its own new objects,
pruned from loose): the user runs ``git fsck``, which the report says. A
whole object of any size is hashed as it streams, with the hash its id's
length names (SHA-1 or SHA-256: ``objectstore.index_hash_size``).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time
import zlib

from dispatchd.daemon.gitguard import fs, keepdirs, objectstore

BUDGET_S = 20.0
MAX_OBJECTS = 2_000_000  # the user's objects read at one end
MAX_NAMES = 2_000_000  # names of the new indexes, all told (about 120 MiB as a set)
MAX_PACKS = 256  # new indexes at one end
_CACHE_BYTES = 64 * 1024 * 1024  # a pack's inflated delta bases kept while it is read
_CHUNK = 1 << 20  # compressed bytes inflated at a time, for an object past objectstore's bound
_KINDS = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class _OnePack:
    """What ``objectstore._Pack.read`` asks of a store, answered from the
    pack being read alone (git: a delta's base "must be in the same pack"),
    and its own reads of a delta's base by offset, both through a cache of
    inflated objects (a chain's bases are read once, not once a delta)."""

    def __init__(self, pack: objectstore._Pack, deadline: float) -> None:
        self.pack, self.deadline = pack, deadline
        self.cache: dict[int, tuple[int, bytes]] = {}
        self.cached = 0
        pack.read = lambda off, store, depth=0: self.at(off, depth)  # type: ignore[method-assign]

    def in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise objectstore.OutOfTime("out of time")

    def read(self, oid: bytes, depth: int = 0) -> tuple[int, bytes] | None:
        off = self.pack.offset(oid)
        return None if off is None else self.at(off, depth)

    def at(self, off: int, depth: int = 0) -> tuple[int, bytes]:
        found = self.cache.get(off)
        if found is None:
            found = objectstore._Pack.read(self.pack, off, self, depth)  # type: ignore[arg-type]
            if self.cached + len(found[1]) > _CACHE_BYTES:
                self.cache.clear()
                self.cached = 0
            self.cache[off] = found
            self.cached += len(found[1])
        return found


def check(objects: str, keep: str, alternates: list[str] | None = None,
          known: set[str] | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """Verify the new packs of ``objects`` against the keep and the user's
    ``alternates`` (see the module): ``(path, why)`` for each pack moved
    aside or left not verified, and what could not be done. ``known``: the
    pack files at the baseline (``History.pack_links``: a checkpoint adds a
    session's packs to the keep meanwhile); None: the keep's."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    pack_dir = os.path.join(objects, "pack")
    kept = known
    if kept is None:
        try:
            kept = set(keepdirs.listdir(os.path.join(keep, "pack")))  # its mode set back, if changed
        except OSError:
            kept = set()
    try:
        # Every index, whatever its name: git reads any ``*.idx`` there as a pack's (``evil.idx``, ``evil.pack``).
        new = sorted(n for n in os.listdir(pack_dir) if n.endswith(".idx") and n not in kept)
    except OSError:
        return done, failed
    if not new:
        return done, failed
    deadline = time.monotonic() + BUDGET_S
    verdicts = _verdicts(pack_dir, new, keep, alternates or [], deadline)
    for idx in new:
        verdict = verdicts.get(idx, "past the bounds of one end")
        if not verdict:
            continue
        if verdict != "forged":
            # Not moved: it may hold the only copy of the session's own new
            # objects (its gc pruned them), and what it names of yours reads
            # right or not at all so far as the end could tell.
            done.append((os.path.join(pack_dir, idx), f"a pack a session made names your objects and was not "
                                                      f"verified ({verdict}): git fsck checks it"))
            continue
        moved, bad = _aside(pack_dir, idx[:-4])
        failed += bad
        done.append((os.path.join(pack_dir, idx), "a pack a session made names your objects for other bytes (git "
                                                  f"would have read them in place of yours); moved aside: "
                                                  f"{', '.join(moved)}"))
    return done, failed


def _verdicts(pack_dir: str, new: list[str], keep: str, alternates: list[str], deadline: float) -> dict[str, str]:
    """Each new index -> "" (verified, or naming none of the user's objects),
    "forged", or why it could not be verified; an index left out is past the
    bounds."""
    verdicts: dict[str, str] = {}
    names: dict[str, list[bytes]] = {}
    first: dict[tuple[int, ...], str] = {}  # an (index, pack) pair of inodes -> the first name read for it
    twins: dict[str, str] = {}
    total = 0
    for idx in new[:MAX_PACKS]:
        key: tuple[int, ...]
        try:
            i = os.stat(os.path.join(pack_dir, idx), follow_symlinks=False)
            p = os.stat(os.path.join(pack_dir, idx[:-4] + ".pack"), follow_symlinks=False)
            key = (i.st_dev, i.st_ino, p.st_dev, p.st_ino)
        except OSError:
            key = (id(idx),)  # no pack beside it (git reads nothing there), or gone: read on its own
        if key in first:
            twins[idx] = first[key]  # hard links of one pair: read once
            continue
        first[key] = idx
        listed = objectstore.names_in_index(pack_dir, idx, MAX_NAMES - total)
        if listed is None:
            verdicts[idx] = "its index is not one git reads (version 2, SHA-1 or SHA-256), or names too many objects"
            continue
        total += len(listed)
        names[idx] = listed
        if time.monotonic() > deadline:
            break
    # The user's objects among all of them, the keep's indexes read once.
    wanted = list({oid for listed in names.values() for oid in listed})
    theirs = users(wanted, keep, alternates)
    left = MAX_OBJECTS
    for idx, listed in names.items():
        mine = sorted(oid for oid in listed if oid in theirs)
        if not mine:
            verdicts[idx] = ""
        elif len(mine) > left:
            verdicts[idx] = f"it names {len(mine)} of your objects, past the {MAX_OBJECTS} read at one end"
        else:
            left -= len(mine)
            verdicts[idx] = _verify(pack_dir, idx, mine, deadline)
    for twin, of in twins.items():
        if of in verdicts:
            verdicts[twin] = verdicts[of]
    return verdicts


def users(oids: list[bytes], keep: str, alternates: list[str]) -> set[bytes]:
    """Which of ``oids`` the user had: in the keep (its pack indexes, its
    loose names) or in an object store of the user's alternates."""
    found: set[bytes] = set()
    for store in [keep, *alternates]:
        if os.path.isdir(os.path.join(store, "pack")):
            found |= objectstore.indexed(store, [oid for oid in oids if oid not in found])
        loose = _loose(store)
        if loose:
            found |= loose.intersection(oids)
    return found


def _loose(store: str) -> set[bytes]:
    """The ids of an object store's loose objects, from its listings."""
    found: set[bytes] = set()
    try:
        dirs = [d for d in os.listdir(store) if d in fs.FANOUT]
    except OSError:
        return found
    for d in dirs:
        try:
            names = os.listdir(os.path.join(store, d))
        except OSError:
            continue
        for n in names:
            if len(n) in (38, 62):  # SHA-1, SHA-256
                try:
                    found.add(bytes.fromhex(d + n))
                except ValueError:
                    continue
    return found


def _verify(pack_dir: str, idx: str, mine: list[bytes], deadline: float) -> str:
    """"" (each of ``mine`` hashes right, read from this pack alone),
    "forged" (one read as git reads it hashes to another id), or why it was
    not verified. What git itself cannot read is not forged: git reads
    such an object from the user's own store instead (it marks the packed
    entry bad and looks again)."""
    try:
        fd = os.open(pack_dir, _DIR)
    except OSError as exc:
        return f"its directory cannot be opened: {exc.strerror}"
    try:
        pack = objectstore._Pack(fd, idx, idx[:-4] + ".pack")
    except (OSError, ValueError, struct.error) as exc:
        return f"it cannot be read: {exc}"
    finally:
        os.close(fd)
    one = _OnePack(pack, deadline)
    try:
        for oid in mine:
            off = pack.offset(oid)
            if off is None:
                return "its index cannot be searched"
            digest = _large(pack, off, one)
            if digest is None:
                kind, body = one.at(off)
                name = _KINDS.get(kind)
                if name is None:
                    return f"an object of kind {kind}, which git does not read"
                digest = _hasher(pack.hash_size, name + b" %d\0" % len(body) + body).digest()
            if digest != oid:
                return "forged"
    except objectstore.OutOfTime:
        return f"past the {BUDGET_S:g} s read at one end"
    except (ValueError, IndexError, struct.error, OSError, MemoryError, RecursionError, zlib.error) as exc:
        return f"an object of yours it names cannot be read as git reads it ({exc})"
    finally:
        one.cache.clear()
        pack.data.close()
    return ""


def _large(pack: objectstore._Pack, off: int, one: _OnePack) -> bytes | None:
    """The id of a whole (not delta) object past ``objectstore``'s size
    bound, inflated and hashed as it streams; None for any other."""
    data = pack.data
    kind, size, pos = objectstore.entry_header(data, off)
    if kind not in _KINDS or size <= objectstore._MAX_OBJECT:
        return None
    digest = _hasher(pack.hash_size, _KINDS[kind] + b" %d\0" % size)
    inflater = zlib.decompressobj()
    done = 0
    while not inflater.eof:
        one.in_time()
        chunk = data[pos:pos + _CHUNK]
        if not chunk:
            raise ValueError("the pack ends inside an object")
        pos += len(chunk)
        out = inflater.decompress(chunk)
        done += len(out)
        if done > size:
            raise ValueError("an object larger than its size")
        digest.update(out)
    if done != size:
        raise ValueError("an object shorter than its size")
    return digest.digest()


def _hasher(hash_size: int, data: bytes) -> "hashlib._Hash":
    """The hash of a pack's ids (SHA-256 for 32 bytes, else SHA-1), begun
    with ``data``."""
    return hashlib.sha256(data) if hash_size == 32 else hashlib.sha1(data)


def _aside(pack_dir: str, stem: str) -> tuple[list[str], list[str]]:
    moved: list[str] = []
    failed: list[str] = []
    for ext in (".idx", ".pack", ".rev", ".bitmap", ".mtimes", ".keep", ".promisor"):
        path = os.path.join(pack_dir, stem + ext)
        if os.path.lexists(path):
            try:
                moved.append(os.path.basename(fs.move_aside(path)))
            except OSError as exc:
                failed.append(f"{path}: a pack that cannot be moved aside ({exc.strerror})")
    return moved, failed
