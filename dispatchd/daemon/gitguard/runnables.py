"""The worktree walked for what the user's own tools act on: repositories
made anywhere below it, and the files editors, agents and shells run.

A session can leave, anywhere in its worktree, something the user's tools
later run without asking: a new repository (``sub/.git`` with a
``core.fsmonitor``; a directory that looks like a bare repository, which git
also enters), a gitfile naming a git directory of the session's choosing,
``.vscode/tasks.json`` (run when the folder opens), ``.mcp.json`` (servers
the user's agent starts), ``.envrc`` (direnv), shell start-up files. ``take``
records each such thing by content; ``changes`` lists what a later walk
found new or different; ``quarantine`` moves those aside, within their own
directory, to an unguessable name (``fs.move_aside_at``: renamed, never
deleted).

Guarantees:
- the walk is iterative (no recursion: any depth a session makes is a loop,
  not a stack), goes by directory descriptors opened ``O_NOFOLLOW`` from the
  worktree's (a symlink is recorded, never entered), and is bounded in
  entries, directories, depth and bytes hashed: over a bound it stops and
  says so (``complete`` False, ``why``), and the caller fails closed (the
  close says so); at a session's end (``ending``) a directory past the depth
  bound is the session's (no baseline has one) and is moved aside instead;
- a git directory (``.git``, or a directory holding ``HEAD`` with ``objects``
  and ``refs``, or with a ``commondir`` naming where they are) is recorded by what git reads from it for configuration or
  commands (``digests.fingerprint``), and a changed or new one loses
  those files only (its objects and refs stay where they are);
- a protected name (the policy's ``protect.paths``, ``DEFAULT_PROTECTED`` by default) matches a
  file or directory of that name at any depth; everything below a protected
  directory is protected too. A new protected directory is moved aside whole,
  a changed file alone;
- the roots in ``excluded`` (worktrees checked under baselines of their own)
  and the worktree's own ``.git`` when ``snapshots`` covers it are not
  walked; a symlink whose text names a path through a git directory or its
  bulk, where the walk does not look, or through the kernel's own links
  (``/proc/self/cwd/...``), is recorded (``_into_blind_spot``): a
  repository hidden there (``.git/objects/tools``) and reached by ``cd``
  through a new link loses the link;
- the worktree's root itself, made to look like a git directory (a
  ``HEAD`` with ``objects`` and ``refs``, or with a ``commondir``: git enters
  it when no ``.git`` is found first), has what git reads there recorded.
"""

from __future__ import annotations

import errno
import os
import stat
import time

import msgspec

from dispatchd import treewalk
from dispatchd.daemon.gitguard import fs, keptfiles
from dispatchd.daemon.gitguard.digests import Budget, digest_at, fingerprint, never_equal
from dispatchd.inside import is_within, outermost
from dispatchd.policy import DEFAULT_PROTECTED

MAX_ENTRIES = 2_000_000
MAX_DIRS = 250_000
MAX_DEPTH = 4096
MAX_OPEN = 256  # directory descriptors a walk holds at once; past it, directories are reached again by name
# Inside a git directory: large, and nothing there runs.
_GIT_BULK = frozenset(("objects", "refs", "logs", "lfs"))
# A directory's listing is reused only if its ctime is older than this
# before the walk began: the kernel stamps a change with a clock that lags by
# up to a tick, so a change after the walk began always gets a later ctime.
SETTLE_NS = 50_000_000
MAX_REMEMBERED = 200_000  # listings remembered, per set of protected names
# Files git opens to read wherever they are in a worktree (a FIFO there hangs the user's git).
_GIT_READS = frozenset((".gitignore", ".gitattributes", ".mailmap", ".gitmodules"))


class _Listing(msgspec.Struct, frozen=True, array_like=True):
    """What the walk needs of a plain directory (nothing protected, no git
    in it or around it): its subdirectories, its entry count, and the stamps
    of the directory when it was listed."""

    ctime_ns: int
    mtime_ns: int
    size: int
    count: int
    subdirs: tuple[str, ...]


# (device, inode) of a directory -> its last listing, for each set of
# protected names (whether a directory is plain depends on them). Never
# written to disk: a daemon that starts walks everything.
_REMEMBERED: dict[frozenset[str], dict[tuple[int, int], _Listing]] = {}


