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
  entries, directories, depth, a path's length, bytes hashed and bytes
  recorded: over a bound it stops and says so (``complete`` False, ``why``),
  and the caller fails closed (the close says so); so does a walk out of
  memory. At a session's end (``ending``) a directory past the depth or the
  path's bound is the session's (no baseline has one) and is moved aside
  instead;
- what it holds is bounded by those bounds, never by their product: a
  pending directory is its name and its parent's node (``walkkinds.Node``),
  its path built only to record or reach it (1,000 levels of 250-byte names
  over 5,000 directories held 1.25 GB of paths; 250 GB were allowed); a
  listing keeps only the entries recorded and the subdirectories' names;
- a git directory (``.git``, or a directory holding ``HEAD`` with ``objects``
  and ``refs``, or with a ``commondir`` naming where they are) is recorded by
  what git reads from it for configuration or commands
  (``digests.fingerprint``), and a changed or new one loses those files
  only (its objects and refs stay where they are). Its bulk (``objects``,
  ``refs``, ``logs``, ``lfs``) is not walked below a ``.git``, inside a git
  directory, at a baseline, or at an end for one the baseline recorded; a
  new one elsewhere (``HEAD`` and ``refs`` put beside a project's own
  ``app/objects/``) has its bulk walked as the worktree, so a repository or
  an ``.envrc`` planted there is still found;
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
from dispatchd.daemon.gitguard.walkkinds import GIT_BULK, GIT_SIGNS, PATH_EVERY, Lender, Node
from dispatchd.daemon.gitguard.walkkinds import into_blind_spot as _into_blind_spot
from dispatchd.daemon.gitguard.walkkinds import kind as _kind
from dispatchd.daemon.gitguard.walkkinds import looks_git as _looks_git
from dispatchd.daemon.gitguard.walkkinds import not_regular as _not_regular
from dispatchd.daemon.gitguard.walkkinds import open_dir as _open_dir
from dispatchd.inside import is_within, outermost
from dispatchd.policy import DEFAULT_PROTECTED

MAX_ENTRIES = 2_000_000
MAX_DIRS = 250_000
MAX_DEPTH = 4096
MAX_PATH = 64 * 1024  # bytes of a worktree-relative directory path: past it, as past MAX_DEPTH
MAX_RECORDED = 128 * 1024 * 1024  # bytes of paths and digests one walk records, with
_OVERHEAD = 256  # what an entry costs besides (its strings' headers, its slot, its inode's look)
MAX_OPEN = 256  # directory descriptors a walk holds at once; past it, directories are reached again by name
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
    nlinks: dict[str, int] | None = None  # a baseline's ``hardlinks.counts`` (None: an older record's)


_Pending = tuple[int, Node, bool, bool]  # (directory fd or -1: reached again by name, its node, below a protected name, inside a git directory)


