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
sessions left), each pack file (any name git reads: ``*.idx`` and the files
beside it; regular) that has more names than at the baseline (``links``, taken once the keep is up to
date: a pack of a ``git clone --local`` shares its inode with the source's,
and keeps the count it had) is copied to a new inode under its own name
(``unshare``; a temporary name, then a rename over it; one copy an inode,
within one budget: a sparse file linked under many names is not copied
again for each); the keep's hard link to the old inode, if any, is made
one to the new. The other name keeps the old inode, and nothing of the
repository's shares it any more. A session's junk in ``objects/pack`` past
``MAX_FILES`` fails the check rather than hiding a pack.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable

_PACK_FILE = re.compile(r"^pack-[0-9a-f]{40}(?:[0-9a-f]{24})?\.(?:pack|idx|rev|bitmap|mtimes)$")
PACKISH = (".pack", ".idx", ".rev", ".bitmap", ".mtimes")  # what git reads of a pack, whatever its name
MAX_FILES = 4096  # pack files looked at; past it the check fails (a session's junk must not hide one)


def is_pack_file(name: str) -> bool:
    """A name git gives a pack's file (``pack-<id>.<ext>``)."""
    return bool(_PACK_FILE.match(name))


def links(objects: str) -> dict[str, int] | None:
    """Each pack file of ``objects/pack`` (any name git would read: ``*.idx``
    and the files beside it) -> its number of names; None past ``MAX_FILES``."""
    found: dict[str, int] = {}
    try:
        entries = [e for e in os.scandir(os.path.join(objects, "pack")) if e.name.endswith(PACKISH)]
    except OSError:
        return found
    if len(entries) > MAX_FILES:
        return None
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            found[entry.name] = st.st_nlink
    return found


def unshare(objects: str, keep: str, before: dict[str, int],
            copy: Callable[[str, str, list[int]], None], budget: int) -> tuple[list[str], list[str]]:
    """Each pack file with more names than ``before`` gave it (one for a pack
    not there then) given a new inode under its name: a copy (``copy(src,
    dst, budget)``: the history's way, never a hard link; one ``budget`` for
    all), made once an inode, the other names of the repository's sharing it
    linked to that copy; the keep's link moved to it. And a kept pack file
    linked to an inode the repository's file no longer is (a daemon killed
    between the two) linked again. Returns the names unshared, and what
    could not be (with why)."""
    done: list[str] = []
    failed: list[str] = []
    pack = os.path.join(objects, "pack")
    now = links(objects)
    if now is None:
        return done, [f"{pack}: more than {MAX_FILES} pack files; those given another name not looked for"]
    left = [budget]
    copies: dict[tuple[int, int], str] = {}  # an old inode -> its copy's path
    _sweep(pack, "tmp-unshared-")  # a killed daemon's copy half made
    for name, count in sorted(now.items()):
        path = os.path.join(pack, name)
        kept = os.path.join(keep, "pack", name) if keep else ""
        try:
            old = os.lstat(path)
            if count > before.get(name, 1):
                # "tmp-", and no pack's ending: no listing of git's, the keep's or newpacks' takes it for one.
                tmp = os.path.join(pack, f"tmp-unshared-{name}.part")
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                first = copies.get((old.st_dev, old.st_ino))
                if first is None:
                    copy(path, tmp, left)
                    copies[(old.st_dev, old.st_ino)] = path
                else:
                    os.link(first, tmp, follow_symlinks=False)
                os.replace(tmp, path)
                done.append(name)
            if kept and os.path.lexists(kept):
                k, here = os.lstat(kept), os.lstat(path)
                if k.st_nlink > 1 and (k.st_dev, k.st_ino) != (here.st_dev, here.st_ino):
                    os.unlink(kept)  # a link to what is no longer the repository's file
                    os.link(path, kept, follow_symlinks=False)
        except OSError as exc:
            failed.append(f"{path}: more names than at the baseline, and it cannot be given an inode of its own "
                          f"({exc.strerror})")
    return done, failed


def _sweep(directory: str, prefix: str) -> None:
    """Remove the files named ``prefix*.part`` in ``directory`` (ours, left by a killed daemon)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if name.startswith(prefix) and name.endswith(".part"):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


def held_names(read_only: list[str], common: str) -> frozenset[str]:
    """The names of ``common``'s pack files among a layout's read-only paths;
    none where a path cannot be resolved (a loop, a chain of symlinks too
    deep to follow, a session's): the keep then copies them all."""
    try:
        pack = os.path.realpath(os.path.join(common, "objects", "pack"))
        return frozenset(os.path.basename(p) for p in read_only
                         if is_pack_file(os.path.basename(p)) and os.path.realpath(os.path.dirname(p)) == pack)
    except (OSError, RecursionError, ValueError):
        return frozenset()
