"""The walk that finds every git directory of a repository the way the
user's git finds them, and records each by content (``digests``).

Which git directories exist: the repository's ``.git``; every directory
under a ``modules`` of a git directory, at any depth (a name may hold
slashes; a directory holding a ``HEAD`` is a git directory, and only its own
``modules`` is walked further); through the index of each git directory
whose worktree is known, every submodule it records, at any depth; wherever
a gitfile inside the worktree leads; and the files inside the worktree that
a git directory's configuration includes or runs (``include.path``,
``core.hooksPath``: ``configwalk``, its base).

Guarantees:
- git directories found are queued, never recursed into: no depth of
  ``modules/a/modules/a/...`` or chain of gitfiles exhausts the stack; the
  walk is bounded in git directories (``MAX_GITDIRS``), directories looked
  into, depth and includes followed, and one that stops short says so
  (``complete`` False);
- every directory is reached from the worktree one component at a time with
  ``O_NOFOLLOW`` (``fs.open_dir_below``), every file read with a bound; an
  index is opened by its path, ``O_NOFOLLOW`` on the file itself
  (``fs.index_gitlinks``); a symlink is recorded, never followed (except to
  learn, with ``realpath``, whether a gitfile or an include leads inside the
  worktree);
- what cannot be looked at is recorded as never equal (fail closed).
"""

from __future__ import annotations

import hashlib
import os
import stat
import time

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs
from dispatchd.daemon.gitguard.configs import config_targets, user_hooks_paths
from dispatchd.daemon.gitguard.configwalk import ConfigWalk
from dispatchd.daemon.gitguard.configwalk import names_in as _names
from dispatchd.daemon.gitguard.digests import Budget, digest_at, fingerprint, hash_fd, never_equal
from dispatchd.inside import is_within