class _Walk(Lender):
    def __init__(self, root: str, names: frozenset[str], excluded: list[str], skip_root_git: bool,
                 ending: bool = False, known_git: frozenset[str] = frozenset()) -> None:
        super().__init__(root)
        self.ending = ending
        self.names = names
        self.excluded = {os.path.relpath(e, root) for e in excluded if e != root and is_within(e, root)}
        self.excluded_names = {rel.rpartition("/")[2] for rel in self.excluded}
        self.skip_root_git = skip_root_git
        self.known_git = known_git  # the baseline's git directories (at an end)
        self.entries: dict[str, str] = {}
        self.recorded = 0  # bytes of the paths and digests in ``entries``
        self.budget = Budget()
        self.count = 0
        self.dirs = 0
        self.why = ""
        self.held = 0  # directory descriptors held in the walk's pending list
        self.remembered = _REMEMBERED.setdefault(names, {})
        self.settled_before = time.time_ns() - SETTLE_NS
        self.reused = 0  # directories whose listing was reused

    def run(self) -> None:
        top = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        pending: list[_Pending] = [(top, Node(None, ""), False, False)]
        self.held = 1
        try:
            while pending:
                fd, node, protected, in_git = pending.pop()
                if fd < 0:
                    reopened = self._reopen(node.path())
                    if reopened is None:
                        continue  # gone meanwhile
                    fd = reopened
                else:
                    self.held -= 1
                try:
                    self._directory(fd, node, protected, in_git, pending)
                finally:
                    self._give_back(fd)
                    os.close(fd)
                if self.why:
                    return
        finally:
            for item in pending:
                if item[0] >= 0:
                    self._give_back(item[0])
                    os.close(item[0])

    def _record(self, rel: str, digest: str) -> None:
        """``rel`` recorded; past ``MAX_RECORDED`` bytes of paths and digests the walk stops, saying so."""
        if rel not in self.entries:
            self.recorded += len(rel) + len(digest) + _OVERHEAD
            if self.recorded > MAX_RECORDED:
                self.why = self.why or f"more than {MAX_RECORDED >> 20} MiB of paths to record"
        self.entries[rel] = digest

    def _push(self, pending: list[_Pending], dir_fd: int, node: Node, protected: bool, in_git: bool) -> None:
        if self.held >= MAX_OPEN:
            pending.append((-1, node, protected, in_git))
            return
        sub = self.open_dir(dir_fd, node.name)
        if sub is not None:
            self.held += 1
            pending.append((sub, node, protected, in_git))

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

    def _too_deep(self, node: Node) -> bool:
        """Past the depth or the path's length: at an end the session's (no
        baseline has one: an open over it is refused), moved aside whole
        rather than the walk given up (the rest of the tree, where a plant
        may wait, walked on); at a baseline the walk stops, saying where."""
        if node.depth <= MAX_DEPTH and node.size <= MAX_PATH:
            return False
        what = (f"deeper than {MAX_DEPTH} directories" if node.depth > MAX_DEPTH
                else f"a path longer than {MAX_PATH} bytes")
        if self.ending:
            self._record(node.path(), never_equal(what))
        else:
            self.why = f"{what} (below {node.top(3)}/...; remove that chain to open sessions here)"
        return True

    def _directory(self, fd: int, node: Node, protected: bool, in_git: bool, pending: list[_Pending]) -> None:
        self.dirs += 1
        if self.dirs > MAX_DIRS:
            self.why = f"more than {MAX_DIRS} directories"
            return
        if self._too_deep(node):
            return
        if node.depth % PATH_EVERY == 0:
            node.path()  # kept: a deeper one's path is built from here
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
                    child = Node(node, name)
                    if self._excluded(child) or self._unchanged_leaf(fd, child, st.st_dev):
                        if self.why:
                            return
                        continue
                    self._push(pending, fd, child, False, False)
                return
        found = self._list(fd, node, protected)
        if found is None:
            return
        signs, subdirs, count = found[1], found[2], found[3]
        looks_git = _looks_git(signs)
        if st is not None and treewalk.settled(st.st_ctime_ns, self.settled_before + SETTLE_NS, SETTLE_NS) \
                and not signs & {".git", "protected"} and not looks_git:
            if len(self.remembered) >= MAX_REMEMBERED:
                self.remembered.clear()
            self.remembered[(st.st_dev, st.st_ino)] = _Listing(st.st_ctime_ns, st.st_mtime_ns, st.st_size,
                                                               count, tuple(subdirs))
        rel = node.path() if looks_git or found[0] else ""
        if looks_git:
            if rel:
                self._gitdir(fd, rel)
                # Its bulk is left unwalked only where git keeps it: inside a
                # git directory, or one the baseline recorded. A new look-alike
                # beside the project's own ``objects/`` hides nothing there.
                in_git = in_git or not self.ending or rel in self.known_git
            else:
                # The worktree itself made to look like a git directory: git
                # enters it when it finds no .git first (a monorepo's
                # subdirectory, a directory in no repository). What git reads
                # there is recorded, its HEAD first (a new one moved aside, git
                # no longer takes the directory for one); directories of those
                # names are the project's (a ``config/``): the rest is walked as
                # a worktree still.
                self._record("HEAD", digest_at(fd, "HEAD", self.budget) or "absent")
                for k, v in fingerprint(fd, self.budget, review=False).items():
                    if v != "directory":
                        self._record(k, v)
                self._no_fifos(fd, "")
        for name, kind, mark in found[0]:
            self._entry(fd, node, f"{rel}/{name}" if rel else name, name, kind, mark)
        if self.why:
            return
        for name in subdirs:
            self._subdir(fd, Node(node, name), protected, in_git, st, pending)
            if self.why:
                return

    def _list(self, fd: int, node: Node, protected: bool
              ) -> tuple[list[tuple[str, str, bool]], set[str], list[str], int] | None:
        """A directory's entries, read as they come: counted, bounded as they
        are read; kept only those the walk records (every one below a
        protected name; ``.git``, protected names, links, what git reads)
        and its subdirectories' names. None: not to be walked on (the walk
        says why, or an unreadable directory is recorded)."""
        kept: list[tuple[str, str, bool]] = []  # (name, kind, recorded whatever it is)
        signs: set[str] = set()
        subdirs: list[str] = []
        count = held = 0
        rel: str | None = None
        try:
            with os.scandir(fd) as listing:
                for entry in listing:
                    count += 1
                    if self.count + count > MAX_ENTRIES:
                        self.why = f"more than {MAX_ENTRIES} entries"
                        return None
                    name, kind = entry.name, _kind(entry)
                    if name in GIT_SIGNS:
                        signs.add(name)
                    named = name in self.names
                    if named:
                        signs.add("protected")
                    if kind == "dir":
                        if self.dirs + len(subdirs) >= MAX_DIRS:
                            self.why = f"more than {MAX_DIRS} directories"
                            return None
                        subdirs.append(name)
                    # Another part's root itself is its walk's, not a name like it elsewhere.
                    if kind == "symlink" and not (protected or named or name == ".git" or (
                            name in self.excluded_names and f"{node.path()}/{name}".lstrip("/") in self.excluded)):
                        rel = node.path() if rel is None else rel
                        named = _into_blind_spot(fd, name, rel)  # recorded: a new one is moved aside (not its target)
                    if protected or named or name == ".git" or name in _GIT_READS or name in self.excluded_names:
                        kept.append((name, kind, protected or named))
                        held += len(name) + _OVERHEAD
                        if self.recorded + held > MAX_RECORDED:
                            self.why = f"more than {MAX_RECORDED >> 20} MiB of paths to record"
                            return None
        except OSError as exc:
            # A directory the session made unreadable may hide anything: the
            # user's tools would see it once the user makes it readable.
            self._record(node.path() or ".", never_equal(f"unreadable {exc.errno}"))
            return None
        self.count += count
        return kept, signs, subdirs, count

    def _excluded(self, node: Node) -> bool:
        return bool(self.excluded) and node.name in self.excluded_names and node.path() in self.excluded

    def _entry(self, fd: int, node: Node, child: str, name: str, kind: str, mark: bool) -> None:
        """One entry the listing kept, recorded as it is; ``mark``: below or
        at a protected name, or a link into a blind spot."""
        if name in self.excluded_names and child in self.excluded:
            if kind != "dir":  # another part's root replaced (a symlink to a tree that part walks through)
                self._record(child, digest_at(fd, name, self.budget) or "absent")
            return
        if kind == "other" and name in _GIT_READS and _not_regular(fd, name):
            # A FIFO (or a socket, a device) where git opens a file to read
            # it (.gitignore at any depth): the user's git waits on it for good.
            self._record(child, digest_at(fd, name, self.budget) or "absent")
            return
        if name == ".git":
            if not node.depth and self.skip_root_git:
                return
            if kind == "dir":
                sub = self.open_dir(fd, name)
                if sub is None:
                    return
                try:
                    self._gitdir(sub, child)
                finally:
                    self._give_back(sub)
                    os.close(sub)
            else:
                self._record(child, "gitfile:" + (digest_at(fd, name, self.budget) or "absent"))
            return
        if mark:
            digest = digest_at(fd, name, self.budget)
            if digest is not None:
                self._record(child, digest)

    def _subdir(self, fd: int, child: Node, protected: bool, in_git: bool, st: os.stat_result | None,
                pending: list[_Pending]) -> None:
        name = child.name
        if self._excluded(child):
            return
        if name == ".git":
            if not (child.depth == 1 and self.skip_root_git):
                self._push(pending, fd, child, protected, True)
            return
        if in_git and name in GIT_BULK:
            return
        mark = protected or name in self.names
        if not (mark or in_git) and st is not None and self._unchanged_leaf(fd, child, st.st_dev):
            return
        self._push(pending, fd, child, mark, in_git)

    def _unchanged_leaf(self, dir_fd: int, node: Node, dev: int) -> bool:
        """True for a subdirectory of a reused listing that is itself a
        remembered listing with no subdirectories, unchanged: counted from
        a ``stat`` by name below ``dir_fd`` (no symlink followed), never
        opened; there is nothing below it to walk. False: walk it as any
        other (opened by descriptor), whatever the reason: another file
        system (its ctime not known to be kept), not remembered, changed,
        over a bound (the walk says which)."""
        if not self.remembered or node.depth > MAX_DEPTH or node.size > MAX_PATH or self.dirs >= MAX_DIRS:
            return False  # (nothing remembered yet, a first walk: no stat that cannot pay)
        try:
            st = os.stat(node.name, dir_fd=dir_fd, follow_symlinks=False)
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
        self._record(rel, "gitdir")
        for name, digest in fingerprint(fd, self.budget, review=False).items():
            self._record(f"{rel}/{name}", digest)
        self._no_fifos(fd, rel)

    def _no_fifos(self, fd: int, rel: str) -> None:
        """A FIFO, socket or device among a git directory's own entries
        (``HEAD`` a FIFO: git opens it blocking, and the user's ``git status``
        outside hung on a new ``sub/.git`` for good) is recorded: new, moved aside."""
        try:
            with os.scandir(fd) as listing:
                for e in listing:
                    if _kind(e) == "other" and _not_regular(fd, e.name):
                        self._record(f"{rel}/{e.name}" if rel else e.name, digest_at(fd, e.name, self.budget) or "absent")
                        if self.why:
                            return
        except OSError:
            return


def take(root: str, names: tuple[str, ...] = DEFAULT_PROTECTED, *, excluded: list[str] | None = None,
         skip_root_git: bool = True, ending: bool = False, before: TreeSnapshot | None = None) -> TreeSnapshot:
    """Walk ``root`` (see the module); ``ending``: at a session's end, a
    directory past the depth or path bound is recorded as changed (moved
    aside) rather than the walk stopped, and the bulk of a git directory
    neither named ``.git``, nor inside one, nor a git directory in
    ``before`` (the baseline) is walked. Out of memory, the walk is
    incomplete as over a bound (the caller fails closed)."""
    known = frozenset(rel for rel, digest in before.entries.items() if digest == "gitdir") if before else frozenset()
    walk = _Walk(root, frozenset(names), excluded or [], skip_root_git, ending, known)
    out_of_memory = False
    try:
        walk.run()
    except OSError as exc:
        walk.why = walk.why or f"cannot be walked: {exc.strerror} ({exc.filename or root})"
    except MemoryError:
        out_of_memory = True  # (what the walk held is let go once out of this handler)
    if out_of_memory:
        walk.entries = {}
        return TreeSnapshot(entries={}, complete=False, why="ran out of memory walking it")
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
