"""What the files restores replaced (``preimages``) cost on disk, and the
one budget all of them are kept within.

A restore keeps what it replaces for 7 days, by time alone (``preimages``):
nothing a session does pushes the user's file out. Time alone bounds
nothing, though: a session (or a harness that restores between attempts)
that writes a large file and restores, again and again, would fill the disk
with files nobody sees. So the kept ones, of every session of every daemon
on the state directory, share one budget, and a restore whose files would
take them over it keeps nothing and is refused (unless forced).

Guarantees:
- **Counted as the file system charges them**: every inode below
  ``STATE/before-restore`` (files, directories, symlinks, ``about.json``)
  once, by device and inode, at its allocated size (``st_blocks`` x 512), so
  a sparse file costs what it holds, and two kept ones that link the same
  copy (a file unchanged between two restores of a session) count it once.
  A file that is a hard link to a checkpoint's copy costs nothing more while
  the checkpoint lives, and is counted in full all the same: that is what it
  costs once the session's checkpoints go, at its end, and a budget that
  grew when a session ended would be no bound. Reflink clones are counted in
  full too (their shared extents are not told apart): the count errs high,
  never low.
- **The budget** (``limit``): the lower of ``DEFAULT_BYTES`` (8 GiB) and a
  quarter of the space free on the state directory's file system, looked at
  each time a restore keeps files. So as each is kept, what is still free
  is at least four times what they all hold: they are never what fills the
  disk (their own size is used space already, never counted as free).
- **Never evicts.** Over the budget the new one is refused; what is kept
  stays until it expires or the user removes it by hand. No request frees
  it, so no session can make room by pushing the user's files out.
- **One check at a time**: measuring, comparing and the rename into place
  hold a lock of this daemon and an ``flock`` of the directory (another
  daemon on the state directory takes it too), so two restores at once do
  not both fit in the last room.
- **Cheap.** A kept one never changes once renamed into place, so it is
  measured once and remembered by name, with the linked files it names;
  each look lists the directory and measures the names new to this daemon
  (another daemon's). A name gone (expired, removed by hand) is subtracted:
  what it alone named, and each linked file no other kept one names.
  ``admitting`` gives the total it admitted (the restore's reply), so a
  restore looks once.
- **An expired one never refuses a restore**: over the budget, the
  caller's ``make_room`` (``preimages.Sweeps.now``: the expired ones go)
  runs and the total is looked at again before a refusal.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import stat
import threading
from collections.abc import Callable, Iterator

from dispatchd import treewalk
from dispatchd.protocol import BeforeRestoreReport

from dispatchd.daemon.checkpoints.reading import Refused

DEFAULT_BYTES = 8 << 30
DEFAULT_INODES = 1_000_000  # files, directories and links kept, at most (empty files cost no block)
FREE_SHARE = 4  # a quarter of the free space, at most; and of the free inodes
_TMP = ".tmp-"  # preimages' half-made ones: not kept yet
_BLOCK = 512  # st_blocks counts 512-byte units, whatever the file system's block


def amount(n: int) -> str:
    """``176160768`` → ``176160768 bytes (168 MiB)``: exact, and readable when large."""
    if n < 1 << 20:
        return f"{n} bytes"
    value, unit = (n / (1 << 30), "GiB") if n >= 1 << 30 else (n / (1 << 20), "MiB")
    text = f"{value:.1f}".removesuffix(".0")
    return f"{n} bytes ({text} {unit})"


def limit(fixed: int, free: int, fixed_why: str = "dispatchd's fixed bound") -> tuple[int, str]:
    """The budget of all the kept files together, and which bound gave it:
    ``fixed``, or a quarter of ``free`` (bytes free on their file system)."""
    share = free // FREE_SHARE
    if fixed <= share:
        return fixed, fixed_why
    return share, f"a quarter of the {free} bytes free on its file system"


def inode_limit(fixed: int, free: int, total: int) -> tuple[int, str]:
    """The inodes all the kept ones may take together, and which bound gave
    it: ``fixed``, or a quarter of ``free`` (inodes free on their file
    system; ``total`` 0: one that counts none, btrfs: ``fixed`` alone)."""
    share = free // FREE_SHARE
    if not total or fixed <= share:
        return fixed, "dispatchd's fixed bound"
    return share, f"a quarter of the {free} inodes free on its file system"


def measure(path: str) -> tuple[int, dict[tuple[int, int], int], int]:
    """What the tree at ``path`` holds on disk: the bytes of the inodes only
    it names (one link; directories), by (device, inode) those of the
    files linked elsewhere too (a checkpoint's copy, another kept one), and
    how many inodes only it names."""
    own = inodes = 0
    linked: dict[tuple[int, int], int] = {}
    # No bound in entries nor depth (a policy may let a checkpoint be deeper than
    # treewalk's default): a level left out would count low.
    for _, names, dfd in treewalk.walk(path, treewalk.Budget(max_entries=1 << 62, max_depth=1 << 30)):
        own += os.fstat(dfd).st_blocks * _BLOCK
        inodes += 1
        for name in names:
            try:
                st = os.lstat(name, dir_fd=dfd)
            except FileNotFoundError:
                continue
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                linked[(st.st_dev, st.st_ino)] = st.st_blocks * _BLOCK
            elif not stat.S_ISDIR(st.st_mode):  # a directory: counted as walked
                own += st.st_blocks * _BLOCK
                inodes += 1
    return own, linked, inodes


class KeptSizes:
    """The kept files' total, remembered per kept one, and their budget."""

    def __init__(self, path: str) -> None:
        self.path = path  # STATE/before-restore
        self.fixed = DEFAULT_BYTES
        self.fixed_why = "dispatchd's fixed bound"  # or the testing option that set it (cli.py)
        self._lock = threading.Lock()
        self._own: dict[str, int] = {}  # kept one -> bytes of the inodes it alone names
        self._links: dict[str, list[tuple[int, int]]] = {}  # kept one -> the files it names linked elsewhere too
        self._linked: dict[tuple[int, int], int] = {}  # those files' bytes: each once
        self._users: collections.Counter[tuple[int, int]] = collections.Counter()  # kept ones naming each
        self._held = 0  # the total: the own bytes and the linked files' bytes, each once
        self._own_inodes: dict[str, int] = {}  # kept one -> the inodes it alone names
        self.fixed_inodes = DEFAULT_INODES

    def _names(self) -> set[str]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return set()
        # Not a half-made one (``.tmp-``: not kept yet), nor anything not a directory (not ours).
        return {n for n in names if not n.startswith(_TMP) and not os.path.islink(os.path.join(self.path, n))
                and os.path.isdir(os.path.join(self.path, n))}

    def _remember(self, name: str, own: int, linked: dict[tuple[int, int], int], inodes: int) -> None:
        self._own[name] = own
        self._own_inodes[name] = inodes
        self._links[name] = list(linked)
        self._held += own + self._new_bytes(linked)
        for key, size in linked.items():
            self._linked.setdefault(key, size)
            self._users[key] += 1

    def _forget(self, name: str) -> None:
        """``name`` went: what it alone named, and the linked files no other kept one names, are not held."""
        self._held -= self._own.pop(name)
        self._own_inodes.pop(name)
        for key in self._links.pop(name):
            self._users[key] -= 1
            if self._users[key] <= 0:
                del self._users[key]
                self._held -= self._linked.pop(key)

    def _new_bytes(self, linked: dict[tuple[int, int], int]) -> int:
        """Of ``linked``, the bytes of the files no kept one names yet."""
        return sum(size for key, size in linked.items() if key not in self._linked)

    def _refresh(self) -> tuple[int, int]:
        """(how many are kept, the bytes they hold); the caller holds ``_lock``."""
        names = self._names()
        for name in sorted(self._own.keys() - names):  # gone: subtracted, the others not measured again
            self._forget(name)
        for name in sorted(names - self._own.keys()):
            self._remember(name, *measure(os.path.join(self.path, name)))
        return len(self._own), self._held

    def _inodes(self) -> int:
        """The inodes the kept ones take: each one's own, and each linked file once."""
        return sum(self._own_inodes.values()) + len(self._linked)

    def _budget(self) -> tuple[int, str]:
        where = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        st = os.statvfs(where)
        return limit(self.fixed, st.f_bavail * st.f_frsize, self.fixed_why)

    def _inode_budget(self) -> tuple[int, str]:
        where = self.path if os.path.isdir(self.path) else os.path.dirname(self.path)
        st = os.statvfs(where)
        return inode_limit(self.fixed_inodes, st.f_favail, st.f_files)

    def report(self) -> BeforeRestoreReport:
        """For ``status`` (a restore's reply has ``admitting``'s)."""
        try:
            with self._lock:
                count, held = self._refresh()
            budget, why = self._budget()
        except OSError as exc:  # status still answers (the directory made unreadable by hand, say)
            return BeforeRestoreReport(path=self.path, count=0, bytes=0, budget=0,
                                       budget_why=f"not measured: {exc.strerror}")
        return BeforeRestoreReport(path=self.path, count=count, bytes=held, budget=budget, budget_why=why)

    @contextlib.contextmanager
    def admitting(self, tmp: str, name: str, make_room: Callable[[], object] | None = None
                  ) -> Iterator[BeforeRestoreReport]:
        """The half-made kept one ``tmp`` measured against the budget, then
        (the caller renames it to ``name`` inside) remembered; refused
        (``Refused``, nothing remembered) when it would take the total over,
        after ``make_room`` (the expired ones swept) if given. Gives the
        total with it kept (the restore's reply: no second look)."""
        with self._lock:
            dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                fcntl.flock(dfd, fcntl.LOCK_EX)  # released with the descriptor
                count, held = self._refresh()
                own, linked, inodes = measure(tmp)
                budget, why = self._budget()
                inode_budget, inode_why = self._inode_budget()
                if make_room is not None and (held + own + self._new_bytes(linked) > budget or
                                              self._inodes() + inodes + len(linked) > inode_budget):
                    make_room()  # expired ones are no reason to refuse: swept, then looked at again
                    count, held = self._refresh()
                    budget, why = self._budget()
                    inode_budget, inode_why = self._inode_budget()
                more = own + self._new_bytes(linked)
                more_inodes = inodes + sum(1 for key in linked if key not in self._linked)
                if self._inodes() + more_inodes > inode_budget:
                    # Empty files cost no block: a session restoring over a million of them, again and
                    # again, filled the file system's inodes (the user's home) with files nobody sees.
                    raise Refused(
                        f"checkpoint refused: keeping it past the session in {self.path} would take what restores "
                        f"replaced there over its budget of inodes: the {count} kept there take {self._inodes()}, "
                        f"this one would add {more_inodes}, and all of them may take at most {inode_budget}, "
                        f"{inode_why}; nothing kept is removed to make room: remove old ones by hand, or wait for "
                        "them to expire (7 days)")
                if held + more > budget:
                    raise Refused(
                        f"checkpoint refused: keeping it past the session in {self.path} would take what restores "
                        f"replaced there over its budget: the {count} kept there hold {amount(held)}, this one "
                        f"would add {amount(more)}, and all of them may hold at most {amount(budget)}, {why}; "
                        "nothing kept is removed to make room: remove old ones by hand (a directory each, named "
                        "by when it was kept, oldest first; no session can), or wait for them to expire (7 days)")
                yield BeforeRestoreReport(path=self.path, count=count + 1, bytes=held + more, budget=budget,
                                          budget_why=why)
                self._remember(name, own, linked, inodes)
            finally:
                os.close(dfd)
