"""Another name of a file in the directories a linked worktree's session is
granted writable: looked for at its open, given an inode of its own at an end.

A linked worktree's session may write the common directory's ``logs``,
``refs`` and ``objects`` and its own ``worktrees/N``. A file there with
another hard link is a way to write its other name: a file of the user's
(the paused rebase's ``git-rebase-todo``, a hook of ``hooks/pre-commit.d``,
the ``.git/index``, a source file) that a session on the main worktree
linked there (full mode: ``.git`` is one mount), or the other repository's
reflog after a ``cp -al``. Git makes no hard link in these directories but
in ``objects``, where ``git clone --local`` links every file; so ``walk``
stats every entry of ``logs``, ``refs`` and the worktrees' own directories,
and in ``objects`` the names not of git's object-store shapes
(``SHAPES``), and of git's only ``info/alternates``, which a local clone
copies: a link at another of git's names cannot be told from a clone's at
an open, and is left to the ends. A fan-out directory is listed, not
stat'ed (256 listings, a few ms), but at an end where it changed since
the baseline; the few files of ``pack``, ``info`` and their chain
directories are stat'ed at every look. At an end a file at git's name
there is judged by its inode's ctime, which a link moves: at or after the
baseline's (``_after``: two ticks of the coarse clock before it, two
seconds for a ctime in whole seconds), it is a link made since; an old
clone's links are left, and a pack's own files (``.pack``, ``.idx``, ...)
too: each session holds them read-only (``layouts.held_packs``), the
history's keep links them after the baseline, and ``packlinks.py`` makes
one given a second name the repository's own.

- a linked open (``hardlinks.open_note``): refused while ``walk`` finds one;
- each end of a part on the repository (``split``): each name found there
  made a file of its own, the same bytes, under git's lock (a reflog's:
  its ref's, ``logs/HEAD``'s ``HEAD.lock``, as git appends under it; a
  packed ref's missing directory made for it, as git would), only
  while the name is still that inode; the other names, wherever they are,
  keep the old one: a link of the user's (``.bashrc`` in their dotfiles
  repository and their home) stays as they made it, and the name a later
  linked session could write reaches nothing else. So the copy of a
  repository made by ``cp -al``, or a link a session left, refuses linked
  opens only until the next end of a session on the main worktree.
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, gitlock, lockfile, ournames, packlinks
from dispatchd.daemon.gitguard.fs import is_dir
from dispatchd.daemon.gitguard.keptfiles import dir_below
from dispatchd.inside import is_below

if TYPE_CHECKING:
    from hashlib import _Hash as Hash

    from dispatchd.daemon.gitguard.hardlinks import Copied

__all__ = ["MAX_SCANNED", "SHAPES", "PastBudget", "Unlooked", "split", "stream", "walk", "worktree_dirs"]

MAX_SCANNED = 200_000  # entries stat'ed at one look (about 3 us each)
try:  # file times follow the coarse clock (1-10 ms a tick): a ctime this far before the baseline's time is after it
    _TICK_NS = max(1_000_000, int(time.clock_getres(5) * 1e9))  # CLOCK_REALTIME_COARSE
except OSError:
    _TICK_NS = 50_000_000
_HEX = r"[0-9a-f]{40}|[0-9a-f]{64}"
# Git's names in ``objects`` (below it, ``/``-separated): never stat'ed.
SHAPES = re.compile(
    rf"[0-9a-f]{{2}}/(?:[0-9a-f]{{38}}|[0-9a-f]{{62}})"
    rf"|pack/pack-(?:{_HEX})\.(?:pack|idx|rev|bitmap|keep|promisor|mtimes)"
    rf"|pack/multi-pack-index(?:-(?:{_HEX})\.(?:bitmap|rev))?"
    rf"|pack/multi-pack-index\.d/(?:multi-pack-index-chain|multi-pack-index-(?:{_HEX})\.(?:midx|bitmap|rev))"
    rf"|info/(?:alternates|http-alternates|packs|commit-graph)"
    rf"|info/commit-graphs/(?:commit-graph-chain|graph-(?:{_HEX})\.graph)")
# Git's names there that ``git clone --local`` copies rather than links (clone.c: ``copy_alternates``).
_NEVER_LINKED = frozenset({"info/alternates"})
_ODD: dict[tuple[int, int], tuple[int, tuple[str, ...]]] = {}  # a fan-out directory -> (its ctime, its odd names)
_ODD_KEPT = 100_000  # directories remembered (a few hundred a repository)
_HEX_DIGITS = "0123456789abcdef"


class Unlooked(Exception):
    """What could not be looked through (past the count, a directory that
    cannot be listed), said."""


class PastBudget(Exception):
    """Past the bytes one part's end copies."""


