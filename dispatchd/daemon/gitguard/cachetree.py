"""Whether an index's cache-tree says what its entries say. Pure.

The cache-tree extension (``TREE``) names, for each directory it marks
valid, the tree object of the entries below it and how many there are;
``git commit`` writes those trees as named, without hashing the entries
again, and ``git status`` skips a directory whose tree is HEAD's. A session
that wrote one naming a tree of its own had the user's next commit record
it. ``agrees`` hashes each valid directory's tree from the entries, as git
writes trees (``<mode> <name>\\0<id>`` each, names ordered with a
directory's as if it ended in ``/``), and compares id and count.

Not told, so not agreeing (the caller leaves the extension out, and git
makes it again): entries of a merge in progress (stages), intent-to-add
entries or a sparse index's directory entries (git's own rules for those
are not followed here), more than ``MAX_ENTRIES``, a malformed extension.
"""

from __future__ import annotations

import hashlib
import re

from dispatchd.daemon.gitguard.indexfile import Entry

MAX_ENTRIES = 200_000
_COUNTS = re.compile(rb"(-1|[0-9]+) ([0-9]+)")
_INTENT_TO_ADD = 0x2000  # of the extended flags
_STAGE = 0x3000


def agrees(data: bytes, entries: list[Entry], hash_size: int, start: int, end: int) -> bool:
    """Whether the ``TREE`` extension at ``data[start:end]`` (its 8-byte
    header included) says of every valid directory what ``entries`` give."""
    if len(entries) > MAX_ENTRIES:
        return False
    files: list[tuple[bytes, int, bytes]] = []
    for e in entries:
        flags = int.from_bytes(data[e.flags_at:e.flags_at + 2], "big")
        extended = int.from_bytes(data[e.extended_at:e.extended_at + 2], "big") if e.extended_at >= 0 else 0
        if flags & _STAGE or extended & _INTENT_TO_ADD or e.mode & 0o170000 == 0o040000 or not e.name:
            return False
        files.append((e.name, e.mode, bytes(data[e.start + 40:e.start + 40 + hash_size])))
    nodes = _nodes(data[start + 8:end], hash_size)
    if nodes is None:
        return False
    trees: dict[bytes, tuple[bytes, int]] = {}
    try:
        _tree(files, 0, b"", hash_size, trees)
    except (RecursionError, ValueError):  # a path thousands of directories deep; a file where a directory is
        return False
    return all(count < 0 or trees.get(path) == (oid, count) for path, count, oid in nodes)


def _nodes(ext: bytes, hash_size: int) -> list[tuple[bytes, int, bytes]] | None:
    """Each node of the extension: (its path, its entry count, its id or b"")."""
    found: list[tuple[bytes, int, bytes]] = []
    stack: list[tuple[bytes, int]] = []  # (a node's path, how many of its subtrees are still to come)
    pos = 0
    try:
        while pos < len(ext):
            nul = ext.index(b"\0", pos)
            name = ext[pos:nul]
            nl = ext.index(b"\n", nul)
            counts = _COUNTS.fullmatch(ext[nul + 1:nl])
            if counts is None:
                return None  # only what git's strtol and Python's int read alike: digits (a count may be -1)
            count, subtrees = int(counts.group(1)), int(counts.group(2))
            pos = nl + 1
            oid = b""
            if count >= 0:
                oid = ext[pos:pos + hash_size]
                pos += hash_size
                if len(oid) != hash_size:
                    return None
            while stack and stack[-1][1] == 0:
                stack.pop()
            if stack:
                parent, left = stack.pop()
                stack.append((parent, left - 1))
                path = parent + b"/" + name if parent else name
            elif found:
                return None  # a second root
            else:
                path = b""
            found.append((path, count, oid))
            stack.append((path, subtrees))
    except ValueError:
        return None
    return found


def _tree(files: list[tuple[bytes, int, bytes]], cut: int, path: bytes, hash_size: int,
          trees: dict[bytes, tuple[bytes, int]]) -> bytes:
    """The id of the tree at ``path`` holding ``files`` (each path's first
    ``cut`` bytes the directory's), recorded in ``trees`` with its count
    of entries, as its subtrees' are."""
    files_here: dict[bytes, tuple[int, bytes]] = {}
    dirs: dict[bytes, list[tuple[bytes, int, bytes]]] = {}
    for entry in files:
        head, slash, _ = entry[0][cut:].partition(b"/")
        if slash:
            dirs.setdefault(head, []).append(entry)
        else:
            files_here[head] = (entry[1], entry[2])
    if set(files_here) & set(dirs):
        raise ValueError("a file where a directory is")
    children = {**files_here, **{name: (0o40000, _tree(below, cut + len(name) + 1, path + b"/" + name if path
                                                       else name, hash_size, trees))
                                 for name, below in dirs.items()}}
    body = b"".join(b"%o %s\0" % (mode, name) + oid for name, (mode, oid) in
                    sorted(children.items(), key=lambda item: item[0] + b"/" if item[0] in dirs else item[0]))
    obj = b"tree %d\0" % len(body) + body
    oid = (hashlib.sha256(obj) if hash_size == 32 else hashlib.sha1(obj)).digest()
    trees[path] = (oid, len(files))
    return oid