class TreeSnapshot(msgspec.Struct, frozen=True):
    """Worktree-relative path -> digest: ``gitdir`` for a git directory (its
    files follow as ``PATH/config``...), ``directory`` for a protected one,
    else a file's or symlink's digest (``digests.digest_at``)."""

    entries: dict[str, str] = {}
    complete: bool = True
    why: str = ""  # when not complete: the bound it reached
    # A baseline's: the config and hooks of the repositories found, by bytes,
    # to put back where a session changed or deleted them (``keptfiles.read_tree``).
    kept: list[keptfiles.Kept] = []


class _Walk:
    def __init__(self, root: str, names: frozenset[str], excluded: list[str], skip_root_git: bool,
                 ending: bool = False) -> None:
        self.root = root
        self.ending = ending
        self.names = names
        self.excluded = [os.path.relpath(e, root) for e in excluded if e != root and is_within(e, root)]
        self.skip_root_git = skip_root_git
        self.entries: dict[str, str] = {}
        self.budget = Budget()
        self.count = 0
        self.dirs = 0
        self.why = ""
        # Directories a session made unreadable, opened after giving their
        # owner (the user, so the daemon) read and search rights back for
        # the walk: directory fd -> (its O_PATH fd, the mode to put back).
        self.lent: dict[int, tuple[int, int]] = {}
        self.held = 0  # directory descriptors held in the walk's pending list
        self.remembered = _REMEMBERED.setdefault(names, {})
        self.settled_before = time.time_ns() - SETTLE_NS
        self.reused = 0  # directories whose listing was reused

    def run(self) -> None:
        top = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # (directory fd, or -1 to reach it again by name, its worktree-relative
        # path, below a protected name, inside a git directory)
        pending: list[tuple[int, str, bool, bool]] = [(top, "", False, False)]
        self.held = 1
        try:
            while pending:
                fd, rel, protected, in_git = pending.pop()
                if fd < 0:
                    reopened = self._reopen(rel)
                    if reopened is None:
                        continue  # gone meanwhile
                    fd = reopened
                else:
                    self.held -= 1
                try:
                    self._directory(fd, rel, protected, in_git, pending)
                finally:
                    self._give_back(fd)
                    os.close(fd)
                if self.why:
                    return
        finally:
            for fd, *_ in pending:
                if fd >= 0:
                    self._give_back(fd)
                    os.close(fd)

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

    def _push(self, pending: list[tuple[int, str, bool, bool]], dir_fd: int, name: str, rel: str,
              protected: bool, in_git: bool) -> None:
        if self.held >= MAX_OPEN:
            pending.append((-1, rel, protected, in_git))
            return
        sub = self.open_dir(dir_fd, name)
        if sub is not None:
            self.held += 1
            pending.append((sub, rel, protected, in_git))

    def _give_back(self, fd: int) -> None:
        lent = self.lent.pop(fd, None)
        if lent is not None:
            path_fd, mode = lent
            try:
                fs.give_back(path_fd, mode)
            finally:
                os.close(path_fd)

    def open_dir(self, dir_fd: int, name: str) -> int | None:
        """A directory below ``dir_fd`` for listing, never through a symlink;
        one the session made unreadable is made readable for the walk, and
        its mode put back once its entries are opened (the daemon is its
        owner: nothing below it goes unchecked)."""
        try:
            return _open_dir(dir_fd, name)
        except PermissionError:
            pass
        path_fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            mode = fs.lend(path_fd)
            try:
                fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except BaseException:
                fs.give_back(path_fd, mode)  # not listed: as the session left it
                raise
        except BaseException:
            os.close(path_fd)
            raise
        self.lent[fd] = (path_fd, mode)
        return fd

    def _directory(self, fd: int, rel: str, protected: bool, in_git: bool,
                   pending: list[tuple[int, str, bool, bool]]) -> None:
        self.dirs += 1
        if self.dirs > MAX_DIRS:
            self.why = f"more than {MAX_DIRS} directories"
            return
        if rel.count("/") >= MAX_DEPTH:
            if self.ending:
                # Deeper than any baseline can be (an open over it is refused):
                # the session's, moved aside whole rather than the walk given
                # up (the rest of the tree, where a plant may wait, walked on).
                self.entries[rel] = never_equal(f"deeper than {MAX_DEPTH} directories")
                return
            first = rel.split("/", 3)
            self.why = (f"deeper than {MAX_DEPTH} directories (below {'/'.join(first[:3])}/...; remove that "
                        "chain to open sessions here)")
            return
        st = None
        if not (protected or in_git or fd in self.lent):
            # A plain directory whose ctime, inode, mtime and size are those
            # of a listing made before: its entries are the same names of
            # the same kinds (any entry added, removed, renamed or replaced
            # sets its ctime, which no process can set back). Only its
            # subdirectories matter then: nothing in it is protected or git.
            st = os.fstat(fd)
            if not treewalk.fine_local_ctime(fd, st.st_dev):
                st = None  # a ctime this kernel does not keep (NFS, FUSE): listed every time
        if st is not None:
            seen = self.remembered.get((st.st_dev, st.st_ino))
            if seen is not None and (seen.ctime_ns, seen.mtime_ns, seen.size) == (
                    st.st_ctime_ns, st.st_mtime_ns, st.st_size):
                self.reused += 1
                self.count += seen.count
                if self.count > MAX_ENTRIES:
                    self.why = f"more than {MAX_ENTRIES} entries"
                    return
                for name in seen.subdirs:
                    child = f"{rel}/{name}" if rel else name
                    if child in self.excluded or self._unchanged_leaf(fd, name, child, st.st_dev):
                        if self.why:
                            return
                        continue
                    self._push(pending, fd, name, child, False, False)
                return
        try:
            with os.scandir(fd) as listing:
                found = [(e.name, _kind(e)) for e in listing]
        except OSError as exc:
            # A directory the session made unreadable may hide anything: the
            # user's tools would see it once the user makes it readable.
            self.entries[rel or "."] = never_equal(f"unreadable {exc.errno}")
            return
        self.count += len(found)
        if self.count > MAX_ENTRIES:
            self.why = f"more than {MAX_ENTRIES} entries"
            return
        names = {name for name, _ in found}
        looks_git = _looks_git(names)
        if st is not None and treewalk.settled(st.st_ctime_ns, self.settled_before + SETTLE_NS, SETTLE_NS) \
                and ".git" not in names and not looks_git and names.isdisjoint(self.names):
            if len(self.remembered) >= MAX_REMEMBERED:
                self.remembered.clear()
            self.remembered[(st.st_dev, st.st_ino)] = _Listing(
                st.st_ctime_ns, st.st_mtime_ns, st.st_size, len(found),
                tuple(name for name, kind in found if kind == "dir"))
        if looks_git:
            if rel:
                self._gitdir(fd, rel)
                in_git = True
            else:
                # The worktree itself made to look like a git directory: git
                # enters it when it finds no .git first (a monorepo's
                # subdirectory, a directory in no repository). What git reads
                # there is recorded, its HEAD first (a new one moved aside, git
                # no longer takes the directory for one); directories of those
                # names are the project's (a ``config/``): the rest is walked as
                # a worktree still.
                self.entries["HEAD"] = digest_at(fd, "HEAD", self.budget) or "absent"
                self.entries.update((k, v) for k, v in fingerprint(fd, self.budget, review=False).items()
                                    if v != "directory")
                self._no_fifos(fd, "")
        for name, kind in found:
            child = f"{rel}/{name}" if rel else name
            if child in self.excluded:
                if kind != "dir":  # another part's root replaced (a symlink to a tree that part walks through)
                    self.entries[child] = digest_at(fd, name, self.budget) or "absent"
                continue
            if kind == "other" and name in _GIT_READS and _not_regular(fd, name):
                # A FIFO (or a socket, a device) where git opens a file to read
                # it (.gitignore at any depth): the user's git waits on it for good.
                self.entries[child] = digest_at(fd, name, self.budget) or "absent"
                continue
            if name == ".git":
                if not rel and self.skip_root_git:
                    continue
                if kind == "dir":
                    sub = self.open_dir(fd, name)
                    if sub is None:
                        continue
                    try:
                        self._gitdir(sub, child)
                    finally:
                        self._give_back(sub)
                        os.close(sub)
                    self._push(pending, fd, name, child, protected, True)
                else:
                    self.entries[child] = "gitfile:" + (digest_at(fd, name, self.budget) or "absent")
                continue
            mark = protected or name in self.names
            if kind == "symlink" and not mark and _into_blind_spot(fd, name, rel):
                mark = True  # recorded: a new one is moved aside (its target is not)
            if mark:
                digest = digest_at(fd, name, self.budget)
                if digest is not None:
                    self.entries[child] = digest
            if kind == "dir" and not (in_git and name in _GIT_BULK):
                if not (mark or in_git) and st is not None and self._unchanged_leaf(fd, name, child, st.st_dev):
                    if self.why:
                        return
                    continue
                self._push(pending, fd, name, child, mark, in_git)

    def _unchanged_leaf(self, dir_fd: int, name: str, rel: str, dev: int) -> bool:
        """True for a subdirectory of a reused listing that is itself a
        remembered listing with no subdirectories, unchanged: counted from
        a ``stat`` by name below ``dir_fd`` (no symlink followed), never
        opened; there is nothing below it to walk. False: walk it as any
        other (opened by descriptor), whatever the reason: another file
        system (its ctime not known to be kept), not remembered, changed,
        over a bound (the walk says which)."""
        if not self.remembered or rel.count("/") >= MAX_DEPTH or self.dirs >= MAX_DIRS:
            return False  # (nothing remembered yet, a first walk: no stat that cannot pay)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            return False
        if st.st_dev != dev or not stat.S_ISDIR(st.st_mode):
            return False
        seen = self.remembered.get((st.st_dev, st.st_ino))
        if seen is None or seen.subdirs or (seen.ctime_ns, seen.mtime_ns, seen.size) != (
                st.st_ctime_ns, st.st_mtime_ns, st.st_size):
            return False
        self.dirs += 1
        self.reused += 1
        self.count += seen.count
        if self.count > MAX_ENTRIES:
            self.why = f"more than {MAX_ENTRIES} entries"
        return True

    def _gitdir(self, fd: int, rel: str) -> None:
        self.entries[rel] = "gitdir"
        for name, digest in fingerprint(fd, self.budget, review=False).items():
            self.entries[f"{rel}/{name}"] = digest
        self._no_fifos(fd, rel)

    def _no_fifos(self, fd: int, rel: str) -> None:
        """A FIFO, socket or device among a git directory's own entries
        (``HEAD`` a FIFO: git opens it blocking, and the user's ``git status``
        outside hung on a new ``sub/.git`` for good) is recorded: new, moved aside."""
        try:
            with os.scandir(fd) as listing:
                odd = [e.name for e in listing if _kind(e) == "other" and _not_regular(fd, e.name)]
        except OSError:
            return
        for name in odd:
            self.entries[f"{rel}/{name}" if rel else name] = digest_at(fd, name, self.budget) or "absent"


