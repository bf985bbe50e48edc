"""A restore's refs: each set to the checkpoint's value under git's lock,
the value it replaces kept first, the other worktrees' branches left.

Guarantees (``restore_refs``, after the files and object files are back):
- **Under git's lock** (``reflock``): each ref that differs is locked as
  git locks it (``NAME.lock``, ``O_EXCL``), its value read again with the
  lock held, and only then changed: a commit the user's git made in
  another worktree a moment before is the value read, not one read earlier.
  A lock the user's git holds past ``reflock.WAIT_S`` leaves that ref as it
  is, said in ``left``; so does ``packed-refs.lock`` for a ref to delete
  that is packed.
- **Nothing replaced is lost.** The value read under the lock, when it is
  a commit the new value does not descend from (asked of the repository's
  objects and the baseline's alternates, as the end asks), is kept as
  ``refs/dispatchd/displaced/STAMP/NAME`` (``reftemp.keep_displaced``, the
  one writer of those) *before* the ref changes: a daemon killed between
  the two has kept it already, and the restore finished at the next start
  keeps it under the same name (``STAMP`` is the record's).
- **Another worktree's branch is not moved**: a branch a linked worktree
  has checked out (its ``HEAD``, or a rebase in progress there) is left as
  it is, and said in ``left``; so is that worktree's whole state
  (``gitplan``).
- **Reflogs are appended to** (``logs/NAME``, as git appends: one
  ``O_APPEND`` write, under the ref's lock), never replaced: the user's
  entries stay. A ref deleted keeps its reflog.
- A second run (a restore finished after a daemon's death) finds the refs
  it set already at their value and does nothing to them.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from dispatchd.confine._sys import open_beneath
from dispatchd.daemon import gitguard
from dispatchd.daemon.gitguard import configs, objectstore, refvalues, reftemp

from dispatchd.daemon.checkpoints import gitplan, reflock
from dispatchd.daemon.checkpoints.plan import _DIR, Entry, Manifest
from dispatchd.daemon.checkpoints.reading import _copy_path
from dispatchd.daemon.checkpoints.restoring import open_root

_MAX_WORKTREES = 10_000
_MAX_PACKED = 64 * 1024 * 1024
_LOGGED = ("refs/heads/", "refs/remotes/", "refs/notes/")  # git's core.logAllRefUpdates=true, HEAD besides


@dataclass
class RefsDone:
    """What ``restore_refs`` did: refs set or deleted (``moved``), the names
    of the values it kept (``kept``), and each ref it left, with why."""

    moved: int = 0
    kept: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)


def checked_out_elsewhere(common_fd: int) -> dict[str, str]:
    """Branches the repository's linked worktrees have checked out, or are
    rebasing, -> the worktree's path (from ``worktrees/NAME/gitdir``)."""
    found: dict[str, str] = {}
    try:
        wt_fd = open_beneath(common_fd, "worktrees", _DIR)
    except OSError:
        return found
    try:
        names = sorted(os.listdir(wt_fd))[:_MAX_WORKTREES]
        for name in names:
            try:
                fd = open_beneath(wt_fd, name, _DIR)
            except OSError:
                continue
            try:
                where = _text(fd, "gitdir").strip()
                where = os.path.dirname(where) if where.endswith("/.git") else where or f"worktrees/{name}"
                for leaf in ("HEAD", "rebase-merge/head-name", "rebase-apply/head-name"):
                    text = _text(fd, leaf).strip()
                    branch = text[5:].strip() if text.startswith("ref: ") else text
                    if branch.startswith("refs/heads/"):
                        found.setdefault(branch, where)
            finally:
                os.close(fd)
    finally:
        os.close(wt_fd)
    return found


def _text(dir_fd: int, rel: str) -> str:
    try:
        parent, _, leaf = rel.rpartition("/")
        fd = open_beneath(dir_fd, parent, _DIR) if parent else os.dup(dir_fd)
        try:
            data = reflock.read_leaf(fd, leaf)
        finally:
            os.close(fd)
    except OSError:
        return ""
    return (data or b"").decode("utf-8", "surrogateescape")


def _entry(old: str | None, new: str | None, hexsz: int, message: str) -> bytes:
    """A reflog line as git writes one (ids, who, when, a tab, the message)."""
    zero = "0" * hexsz
    o = old if old is not None and refvalues.is_id(old) else zero
    n = new if new is not None and refvalues.is_id(new) else zero
    return f"{o} {n} dispatchd <dispatchd@localhost> {int(time.time())} +0000\t{message}\n".encode()


