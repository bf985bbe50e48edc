"""How the history's keep takes an object file, and gives one back.

``clone`` makes ``dst`` a copy of ``src`` at the least cost the file
system allows: a reflink clone (btrfs, XFS), a hard link, a copy (another
file system) within a byte budget. A hard link shares the inode, so the kept
bytes are the repository's: rewritten in place (a session makes the file
writable with ``chmod`` first; neither Landlock nor a path-blind seccomp
filter can refuse that for these files alone), they are gone from both. So:

- a **pack** (``pack/*``) the session holds read-only (each of its files
  bound over itself in the session's mount namespace:
  ``layouts.held_packs``) is hard-linked where there is no reflink: its
  files are large, and the session cannot rewrite them in place. One it
  does not hold (past the bound; degraded mode, no mount namespace) is a
  copy of its own within the budget (``own_unheld`` for one linked
  before), and a pack a session gave a second name is made the
  repository's own again at the end (``packlinks.py``);
- a **loose object** (``own=True``) is never hard-linked while the budget
  lasts: a reflink, else a copy (they are small: the commits not yet
  packed). Past the budget it is linked, as before (``own_loose`` counts
  those). The end finds a loose object rewritten in place by its ctime
  (``replaced.find_rewritten``) and puts the kept bytes back, as a copy
  again: the repository's file and the keep never share an inode.

``own_loose`` makes the loose objects of a keep written before this rule
copies of their own, once (``OWN_MARK`` in the keep says it was done).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from dispatchd.daemon.gitguard import fs, keepdirs, packlinks

COPY_BUDGET = 512 * 1024 * 1024  # bytes copied (not cloned or linked) at one baseline
FICLONE = 0x40049409
OWN_MARK = ".own-loose"  # in a keep: its loose objects are copies of their own

# What FICLONE answers where the file system has no reflinks (ext4: EOPNOTSUPP),
# or the two files are on different ones (EXDEV). Not EINVAL: on btrfs it is
# one file's answer (no checksums: chattr +C), and a session could plant such
# a file first in the batch to have the rest hard-linked (sharing inodes).
_NO_REFLINK = frozenset({errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.ENOSYS})


class Ways:
    """The ways of copying a file one batch of ``clone`` found refused, by
    (source device, destination device): asked once each, not once a
    file. On a file system without reflinks each attempt made the
    destination, asked, then removed it: a repository's first baseline
    (every object file) took 30-40x a plain hard link's time (ext4, 2,042
    files: 1.0-1.3 s against 32 ms)."""

    def __init__(self) -> None:
        self.no_reflink: set[tuple[int, int]] = set()
        self._devices: dict[str, int] = {}

    def between(self, src_dev: int, dst: str) -> tuple[int, int]:
        """(source device, device of ``dst``'s directory), the latter looked up once a directory."""
        folder = os.path.dirname(dst)
        dev = self._devices.get(folder)
        if dev is None:
            dev = self._devices[folder] = os.stat(folder).st_dev
        return src_dev, dev


def git_reads(rel: str) -> bool:
    """Whether git reads ``rel`` (below ``objects``): a loose object's name
    (SHA-1 or SHA-256), or a pack's file (git's ``pack-`` and
    ``multi-pack-index`` names, and any name a pack's files end in). What
    else a session leaves there (a sparse file of gigabytes among it) is not
    kept: the keep would copy it at every record."""
    d, _, name = rel.partition("/")
    if d == "pack":
        return name.endswith(packlinks.PACKISH) or name.startswith(("pack-", "multi-pack-index"))
    return len(name) in (38, 62) and all(c in "0123456789abcdef" for c in name)


def is_loose(rel: str) -> bool:
    """Whether ``rel`` (``ab/cdef...`` or ``pack/...``, below ``objects``) is a loose object's file."""
    return not rel.startswith("pack/")


def clone(src: str, dst: str, budget: list[int], ways: Ways | None = None, *, own: bool = False,
          never_link: bool = False) -> None:
    """``dst`` as a copy of ``src`` (see the module). ``ways``: what this
    batch found refused (one per batch; none: ask). ``own``: not a hard
    link while ``budget`` lasts; ``never_link``: past it, EFBIG. ``src`` is opened without blocking and
    copied through that descriptor: a FIFO a session planted among the
    object files (a blocking open waits for a writer for good, holding its
    domain's lock) is not a regular file, and is left."""
    sfd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(sfd)
        if not stat.S_ISREG(st.st_mode):
            return
        where = ways.between(st.st_dev, dst) if ways is not None else (st.st_dev, 0)
        if ways is None or where not in ways.no_reflink:
            dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
            try:
                try:
                    fcntl.ioctl(dfd, FICLONE, sfd)
                    return
                except OSError as exc:
                    if ways is not None and exc.errno in _NO_REFLINK:
                        ways.no_reflink.add(where)
            finally:
                os.close(dfd)
            os.unlink(dst)
        if never_link or (own and st.st_size <= budget[0]):
            _copy(sfd, st, dst, budget)
            return
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        else:
            # Linked by path: kept only if it is the inode opened and looked at
            # (a session swapping a FIFO in meanwhile would have it in the keep).
            linked = os.stat(dst, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino) != (st.st_dev, st.st_ino):
                os.unlink(dst)
            return
        _copy(sfd, st, dst, budget)
    finally:
        os.close(sfd)


def _copy(sfd: int, st: os.stat_result, dst: str, budget: list[int]) -> None:
    if st.st_size > budget[0]:
        raise OSError(errno.EFBIG, "over the copy budget")
    budget[0] -= st.st_size
    dfd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o444)
    try:
        left = st.st_size
        while left > 0:  # no further: a file that grows meanwhile is kept as it was when looked at
            n = os.sendfile(dfd, sfd, None, min(left, 1 << 30))
            if n == 0:
                break
            left -= n
    except BaseException:
        os.close(dfd)
        os.unlink(dst)
        raise
    os.close(dfd)


