"""Whether a commit-graph says of each commit what its object says.

Git trusts ``objects/info/commit-graph`` for a commit's tree and parents
(``git log``, ``git diff``, merge bases): a session's graph that gives a
commit no parents hides the user's history; one that gives it another tree
shows the session's files in ``git diff``. A graph a session's ``git gc``
wrote is an ordinary one, and is kept when ``disagrees`` finds every commit's
tree and parents as its object has them (read through ``objectstore.Store``:
loose or packed, no symlink followed, bounded), read as git reads them (a
first parent "none" is no parents, whatever the second says), and each
commit's topological level, date and corrected date (``GDA2``/``GDAT``,
``GDOV``: what ``merge-base`` and ``--contains`` trust) as computed from
those. Anything else is a reason to move it aside (``viewfiles``), and git
builds it again: a graph whose hash is neither SHA-1 nor SHA-256, a chain of graphs, changed-path
filters (``BIDX``/``BDAT``: checking them is a diff a commit), a chunk named
twice or out of the file, more than ``MAX_COMMITS`` commits, a read past
``BUDGET_S``, a malformed file, any error while checking.
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
    commit; else why it is not kept. Never raises."""
    try:
        opened = fs.open_regular(path)
        if opened is None:
            return "not a regular file"
        fd, st = opened
        try:
            if st.st_size > _MAX_BYTES:
                return f"over {_MAX_BYTES} bytes"
            data = fs.read_all(fd, st.st_size)
        finally:
            os.close(fd)
        return _check(objects, data)
    except Exception as exc:  # noqa: BLE001 - a graph that cannot be checked is not kept
        return f"cannot be checked ({type(exc).__name__}: {exc})"


def _chunks(b: bytes) -> dict[bytes, int] | str:
    """The chunk table: id -> offset; or why it is refused."""
    table: dict[bytes, int] = {}
    last = 0
    for i in range(b[6] + 1):
        cid, off = struct.unpack_from(">4sQ", b, 8 + 12 * i)
        if off < last or off > len(b):
            return "a chunk out of order or out of the file"
        last = off
        if i == b[6]:
            break
        if cid in table:
            return f"chunk {cid!r} named twice"
        table[cid] = off
    if b"BIDX" in table or b"BDAT" in table:
        return "changed-path filters (not checked)"
    return table


def _check(objects: str, b: bytes) -> str | None:
    if b[:4] != b"CGPH" or b[4] != 1:
        return "not a commit-graph of version 1"
    h = {1: 20, 2: 32}.get(b[5])  # git's hash versions: SHA-1, SHA-256
    if h is None:
        return f"a graph of hash version {b[5]} (not checked)"
    if b[7] != 0:
        return "a graph with base graphs (not checked)"
    chunks = _chunks(b)
    if isinstance(chunks, str):
        return chunks
    fanout, oids, cdat = chunks[b"OIDF"], chunks[b"OIDL"], chunks[b"CDAT"]
    n = struct.unpack_from(">I", b, fanout + 255 * 4)[0]
    if n > MAX_COMMITS:
        return f"more than {MAX_COMMITS} commits (not checked)"
    ids = [b[oids + h * i: oids + h * i + h] for i in range(n)]
    store = objectstore.Store(objects, deadline=time.monotonic() + BUDGET_S)
    parents: list[list[int]] = []
    dates: list[int] = []
    for i, oid in enumerate(ids):
        tree, p1, p2 = struct.unpack_from(f">{h}sII", b, cdat + (h + 16) * i)
        mine = [] if p1 == _NONE else [p1] + _more(b, chunks.get(b"EDGE"), p2)  # as git reads them
        try:
            found = store.read(oid)
        except objectstore.OutOfTime:
            return f"more than {BUDGET_S} s to check"
        if found is None or found[0] != 1:
            return f"names {oid.hex()}, which is no commit here"
        header = found[1].split(b"\n\n", 1)[0].split(b"\n")
        said_tree = bytes.fromhex(header[0][5:].decode("ascii")) if header[0].startswith(b"tree ") else b""
        said_parents = [bytes.fromhex(line[7:].decode("ascii")) for line in header if line.startswith(b"parent ")]
        if said_tree != tree or said_parents != [ids[p] for p in mine]:
            return f"disagrees with the object of commit {oid.hex()} (its tree or parents)"
        committer = next((line for line in header if line.startswith(b"committer ")), b"")
        dates.append(int(committer.rsplit(b" ", 2)[-2]) if committer.count(b" ") >= 2 else 0)
        parents.append(mine)
    return _generations(b, chunks, parents, dates, h)


def _more(b: bytes, edges: int | None, p2: int) -> list[int]:
    """The parents after the first: none, the second, or an octopus's list."""
    if p2 == _NONE:
        return []
    if not p2 & _EXTRA:
        return [p2]
    if edges is None:
        raise ValueError("an edge list with no EDGE chunk")
    found, at = [], p2 & ~_EXTRA
    while True:
        e = struct.unpack_from(">I", b, edges + 4 * at)[0]
        found.append(e & ~_EXTRA)
        if e & _EXTRA or len(found) > MAX_COMMITS:
            return found
        at += 1


def _generations(b: bytes, chunks: dict[bytes, int], parents: list[list[int]], dates: list[int],
                 h: int) -> str | None:
    """Whether each commit's level, date and corrected date are those its
    parents give it (walked parents first, without recursion)."""
    n = len(parents)
    level, corrected, state = [0] * n, [0] * n, [0] * n
    for start in range(n):
        stack = [start]
        while stack:
            c = stack[-1]
            if state[c] == 2:
                stack.pop()
            elif state[c] == 0:
                state[c] = 1
                for p in parents[c]:
                    if state[p] == 1:
                        return "a commit its own ancestor"
                    if state[p] == 0:
                        stack.append(p)
            else:
                stack.pop()
                state[c] = 2
                level[c] = 1 + max((level[p] for p in parents[c]), default=0)
                corrected[c] = max([dates[c]] + [corrected[p] + 1 for p in parents[c]])
    gda = chunks.get(b"GDA2", chunks.get(b"GDAT"))
    for c in range(n):
        word = struct.unpack_from(">Q", b, chunks[b"CDAT"] + (h + 16) * c + h + 8)[0]
        if word >> 34 != min(level[c], 0x3FFFFFFF) or word & ((1 << 34) - 1) != dates[c] & ((1 << 34) - 1):
            return f"a commit's level or date (entry {c}) is not what its parents give"
        if gda is not None:
            offset = struct.unpack_from(">I", b, gda + 4 * c)[0]
            if offset & _EXTRA:
                offset = struct.unpack_from(">Q", b, chunks[b"GDOV"] + 8 * (offset & ~_EXTRA))[0]
            if dates[c] + offset != corrected[c]:
                return f"a commit's corrected date (entry {c}) is not what its parents give"
    return None