def _append_log(common_fd: int, name: str, line: bytes) -> None:
    """One reflog entry appended (``O_APPEND``, as git), where git keeps a
    reflog for that ref: the user's entries before it stay."""
    rel, _, leaf = f"logs/{name}".rpartition("/")
    try:
        existing = open_beneath(common_fd, f"logs/{name}", os.O_RDONLY)
        os.close(existing)
    except FileNotFoundError:
        if name != "HEAD" and not name.startswith(_LOGGED):
            return
    dir_fd = reflock.open_dir(common_fd, rel, make=True)
    try:
        fd = os.open(leaf, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dir_fd)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def _resolved(values: dict[str, str | None], name: str) -> str | None:
    """What ``name`` names after following symbolic refs (at most 5), in ``values``."""
    for _ in range(5):
        v = values.get(name)
        if v is None or not v.startswith("ref: "):
            return v
        name = v[5:]
    return None


class _Run:
    """One ``restore_refs``: the repository's descriptor, what it knows."""

    def __init__(self, common: str, common_fd: int, stamp: str, borrowed: list[str], message: str,
                 take_over: bool = False) -> None:
        self.common, self.fd, self.stamp, self.message = common, common_fd, stamp, message
        self.take_over = take_over  # a killed restore's locks (reflock.take): only where no session runs
        self.hexsz = configs.object_id_size(common) * 2
        self.objects = os.path.join(common, "objects")
        self.store = objectstore.Store(self.objects, deadline=time.monotonic() + objectstore.BUDGET_S * 2,
                                       alternates=borrowed)
        self.there = objectstore.finder(self.objects, borrowed)
        self.done = RefsDone()

    def keep(self, name: str, old: str | None, new: str | None) -> None:
        """``old`` (read under the lock) kept when ``new`` does not descend from it."""
        if old is None or not refvalues.is_id(old):
            return  # no value, or a symbolic ref: nothing it names becomes unreachable
        if new is not None and refvalues.is_id(new) and objectstore.is_ancestor(self.objects, old, new, self.store):
            return  # moved forward: the old value is an ancestor, still reachable
        named = reftemp.keep_displaced(self.common, self.stamp, name, old, self.there)  # "": names no object
        if named:
            self.done.kept.append(named)

    def lock(self, name: str) -> reflock.Held | None:
        try:
            return reflock.take(self.fd, name, take_over=self.take_over)
        except reflock.Busy as exc:
            self.done.left.append(f"{name}: locked by another git ({exc}, held over {reflock.WAIT_S:g} s); "
                                  "left as it is: restore again, or set it by hand")
            return None

    def delete(self, names: list[str]) -> None:
        """Each ref of ``names`` deleted as git deletes one: its lock, then
        ``packed-refs.lock`` when it is packed; the loose file unlinked."""
        held: list[tuple[reflock.Held, str | None]] = []
        try:
            for name in names:
                h = self.lock(name)
                if h is not None:
                    held.append((h, reflock.value(self.fd, h, self.hexsz)))
            packed = reflock.packed_text(self.fd)
            in_packed = {h.name for h, _ in held if reflock.packed_value(packed, h.name, self.hexsz) is not None}
            plock: reflock.Held | None = None
            if in_packed:
                try:
                    plock = reflock.take(self.fd, "packed-refs", take_over=self.take_over)
                except reflock.Busy as exc:  # those stay as they are, the others are deleted
                    self.done.left += [f"{name}: not deleted, packed-refs is locked by another git ({exc}); left as "
                                       "it is: restore again" for name in sorted(in_packed)]
                    for h, _ in held:
                        if h.name in in_packed:
                            reflock.release(h)
                    held = [(h, v) for h, v in held if h.name not in in_packed]
            for h, old in held:
                self.keep(h.name, old, None)  # before anything of it goes
            if plock is not None:
                reflock.commit(plock, reflock.without(reflock.packed_text(self.fd), in_packed,
                                                      self.hexsz).encode("utf-8", "surrogateescape"))
            for h, _ in held:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(h.leaf, dir_fd=h.dir_fd)
                self.done.moved += 1
        finally:
            for h, _ in held:
                reflock.release(h)

    def set(self, name: str, new: str) -> None:
        """``name`` set to ``new`` as git sets it (lock, read, log, rename)."""
        h = self.lock(name)
        if h is None:
            return
        try:
            old = reflock.value(self.fd, h, self.hexsz)
            if old == new:
                reflock.release(h)
                return
            self.keep(name, old, new)  # kept before the ref changes
            if name != "HEAD":  # HEAD's own reflog: once, at the end (restore_refs)
                _append_log(self.fd, name, _entry(old, new, self.hexsz, self.message))
        except BaseException:
            reflock.release(h)
            raise
        reflock.commit(h, (new + "\n").encode("utf-8", "surrogateescape"))
        self.done.moved += 1


def _prune(common_fd: int, dirs: list[bytes]) -> None:
    """Each of ``dirs`` (``.git/refs/...``, deepest first) removed if empty:
    one holding a ref of the user's, or left, stays."""
    for path in dirs:
        parent, _, leaf = path[len(b".git/"):].decode("utf-8", "surrogateescape").rpartition("/")
        try:
            fd = reflock.open_dir(common_fd, parent, make=False)
        except OSError:
            continue
        try:
            os.rmdir(leaf, dir_fd=fd)
        except OSError:
            pass  # not empty (a ref kept, left or the user's), or gone: as git leaves them
        finally:
            os.close(fd)


