"""Hard links to the user's files in the directories a linked worktree's
session may write: refused at its open, split at each end.

A linked worktree's session is granted the common directory's ``objects``,
``refs`` and ``logs`` and its own ``worktrees/N`` writable. Landlock and the
binds hold names, not files: another name of a file of the user's in one
of those (``ln .envrc .git/logs/x``, by a session on the main worktree in
degraded mode, or by one on an outer worktree holding the repository as a
clone, which holds nothing of it) is a way for a later linked session to
write that file, and no end of that session looks at the main worktree.

- ``open_note``, at a linked worktree's open: refused ("not granted") while
  a name in what the session would be granted has another hard link
  (``arealinks.walk``: every file of ``logs``, ``refs`` and its own
  ``worktrees/N``, and of ``objects`` the names not of git's, since
  ``git clone --local`` links every file there at git's names), or while
  a file of the common directory git runs or reads has one wherever the
  other name is (``config``, the hooks, every hook of a hooks path in the
  main worktree, an included file inside the common directory:
  ``confreach``); the note says what ends it. Bounded: past
  ``arealinks.MAX_SCANNED`` entries stat'ed, or at a directory there the
  daemon cannot list, the open is refused, said.
- at each end, ``arealinks.split`` first gives each such name in git's
  directories an inode of its own (the user's other names keep theirs);
  then ``detach`` and ``detach_tree``: each file of the user's that git
  runs or reads (a repository's config, hooks and review files; every
  hook of a hooks path and include target in the worktree) and each file
  the tree walk records (``runnables``: ``.envrc``, ``.vscode/*``, a
  nested clone's config, hooks and hooks path) whose count of links rose
  since the baseline (``counts``: a link there then is the user's, left;
  a git directory's config and review files are not counted: split
  whenever linked) is made a file of its own under git's lock
  (``gitlock.replace``, only while the name is still the inode read): its
  bytes streamed through the descriptor and hashed as they are copied,
  whatever its size, within ``MAX_SPLIT`` bytes at one part's end (past
  it: a failure of the check, said, never a silent skip). Only bytes the
  end's look saw are made the user's file: a copy whose digest is not the
  look's (a session still running wrote through the other name since) is
  dropped, and the kept copy of the user's written back
  (``keptfiles.write_below``), or, none kept, the name moved aside, said
  either way.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable

from dispatchd.daemon.gitguard import arealinks, fs, gitlock
from dispatchd.daemon.gitguard.arealinks import PastBudget
from dispatchd.daemon.gitguard.configs import IncludeBudget
from dispatchd.daemon.gitguard.confreach import reach
from dispatchd.daemon.gitguard.digests import CONFIG_FILES, REVIEW_FILES, file_digest
from dispatchd.daemon.gitguard.keptfiles import Kept, Left, dir_below, keepable, kept_name, write_below

__all__ = ["MAX_SPLIT", "Copied", "counts", "detach", "detach_tree", "git_items", "open_note",
           "tree_items"]

MAX_SPLIT = 256 * 1024 * 1024  # bytes one part's end copies to make files of their own
_NEXT_END = " (the next end of a session on the main worktree makes this name a file of its own)"
_BY_HAND = " (yours? `cp -p NAME NAME.new && mv NAME.new NAME` makes it a file of its own)"


def open_note(common: str, gitdir: str) -> str:
    """Why a linked worktree whose own git directory is ``gitdir`` is not
    granted ``common`` (see the module), or "". ``PastBound`` where the
    configuration's includes are more than are followed."""
    names = [os.path.join(common, n) for n in (*CONFIG_FILES, *REVIEW_FILES)]
    split = len(names)  # git's files an end splits whatever the baseline counted (``counts``)
    main = os.path.dirname(common) if os.path.basename(common) == ".git" else ""
    found = reach(main, common, IncludeBudget(), make=False)
    for hooks in [os.path.join(common, "hooks"), *found.hooks]:
        try:
            names += [os.path.join(hooks, n) for n in os.listdir(hooks) if not n.endswith(".sample")]
        except OSError:
            pass
    try:
        for path, _ in arealinks.walk(common, [gitdir]):
            return _linked(path, _NEXT_END)
    except arealinks.Unlooked as exc:
        return f"{exc}; not granted"
    for i, path in enumerate(names + found.includes_inside):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            return _linked(path, _NEXT_END if i < split else _BY_HAND)
    return ""


