"""Pack files a session gave a second name: made the repository's own again.

A pack the repository has at a session's open is bound read-only over
itself (``layouts.held_packs``): its path cannot be written, and a hard link
from it fails (EXDEV: another mount). But a pack a session makes (``git
fetch``, ``git repack``), or one past the bound, can be hard-linked under a
name of the session's (``ln .git/objects/pack/pack-X.pack ../x``): the
repository keeps the pack, the user's history comes to rest in it, and a
later session rewrites it in place through that other name (``chmod u+w
x``), which no bind by path holds and which the history's keep would share.

So at the domain's last end (``history.restore``, with no process of the
sessions left), each of git's pack files (``pack-*``, regular) that has
more names than at the baseline (``links``, taken once the keep is up to
date: a pack of a ``git clone --local`` shares its inode with the source's,
and keeps the count it had) is copied to a new inode under its own name
(``unshare``; a temporary name, then a rename over it); the keep's hard
link to the old inode, if any, is made one to the new. The other name keeps
the old inode, and nothing of the repository's shares it any more.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable

_PACK_FILE = re.compile(r"^pack-[0-9a-f]{40}(?:[0-9a-f]{24})?\.(?:pack|idx|rev|bitmap|mtimes)$")
_MAX_FILES = 4096  # pack files looked at


def is_pack_file(name: str) -> bool:
    """A name git gives a pack's file (``pack-<id>.<ext>``)."""
    return bool(_PACK_FILE.match(name))


def links(objects: str) -> dict[str, int]:
    """Each pack file of ``objects/pack`` -> its number of names."""
    found: dict[str, int] = {}
    try:
        entries = list(os.scandir(os.path.join(objects, "pack")))
    except OSError:
        return found
    for entry in entries[:_MAX_FILES]:
        if is_pack_file(entry.name):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                found[entry.name] = st.st_nlink
    return found


def unshare(objects: str, keep: str, before: dict[str, int],
            copy: Callable[[str, str], None]) -> tuple[list[str], list[str]]:
    """Each pack file with more names than ``before`` gave it (one for a pack
    not there then) copied to a new inode under its name (``copy``: the
    history's way, never a hard link), the keep's link moved to it. Returns
    the names unshared, and what could not be (with why)."""
    done: list[str] = []
    failed: list[str] = []
    pack = os.path.join(objects, "pack")
    for name, count in sorted(links(objects).items()):
        if count <= before.get(name, 1):
            continue
        path = os.path.join(pack, name)
        tmp = os.path.join(pack, f"tmp-unshared-{name}")
        try:
            old = os.lstat(path)
            if os.path.lexists(tmp):
                os.unlink(tmp)
            copy(path, tmp)
            os.replace(tmp, path)
            kept = os.path.join(keep, "pack", name)
            if keep and os.path.lexists(kept) and (os.lstat(kept).st_dev, os.lstat(kept).st_ino) == \
                    (old.st_dev, old.st_ino):
                os.unlink(kept)
                os.link(path, kept, follow_symlinks=False)
            done.append(name)
        except OSError as exc:
            failed.append(f"{path}: a session gave it another name, and it cannot be made the repository's own "
                          f"again ({exc.strerror})")
    return done, failed


def held_names(read_only: list[str], common: str) -> frozenset[str]:
    """The names of ``common``'s pack files among a layout's read-only paths."""
    pack = os.path.realpath(os.path.join(common, "objects", "pack"))
    return frozenset(os.path.basename(p) for p in read_only
                     if is_pack_file(os.path.basename(p)) and os.path.realpath(os.path.dirname(p)) == pack)
