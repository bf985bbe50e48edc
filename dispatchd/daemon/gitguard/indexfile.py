"""A git index parser: which paths an index records as submodules. Pure.

We read git's files ourselves and never run ``git``: in a worktree a session
wrote, git would read the session's configuration (``core.fsmonitor``,
hooks, filters) and run what it names, as the user, outside any sandbox.

Guarantees: index versions 2, 3 and 4, SHA-1 or SHA-256 (the index does not
say which: the one that parses cleanly, its extensions ending exactly at the
checksum); a split index's "link" extension named; any other bytes (short,
unknown version, an entry or extension past the end) give None, never an
exception. A count of entries the bytes cannot hold (``could_fit``) is
refused before any entry is read: 256 MiB of zeros counted 2^32-1 entries
were walked as ~4 million empty ones, twice, ~5 s and ~0.9 GB each time.
Bytes in, data out: the reading is ``fs.index_gitlinks``.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import msgspec

GITLINK = 0o160000  # the mode git records a submodule with


_MAX_NAME = 4096  # bytes of a path in an index (git's own PATH_MAX)

class Index(msgspec.Struct):
    links: set[str]  # the paths recorded as submodules
    shared: str  # the shared index a split index names, "" if none
    replaced_gitlink: bool  # a split index replaces some shared entry by a submodule
    names: set[str]  # every path, when asked for


def decode_varint(data: bytes | mmap.mmap, pos: int) -> tuple[int, int]:
    """Git's offset varint at ``pos`` (varint.c: decode_varint; an index v4
    entry's prefix length, a pack's delta offset) and the position after it.
    Raises IndexError past the end."""
    byte = data[pos]
    pos += 1
    value = byte & 0x7F
    while byte & 0x80:
        byte = data[pos]
        pos += 1
        value = ((value + 1) << 7) | (byte & 0x7F)
    return value, pos


def parse_gitlinks(data: bytes) -> set[str] | None:
    """The paths a git index (versions 2-4, SHA-1 or SHA-256) records as
    submodules (mode 160000). None when the bytes are not an index we can read."""
    parsed = parse_index(data)
    return parsed.links if parsed is not None else None


def parse_index(data: bytes, all_names: bool = False) -> Index | None:
    """The index's submodules and the shared index it names; with
    ``all_names``, every path it records too. None when unreadable."""
    for found in _layouts(data):
        links: set[str] = set()
        names: set[str] = set()
        replaced = replaced_gitlink = False
        for entry in found.entries:
            gitlink = entry.mode & 0o170000 == GITLINK
            if not entry.name:
                # Only a split index has these: an entry that replaces the
                # shared index's entry at a position its "link" extension
                # gives, under that entry's name.
                replaced = True
                replaced_gitlink |= gitlink
                continue
            name = entry.name.decode("utf-8", "surrogateescape")
            if all_names:
                names.add(name)
            if gitlink:
                links.add(name)
        shared = next((data[start + 8:start + 8 + found.hash_size].hex() for sig, start, _ in found.extensions
                       if sig == b"link"), "")
        if shared or not replaced:
            return Index(links=links, shared=shared, replaced_gitlink=replaced_gitlink, names=names)
    return None


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One index entry: where it starts, its mode, where its 16-bit flags
    and (-1: none) its extended flags lie, and its path's bytes."""

    start: int
    mode: int
    flags_at: int
    extended_at: int
    name: bytes