def _looks_git(names: set[str]) -> bool:
    """Whether a directory of these entries is one git enters as a git
    directory: a ``HEAD`` with ``objects`` and ``refs`` beside it, or with a
    ``commondir`` naming where they are (git looks for them there)."""
    return "HEAD" in names and ({"objects", "refs"} <= names or "commondir" in names)


def _into_blind_spot(fd: int, name: str, rel: str) -> bool:
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
    return ".git" in parts or not _GIT_BULK.isdisjoint(parts)


def _not_regular(fd: int, name: str) -> bool:
    try:
        return not stat.S_ISREG(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _kind(entry: os.DirEntry[str]) -> str:
    try:
        if entry.is_symlink():
            return "symlink"
        return "dir" if entry.is_dir(follow_symlinks=False) else "other"
    except OSError:
        return "other"


def _open_dir(dir_fd: int, name: str) -> int | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise
    return fd


def take(root: str, names: tuple[str, ...] = DEFAULT_PROTECTED, *, excluded: list[str] | None = None,
         skip_root_git: bool = True, ending: bool = False) -> TreeSnapshot:
    """Walk ``root`` (see the module); ``ending``: at a session's end, a
    directory past the depth bound is recorded as changed (moved aside)
    rather than the walk stopped."""
    walk = _Walk(root, frozenset(names), excluded or [], skip_root_git, ending)
    try:
        walk.run()
    except OSError as exc:
        walk.why = walk.why or f"cannot be walked: {exc.strerror} ({exc.filename or root})"
    return TreeSnapshot(entries=walk.entries, complete=not walk.why, why=walk.why)


def changes(before: TreeSnapshot, now: TreeSnapshot) -> list[str]:
    """What to move aside (worktree-relative, outermost first, none inside
    another): new or changed files and symlinks, new protected directories
    whole; a git directory's changed or new configuration and hooks, never
    the git directory itself."""
    found: list[str] = []
    for rel, digest in now.entries.items():
        old = before.entries.get(rel)
        if old == digest or digest == "gitdir":
            continue
        if digest == "directory" and old is not None:
            continue
        found.append(rel)
    return outermost(found)


def quarantine(root: str, todo: list[str]) -> tuple[list[str], list[str]]:
    """Move aside each of ``todo`` (``changes``' list) once the sessions'
    processes are gone; returns the new names (absolute) and what could not
    be moved, with why."""
    return fs.move_all_below_aside(root, todo)