def walk(common: str, gitdirs: list[str], since_ns: int | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """Each regular file with another hard link in ``common``'s ``logs``,
    ``refs`` and ``objects`` (see the module) and in ``gitdirs`` (the
    worktrees' own), with its ``lstat``; a submodule's objects below one of
    those not looked in. ``since_ns``: an end's (the baseline's time): the
    files at git's names in ``pack`` and ``info``, and the object-named
    files of a fan-out directory changed since, are looked at, those linked
    since (``_after``). Raises ``Unlooked``."""
    count = [0]
    pending = [p for p in [os.path.join(common, d) for d in ("logs", "refs")] + gitdirs if is_dir(p)]
    for top, rel, st in _objects(os.path.join(common, "objects"), since_ns, count):
        if rel.endswith("/"):
            pending.append(top)
        elif _linked(st):
            yield top, st
    while pending:
        top = pending.pop()
        for entry in _list(top, count, common):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                if not (entry.name == "objects" and any(is_below(top, os.path.join(g, "modules")) for g in gitdirs)
                        and os.path.lexists(f"{top}/HEAD")):
                    pending.append(entry.path)
            elif _linked(st):
                yield entry.path, st


def _linked(st: os.stat_result) -> bool:
    """A regular file of other names, not a lock of ours and its temporary's
    name (``ournames``: while an end holds a ref's lock, or a killed one
    left it, for the start's sweep to remove)."""
    return stat.S_ISREG(st.st_mode) and st.st_nlink > 1 and not ournames.known(st)


def _list(top: str, count: list[int], common: str, charged: bool = True) -> list[os.DirEntry[str]]:
    try:
        entries = list(os.scandir(top))
    except FileNotFoundError:
        return []
    except OSError as exc:  # a session's chmod 000: it can give itself the mode back and write through
        raise Unlooked(f"{top} cannot be looked through for hard links ({exc.strerror})") from None
    if charged:
        count[0] += len(entries)
        if count[0] > MAX_SCANNED:
            raise Unlooked(f"{common}: more than {MAX_SCANNED} files in its refs, logs and objects to look at for "
                           f"hard links, {len(entries)} of them in {top} (`git pack-refs --all` packs the refs; "
                           "a reflog or a file git does not use can be removed)")
    return entries


def _objects(objects: str, since_ns: int | None, count: list[int]) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(path, rel, lstat)`` of each name in ``objects`` to judge: not of
    git's shapes, or a file at git's name linked since ``since_ns`` (see
    ``_clone_may_link``); a
    directory of no shape of git's as ``(path, "rel/", its lstat)``, for
    the caller to walk whole."""
    if not is_dir(objects):
        return
    fine = _fine_ctime(objects)
    pending = [("", objects)]
    while pending:
        rel_dir, top = pending.pop()
        changed = False
        fan = rel_dir in fs.FANOUT
        if fan:
            try:
                st = os.lstat(top)
            except OSError:
                continue
            changed = since_ns is not None and _after(st.st_ctime_ns, since_ns)
            if not changed and st.st_nlink == 2:  # no directory in it (ext4, xfs, tmpfs count them): names alone
                for name in _odd_names(top, st, fine):
                    yield from _judged(os.path.join(top, name), f"{rel_dir}/{name}", since_ns, count, top)
                continue
        for entry in _list(top, count, objects, charged=False):
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            if (fan and not changed and SHAPES.fullmatch(rel)
                    and not entry.is_dir(follow_symlinks=False)):  # d_type, no stat: pack and info stat'ed whole
                continue
            if not rel_dir and entry.name in fs.FANOUT or rel in ("pack", "info", "pack/multi-pack-index.d",
                                                                         "info/commit-graphs"):
                if entry.is_dir(follow_symlinks=False):
                    pending.append((rel, entry.path))
                    continue
            yield from _judged(entry.path, rel, since_ns, count, top)


def _fine_ctime(path: str) -> bool:
    """Whether ``path``'s file system sets a directory's ctime at each change of its entries (treewalk's rule)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        return treewalk.fine_local_ctime(fd, os.fstat(fd).st_dev)
    finally:
        os.close(fd)


def _odd_names(top: str, st: os.stat_result, fine: bool) -> tuple[str, ...]:
    """The names of fan-out directory ``top`` (``st``, its lstat) not of an
    object's shape; its listing reused while its ctime is the one it was
    listed with, and was settled then: every change of its entries sets its
    ctime (``fine``), so the names are those listed (a close of a repository
    of 256 fan-out directories spared their listings: some ms)."""
    key = (st.st_dev, st.st_ino)
    seen = _ODD.get(key)
    if fine and seen is not None and seen[0] == st.st_ctime_ns:
        return seen[1]
    began = time.time_ns()
    odd = tuple(n for n in _names(top) if len(n) not in (38, 62) or n.strip(_HEX_DIGITS))
    if fine and treewalk.settled(st.st_ctime_ns, began, _TICK_NS):
        if len(_ODD) >= _ODD_KEPT:
            _ODD.clear()
        _ODD[key] = (st.st_ctime_ns, odd)
    return odd


def _names(top: str) -> list[str]:
    try:
        return os.listdir(top)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise Unlooked(f"{top} cannot be looked through for hard links ({exc.strerror})") from None


def _judged(path: str, rel: str, since_ns: int | None, count: list[int],
            top: str) -> Iterator[tuple[str, str, os.stat_result]]:
    """``path`` (``rel`` in ``objects``, listed in ``top``) stat'ed and
    yielded as ``_objects`` says, charged to ``count``."""
    count[0] += 1
    if count[0] > MAX_SCANNED:
        raise Unlooked(f"{os.path.dirname(os.path.dirname(path))}: more than {MAX_SCANNED} files not of git's "
                       f"names to look at for hard links, in {top} among others")
    try:
        st = os.lstat(path)
    except OSError:
        return
    if SHAPES.fullmatch(rel) and stat.S_ISREG(st.st_mode) and _clone_may_link(rel, st, since_ns):
        return
    yield path, rel + ("/" if stat.S_ISDIR(st.st_mode) else ""), st


def _clone_may_link(rel: str, st: os.stat_result, since_ns: int | None) -> bool:
    """Whether the regular file at git's name ``rel`` in ``objects`` is left
    unjudged: at an open, any but ``_NEVER_LINKED`` (``git clone --local``
    links every other file there); at an end, one linked before the
    baseline (a local clone's), and a pack file git reads, which each
    session holds read-only and the history's keep links (``packlinks.py``
    makes one given a second name the repository's own)."""
    if rel in _NEVER_LINKED:
        return False
    if since_ns is None:
        return True
    if rel.startswith("pack/") and packlinks.is_pack_file(rel[5:]):
        return True
    return not _after(st.st_ctime_ns, since_ns)


def _after(ctime_ns: int, since_ns: int) -> bool:
    """Whether an inode's ctime may be at or after ``since_ns`` (a
    baseline's time, read off the fine clock): file times follow the coarse
    one, a tick or two behind (``_TICK_NS``), and a file system keeping
    whole seconds sets the second's start (``treewalk.settled``'s rule)."""
    return not treewalk.settled(ctime_ns, since_ns, 2 * _TICK_NS)


def worktree_dirs(common: str) -> list[str]:
    """The linked worktrees' own git directories of ``common`` (``worktrees/N``)."""
    top = os.path.join(common, "worktrees")
    try:
        return [e.path for e in os.scandir(top) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []


def split(common: str, gitdirs: list[str], since_ns: int,
          copied: Copied) -> tuple[list[tuple[str, str]], list[str]]:
    """Each name ``walk`` finds made a file of its own (see the module):
    what was done, with why, and what could not be. ``since_ns``: the
    baseline's time (0, an older record's: no object-named file looked at)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    deadline = time.monotonic() + gitlock.WAIT_S
    try:
        found = list(walk(common, gitdirs, since_ns or None))
    except Unlooked as exc:
        return done, [f"{exc}: its other names not made files of their own"]
    for path, st in found:
        said = (f"had {st.st_nlink - 1} other hard link(s), a name a linked worktree's session could write them "
                "through")
        try:
            with _ReflogLock(common, gitdirs, path, max(0.0, deadline - time.monotonic())):
                if _own(common, path, st, copied, max(0.0, deadline - time.monotonic())):
                    done.append((path, f"{said}; made a file of its own (the other names keep the old one)"))
        except PastBudget:
            failed.append(f"{path}: {said}; not made a file of its own: past the {copied.limit >> 20} MiB copied at "
                          "one end")
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                failed.append(f"{path}: {said}; not made a file of its own ({exc.strerror or exc})")
    return done, failed


class _ReflogLock:
    """Git's lock of the ref whose reflog ``path`` is (``B/logs/REL``:
    ``B/REL.lock``, ``B`` the common directory or a worktree's own), held
    for the block; none for a file of no reflog. A packed ref's directory
    may be gone (``git pack-refs --all`` prunes it) while its reflog stays:
    the directories missing below ``B/refs`` are made first, one at a time
    below a descriptor with no symlink followed, as git makes them to lock
    the ref, and those still empty removed after."""

    def __init__(self, common: str, gitdirs: list[str], path: str, wait_s: float) -> None:
        self.held: lockfile.Held | None = None
        self.made: list[tuple[int, str]] = []  # (its parent's descriptor, name): the directories made here
        self.common = common
        for base in [common, *gitdirs]:
            logs = os.path.join(base, "logs")
            if is_below(path, logs) and path != logs:
                self.base = base
                self.ref = os.path.join(base, os.path.relpath(path, logs))
                self.wait_s = wait_s
                return
        self.ref = ""

    def __enter__(self) -> None:
        if not self.ref:
            return
        dir_fd = _below(self.common, os.path.dirname(self.ref))
        if dir_fd is None:
            dir_fd = self._made()
        if dir_fd is None:
            return
        try:
            self.held = lockfile.take_in(dir_fd, os.path.basename(self.ref), lockfile.Policy(self.wait_s))
        except BaseException as exc:  # take_in closed dir_fd
            self._unmade()
            if isinstance(exc, lockfile.Refused):
                raise lockfile.Refused(f"{self.ref}.lock") from None
            raise

    def __exit__(self, *_: object) -> None:
        if self.held is not None:
            self.held.release()
        self._unmade()

    def _made(self) -> int | None:
        """A descriptor of the ref's directory, those missing of it below
        ``B/refs`` made; None for a ref not below it, or where one on the
        way is not a directory (a symlink included) or cannot be made."""
        rel = os.path.relpath(os.path.dirname(self.ref), self.base)
        if not rel.startswith("refs/"):
            return None
        fd = _below(self.common, os.path.join(self.base, "refs"))
        for name in rel.split("/")[1:]:
            if fd is None:
                return None
            try:
                os.mkdir(name, 0o777, dir_fd=fd)  # less the umask, as git's
                self.made.append((os.dup(fd), name))
            except FileExistsError:
                pass  # there (git made it meanwhile), or not a directory: the open below says
            except OSError:
                os.close(fd)
                return None
            parent, fd = fd, _opened_below(fd, name)
            os.close(parent)
        return fd

    def _unmade(self) -> None:
        """The directories ``_made`` made removed, the deepest first, while empty (a ref git added stays)."""
        while self.made:
            fd, name = self.made.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                pass
            finally:
                os.close(fd)


def _opened_below(fd: int, name: str) -> int | None:
    try:
        return os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
    except OSError:
        return None


def _below(common: str, directory: str) -> int | None:
    """A descriptor of ``directory`` (inside ``common``) reached from ``common`` with no symlink on the way."""
    rel = os.path.relpath(directory, common)
    return dir_below(common, "" if rel == "." else rel)


def _own(common: str, path: str, st: os.stat_result, copied: Copied, wait_s: float) -> bool:
    """``path`` made a file of its own while it is still ``st``'s inode:
    its bytes copied (charged to ``copied``) under its own ``.lock``."""
    fd = _below(common, os.path.dirname(path))  # no symlink a session swapped in since the walk
    if fd is None:
        return False
    try:
        opened = fs.open_regular(os.path.basename(path), fd)
        if opened is None:
            return False
        src, now = opened
        try:
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or now.st_nlink < 2:
                return False

            return gitlock.replace(fd, os.path.basename(path), b"", stat.S_IMODE(now.st_mode),
                                   inode=(now.st_dev, now.st_ino), wait_s=wait_s,
                                   fill=lambda out: stream(src, out, copied)) is not None
        finally:
            os.close(src)
    finally:
        os.close(fd)


def stream(src: int, out: int, copied: Copied, h: Hash | None = None) -> None:
    """``src``'s bytes written into ``out``, charged to ``copied`` (``PastBudget``
    past it), and fed to ``h`` where one is given."""
    while chunk := os.read(src, 1 << 20):
        if len(chunk) > copied.left:
            raise PastBudget()
        copied.left -= len(chunk)
        if h is not None:
            h.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(out, view):]