def walk_entries(data: bytes, version: int, count: int, hash_size: int) -> tuple[list[Entry], int] | None:
    """Each entry of an index of ``version`` whose ids are ``hash_size``
    bytes, and where the entries end; None when they do not parse."""
    entries: list[Entry] = []
    pos, previous = 12, b""
    try:
        for _ in range(count):
            start = pos
            mode = int.from_bytes(data[pos + 24:pos + 28], "big")
            pos += 40 + hash_size
            flags_at = pos
            flags = int.from_bytes(data[pos:pos + 2], "big")
            pos += 2
            extended_at = -1
            if flags & 0x4000:  # git reads extended flags whatever the version says (create_from_disk)
                extended_at = pos
                pos += 2
            if version == 4:
                strip, pos = decode_varint(data, pos)
                end = data.index(b"\0", pos)
                if strip > len(previous) or len(previous) - strip + end - pos > _MAX_NAME:
                    return None  # each name is the last one grown: unbounded, its sum grew as the square
                name = previous[:len(previous) - strip] + data[pos:end]
                pos = end + 1
            else:
                end = data.index(b"\0", pos)
                name = data[pos:end]
                pos = start + ((end - start) // 8 + 1) * 8  # 1 to 8 NULs pad each entry
            length = flags & 0xFFF
            if length != 0xFFF and length != len(name) or pos > len(data):
                return None
            previous = name
            entries.append(Entry(start, mode, flags_at, extended_at, name))
    except (IndexError, ValueError):
        return None
    return entries, pos


def extensions(data: bytes, pos: int, hash_size: int) -> list[tuple[bytes, int, int]] | None:
    """The extensions after the entries, as git reads them: (signature,
    where it starts, where it ends), while 8 bytes or more are left before
    the checksum (fewer are passed over, as git does); None if one runs
    past the checksum."""
    found = []
    end = len(data) - hash_size
    if pos > end:
        return None
    while pos + 8 <= end:
        size = int.from_bytes(data[pos + 4:pos + 8], "big")
        if pos + 8 + size > end:
            return None
        found.append((bytes(data[pos:pos + 4]), pos, pos + 8 + size))
        pos += 8 + size
    return found


class Layout(msgspec.Struct, frozen=True):
    """Where an index's parts lie: its version, its ids' length, its
    entries and its extensions (``extensions``)."""

    version: int
    hash_size: int
    entries: list[Entry]
    extensions: list[tuple[bytes, int, int]]
    entries_end: int


def layout(data: bytes, hash_size: int = 0) -> Layout | None:
    """The layout of an index (versions 2-4) whose ids are ``hash_size``
    bytes, as the repository's git reads it (0: SHA-1, or SHA-256 where
    SHA-1 does not parse); None when the bytes are not an index git reads."""
    return next((found for found in _layouts(data) if found.hash_size == hash_size or not hash_size), None)


def _smallest_entry(version: int, hash_size: int) -> int:
    """The fewest bytes an entry of ``version`` with ids of ``hash_size``
    bytes takes: stat data, id and flags, then an empty name's end (v2, v3:
    padded to a multiple of 8, one NUL at least; v4: a varint and a NUL)."""
    fixed = 40 + hash_size + 2
    return fixed + 2 if version == 4 else (fixed // 8 + 1) * 8


def _count_fits(version: int, count: int, hash_size: int, size: int) -> bool:
    """Whether ``count`` entries can lie between the 12-byte header and the
    checksum of an index of ``size`` bytes: if not, the walk would fail
    anyway (an entry or the extensions past the checksum), only later."""
    return count * _smallest_entry(version, hash_size) <= size - 12 - hash_size


def could_fit(head: bytes, size: int) -> bool:
    """Whether an index of ``size`` bytes starting with ``head`` (its first
    12 bytes) could be one git reads: its signature, a version we read, and
    as many entries as it counts fit in it with SHA-1 ids (the smaller).
    False says that no reading of the whole can parse, so none is needed."""
    if len(head) < 12 or head[:4] != b"DIRC":
        return False
    version = int.from_bytes(head[4:8], "big")
    return version in (2, 3, 4) and _count_fits(version, int.from_bytes(head[8:12], "big"), 20, size)


def _layouts(data: bytes) -> Iterator[Layout]:
    """Each reading of the index that parses, SHA-1 ids first (the index
    does not say which its ids are: the repository's configuration does)."""
    if len(data) < 12 or data[:4] != b"DIRC":
        return
    version = int.from_bytes(data[4:8], "big")
    count = int.from_bytes(data[8:12], "big")
    if version not in (2, 3, 4):
        return
    for hash_size in (20, 32):
        if not _count_fits(version, count, hash_size, len(data)):
            continue  # refused before a single entry is built
        walked = walk_entries(data, version, count, hash_size)
        found = extensions(data, walked[1], hash_size) if walked is not None else None
        if walked is not None and found is not None:
            yield Layout(version, hash_size, walked[0], found, walked[1])
