"""Packs a session made that name the user's objects: each of those objects
read from the new pack and hashed, at the domain's last end.

Git looks an object up in the packs before the loose objects, and in the
newest pack first, so a pack a session writes whose index names one of the
user's object ids at bytes of the session's own has the user's ``git
show`` and ``git checkout`` read the session's bytes for that id (only
``git fsck`` tells). The keep holds the user's objects, but nothing was
missing, so nothing was put back. Honest new packs name the user's objects
too (a session's ``git gc``, ``git repack``, a fetch of what the user has),
so a pack is not refused for naming them: each object it names that the
user had (in the keep: its packs' indexes, its loose names) is read from
the new pack as git would (deltas applied: ``objectstore``) and hashed
against its id. A pack with one that does not hash to its id, or cannot be
read, has its files moved aside (its index first: git reads a pack through
its ``.idx``; a name ending otherwise is no pack to git), reported.

Bounded: ``BUDGET_S`` of reading and ``MAX_OBJECTS`` objects at one end;
past either, the packs not yet verified are reported as such (``git fsck``
checks them), not refused: a session's ``git gc`` on a large repository
would otherwise fail every end. Only packs whose index is not in the keep
(new since the baseline) are read. SHA-1 repositories only (a SHA-256
one's packs are reported not verified).
"""

from __future__ import annotations

import hashlib
import os
import struct
import time

from dispatchd.daemon.gitguard import fs, objectstore

BUDGET_S = 2.0
MAX_OBJECTS = 200_000  # the user's objects read at one end
_MAX_NAMES = 10_000_000  # names of one new index looked up (200 MiB of index)
_KINDS = {1: b"commit", 2: b"tree", 3: b"blob", 4: b"tag"}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check(objects: str, keep: str) -> tuple[list[tuple[str, str]], list[str]]:
    """Verify the new packs of ``objects`` against the keep (see the module):
    ``(path, why)`` for each pack moved aside or left not verified, and what
    could not be done."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    pack_dir = os.path.join(objects, "pack")
    try:
        kept = set(os.listdir(os.path.join(keep, "pack")))
    except OSError:
        kept = set()
    try:
        # Every index, whatever its name: git reads any ``*.idx`` there as a pack's (``evil.idx``, ``evil.pack``).
        new = sorted(n for n in os.listdir(pack_dir) if n.endswith(".idx") and n not in kept)
    except OSError:
        return done, failed
    if not new:
        return done, failed
    loose = _kept_loose(keep)
    deadline = time.monotonic() + BUDGET_S
    store = objectstore.Store(objects, deadline=deadline)
    left = [MAX_OBJECTS]
    for idx in new:
        path = os.path.join(pack_dir, idx[:-4] + ".pack")
        verdict = _verify(pack_dir, idx, keep, loose, store, left)
        if verdict == "forged":
            moved, bad = _aside(pack_dir, idx[:-4])
            failed += bad
            done.append((path, "a pack a session made names your objects for other bytes (git would have read "
                               f"them in place of yours); moved aside: {', '.join(moved)}"))
        elif verdict:
            done.append((path, f"a pack a session made, naming your objects, not verified ({verdict}): "
                               "git fsck checks it"))
    return done, failed


def _kept_loose(keep: str) -> set[bytes]:
    found: set[bytes] = set()
    try:
        dirs = [d for d in os.listdir(keep) if len(d) == 2 and not d.strip("0123456789abcdef")]
    except OSError:
        return found
    for d in dirs:
        try:
            names = os.listdir(os.path.join(keep, d))
        except OSError:
            continue
        for n in names:
            if len(n) == 38:
                try:
                    found.add(bytes.fromhex(d + n))
                except ValueError:
                    continue
    return found


def _verify(pack_dir: str, idx: str, keep: str, loose: set[bytes], store: objectstore.Store,
            left: list[int]) -> str:
    """"" (every object of the user's it names hashes right), "forged", or
    why it was not verified."""
    names = objectstore.names_in_index(pack_dir, idx, _MAX_NAMES)
    if names is None:
        return "its index is not one of version 2 with SHA-1 ids, or names too many objects"
    users = sorted((objectstore.indexed(keep, names) if os.path.isdir(os.path.join(keep, "pack")) else set())
                   | (loose & set(names)))
    if not users:
        return ""
    if len(users) > left[0]:
        return f"it names {len(users)} of your objects, past the {MAX_OBJECTS} read at one end"
    left[0] -= len(users)
    try:
        fd = os.open(pack_dir, _DIR)
    except OSError as exc:
        return f"its directory cannot be opened: {exc.strerror}"
    try:
        pack = objectstore._Pack(fd, idx, idx[:-4] + ".pack")
    except (OSError, ValueError, struct.error):
        return "forged"  # an index naming your objects over a pack that cannot be read
    finally:
        os.close(fd)
    try:
        for oid in users:
            off = pack.offset(oid)
            if off is None:
                return "forged"
            kind, body = pack.read(off, store)
            name = _KINDS.get(kind)
            if name is None or hashlib.sha1(name + b" %d\0" % len(body) + body).digest() != oid:
                return "forged"
    except objectstore.OutOfTime:
        return f"past the {BUDGET_S:g} s read at one end"
    except (ValueError, IndexError, struct.error, OSError, MemoryError):
        return "forged"  # git could not read it either: nothing of yours is to be read there
    finally:
        pack.data.close()
    return ""


def _aside(pack_dir: str, stem: str) -> tuple[list[str], list[str]]:
    moved: list[str] = []
    failed: list[str] = []
    for ext in (".idx", ".pack", ".rev", ".bitmap", ".mtimes", ".keep", ".promisor"):
        path = os.path.join(pack_dir, stem + ext)
        if os.path.lexists(path):
            try:
                moved.append(os.path.basename(fs.move_aside(path)))
            except OSError as exc:
                failed.append(f"{path}: a forged pack that cannot be moved aside ({exc.strerror})")
    return moved, failed
