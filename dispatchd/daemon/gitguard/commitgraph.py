"""Whether a commit-graph says of each commit what its object says.

Git trusts ``objects/info/commit-graph`` for a commit's tree and parents
(``git log``, ``git diff``, merge bases): a session's graph that gives a
commit no parents hides the user's history; one that gives it another tree
shows the session's files in ``git diff``. A graph a session's ``git gc``
wrote is an ordinary one, and is kept when ``disagrees`` finds every commit's
tree and parents as its object has them (read through ``objectstore.Store``:
loose or packed, no symlink followed, bounded). Anything else is a reason to
move it aside (``viewfiles``), and git builds it again: a graph of another
hash or a chain of graphs, more than ``MAX_COMMITS`` commits, a read past
``BUDGET_S``, a malformed file.
"""

from __future__ import annotations

import os
import struct
import time

from dispatchd.daemon.gitguard import fs, objectstore

MAX_COMMITS = 50_000
BUDGET_S = 2.0
_NONE = 0x70000000
_EXTRA = 0x80000000
_MAX_BYTES = 64 * 1024 * 1024


def disagrees(objects: str, path: str) -> str | None:
    """None when the graph at ``path`` agrees with ``objects`` on every
    commit; else why it is not kept."""
    try:
        opened = fs.open_regular(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if opened is None:
        return "not a regular file"
    fd, st = opened
    try:
        if st.st_size > _MAX_BYTES:
            return f"over {_MAX_BYTES} bytes"
        data = _read(fd, st.st_size)
    finally:
        os.close(fd)
    try:
        return _check(objects, data)
    except (struct.error, IndexError, ValueError) as exc:
        return f"malformed ({exc})"


def _read(fd: int, size: int) -> bytes:
    chunks, left = [], size
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 24))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _check(objects: str, b: bytes) -> str | None:
    if b[:4] != b"CGPH" or b[4] != 1:
        return "not a commit-graph of version 1"
    if b[5] != 1:
        return "not a SHA-1 graph (not checked)"
    if b[7] != 0:
        return "a graph with base graphs (not checked)"
    chunks = {}
    for i in range(b[6] + 1):
        cid, off = struct.unpack_from(">4sQ", b, 8 + 12 * i)
        chunks[cid] = off
    fanout, oids, cdat = chunks[b"OIDF"], chunks[b"OIDL"], chunks[b"CDAT"]
    edges = chunks.get(b"EDGE")
    n = struct.unpack_from(">I", b, fanout + 255 * 4)[0]
    if n > MAX_COMMITS:
        return f"more than {MAX_COMMITS} commits (not checked)"
    ids = [b[oids + 20 * i: oids + 20 * i + 20] for i in range(n)]
    store = objectstore.Store(objects, deadline=time.monotonic() + BUDGET_S)
    for i, oid in enumerate(ids):
        tree, p1, p2 = struct.unpack_from(">20sII", b, cdat + 36 * i)
        parents = [] if p1 == _NONE else [ids[p1]]
        if p2 & _EXTRA:
            at = p2 & ~_EXTRA
            while True:
                e = struct.unpack_from(">I", b, edges + 4 * at)[0] if edges is not None else _NONE
                parents.append(ids[e & ~_EXTRA])
                if e & _EXTRA:
                    break
                at += 1
        elif p2 != _NONE:
            parents.append(ids[p2])
        try:
            found = store.read(oid)
        except objectstore.OutOfTime:
            return f"more than {BUDGET_S} s to check"
        if found is None or found[0] != 1:
            return f"names {oid.hex()}, which is no commit here"
        lines = found[1].split(b"\n\n", 1)[0].split(b"\n")
        said_tree = bytes.fromhex(lines[0][5:].decode("ascii")) if lines[0].startswith(b"tree ") else b""
        said_parents = [bytes.fromhex(line[7:].decode("ascii")) for line in lines[1:] if line.startswith(b"parent ")]
        if said_tree != tree or said_parents != parents:
            return f"disagrees with the object of commit {oid.hex()} (its tree or parents)"
    return None