MAX_GITDIRS = 5000
_MAX_VISITS = 50000  # directories looked into for git directories
_MAX_DEPTH = 64  # components of a git directory's path below the worktree
_MAX_POINTER = 4096  # a gitfile
_MAX_HASHED_INDEX = 4 * 1024 * 1024 * 1024  # an index that cannot be parsed is compared by content up to this
# ... and the indexes of one walk up to this in all: a session's thousands of
# sparse 4 GiB indexes (no disk space) were each hashed, for hours.
_MAX_HASHED_INDEXES = 8 * 1024 * 1024 * 1024
# The submodules' indexes a walk parses, distinct files, in all: each planted
# one of 256 MiB (its count fitting its size) took 2 s, a walk of thousands
# hours. Past it an index is judged by its bytes, as one that does not parse.
_MAX_PARSED_INDEXES = 512 * 1024 * 1024
# An unparsable index whose inode, size and ctime are those of the look
# before is that index (any write sets its ctime, which nothing can set
# back), unless that ctime was within this of the look (the clock's tick).
_SETTLE_NS = 50_000_000


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class Walk(ConfigWalk):
    """The walk of ``take`` (what a configuration names: its base,
    ``ConfigWalk``). Git directories found are queued, never recursed into:
    no depth of ``modules/a/modules/a/...`` or chain of gitfiles a session
    makes can exhaust the daemon's stack."""

    def __init__(self, worktree: str, home: str = "",
                 known: dict[str, tuple[str, list[int]]] | None = None) -> None:
        super().__init__()
        self.worktree = worktree.rstrip("/") or "/"
        self.home = home
        # A relative core.hooksPath of the user's own configuration names a
        # directory in every worktree: its hooks are checked as the repository's are.
        self.user_hooks = user_hooks_paths(home)
        self.gitdirs: dict[str, dict[str, str]] = {}
        self.pointers: dict[str, str] = {}
        self.indexes: dict[str, str] = {}
        # Of the unparsable indexes: their stamps at this look, and (``known``)
        # what the look before recorded of each (its value, its stamps).
        self.index_stamps: dict[str, list[int]] = {}
        self.known = known or {}
        self.index_budget = Budget(_MAX_HASHED_INDEXES)
        self.parse_left = _MAX_PARSED_INDEXES
        self.parsed: set[tuple[int, int]] = set()  # (device, inode) of the indexes counted against it
        self.included: dict[str, str] = {}
        self.links: dict[str, str] = {}  # the symlinks on the way to a hooks path in the worktree (hookslinks)
        self.indexed: set[str] = set()
        self.queue: list[tuple[str, str | None]] = []
        self.budget = Budget()
        self.visits = 0
        self.complete = True

    def run(self) -> None:
        while self.queue:
            rel, worktree = self.queue.pop()
            self._gitdir(rel, worktree)

    def _budget(self) -> bool:
        self.visits += 1
        if self.visits > _MAX_VISITS or len(self.gitdirs) > MAX_GITDIRS:
            self.complete = False
        return self.complete

    def open(self, rel: str) -> int | None:
        """An O_PATH descriptor of the directory at ``rel``, reached without
        following a symlink; None when there is none; OSError when it cannot
        be looked at."""
        if not rel:
            return os.open(self.worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return fs.open_dir_below(self.worktree, rel)

    def recorded(self, rel: str) -> int | None:
        """Record the git directory at ``rel`` by what git reads from it
        (``fingerprint``) and return its descriptor, the caller's to close;
        None when there is none, or when it cannot be looked at (then
        recorded as never equal: it goes aside whole)."""
        try:
            fd = self.open(rel)
        except OSError as exc:
            self.gitdirs[rel] = {"": never_equal(f"unsearchable {exc.errno}")}
            return None
        if fd is None:
            return None
        try:
            self.gitdirs[rel] = fingerprint(fd, self.budget)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def linked_entries(self) -> list[str]:
        """Record the entries of the repository's other linked worktrees
        (``.git/worktrees/N``, each by what git reads from it) and return
        those recorded by their files (the others go aside whole)."""
        try:
            fd = self.open(".git/worktrees")
        except OSError as exc:
            self.gitdirs[".git/worktrees"] = {"": never_equal(f"unsearchable {exc.errno}")}
            return []
        if fd is None:
            return []
        try:
            names = _names(fd)
        except OSError as exc:  # unreadable (chmod 000): what is in it cannot be known
            self.gitdirs[".git/worktrees"] = {"": never_equal(f"unreadable {exc.errno}")}
            return []
        finally:
            os.close(fd)
        by_file: list[str] = []
        for name in names:
            entry = self.recorded(f".git/worktrees/{name}")
            if entry is not None:
                os.close(entry)
                by_file.append(f".git/worktrees/{name}")
                # Its submodules' git directories (``git submodule update`` run in that worktree).
                self.modules(f".git/worktrees/{name}/modules")
        self.run()
        return by_file

    def gitdir(self, rel: str, worktree: str | None) -> None:
        """Queue the git directory at ``rel`` (see ``_gitdir``)."""
        self.queue.append((rel, worktree))

    def _gitdir(self, rel: str, worktree: str | None) -> None:
        """Record the git directory at ``rel`` and queue the ones below it;
        with ``worktree`` (the directory its index's paths are relative to),
        the submodules its index records too."""
        if rel.count("/") > _MAX_DEPTH:
            self.complete = False
            return
        if rel not in self.gitdirs:
            if not self._budget():
                return
            fd = self.recorded(rel)
            if fd is None:
                return
            try:
                includes, hooks_paths = config_targets(fd)
            finally:
                os.close(fd)
            self.config_targets(rel, worktree or "", includes, hooks_paths)
            self.modules(_join(rel, "modules"))
        if worktree is not None and rel not in self.indexed:
            self.indexed.add(rel)
            self.index(rel, worktree)

    def modules(self, top: str) -> None:
        """Every git directory under a ``modules``: a directory holding a
        ``HEAD`` is one; any other directory is a step of a name with slashes."""
        pending = [top]
        while pending and self._budget():
            rel = pending.pop()
            if rel.count("/") > _MAX_DEPTH:
                # Each level is reached from the worktree down, so a walk
                # past this depth would cost its depth squared (a 600-level
                # chain: 725,000 opens). What lies deeper is not looked
                # into: it is never equal, so it goes aside whole.
                self.gitdirs[rel] = {"": never_equal(f"deeper than {_MAX_DEPTH} components")}
                continue
            try:
                fd = self.open(rel)
                if fd is None:
                    continue
                try:
                    names = _names(fd)
                    kinds = {name: _kind(fd, name) for name in names}
                finally:
                    os.close(fd)
            except OSError as exc:
                # A directory here the daemon cannot read may hold a git
                # directory the user's git reaches later: it goes aside whole.
                self.gitdirs[rel] = {"": never_equal(f"unsearchable {exc.errno}")}
                continue
            for name in reversed(names):
                if kinds[name] == "gitdir":
                    self.gitdir(_join(rel, name), None)
                elif kinds[name] == "directory":
                    pending.append(_join(rel, name))
                elif kinds[name] == "unsearchable":
                    self.gitdirs[_join(rel, name)] = {"": never_equal("unsearchable")}

    def _may_parse(self, path: str) -> bool:
        """Whether the index at ``path`` is within what this walk parses
        (``_MAX_PARSED_INDEXES``; each file once, whatever its names)."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            return True  # absent, or unreadable: index_gitlinks says so
        if (st.st_dev, st.st_ino) in self.parsed:
            return True
        if st.st_size > self.parse_left:
            return False
        self.parsed.add((st.st_dev, st.st_ino))
        self.parse_left -= st.st_size
        return True

    def index(self, gitdir_rel: str, worktree: str) -> None:
        index_rel = _join(gitdir_rel, "index")
        path = os.path.join(self.worktree, index_rel)
        links = fs.index_gitlinks(path) if self._may_parse(path) else None
        if links is None:
            self.indexes[index_rel], stamps = _index_content(path, self.known.get(index_rel), self.index_budget)
            if stamps:
                self.index_stamps[index_rel] = stamps
            return
        for link in sorted(links):
            if not self._budget():
                return
            if not fs.safe_link(link):
                # git would not write it, but walks it: never followed here,
                # and so never "as before"
                self.indexes[index_rel] = never_equal("a submodule path git would not write")
                continue
            sub = _join(worktree, link)
            try:
                fd = self.open(sub)
                if fd is None:
                    continue  # nothing there, a file or a symlink on the way: git skips it too
                try:
                    st = os.stat(".git", dir_fd=fd, follow_symlinks=False)
                    if not stat.S_ISDIR(st.st_mode):
                        self.pointer(_join(sub, ".git"), sub, fd, st)
                finally:
                    os.close(fd)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if exc.errno in fs.ABSENT:
                    continue
                self.indexes[index_rel] = never_equal(f"a submodule that cannot be looked at ({exc.errno})")
                continue
            if stat.S_ISDIR(st.st_mode):
                self.gitdir(_join(sub, ".git"), sub)

    def pointer(self, rel: str, worktree: str, dir_fd: int, st: os.stat_result) -> None:
        """A ``.git`` that is a file (``gitdir: PATH``) or a symlink: its
        content, and the git directory it leads to, which is walked too when
        it lies in the worktree."""
        target = ""
        if stat.S_ISLNK(st.st_mode):
            text = os.readlink(".git", dir_fd=dir_fd)
            target = text
            content = "symlink:" + text
        elif stat.S_ISREG(st.st_mode) and (opened := fs.open_regular(".git", dir_fd)) is not None:
            try:
                data = os.read(opened[0], _MAX_POINTER + 1)
            finally:
                os.close(opened[0])
            text = data.decode("utf-8", "surrogateescape")
            if len(data) <= _MAX_POINTER and text.startswith("gitdir: "):
                target = text[len("gitdir: "):].strip()
            content = "file:" + text
        else:
            content = f"mode:{st.st_mode:o}"
        leads = ""
        try:
            real = os.path.realpath(os.path.join(self.worktree, worktree, target)) \
                if target and "\0" not in target else ""
        except RecursionError:  # a chain of a thousand symlinks (realpath recurses once a link)
            real, leads = "", never_equal("a chain of symlinks too long to follow")
        if real:
            inside = os.path.relpath(real, self.worktree) if is_within(real, self.worktree) else None
            if inside is None:
                leads = "outside:" + real  # not the session's to write
            elif inside == ".":
                leads = never_equal("the worktree itself")
            else:
                inside = inside.replace(os.sep, "/")
                target_fd: int | None
                try:
                    target_fd = self.open(inside)
                except OSError as exc:
                    target_fd, leads = None, never_equal(f"unsearchable {exc.errno}")
                if target_fd is not None:
                    os.close(target_fd)
                    leads = "gitdir:" + inside
                    self.gitdir(inside, worktree)
                elif not leads:
                    leads = "nothing"
        self.pointers[rel] = hashlib.sha256(os.fsencode(content)).hexdigest() + " -> " + leads


def _kind(dir_fd: int, name: str) -> str:
    """"gitdir" (a directory holding a ``HEAD``, as git's own test), "directory",
    "unsearchable", or "other" (a file, a symlink: not walked)."""
    try:
        if not stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return "other"
        os.stat(f"{name}/HEAD", dir_fd=dir_fd, follow_symlinks=False)
        return "gitdir"
    except FileNotFoundError:
        return "directory"
    except OSError:
        return "unsearchable"


def _index_content(path: str, known: tuple[str, list[int]] | None, budget: Budget) -> tuple[str, list[int]]:
    """An index that cannot be parsed: compared by its bytes, so that the
    user's own (too large, say) is left alone and any other goes aside; and
    its stamps (device, inode, size, ctime, mtime, when looked at). With
    ``known`` (the look before: value, stamps), one whose stamps are
    unchanged, its ctime settled before that look, is not read again. Each
    is hashed up to ``_MAX_HASHED_INDEX`` bytes, and up to ``budget`` in all:
    past either it is never equal (it goes aside)."""
    try:
        opened = fs.open_regular(path)
    except OSError as exc:
        return never_equal(f"an index that cannot be read ({exc.errno})"), []
    if opened is None:
        return never_equal("an index that is not a file"), []
    fd, st = opened
    try:
        stamps = [st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns, st.st_mtime_ns, time.time_ns()]
        if known is not None and len(known[1]) == 6 and known[1][:5] == stamps[:5] \
                and treewalk.settled(known[1][3], known[1][5], _SETTLE_NS) \
                and treewalk.fine_local_ctime(fd, st.st_dev):
            return known[0], known[1]
        digest = hash_fd(fd, _MAX_HASHED_INDEX, budget)
    finally:
        os.close(fd)
    if not digest:
        return never_equal("an index too large to compare"), []
    return f"an index that cannot be parsed:{digest}", stamps
