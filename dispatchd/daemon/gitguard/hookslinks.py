"""The symbolic links on the way to a hooks path in the worktree: recorded at
the baseline, and put back where a session changed them.

``core.hooksPath = .githooks`` with ``.githooks -> tools/hooks`` (a link
the repository tracks, so that every clone shares one hooks directory):
the look records a hooks path's entries by the path git opens, after the
links (``tools/hooks/pre-commit``: ``gitdirs.Walk.config_targets``), and
the baseline keeps their bytes (``keptfiles``). A session that replaced the
link by a plain empty directory changed none of them: every hook of the
user's was still there, unchanged, and the end said nothing; the user's git
then looked in the empty directory, and ran none of them.

- ``on_the_way``, at a baseline's look: each symbolic link in the worktree
  met on the way to a hooks path (one in the worktree, or one a link there
  leads out to: ``.githooks -> ../shared-hooks``), followed as the kernel
  follows them (each link's target in its turn, ``MAX_LINKS`` at most), by
  the path where it was met (worktree-relative, its directories real ones)
  -> its target (``GitSnapshot.links``);
- ``put_back``, at each end, before the quarantine (a plant in a directory
  that replaced the link goes aside with it, whole, not name by name into a
  directory then renamed): a recorded link that is no longer that very link
  (another target; a directory, a file or nothing in its place) has what
  stands there moved aside (renamed, never deleted: a directory whole), and
  the link made again, its directory reached from the worktree one
  component at a time, no symlink followed (one in the way moved aside, a
  missing directory made: ``keptfiles.subdir``), as a kept file is put back.
  What cannot be done is a failure of the check (the worktree refused,
  ``taints``);
- as kept bytes are (``parts.keep_outside``), a part joined while sessions
  of its domain run records only the links none of them could write.

Not judged: a link made where the baseline had a real directory on the way
(the hooks git then runs are another directory's, whose entries the look
finds new and the end moves aside; a kept hook is written back into the
directory made again at its path: ``keptfiles.write_below``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

from dispatchd.daemon.gitguard import fs, keptfiles
from dispatchd.fsnames import shown
from dispatchd.inside import is_within

__all__ = ["MAX_LINKS", "on_the_way", "put_back"]

MAX_LINKS = 40  # links followed resolving one path, as the kernel follows them (ELOOP past it)


def on_the_way(worktree: str, path: str) -> dict[str, str]:
    """Each symbolic link inside ``worktree`` met resolving ``path``
    (absolute) as the kernel does, by the worktree-relative path where it
    was met -> its target (see the module). A name that cannot be looked
    at ends the walk: what lies past it is not the hooks path git finds."""
    found: dict[str, str] = {}
    pending = path.split("/")
    current, hops = "/", 0
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        nxt = os.path.join(current, name)
        try:
            if not stat.S_ISLNK(os.lstat(nxt).st_mode):
                current = nxt
                continue
            target = os.readlink(nxt)
        except OSError:
            break
        hops += 1
        if hops > MAX_LINKS:
            break
        if is_within(nxt, worktree) and nxt != worktree:
            found[os.path.relpath(nxt, worktree)] = target
        if target.startswith("/"):
            current = "/"
        pending = target.split("/") + pending
    return found


def put_back(worktree: str, links: dict[str, str], skip: Callable[[str], bool] = lambda path: False,
             ) -> tuple[list[tuple[str, str]], list[str]]:
    """Each of ``links`` (a baseline's ``GitSnapshot.links``) made that link
    again where it is not, but those ``skip`` says an earlier part judges;
    returns what was put back or moved aside, with why, and what could not be."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    try:
        if not stat.S_ISDIR(os.lstat(worktree).st_mode):
            return done, failed  # another directory is at the worktree's path, or none: nothing made there
    except OSError:
        return done, failed
    for rel, target in sorted(links.items()):
        path = os.path.join(worktree, rel)
        if skip(path):
            continue
        try:
            aside = _restore(worktree, rel, target)
        except OSError as exc:
            failed.append(f"{path}: the link to the hooks path changed by a session, yours cannot be put back "
                          f"({exc.strerror})")
            continue
        if aside is None:
            continue
        if aside:
            done.append((aside, "git configuration, hooks or state changed or new"))
        done.append((path, f"yours, a link to {shown(target)} on the way to the hooks path (core.hooksPath), as it "
                           "was before the session changed it, put back"))
    return done, failed


def _restore(worktree: str, rel: str, target: str) -> str | None:
    """The link ``rel`` -> ``target`` made again below ``worktree``; None
    when it is that link already, else where what stood there went ("":
    nothing did)."""
    parent, _, leaf = rel.rpartition("/")
    fd = keptfiles.parent_made(worktree, parent)
    try:
        try:
            st: os.stat_result | None = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is not None and stat.S_ISLNK(st.st_mode) and os.readlink(leaf, dir_fd=fd) == target:
            return None
        aside = fs.move_aside_at(fd, leaf) if st is not None else ""
        try:
            os.symlink(target, leaf, dir_fd=fd)
        except PermissionError:
            with fs.lent(fd):
                os.symlink(target, leaf, dir_fd=fd)
        return os.path.join(worktree, parent, aside) if aside else ""
    finally:
        os.close(fd)
