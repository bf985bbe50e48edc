"""What a git directory's configuration makes the user's git run or read
in the worktree, found at a session's open: the hooks paths its
``core.hooksPath`` names and the files its includes name.

``reach`` reads the git directory's ``config`` and ``config.worktree`` and
follows their includes (``include.path``, ``includeIf.*.path``) as
``gitdirs.Walk.config_targets`` does at the end: each include that lies in
the worktree after symlinks (``realpath``, only to learn where), read from
there by descriptor with no symlink on the way (``configs.includes_of``: a
regular file, bounded), up to ``_MAX_INCLUDES`` deep and
``_MAX_INCLUDE_FILES`` files; a ``~/`` one, or one outside, not read. What
it finds:

- the hooks paths inside the git directory (``.git/myhooks``), made where
  missing so that they can be held read-only as ``hooks`` is, but only at
  a name git never gives a file of its own there (``_makeable``): a
  session's include naming ``.git/index.lock`` had the next open make a
  directory there, and the user's git stopped on it ("File exists");
- every hooks path in the worktree (a ``.githooks`` beside the code too),
  for a linked worktree's open to look at their hooks' links;
- the included files inside the git directory (``.git/hooks.inc``), held
  read-only as ``config`` is: rewritten, one moved the hooks path to a
  directory of the session's while the session ran.

The walk is bounded in work, not only in files: one ``configs.IncludeBudget``
for all the git directories of one open (an include path is charged before
it is resolved, a repeat costs a set's look-up); past it ``PastBound``, and
the open is refused (``layouts``).
"""

from __future__ import annotations

import os
from typing import NamedTuple

from dispatchd.daemon.gitguard.configs import IncludeBudget, config_targets, includes_of
from dispatchd.daemon.gitguard.fs import is_dir, is_file, open_dir_below
from dispatchd.inside import is_below

__all__ = ["Reach", "reach"]

_MAX_INCLUDES = 10  # include chains followed for a hooks path (git stops at 10 too)
_MAX_INCLUDE_FILES = 64  # included files read for one git directory's hooks paths
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What git itself names at the top of a git directory: a directory made at
# one of these (or at a name in capitals, git's pseudo-refs and state files,
# or at a lock's) stops the user's git, or a command of it.
_GITS = frozenset(("config", "config.worktree", "description", "index", "packed-refs", "shallow", "objects", "refs",
                   "logs", "info", "hooks", "modules", "worktrees", "lfs", "rebase-merge", "rebase-apply",
                   "sequencer", "rr-cache", "commondir", "gitdir", "branches", "remotes", "svn", "gc.pid",
                   "gc.log", "gitk.cache"))


class Reach(NamedTuple):
    """What ``reach`` found, absolute paths, each a real directory or a
    regular file reached through no symlink."""

    hooks_inside: list[str]  # hooks paths inside the git directory (held read-only)
    hooks: list[str]  # every hooks path in the worktree, those inside the git directory too
    includes_inside: list[str]  # included files inside the git directory (held read-only)


def reach(worktree: str, gitdir: str, budget: IncludeBudget, *, make: bool = True) -> Reach:
    """What ``gitdir``'s configuration runs or reads (see the module).
    Relative hooks paths are the worktree's (the repository's ``.git`` only:
    a submodule's are its own worktree's; none without a worktree); a
    missing one inside the git directory is made, empty, at a name git
    never gives (``_makeable``), unless not ``make``. ``PastBound`` past
    ``budget``."""
    try:
        fd = os.open(gitdir, _DIR)
    except OSError:
        return Reach([], [], [])
    try:
        values, read = _walk(worktree or gitdir, gitdir, fd, budget)
    finally:
        os.close(fd)
    inside: list[str] = []
    hooks: list[str] = []
    for value in values:
        if value.startswith("~") or "\0" in value or \
                (not os.path.isabs(value) and (not worktree or gitdir != os.path.join(worktree, ".git"))):
            continue
        path = os.path.normpath(os.path.join(worktree, value))
        if is_below(path, gitdir) and path != os.path.join(gitdir, "hooks"):
            rel = os.path.relpath(path, gitdir)
            if make and not os.path.lexists(path) and _makeable(rel):
                _make_below(gitdir, rel)  # as ``hooks`` is: none of a session's making
            if os.path.realpath(path) == path and is_dir(path):
                inside.append(path)
                hooks.append(path)
        elif worktree and is_below(path, worktree) and os.path.realpath(path) == path and is_dir(path):
            hooks.append(path)
    # Inside the repository's ``.git`` too, from a submodule's (``.git/modules/sub``) configuration.
    tops = [gitdir, os.path.join(worktree, ".git")] if worktree else [gitdir]
    return Reach(inside, hooks, [p for p in read if any(is_below(p, t) for t in tops) and is_file(p)])


def _makeable(rel: str) -> bool:
    """Whether a hooks path at ``rel`` below a git directory may be made:
    its first component is no name git gives a file or directory of its own
    there (``_GITS``, a name in capitals, a lock's, the index's, a temporary's)."""
    first = rel.split("/", 1)[0]
    return not (first in _GITS or first.upper() == first or first.endswith(".lock")
                or first.startswith(("index", "sharedindex.", "packed-refs", "tmp_")))


def _walk(within: str, gitdir: str, fd: int, budget: IncludeBudget) -> tuple[list[str], list[str]]:
    """The ``core.hooksPath`` values of the git directory's ``config`` and
    ``config.worktree`` (``fd``) and of the files they include (see the
    module), and the included files read (real paths)."""
    includes, values = config_targets(fd)
    pending = [(value, gitdir, 0) for value in includes]
    seen: list[str] = []
    while pending and len(seen) < _MAX_INCLUDE_FILES:
        value, base, depth = pending.pop()
        if depth >= _MAX_INCLUDES or value.startswith("~") or "\0" in value:
            continue
        if not budget.first(os.path.join(base, value)):
            continue  # met already, here or in another git directory's walk of this open
        try:
            real = os.path.realpath(os.path.join(base, value))
        except (OSError, RecursionError, ValueError):  # a chain of links git cannot follow either
            continue
        if real in seen or not is_below(real, within):
            continue
        seen.append(real)
        parent, name = os.path.split(os.path.relpath(real, within))
        try:
            dir_fd = open_dir_below(within, parent) if parent else os.open(within, _DIR)
        except OSError:
            continue
        if dir_fd is None:
            continue
        try:
            more, hooks = includes_of(dir_fd, name, budget)
        finally:
            os.close(dir_fd)
        values += hooks
        pending += [(value, os.path.dirname(real), depth + 1) for value in more]
    return values, seen


def _make_below(top: str, rel: str) -> None:
    """The directories of ``rel`` below ``top`` made where missing (0755),
    each reached by descriptor, no symlink followed: a link a running
    session swapped in on the way makes nothing elsewhere. Best effort."""
    try:
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for part in rel.split("/"):
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except OSError:
        pass
    finally:
        os.close(fd)
