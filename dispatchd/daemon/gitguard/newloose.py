"""Loose object files a session made at the ids of objects the user had in a
pack: each checked against its name at the domain's last end; one that is
not the object its name says is moved aside.

Git reads an object from the packs before the loose files, so such a file
is not what the user's git shows while the pack is there; but it is what a
reader that looks loose first shows (one of the end's own checks did: a
commit-graph agreeing with a planted commit was kept), what ``git fsck``
fails on ("hash-path mismatch"), and what git reads once a repack leaves
the object loose-only. An honest one (``git gc`` loosens the objects it
finds unreachable, ``git unpack-objects``) holds the object its name says,
and stays. A file at a name the user had loose is ``replaced.py``'s; one at an id an
alternate holds loose is looked at too (git reads a local loose file before
an alternate's).

Bounded: ``MAX_FILES`` files checked at one end, each up to
``replaced._LOOSE_MAX`` inflated, all within ``BUDGET_S`` of reading; past
the count or the time, the rest is reported and left (as ``newpacks`` leaves
a pack it could not verify: ``git fsck`` checks them). A file's header
(``kind size\\0``) is inflated and checked first, and the rest only up to the
size it declares: a stream that inflates to 64 MiB of anything else costs a
few bytes. Each inode is decided once (a file hard-linked at every id is
inflated once, its verdict per name from its digest). Files are opened
without following a symlink or waiting on a FIFO.
"""

from __future__ import annotations

import os
import re

from dispatchd.daemon.gitguard import fs, objectstore, replaced

BUDGET_S = 10.0  # of inflating at one end, all files together
MAX_FILES = 100_000
_NAME = re.compile(r"[0-9a-f]{2}/(?:[0-9a-f]{38}|[0-9a-f]{62})")


def _packed_or_borrowed(oids: list[bytes], keep: str, alternates: list[str]) -> set[bytes]:
    """Which of ``oids`` the user had in a pack (the keep's indexes, an
    alternate's) or loose in an alternate (git reads a local loose file
    before an alternate's): each looked up, no store listed whole."""
    found = objectstore.indexed(keep, oids) if os.path.isdir(os.path.join(keep, "pack")) else set()
    for store in alternates:
        rest = [oid for oid in oids if oid not in found]
        found |= objectstore.indexed(store, rest)
        found |= {oid for oid in rest if os.path.lexists(os.path.join(store, oid.hex()[:2], oid.hex()[2:]))}
    return found


def check(objects: str, keep: str, alternates: list[str], names: list[str],
          look: replaced.Inflating | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """``names`` ("ab/cdef..."): loose files new since the baseline. Returns
    ``(path, why)`` for each moved aside, and what could not be done.
    ``look``: the inflations' deadline and record (``BUDGET_S`` from now
    when None)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    ids = {bytes.fromhex(n[:2] + n[3:]): n for n in names if _NAME.fullmatch(n)}
    if not ids:
        return done, failed  # the usual end: no new loose file, and no store listed
    theirs = sorted(_packed_or_borrowed(list(ids), keep, alternates))
    if len(theirs) > MAX_FILES:
        failed.append(f"{objects}: {len(theirs)} new loose files at ids of your packed objects, past the "
                      f"{MAX_FILES} checked at one end: the rest not looked at (git fsck checks them)")
        theirs = theirs[:MAX_FILES]
    look = look or replaced.Inflating(BUDGET_S)
    for n, oid in enumerate(theirs):
        rel = ids[oid]
        folder = os.path.join(objects, rel[:2])
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                if replaced._valid_loose(fd, rel[3:], oid.hex(), look):
                    continue
            except objectstore.OutOfTime:
                failed.append(f"{objects}: {len(theirs) - n} new loose files at ids of your packed objects not "
                              f"looked at, past the {BUDGET_S:g} s read at one end: left where they are (git fsck "
                              f"checks them)")
                break
            path = os.path.join(objects, rel)
            try:
                moved = fs.move_aside_at(fd, rel[3:])
            except OSError as exc:
                failed.append(f"{path}: not the object its name says, and cannot be moved aside ({exc.strerror})")
                continue
            done.append((path, f"a loose file a session made at the id of one of your packed objects, holding "
                               f"something else (git fsck: hash-path mismatch); moved aside to {moved}"))
        finally:
            os.close(fd)
    return done, failed