def own_loose(keep: str, budget: list[int]) -> int:
    """Once a keep (``OWN_MARK`` absent): each of its loose objects that
    shares its inode (more than one link: a hard link of the repository's)
    replaced by a copy of its own, through a temporary name; returns how
    many are still shared (the budget ran out: ``OWN_MARK`` not written, so
    the next baseline tries again)."""
    if os.path.exists(os.path.join(keep, OWN_MARK)):
        return 0
    shared = 0
    for d in sorted(set(keepdirs.listdir(keep)) & fs.FANOUT):  # modes a session changed set back
        folder = os.path.join(keep, d)
        for name in keepdirs.listdir(folder):
            path = os.path.join(folder, name)
            try:
                if name.startswith("tmp-own-") and name.endswith(".part"):
                    os.unlink(path)  # a killed daemon's copy half made
                    continue
                if name.startswith("tmp") or os.lstat(path).st_nlink <= 1:
                    continue
                # "tmp": a name no listing of the keep takes for an object's (history._files_in).
                tmp = os.path.join(folder, f"tmp-own-{name}.part")
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                clone(path, tmp, budget, own=True)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno != errno.EFBIG:
                    raise
                shared += 1
                continue
            if os.lstat(tmp).st_nlink > 1:  # over the budget: linked after all
                os.unlink(tmp)
                shared += 1
                continue
            os.replace(tmp, path)
    if not shared:
        with open(os.path.join(keep, OWN_MARK), "wb"):
            pass
    return shared


def own_unheld(keep: str, objects: str, held: frozenset[str], budget: list[int]) -> int:
    """Each pack file the keep holds as the repository's own inode (a hard
    link) that the session does not hold read-only: replaced by a copy of its
    own within ``budget``, through a temporary name. Returns how many stay
    linked (past the budget). Two listings: the inodes from the directories."""
    shared = 0
    try:
        keepdirs.listdir(os.path.join(keep, "pack"))  # its mode set back, if a session changed it
        with os.scandir(os.path.join(keep, "pack")) as scan:
            entries = list(scan)
        for e in entries:  # a killed daemon's copy half made
            if e.name.startswith("tmp-own-") and e.name.endswith(".part"):
                os.unlink(e.path)
        # What git reads only (a session's junk beside it is not copied at every join).
        kept = {e.name: e.inode() for e in entries
                if not e.name.startswith("tmp") and e.name.endswith(packlinks.PACKISH)}
        with os.scandir(os.path.join(objects, "pack")) as scan:
            now = {e.name: e.inode() for e in scan}
    except OSError:
        return 0
    for name in sorted(kept.keys() & now.keys()):
        if name in held or kept[name] != now[name]:
            continue
        path = os.path.join(keep, "pack", name)
        tmp = os.path.join(keep, "pack", f"tmp-own-{name}.part")
        try:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            clone(path, tmp, budget, never_link=True)
            os.replace(tmp, path)
        except OSError:
            shared += 1
    return shared
