"""Whether an index's cache-tree says what its entries say. Pure.

The cache-tree extension (``TREE``) names, for each directory it marks
valid, the tree object of the entries below it and how many there are;
``git commit`` writes those trees as named, without hashing the entries
again, and ``git status`` skips a directory whose tree is HEAD's. A session
that wrote one naming a tree of its own had the user's next commit record
it. ``agrees`` hashes each valid directory's tree from the entries, as git
writes trees (``<mode> <name>\\0<id>`` each, names ordered with a
directory's as if it ended in ``/``), and compares id and count.

Only the trees a valid directory needs are hashed, and only the directories
on the way to one are looked into, each entry's name from where the last
looked ended: the work is linear in the names' bytes. Each name was sliced
anew at every level, and every directory's tree hashed and its path kept:
2,000 names 450 directories deep (a 2 MB index, its root marked invalid)
took ~18 s and ~640 MB.

Not told, so not agreeing (the caller leaves the extension out, and git
makes it again): entries of a merge in progress (stages), intent-to-add
entries or a sparse index's directory entries (git's own rules for those
are not followed here), more than ``MAX_ENTRIES``, more than
``MAX_LEVELS`` directories on the way to the entries in all, a malformed
extension, or one whose nodes' paths total more than ``_MAX_PATHS`` bytes.
"""

from __future__ import annotations

import bisect
import hashlib
import re

from dispatchd.daemon.gitguard.indexfile import Entry

MAX_ENTRIES = 200_000
MAX_LEVELS = 1_000_000  # directories on the way to each entry, summed: the most work (200,000 entries 5 deep)
_MAX_PATHS = 16 * 1024 * 1024  # bytes of the nodes' paths, each its parent's grown: a deep chain's grew as the square
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
    if nodes is None or sum(name.count(b"/") for name, _, _ in files) > MAX_LEVELS or _file_in_the_way(files):
        return False
    root, wanted = _wanted(nodes)
    try:
        _tree(files, 0, root, root.wanted, True, hash_size)
    except RecursionError:  # a path thousands of directories deep on the way to a valid one
        return False
    return all(count < 0 or wanted[path].found == (oid, count) for path, count, oid in nodes)


def _file_in_the_way(files: list[tuple[bytes, int, bytes]]) -> bool:
    """Whether a file's path is a directory's on the way to another entry
    (``a`` and ``a/b``): the tree git would write cannot say both."""
    names = sorted({name for name, _, _ in files})
    for name in names:
        at = bisect.bisect_left(names, name + b"/")
        if at < len(names) and names[at].startswith(name + b"/"):
            return True
    return False


class _Want:
    """A directory path a valid node names (``wanted``), or one on the way
    to one: the components that go on (``below``), and what the entries
    say of it (``found``: its tree's id and count)."""

    __slots__ = ("below", "found", "wanted")

    def __init__(self) -> None:
        self.below: dict[bytes, _Want] = {}
        self.found: tuple[bytes, int] | None = None
        self.wanted = False


def _wanted(nodes: list[tuple[bytes, int, bytes]]) -> tuple[_Want, dict[bytes, _Want]]:
    """The paths of the valid nodes as a tree of components from the root,
    and each such path's place in it."""
    root = _Want()
    places: dict[bytes, _Want] = {}
    for path, count, _ in nodes:
        if count >= 0:
            place = root
            for part in path.split(b"/") if path else ():
                place = place.below.setdefault(part, _Want())
            place.wanted = True
            places[path] = place
    return root, places


def _nodes(ext: bytes, hash_size: int) -> list[tuple[bytes, int, bytes]] | None:
    """Each node of the extension: (its path, its entry count, its id or b"")."""
    found: list[tuple[bytes, int, bytes]] = []
    stack: list[tuple[bytes, int]] = []  # (a node's path, how many of its subtrees are still to come)
    pos = paths = 0
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
            paths += len(path)
            if paths > _MAX_PATHS:
                return None
            found.append((path, count, oid))
            stack.append((path, subtrees))
    except ValueError:
        return None
    return found


def _tree(files: list[tuple[bytes, int, bytes]], cut: int, want: _Want | None, need: bool, empty: bool,
          hash_size: int) -> bytes:
    """The id of the tree holding ``files`` (each path's first ``cut``
    bytes the directory's; ``empty``: its path is b"") when ``need``, else
    b"". ``want``: this directory's place among the valid nodes' paths, None
    when none goes through it; recorded there, with its count of entries,
    when one names it, as its subtrees' are. A subtree neither needed nor
    on the way to a valid one is not looked into."""
    files_here: dict[bytes, tuple[int, bytes]] = {}
    dirs: dict[bytes, list[tuple[bytes, int, bytes]]] = {}
    for entry in files:
        name = entry[0]
        slash = name.find(b"/", cut)  # from the cut on: a name is never sliced whole at each level
        if slash < 0:
            files_here[name[cut:]] = (entry[1], entry[2])
        else:
            dirs.setdefault(name[cut:slash], []).append(entry)
    children = dict(files_here)
    for name, below in dirs.items():
        # A path is its parent's, "/" and its name; below b"", its name alone:
        # a directory named "" there has the path b"" (``_nodes`` builds them alike).
        step = want if empty and not name else want.below.get(name) if want is not None else None
        sub_need = need or step is not None and step.wanted
        if sub_need or step is not None:
            oid = _tree(below, cut + len(name) + 1, step, sub_need, empty and not name, hash_size)
            children[name] = (0o40000, oid)
    if not need:
        return b""
    body = b"".join(b"%o %s\0" % (mode, name) + oid for name, (mode, oid) in
                    sorted(children.items(), key=lambda item: item[0] + b"/" if item[0] in dirs else item[0]))
    obj = b"tree %d\0" % len(body) + body
    oid = (hashlib.sha256(obj) if hash_size == 32 else hashlib.sha1(obj)).digest()
    if want is not None and want.wanted:
        want.found = (oid, len(files))
    return oid
