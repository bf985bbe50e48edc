"""Which object files that a session's end finds gone git itself packed
meanwhile (``git gc``, ``git repack``, the ``gc --auto`` after a commit):
told by the pack indexes there now, for the end's report only.

Guarantees:
- nothing here decides what is put back: ``history.restore`` puts back
  every kept object file that is gone, these included (an index can name an
  object its pack does not hold, and a pack can be one git cannot read:
  only the old file makes sure nothing is lost); these are only not
  reported as deleted by a session;
- the indexes are read as ``objectstore`` reads them (bounded, no symlink
  followed, no FIFO waited on); an old pack is looked up from the keep's
  copy of its index, up to ``_PACKED_MAX`` objects (past it, reported).
"""

from __future__ import annotations

import os
import re

from dispatchd.daemon.gitguard import objectstore

_LOOSE = re.compile(r"^[0-9a-f]{2}/(?:[0-9a-f]{38}|[0-9a-f]{62})$")  # a loose object file (SHA-1, SHA-256), as kept
_PACK_FILE = re.compile(r"^pack/(pack-[0-9a-f]{40,64})\.[a-z]+$")  # a pack and its .idx, .rev, .bitmap...
_PACKED_MAX = 500_000  # objects of one gone pack looked up in the packs there now; past it, reported


def packed_meanwhile(objects: str, gone: list[str], keep: str = "") -> set[str]:
    """The object files of ``gone`` whose objects a pack index of
    ``objects`` names now (``objectstore.indexed``): a loose object, or
    every file of a pack (``keep``'s copy of its index lists its objects).
    Git packed them while the session ran (``git gc``, the ``gc --auto``
    after a commit, ``git repack``) and removed the old files. They are put
    back all the same (an index can name an object its pack does not hold,
    and a pack can be one git cannot read: only the old file makes sure
    nothing is lost; git's next ``gc`` removes it), but not reported as
    deleted by a session."""
    loose = {rel: bytes.fromhex(rel[:2] + rel[3:]) for rel in gone if _LOOSE.match(rel)}
    stems: dict[str, list[str]] = {}
    for rel in gone:
        m = _PACK_FILE.match(rel)
        if m:
            stems.setdefault(m.group(1), []).append(rel)
    wanted = list(loose.values())
    in_packs: dict[str, list[bytes]] = {}
    for stem in stems:
        names = objectstore.names_in_index(os.path.join(keep, "pack"), stem + ".idx", _PACKED_MAX) if keep else None
        if names is not None:
            in_packs[stem] = names
            wanted += names
    # What git derives from packs and writes again at will (a multi-pack
    # index, its bitmap and reverse index): not the user's objects.
    derived = {rel for rel in gone if rel.startswith("pack/multi-pack-index")}
    if not wanted:
        return derived
    named = objectstore.indexed(objects, wanted)
    found = derived | {rel for rel, oid in loose.items() if oid in named}
    for stem, names in in_packs.items():
        if all(oid in named for oid in names):
            found.update(stems[stem])
    return found
