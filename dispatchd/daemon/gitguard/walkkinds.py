"""What the worktree walk (``runnables``) asks of one directory entry or
one directory's place, without following a symlink: its kind, whether a
directory's entries make it a git directory, whether a symlink's text names
a place the walk does not look into; ``Node``, a directory's place held as
its parent's and its name (never its whole path: a walk's pending
directories cost their names, not their depth times their width); and
``Lender``, a directory reached again by name and the rights lent to one a
session made unreadable given back.
"""

from __future__ import annotations

import errno
import os
import stat

from dispatchd.daemon.gitguard import fs

# Inside a git directory: large, and nothing there runs.
GIT_BULK = frozenset(("objects", "refs", "logs", "lfs"))
# Names that make a directory one git enters (``looks_git``), looked for as a listing is read.
GIT_SIGNS = frozenset(("HEAD", "objects", "refs", "commondir", ".git"))
PATH_EVERY = 64  # a node of every this many levels keeps its path: one is built from at most this many names


class Node:
    """A directory of the walk: its parent's node (None for the worktree's
    own), its name, its depth in directories and the length in bytes of its
    worktree-relative path, known without building it."""

    __slots__ = ("parent", "name", "depth", "size", "_path")

    def __init__(self, parent: Node | None, name: str) -> None:
        self.parent = parent
        self.name = name
        self.depth: int = parent.depth + 1 if parent is not None else 0
        own = len(name.encode("utf-8", "surrogateescape"))
        self.size: int = (parent.size + 1 + own if parent.depth else own) if parent is not None else 0
        self._path: str | None = None

    def path(self) -> str:
        """The worktree-relative path (``""`` for the worktree), built from
        the names up to the nearest ancestor that keeps its own; only every
        ``PATH_EVERY``-th level keeps it, so what the walk holds of paths is
        its depth over that times a path, whatever its width."""
        names: list[str] = []
        node: Node | None = self
        while node is not None and node.parent is not None and node._path is None:
            names.append(node.name)
            node = node.parent
        base = node._path if node is not None and node._path is not None else ""
        names.reverse()
        built = "/".join([base, *names] if base else names)
        if self.depth % PATH_EVERY == 0:
            self._path = built
        return built

    def top(self, parts: int) -> str:
        """The first ``parts`` names of the path (for a message)."""
        names: list[str] = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            names.append(node.name)
            node = node.parent
        return "/".join(reversed(names[-parts:]))


class Lender:
    """What of a walk reaches directories again and gives back the rights
    it lent: directories a session made unreadable are opened after giving
    their owner (the user, so the daemon) read and search rights back for
    the walk (``lent``: directory fd -> its O_PATH fd, the mode to put back)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.lent: dict[int, tuple[int, int]] = {}

    def open_dir(self, dir_fd: int, name: str) -> int | None:
        raise NotImplementedError

    def _reopen(self, rel: str) -> int | None:
        """The directory at ``rel`` (a wide tree's directories past
        ``MAX_OPEN`` held descriptors), reached from the worktree without
        following a symlink (``fs.path_below``), and opened as ``open_dir``
        opens one: a directory made unreadable is lent its owner's rights."""
        parent, _, name = rel.rpartition("/")
        top = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            below = fs.path_below(top, parent, lend=True) if parent else os.dup(top)
        finally:
            os.close(top)
        if below is None:
            return None
        try:
            try:
                return self.open_dir(below, name)
            except PermissionError:  # below, a directory the session made unsearchable
                with fs.lent(below):
                    return self.open_dir(below, name)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None  # gone or replaced meanwhile
            raise
        finally:
            os.close(below)

    def _give_back(self, fd: int) -> None:
        lent = self.lent.pop(fd, None)
        if lent is not None:
            path_fd, mode = lent
            try:
                fs.give_back(path_fd, mode)
            finally:
                os.close(path_fd)


def looks_git(names: set[str] | frozenset[str]) -> bool:
    """Whether a directory of these entries is one git enters as a git
    directory: a ``HEAD`` with ``objects`` and ``refs`` beside it, or with a
    ``commondir`` naming where they are (git looks for them there)."""
    return "HEAD" in names and ({"objects", "refs"} <= names or "commondir" in names)


def into_blind_spot(fd: int, name: str, rel: str) -> bool:
    """Whether the symlink ``name`` (in the directory ``rel``) names a path
    through a git directory or its bulk (``.git``, ``objects``, ``refs``,
    ``logs``, ``lfs``): places the walk does not look into, where a
    repository can be hidden and then reached by ``cd`` through the link.
    Read as its text says (lexically); a chain of links passes through one
    whose text does, and that one is caught."""
    try:
        target = os.readlink(name, dir_fd=fd)
    except OSError:
        return False
    if os.path.isabs(target):
        # Through the kernel's own links (a process's cwd, root, descriptors)
        # a text names anything: recorded whatever it says next. Otherwise
        # read as the kernel reads it (``//``, ``/./``, ``..`` taken away),
        # wherever it points: a path through another repository's bulk is as blind.
        normal = os.path.normpath(target)
        if normal.startswith(("/proc/", "/dev/fd")) or normal in ("/proc", "/dev/fd"):
            return True
        parts = normal.split("/")
    else:
        parts = os.path.normpath(os.path.join(rel, target)).split("/")
    return ".git" in parts or not GIT_BULK.isdisjoint(parts)


def not_regular(fd: int, name: str) -> bool:
    try:
        return not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def kind(entry: os.DirEntry[str]) -> str:
    try:
        if entry.is_symlink():
            return "symlink"
        return "dir" if entry.is_dir(follow_symlinks=False) else "other"
    except OSError:
        return "other"


def open_dir(dir_fd: int, name: str) -> int | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    return fd
