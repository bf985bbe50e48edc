"""What a git directory's configuration reads or runs in the worktree,
recorded by content at a look: the part of ``gitdirs.Walk`` that follows
includes and hooks paths.

``ConfigWalk.config_targets`` records the targets of ``include.path`` and
``includeIf.*.path`` that lie in the worktree (followed, as git does, up to
``_MAX_INCLUDES`` deep), and every entry of a ``core.hooksPath`` there (the
repository's, an included file's, the user's own relative one), each by
content (``digests``); the symlinks on the way to a hooks path
(``hookslinks``). Bounded in work, not only in files: one
``configs.IncludeBudget`` for the whole walk (an include path is charged
before it is resolved; a repeat costs a set's look-up: 64 files each listing
itself 20,000 times took 125 s); past it the file that names the includes
is never equal (moved aside, the user's kept bytes put back) and the walk
says so (``unfollowed``: the check fails, saying it).
"""

from __future__ import annotations

import os
from collections import deque

from dispatchd.daemon.gitguard import fs, hookslinks
from dispatchd.daemon.gitguard.configs import IncludeBudget, PastBound, includes_of
from dispatchd.daemon.gitguard.digests import MAX_ENTRIES, Budget, digest_at, never_equal, open_subdir
from dispatchd.inside import is_within

__all__ = ["ConfigWalk", "names_in"]

_MAX_INCLUDES = 10  # include.path chains followed (git stops at 10 too)


class ConfigWalk:
    """The includes and hooks paths of ``gitdirs.Walk`` (its base): what it
    records them in, and how it reaches a directory, are the walk's."""

    worktree: str
    home: str
    user_hooks: list[str]
    gitdirs: dict[str, dict[str, str]]
    included: dict[str, str]
    links: dict[str, str]
    budget: Budget

    def __init__(self) -> None:
        self.include_budget = IncludeBudget()  # the includes this walk follows, all git directories together
        self.unfollowed = ""  # past it: why (the check fails, saying so)

    def open(self, rel: str) -> int | None:
        """The directory at ``rel``, reached with no symlink (``gitdirs.Walk.open``)."""
        raise NotImplementedError

    def _inside(self, path: str) -> str | None:
        """``path`` after symlinks, worktree-relative, when it lies in the
        worktree (what a session can write); None otherwise."""
        try:
            real = os.path.realpath(path)
        except (RecursionError, ValueError):  # a chain of a thousand symlinks: git cannot follow it either
            return None
        if not is_within(real, self.worktree) or real == self.worktree:
            return None
        return os.path.relpath(real, self.worktree).replace(os.sep, "/")

    def _expand(self, value: str, base: str) -> str | None:
        if "\0" in value:
            return None
        if value.startswith("~/"):
            return os.path.join(self.home, value[2:]) if self.home else None
        return os.path.join(base, value)

    def config_targets(self, gitdir_rel: str, worktree_rel: str, includes: list[str], hooks_paths: list[str]) -> None:
        """Record what a git directory's configuration reads from or runs in
        the worktree: include targets (followed, as git does, up to
        ``_MAX_INCLUDES`` deep) and every entry of a ``core.hooksPath`` there,
        one an included file sets too (a shared config's). An entry an end
        moved aside is no hook (git runs exact names): not recorded, as
        ``fingerprint`` leaves it out of ``hooks``."""
        gitdir_abs = os.path.join(self.worktree, gitdir_rel)
        # Each with the file that names it ("": the git directory's own config).
        # Breadth first: the configuration's own includes are charged before
        # any file they include can spend the budget on includes of its own.
        pending = deque((value, gitdir_abs, 0, "") for value in includes)
        hooks_paths = list(hooks_paths)
        while pending:
            value, base, depth, by = pending.popleft()
            path = self._expand(value, base)
            try:
                if path is None or not self.include_budget.first(path):
                    continue  # met already: resolved once
            except PastBound:
                self._past(gitdir_rel, by)
                continue
            rel = self._inside(path)
            if rel is None or rel in self.included:
                continue
            if depth >= _MAX_INCLUDES or len(self.included) > MAX_ENTRIES:
                self.included[rel] = never_equal("too many includes")
                continue
            self.included[rel] = self._digest_rel(rel)
            try:
                more, hooks = self._includes_of(rel)
            except PastBound:
                self._past(gitdir_rel, rel)
                continue
            hooks_paths += hooks
            for value in more:
                pending.append((value, os.path.dirname(os.path.join(self.worktree, rel)), depth + 1, rel))
        for value in hooks_paths + self.user_hooks:
            path = self._expand(value, os.path.join(self.worktree, worktree_rel))
            if path:  # a link in the worktree to hooks outside it too (``.githooks -> ../shared-hooks``)
                self.links.update(hookslinks.on_the_way(self.worktree, path))
            rel = self._inside(path) if path else None
            if rel is None:
                continue
            self.included[rel] = "hooks directory"
            try:
                fd = self.open(rel)
            except OSError as exc:
                self.included[rel] = never_equal(f"unsearchable {exc.errno}")
                continue
            if fd is None:
                continue
            try:
                names = names_in(fd)
                if len(names) > MAX_ENTRIES:
                    self.included[rel] = never_equal("too many entries")
                    continue
                for name in (n for n in names if fs.QUARANTINED not in n):
                    digest = digest_at(fd, name, self.budget)
                    if digest is not None:
                        self.included[f"{rel}/{name}"] = digest
            except OSError as exc:
                self.included[rel] = never_equal(f"unreadable {exc.errno}")
            finally:
                os.close(fd)

    def _past(self, gitdir_rel: str, by: str) -> None:
        """Past the walk's budget (``configs.IncludeBudget``): said (``unfollowed``), and what names
        the includes made never equal, moved aside (the user's kept bytes put back). ``by``: an
        included file, or "": the git directory's own config (a linked worktree's: read-only)."""
        self.unfollowed = str(PastBound())
        why = never_equal("more includes than dispatchd follows")
        if by:
            self.included[by] = why
            return
        for name in ("config", "config.worktree"):
            if name in self.gitdirs.get(gitdir_rel, {}):
                self.gitdirs[gitdir_rel][name] = why

    def _digest_rel(self, rel: str) -> str:
        parent, _, name = rel.rpartition("/")
        try:
            fd = self.open(parent)
        except OSError as exc:
            return never_equal(f"unsearchable {exc.errno}")
        if fd is None:
            return "absent"
        try:
            return digest_at(fd, name, self.budget) or "absent"
        finally:
            os.close(fd)

    def _includes_of(self, rel: str) -> tuple[list[str], list[str]]:
        """An included file's includes and hooks paths (``configs.includes_of``;
        ``PastBound`` past the walk's budget)."""
        parent, _, name = rel.rpartition("/")
        try:
            fd = self.open(parent)
        except OSError:
            return [], []
        if fd is None:
            return [], []
        try:
            return includes_of(fd, name, self.include_budget)
        finally:
            os.close(fd)


def names_in(dir_fd: int) -> list[str]:
    """The sorted names in the directory an O_PATH descriptor holds."""
    listing = open_subdir(dir_fd, ".", os.O_RDONLY)
    if listing is None:
        return []
    try:
        return sorted(os.listdir(listing))
    finally:
        os.close(listing)