def restore_refs(worktree_fd: int, common: str, want: dict[str, str], prune: list[bytes], stamp: str,
                 borrowed: list[str], message: str, take_over: bool = False) -> RefsDone:
    """The repository at ``worktree_fd``'s ``.git`` (``common``, its path,
    for the keep of displaced values) with the refs ``want`` holds: those
    absent from it deleted, the others set, as the module says; ``prune``:
    directories below ``.git/refs`` the checkpoint did not have, removed
    when empty (``gitplan.ref_dirs_gone``); ``message``: the reflog's."""
    common_fd = open_beneath(worktree_fd, ".git", _DIR)
    try:
        run = _Run(common, common_fd, stamp, borrowed, message, take_over)
        elsewhere = checked_out_elsewhere(common_fd)
        # Which refs differ, as read now; each is read again under its lock before it is changed.
        now: dict[str, str | None] = {n: v for n, v in gitguard.read_all_refs(common).items() if gitplan.wanted(n)}
        head = reflock.read_leaf(common_fd, "HEAD")
        now["HEAD"] = None if head is None else refvalues.parse_loose(head.decode("utf-8", "surrogateescape"))
        values_before = dict(now)
        for name in sorted(set(now) | set(want)):
            if name in elsewhere and now.get(name) != want.get(name):
                run.done.left.append(f"{name}: checked out in the worktree {elsewhere[name]}; left as it is "
                                     f"(a restore moves no other worktree's branch)")
        todo = sorted(n for n in set(now) | set(want) if n not in elsewhere and now.get(n) != want.get(n))
        run.delete([n for n in todo if n not in want and n != "HEAD"])
        _prune(common_fd, prune)
        for name in todo:
            if name in want and gitplan.settable(want[name]):
                run.set(name, want[name])
        # HEAD's own reflog: where the commit it resolves to moved (git logs it beside the branch's).
        values_after = dict(values_before)
        values_after.update({n: want.get(n) for n in todo})
        before, after = _resolved(values_before, "HEAD"), _resolved(values_after, "HEAD")
        if before != after and (before is None or refvalues.is_id(before)) and (after is None or refvalues.is_id(after)):
            with contextlib.suppress(OSError):
                _append_log(common_fd, "HEAD", _entry(before, after, run.hexsz, message))
        return run.done
    finally:
        os.close(common_fd)


def restore_from(worktree: str, expect: tuple[int, int] | None, top: str, manifest: Manifest, now: list[Entry],
                 stamp: str, borrowed: list[str], take_over: bool = False) -> RefsDone:
    """``restore_refs`` of the repository at ``worktree``'s root (``.git``, a
    directory: the one a checkpoint keeps) to the refs checkpoint
    ``manifest`` saw (its copies in ``top``); ``now``: the worktree as the
    restore listed it (for the directories to prune). Nothing when the
    checkpoint had no repository there, or there is none now."""
    root_fd = open_root(worktree, expect)
    try:
        found = _want(root_fd, worktree, top, manifest)
        if found is None:
            return RefsDone()
        common, want = found
        return restore_refs(root_fd, common, want, gitplan.ref_dirs_gone(manifest.entries, now), stamp, borrowed,
                            f"dispatchd: restore checkpoint {manifest.info.id}", take_over)
    finally:
        os.close(root_fd)


def _want(root_fd: int, worktree: str, top: str, manifest: Manifest) -> tuple[str, dict[str, str]] | None:
    """The repository's path and the refs the checkpoint saw, or None when
    the checkpoint had no repository at the root, or there is none now."""
    if not any(e.path == b".git" and e.kind == "d" for e in manifest.entries):
        return None
    try:
        os.close(open_beneath(root_fd, ".git", _DIR))
    except (FileNotFoundError, NotADirectoryError):
        return None
    common = os.path.join(worktree, ".git")
    hexsz = configs.object_id_size(common) * 2

    def read(e: Entry) -> bytes:
        limit = _MAX_PACKED if e.path == b".git/packed-refs" else 4096
        with open(_copy_path(top, e.copy), "rb") as f:
            return f.read(limit)

    return common, gitplan.saved_refs(manifest.entries, read, hexsz)


def moved_since(worktree: str, expect: tuple[int, int] | None, top: str, manifest: Manifest,
                before: dict[str, str]) -> list[str]:
    """``gitplan.refs_changed`` of the repository at ``worktree``'s root now."""
    root_fd = open_root(worktree, expect)
    try:
        found = _want(root_fd, worktree, top, manifest)
        if found is None:
            return []
        common, want = found
        common_fd = open_beneath(root_fd, ".git", _DIR)
        try:
            elsewhere = set(checked_out_elsewhere(common_fd))
        finally:
            os.close(common_fd)
        now = {n: v for n, v in gitguard.read_all_refs(common).items() if gitplan.wanted(n)}
        return gitplan.refs_changed(before, want, now, elsewhere)
    finally:
        os.close(root_fd)
