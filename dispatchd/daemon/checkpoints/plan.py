"""Checkpoints, the pure part: what a checkpoint records of each name
(``Entry``), a checkpoint (``Manifest``), which files need a new copy
(``plan_copies``) and what a restore changes (``plan_restore``). No I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from dispatchd.protocol import CheckpointInfo


RACY_NS = 50_000_000  # a file changed this close before a checkpoint began is copied again
_FICLONE = 0x40049409
_POOL = "pool"  # the session's copies, each shared by every checkpoint it is unchanged in
_FANOUT = 4096  # copies per directory of the pool
_FSYNC_EACH = 256  # up to this many files copied or written: an fsync each; more: one syncfs
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OBJECTS = b".git/objects"  # the repository's object files: kept by gitguard's history, not here
_TMP = ".tmp-"

Kind = Literal["f", "d", "l", "p"]


class Entry(msgspec.Struct, frozen=True, array_like=True):
    """One name below the worktree (``path`` relative, ``/``-separated, b"" the
    root), as a checkpoint saw it or as it is now."""

    path: bytes
    kind: Kind  # file, directory, symlink, FIFO
    mode: int = 0  # permission bits
    size: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    dev: int = 0
    ino: int = 0
    target: bytes = b""  # a symlink's
    copy: int = -1  # a file's copy in the session's pool (pool/N//FANOUT/N), -1: none


class Manifest(msgspec.Struct, frozen=True):
    info: CheckpointInfo
    started_ns: int  # when its walk began (for RACY_NS)
    entries: list[Entry]
    objects: list[str] = []  # the repository's object files ("ab/cdef...", "pack/..."), kept by gitguard's history
    keep: str = ""  # where they are kept


_manifest_decoder = msgspec.msgpack.Decoder(Manifest)


# --- pure plans ---------------------------------------------------------------


def _same_file(a: Entry, b: Entry) -> bool:
    return (a.kind == b.kind == "f" and a.dev == b.dev and a.ino == b.ino and a.size == b.size
            and a.mtime_ns == b.mtime_ns and a.ctime_ns == b.ctime_ns)


def plan_copies(now: list[Entry], previous: Manifest | None) -> dict[bytes, int]:
    """For each file of ``now`` unchanged since ``previous``: its copy there
    (to hard-link). The others are cloned or copied from the worktree."""
    if previous is None:
        return {}
    before = {e.path: e for e in previous.entries if e.kind == "f" and e.copy >= 0}
    links: dict[bytes, int] = {}
    for e in now:
        old = before.get(e.path)
        if old is not None and e.kind == "f" and _same_file(e, old) and previous.started_ns - e.ctime_ns >= RACY_NS:
            links[e.path] = old.copy
    return links


@dataclass
class RestorePlan:
    """What a restore does, in order: remove (a directory with what it holds),
    make directories (parents first), write files, links and FIFOs, then set
    directory modes (children first: a read-only one is set last)."""

    remove: list[Entry] = field(default_factory=list)
    make: list[Entry] = field(default_factory=list)
    write: list[Entry] = field(default_factory=list)
    modes: list[Entry] = field(default_factory=list)


def _parent(path: bytes) -> bytes:
    return path.rpartition(b"/")[0]


def plan_restore(saved: list[Entry], now: list[Entry]) -> RestorePlan:
    """From what the checkpoint saw and what is there now. A name whose kind
    changed is removed and made again; a file whose identity changed
    (``_same_file``) is written again; a symlink whose target changed too."""
    plan = RestorePlan()
    want = {e.path: e for e in saved}
    have = {e.path: e for e in now}
    removed: set[bytes] = set()

    def inside_removed(path: bytes) -> bool:
        p = path
        while p:
            if p in removed:
                return True
            p = _parent(p)
        return False

    for e in sorted(now, key=lambda e: e.path):  # parents first
        if e.path == b"" or inside_removed(_parent(e.path)):
            continue  # the root stays; what a removed directory holds goes with it
        w = want.get(e.path)
        if w is None or w.kind != e.kind:
            plan.remove.append(e)
            removed.add(e.path)

    for w in sorted(saved, key=lambda e: e.path):
        h = have.get(w.path)
        fresh = h is None or h.kind != w.kind or inside_removed(w.path)
        if w.kind == "d":
            if fresh and w.path != b"":
                plan.make.append(w)
            if fresh or h is None or h.mode != w.mode:
                plan.modes.append(w)
        elif w.kind == "f":
            if fresh or h is None or not _same_file(h, w) or h.mode != w.mode:
                plan.write.append(w)
        elif w.kind == "l":
            if fresh or h is None or h.target != w.target:
                plan.write.append(w)
        elif fresh or h is None or h.mode != w.mode:
            plan.write.append(w)
    plan.modes.sort(key=lambda e: e.path, reverse=True)
    return plan