def _linked(path: str, out: str = "") -> str:
    return (f"{path} has another hard link (a name elsewhere for the same file, which a write through would "
            f"change); not granted{out}")


class Copied:
    """What one part's end has copied to make files of their own, against ``MAX_SPLIT``."""

    def __init__(self) -> None:
        self.limit = self.left = MAX_SPLIT


class _Changed(Exception):
    """The bytes copied are not those the end's look saw."""


def git_items(gitdirs: dict[str, dict[str, str]], by_file: list[str],
              included: dict[str, str]) -> list[tuple[str, bool, str]]:
    """What ``detach`` looks at, from one look: the repository's own files
    (``keptfiles.kept_name``, in ``by_file``'s git directories) and what its
    configuration names in the worktree (``included``), each as (path below
    the worktree, whether a session could write it while it ran, digest)."""
    items = [(f"{rel}/{name}", False, digest) for rel in by_file for name, digest in gitdirs.get(rel, {}).items()
             if kept_name(name) and digest.startswith("file:")]
    return items + [(rel, True, digest) for rel, digest in included.items()
                    if digest.startswith("file:") and keepable(os.path.basename(rel))]


def tree_items(entries: dict[str, str]) -> list[tuple[str, bool, str]]:
    """What ``detach_tree`` looks at of a tree walk's ``entries``, as ``git_items``."""
    return [(rel, True, digest) for rel, digest in entries.items()
            if digest.startswith("file:") and keepable(os.path.basename(rel))]


def counts(top: str, items: list[tuple[str, bool, str]]) -> dict[str, int]:
    """At a baseline: the link count of each of ``items`` (``git_items``,
    ``tree_items``) that has more than one, reached with no symlink on the
    way. A link there then is the user's (a dotfiles repository's
    ``.bashrc`` linked into the home, a hook under two names): an end
    splits a file only where its count rose since. Not counted, so split at
    every end: a git directory's config and review files, which no one
    links on purpose (a ``cp -al`` copy's), and whose link git's next write
    of them (a rename) would end anyway."""
    found: dict[str, int] = {}
    for rel, left, _ in items:
        if not left and "/hooks/" not in f"/{rel}":
            continue  # a git directory's config or review file: git's next write of it (a rename) ends a link anyway
        parent, _, leaf = rel.rpartition("/")
        fd = dir_below(top, parent)
        if fd is None:
            continue
        try:
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        finally:
            os.close(fd)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            found[rel] = st.st_nlink
    return found


def detach(worktree: str, gitdirs: dict[str, dict[str, str]], by_file: list[str], included: dict[str, str],
           kept: list[Kept], copied: Copied, before: dict[str, int] | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """Each file of the user's that git runs or reads with more hard links
    than at the baseline made a file of its own (see the module):
    ``git_items`` of ``gitdirs``, ``by_file`` and ``included``, the end's
    look; ``kept``: the baseline's bytes; ``before``: the baseline's
    ``counts`` (None, an older record's: every file with another link).
    Returns what was done, with why, and what could not be."""
    return _detach(worktree, git_items(gitdirs, by_file, included), kept, copied, before)


def detach_tree(root: str, entries: dict[str, str], kept: list[Kept], copied: Copied,
                before: dict[str, int] | None = None) -> tuple[list[tuple[str, str]], list[str]]:
    """``detach`` for every file the tree walk records (``entries``, the
    end's: the files the user's tools run, and the repositories found in the
    worktree, their config, hooks and what their configuration names): a
    session on the main worktree (degraded mode), or on an outer worktree
    holding a clone, linked the clone's ``.envrc`` or hook into its
    ``.git/logs``, and a later session of the clone's linked worktree wrote
    through it."""
    return _detach(root, tree_items(entries), kept, copied, before)


def _detach(top: str, items: list[tuple[str, bool, str]], kept: list[Kept], copied: Copied,
            before: dict[str, int] | None) -> tuple[list[tuple[str, str]], list[str]]:
    """Each of ``items`` (below ``top``; True: a session could write it
    while it ran, and a lock it left beside is moved aside; the look's
    digest) with more hard links than ``before`` counted (one where it
    counted none; None: more than one) made a file of its own, its
    directory reached with no symlink on the way; one wait for locks in all."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    ours = {k.rel: k for k in kept if not k.base}
    gone: dict[tuple[int, int], int] = {}  # an inode -> its names split from it here: still counted as its own
    deadline = time.monotonic() + gitlock.WAIT_S
    for rel, left, seen in items:
        parent, _, leaf = rel.rpartition("/")
        fd = dir_below(top, parent)
        if fd is None:
            continue
        path = os.path.join(top, rel)
        try:  # only a file of other names read (most are of one)
            had = 1 if before is None else before.get(rel, 1)
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
            if st.st_nlink + gone.get((st.st_dev, st.st_ino), 0) <= had:
                continue
            opened = fs.open_regular(leaf, fd)
            if opened is None:
                continue
            inode = (opened[1].st_dev, opened[1].st_ino)
            if opened[1].st_nlink + gone.get(inode, 0) <= had:
                os.close(opened[0])
                continue
            if _split(top, rel, fd, opened, (left, seen, ours.get(rel), deadline, before is not None), copied, done,
                      failed):
                gone[inode] = gone.get(inode, 0) + 1
        except FileNotFoundError:
            continue  # gone since the look
        except OSError as exc:
            failed.append(f"{path}: has another hard link, and could not be made a file of its own "
                          f"({exc.strerror or exc})")
        finally:
            os.close(fd)
    return done, failed


def _split(top: str, rel: str, fd: int, opened: tuple[int, os.stat_result],
           how: tuple[bool, str, Kept | None, float, bool], copied: Copied, done: list[tuple[str, str]],
           failed: list[str]) -> bool:
    """``rel``, opened (``src``, its ``fstat``), made a file of its own in
    ``fd``, its directory; ``how``: whether a lock left beside is moved
    aside, the look's digest, the kept copy, the deadline of lock waits,
    whether the baseline counted its links. True: it no longer has the inode it had."""
    src, st = opened
    left, seen, kept, deadline, counted = how
    path = os.path.join(top, rel)
    said = f"had {st.st_nlink - 1} other hard link(s){', more than at the session start' if counted else ''}, a way " \
           "to write it from where a session could"
    wait_s = max(0.0, deadline - time.monotonic())
    try:
        if gitlock.replace(fd, os.path.basename(rel), b"", stat.S_IMODE(st.st_mode), inode=(st.st_dev, st.st_ino),
                           move_left=left, wait_s=wait_s, fill=_copy(src, st, seen, copied)) is not None:
            done.append((path, f"{said}; made a file of its own (the other names keep the old one)"))
            return True
    except _Changed:
        _changed(top, rel, fd, kept, (left, wait_s), f"{said}, and was written through one since the end's look",
                 done, failed)
        return True
    except PastBudget:
        failed.append(f"{path}: {said}; not made a file of its own: past the {copied.limit >> 20} MiB copied at "
                      "one end")
    finally:
        os.close(src)
    return False


def _copy(src: int, st: os.stat_result, seen: str, copied: Copied) -> Callable[[int], None]:
    """What fills the new file: ``src``'s bytes streamed into it, hashed as
    they go, charged to ``copied``; ``_Changed`` when they (with the mode)
    are not the look's ``seen``."""
    def fill(out: int) -> None:
        h = hashlib.sha256()
        arealinks.stream(src, out, copied, h)
        if file_digest(stat.S_IMODE(st.st_mode), h.hexdigest()) != seen:
            raise _Changed()
    return fill


def _changed(top: str, rel: str, fd: int, k: Kept | None, lock: tuple[bool, float], why: str,
             done: list[tuple[str, str]], failed: list[str]) -> None:
    """A file of other names changed since the end's look (through another
    name, by a session still running): the user's kept bytes written back
    in its place, or, none kept, it moved aside; never made theirs.
    ``lock``: whether a lock left beside is moved aside, and the wait."""
    path = os.path.join(top, rel)
    try:
        if k is not None:
            aside = write_below(top, rel, k.data.encode("latin-1"), k.mode, move_left=lock[0], wait_s=lock[1])
            if aside:
                done.append((aside, "git configuration, hooks or state changed or new"))
            done.append((path, f"{why}: yours, as it was before, put back"))
        else:
            aside = os.path.join(os.path.dirname(path), fs.move_aside_at(fd, os.path.basename(rel)))
            done.append((aside, f"{why}: moved aside (no copy of yours was kept to put back)"))
    except Left as exc:
        failed.append(f"{path}: {why}; yours not put back: {exc}")
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            failed.append(f"{path}: {why}; neither put back nor moved aside ({exc.strerror})")
