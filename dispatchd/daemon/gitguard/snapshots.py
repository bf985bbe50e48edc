"""What the user's git reads for configuration or hooks, by content, at open
and at the end of a session; and moving aside what a session changed.

Read-only binds hold names, and a session can rename the directory around a
name (``.git/modules/sub``, ``.git/modules``, a submodule's worktree) and
build a new one in its place, or make a git directory where there was none
(a submodule of a submodule). This module does not care how: it records, for
every git directory of a repository, the content of what git reads from it
for configuration or commands — ``config``, ``config.worktree``,
``commondir``, ``info/attributes`` and every entry of ``hooks`` (content and
mode, a symlink by its target; ``*.sample`` never runs) — and the content of
every gitfile (a submodule's ``.git`` file or symlink) with where it leads;
``take`` walks, and
``quarantine`` compares two walks by content (never by name, inode or time)
and moves aside, to an unguessable name beside it:

- a submodule's git directory (``.git/modules/**``, an in-place ``sub/.git``,
  or wherever a gitfile inside the worktree leads) that is new or whose
  recorded content differs: whole (the user's git then finds no repository
  there: it runs nothing, and says so);
- in the repository's own ``.git`` and in the entries of its other linked
  worktrees (``.git/worktrees/N``), each changed or new file only: moving the
  ``.git`` whole would leave the worktree no repository, and the user's git
  would look for one in a directory above;
- a gitfile that is new or differs (content, or where it leads);
- an index that cannot be checked now (unparsable, recording a submodule
  under a name git would not write, or behind a directory the daemon cannot
  search) unless it is byte for byte the index of the open (the user's own).

Which git directories exist is found the way the user's git finds them: the
repository's ``.git``; every directory under a ``modules`` of a git
directory, at any depth (a name may hold slashes; a directory holding a
``HEAD`` is a git directory, and only its own ``modules`` is walked further);
and, through the index of each git directory whose worktree is known, every
submodule it records, at any depth (a submodule's index records submodules of
its own). Every directory is reached from the worktree one component at a
time with ``O_NOFOLLOW`` (``fs.open_dir_below``), every file read with a
bound; an index is opened by its path, ``O_NOFOLLOW`` on the file itself
(``fs.index_gitlinks``). A symlink is recorded, never followed (except to
learn, with ``realpath``, whether a gitfile leads inside the worktree).
What cannot be looked at counts as changed, every time (a random value that
no later walk repeats): fail closed.

Call ``quarantine`` only once every process of the session is gone: nothing
can then change the tree between the walk and the renames.
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import stat

import msgspec

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard import fs, identity
from dispatchd.inside import is_within

# What git reads, in a git directory, that names or runs a command or
# redirects where configuration comes from (hooks: each entry).
CONFIG_FILES = ("config", "config.worktree", "commondir", "info/attributes")
# State git acts on later: ``git rebase --continue`` runs a todo's ``exec``
# lines, ``git status`` tells the user to. Compared whole, moved aside whole.
STATE_DIRS = ("rebase-merge", "rebase-apply", "sequencer")
_MAX_READ = 16 * 1024 * 1024  # one file of configuration or one hook
_MAX_HASHED = 256 * 1024 * 1024  # all the bytes one walk hashes (an inode once, however many links)
_MAX_ENTRIES = 2000  # entries of one hooks or state directory
_MAX_DEPTH = 64  # components of a git directory's path below the worktree
_MAX_INCLUDES = 10  # include.path chains followed (git stops at 10 too)
_MAX_POINTER = 4096  # a gitfile
_MAX_HASHED_INDEX = 4 * 1024 * 1024 * 1024  # an index that cannot be parsed is compared by content up to this
MAX_GITDIRS = 5000
_MAX_VISITS = 50000


class GitSnapshot(msgspec.Struct, frozen=True):
    """Paths are relative to the worktree (``/``-separated); values are
    digests, equal only for equal content."""

    gitdirs: dict[str, dict[str, str]] = {}  # a git directory -> {"config", "hooks/pre-commit", ...: digest}
    by_file: list[str] = []  # git directories never moved whole (``.git``, ``.git/worktrees/N``)
    pointers: dict[str, str] = {}  # a ``.git`` that is a file or a symlink -> digest of it and where it leads
    indexes: dict[str, str] = {}  # an index that cannot be checked -> why (equal only for the same bytes)
    external: dict[str, str] = {}  # a linked worktree's own git directory, outside: absolute path -> digest
    complete: bool = True  # False: more git directories than the walk looks at
    # Files inside the worktree that a git directory's configuration reads or
    # runs: ``include.path``/``includeIf.*.path`` targets and ``core.hooksPath``
    # entries, keyed by the file git would open (worktree-relative, after
    # symlinks) -> digest.
    included: dict[str, str] = {}


def _never_equal(why: str) -> str:
    return f"{why}:{secrets.token_hex(8)}"


class Budget:
    """What one walk may hash: bytes in all, each inode once (a session's
    2,000 hard links to one large file cost one read)."""

    def __init__(self, limit: int = _MAX_HASHED) -> None:
        self.left = limit
        self.seen: dict[tuple[int, int, int, int, int], str | None] = {}


def _hash_fd(fd: int, limit: int, budget: Budget | None = None) -> str | None:
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if budget is not None and key in budget.seen:
        return budget.seen[key]
    if budget is not None and min(st.st_size, limit + 1) > budget.left:
        return None
    h = hashlib.sha256()
    total = 0
    while chunk := os.read(fd, 1 << 20):
        total += len(chunk)
        if total > limit:
            return None
        h.update(chunk)
    if budget is not None:
        budget.left -= total
        budget.seen[key] = h.hexdigest()
    return h.hexdigest()


def digest_at(dir_fd: int, name: str, budget: Budget | None = None) -> str | None:
    """The digest of ``name`` in ``dir_fd`` (None when absent), without
    following a symlink: a regular file by mode and content, a symlink by its
    target, anything else by its type."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as exc:
        return None if exc.errno in (errno.ENOENT, errno.ENOTDIR) else _never_equal(f"unreadable {exc.errno}")
    if stat.S_ISLNK(st.st_mode):
        try:
            return "symlink:" + hashlib.sha256(os.fsencode(os.readlink(name, dir_fd=dir_fd))).hexdigest()
        except OSError as exc:
            return _never_equal(f"unreadable {exc.errno}")
    if stat.S_ISDIR(st.st_mode):
        return "directory"
    if not stat.S_ISREG(st.st_mode):
        return f"mode:{st.st_mode:o}"
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        return _never_equal(f"unreadable {exc.errno}")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _never_equal("changed type")
        digest = _hash_fd(fd, _MAX_READ, budget)
    except OSError as exc:
        return _never_equal(f"unreadable {exc.errno}")
    finally:
        os.close(fd)
    # The mode counts: a hook made executable runs where it did not.
    return f"file:{stat.S_IMODE(st.st_mode):o}:{digest}" if digest else _never_equal("too large")


def tree_digest(dir_fd: int, name: str, budget: Budget | None = None) -> str | None:
    """A small directory (git's rebase or sequencer state) by the names,
    kinds and contents of everything in it, walked without recursion and
    bounded in entries; None when absent."""
    top = digest_at(dir_fd, name, budget)
    if top != "directory":
        return top
    h = hashlib.sha256()
    pending: list[tuple[int, str]] = []
    try:
        first = _open_subdir(dir_fd, name, os.O_RDONLY)
    except OSError as exc:
        return _never_equal(f"unsearchable {exc.errno}")
    if first is None:
        return _never_equal("changed type")
    pending.append((first, ""))
    count = 0
    try:
        while pending:
            fd, rel = pending.pop()
            try:
                names = sorted(os.listdir(fd))
                for entry in names:
                    count += 1
                    if count > _MAX_ENTRIES or rel.count("/") > 8:
                        return _never_equal("too many entries")
                    digest = digest_at(fd, entry, budget)
                    h.update(f"{rel}{entry}\0{digest}\0".encode("utf-8", "surrogateescape"))
                    if digest == "directory":
                        sub = _open_subdir(fd, entry, os.O_RDONLY)
                        if sub is not None:
                            pending.append((sub, f"{rel}{entry}/"))
            finally:
                os.close(fd)
    except OSError as exc:
        return _never_equal(f"unreadable {exc.errno}")
    finally:
        for fd, _ in pending:
            os.close(fd)
    return "tree:" + h.hexdigest()


def _open_subdir(dir_fd: int, name: str, flags: int = os.O_PATH) -> int | None:
    try:
        return os.open(name, flags | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def fingerprint(dir_fd: int, budget: Budget | None = None) -> dict[str, str]:
    """What git reads from one git directory for configuration or commands,
    and the rebase or sequencer state it acts on later."""
    found: dict[str, str] = {}
    for name in CONFIG_FILES:
        parent, _, leaf = name.rpartition("/")
        fd = dir_fd
        if parent:
            try:
                sub = _open_subdir(dir_fd, parent)
            except OSError as exc:
                found[parent] = _never_equal(f"unsearchable {exc.errno}")
                continue
            if sub is None:
                # absent, or not a directory: a symlink ``info`` is recorded as such
                digest = digest_at(dir_fd, parent)
                if digest is not None:
                    found[parent] = digest
                continue
            fd = sub
        try:
            digest = digest_at(fd, leaf, budget)
        finally:
            if fd != dir_fd:
                os.close(fd)
        if digest is not None:
            found[name] = digest
    for name in STATE_DIRS:
        digest = tree_digest(dir_fd, name, budget)
        if digest is not None:
            found[name] = digest
    hooks = digest_at(dir_fd, "hooks")
    if hooks == "directory":
        try:
            hooks_fd = _open_subdir(dir_fd, "hooks", os.O_RDONLY)
            names = sorted(os.listdir(hooks_fd)) if hooks_fd is not None else []
        except OSError as exc:
            found["hooks"] = _never_equal(f"unreadable {exc.errno}")
            return found
        if hooks_fd is None:
            return found
        try:
            if len(names) > _MAX_ENTRIES:
                found["hooks"] = _never_equal("too many entries")
                return found
            # git runs a hook by its exact name only: the samples git init
            # copies (pre-commit.sample...) never run, and cost the most to read.
            for name in (n for n in names if not n.endswith(".sample")):
                digest = digest_at(hooks_fd, name, budget)
                if digest is not None:
                    found[f"hooks/{name}"] = digest
        finally:
            os.close(hooks_fd)
    elif hooks is not None:
        found["hooks"] = hooks
    return found


def config_targets(dir_fd: int) -> tuple[list[str], list[str]]:
    """The ``include.path``/``includeIf.*.path`` values and the
    ``core.hooksPath`` values of a git directory's ``config`` and
    ``config.worktree``, as written (relative ones are relative to that
    directory, hooksPath's to the worktree)."""
    includes: list[str] = []
    hooks: list[str] = []
    for name in ("config", "config.worktree"):
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            text = os.read(fd, 1 << 20).decode("utf-8", "surrogateescape")
        except OSError:
            continue
        finally:
            os.close(fd)
        for section, sub, key, value in identity.config_entries(text):
            if not value:
                continue
            if key == "path" and (section == "include" and sub is None or section == "includeif" and sub is not None):
                includes.append(value)
            elif section == "core" and sub is None and key == "hookspath":
                hooks.append(value)
    return includes, hooks


def config_targets_of_file(dir_fd: int, name: str) -> list[str]:
    """The include paths of one included config file (regular, bounded)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return []
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        text = os.read(fd, 1 << 20).decode("utf-8", "surrogateescape")
    except OSError:
        return []
    finally:
        os.close(fd)
    return [value for section, sub, key, value in identity.config_entries(text)
            if value and key == "path" and (section == "include" and sub is None
                                            or section == "includeif" and sub is not None)]


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class _Walk:
    """The walk of ``take``. Git directories found are queued, never
    recursed into: no depth of ``modules/a/modules/a/...`` or chain of
    gitfiles a session makes can exhaust the daemon's stack."""

    def __init__(self, worktree: str, home: str = "") -> None:
        self.worktree = worktree.rstrip("/") or "/"
        self.home = home
        self.gitdirs: dict[str, dict[str, str]] = {}
        self.pointers: dict[str, str] = {}
        self.indexes: dict[str, str] = {}
        self.included: dict[str, str] = {}
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
            try:
                fd = self.open(rel)
            except OSError as exc:
                self.gitdirs[rel] = {"": _never_equal(f"unsearchable {exc.errno}")}
                return
            if fd is None:
                return
            try:
                self.gitdirs[rel] = fingerprint(fd, self.budget)
                includes, hooks_paths = config_targets(fd)
            finally:
                os.close(fd)
            self.config_targets(rel, worktree or "", includes, hooks_paths)
            self.modules(_join(rel, "modules"))
        if worktree is not None and rel not in self.indexed:
            self.indexed.add(rel)
            self.index(rel, worktree)

    def _inside(self, path: str) -> str | None:
        """``path`` after symlinks, worktree-relative, when it lies in the
        worktree (what a session can write); None otherwise."""
        real = os.path.realpath(path)
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
        ``_MAX_INCLUDES`` deep) and every entry of a ``core.hooksPath`` there."""
        gitdir_abs = os.path.join(self.worktree, gitdir_rel)
        pending = [(value, gitdir_abs, 0) for value in includes]
        while pending:
            value, base, depth = pending.pop()
            path = self._expand(value, base)
            rel = self._inside(path) if path else None
            if rel is None or rel in self.included:
                continue
            if depth >= _MAX_INCLUDES or len(self.included) > _MAX_ENTRIES:
                self.included[rel] = _never_equal("too many includes")
                continue
            self.included[rel] = self._digest_rel(rel)
            for more in self._includes_of(rel):
                pending.append((more, os.path.dirname(os.path.join(self.worktree, rel)), depth + 1))
        for value in hooks_paths:
            path = self._expand(value, os.path.join(self.worktree, worktree_rel))
            rel = self._inside(path) if path else None
            if rel is None:
                continue
            self.included[rel] = "hooks directory"
            try:
                fd = self.open(rel)
            except OSError as exc:
                self.included[rel] = _never_equal(f"unsearchable {exc.errno}")
                continue
            if fd is None:
                continue
            try:
                names = _names(fd)
                if len(names) > _MAX_ENTRIES:
                    self.included[rel] = _never_equal("too many entries")
                    continue
                for name in names:
                    digest = digest_at(fd, name, self.budget)
                    if digest is not None:
                        self.included[f"{rel}/{name}"] = digest
            except OSError as exc:
                self.included[rel] = _never_equal(f"unreadable {exc.errno}")
            finally:
                os.close(fd)

    def _digest_rel(self, rel: str) -> str:
        parent, _, name = rel.rpartition("/")
        try:
            fd = self.open(parent)
        except OSError as exc:
            return _never_equal(f"unsearchable {exc.errno}")
        if fd is None:
            return "absent"
        try:
            return digest_at(fd, name, self.budget) or "absent"
        finally:
            os.close(fd)

    def _includes_of(self, rel: str) -> list[str]:
        parent, _, name = rel.rpartition("/")
        try:
            fd = self.open(parent)
        except OSError:
            return []
        if fd is None:
            return []
        try:
            return config_targets_of_file(fd, name)
        finally:
            os.close(fd)

    def modules(self, top: str) -> None:
        """Every git directory under a ``modules``: a directory holding a
        ``HEAD`` is one; any other directory is a step of a name with slashes."""
        pending = [top]
        while pending and self._budget():
            rel = pending.pop()
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
                self.gitdirs[rel] = {"": _never_equal(f"unsearchable {exc.errno}")}
                continue
            for name in reversed(names):
                if kinds[name] == "gitdir":
                    self.gitdir(_join(rel, name), None)
                elif kinds[name] == "directory":
                    pending.append(_join(rel, name))
                elif kinds[name] == "unsearchable":
                    self.gitdirs[_join(rel, name)] = {"": _never_equal("unsearchable")}

    def index(self, gitdir_rel: str, worktree: str) -> None:
        index_rel = _join(gitdir_rel, "index")
        path = os.path.join(self.worktree, index_rel)
        links = fs.index_gitlinks(path)
        if links is None:
            self.indexes[index_rel] = _index_content(path)
            return
        for link in sorted(links):
            if not self._budget():
                return
            if not fs.safe_link(link):
                # git would not write it, but walks it: never followed here,
                # and so never "as before"
                self.indexes[index_rel] = _never_equal("a submodule path git would not write")
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
                self.indexes[index_rel] = _never_equal(f"a submodule that cannot be looked at ({exc.errno})")
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
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(".git", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                data = os.read(fd, _MAX_POINTER + 1)
            finally:
                os.close(fd)
            text = data.decode("utf-8", "surrogateescape")
            if len(data) <= _MAX_POINTER and text.startswith("gitdir: "):
                target = text[len("gitdir: "):].strip()
            content = "file:" + text
        else:
            content = f"mode:{st.st_mode:o}"
        leads = ""
        if target and "\0" not in target:
            real = os.path.realpath(os.path.join(self.worktree, worktree, target))
            inside = os.path.relpath(real, self.worktree) if is_within(real, self.worktree) else None
            if inside is None:
                leads = "outside:" + real  # not the session's to write
            elif inside == ".":
                leads = _never_equal("the worktree itself")
            else:
                inside = inside.replace(os.sep, "/")
                target_fd: int | None
                try:
                    target_fd = self.open(inside)
                except OSError as exc:
                    target_fd, leads = None, _never_equal(f"unsearchable {exc.errno}")
                if target_fd is not None:
                    os.close(target_fd)
                    leads = "gitdir:" + inside
                    self.gitdir(inside, worktree)
                elif not leads:
                    leads = "nothing"
        self.pointers[rel] = hashlib.sha256(os.fsencode(content)).hexdigest() + " -> " + leads


def _names(dir_fd: int) -> list[str]:
    """The sorted names in the directory an O_PATH descriptor holds."""
    listing = _open_subdir(dir_fd, ".", os.O_RDONLY)
    if listing is None:
        return []
    try:
        return sorted(os.listdir(listing))
    finally:
        os.close(listing)


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


def _index_content(path: str) -> str:
    """An index that cannot be parsed: compared by its bytes, so that the
    user's own (too large, say) is left alone and any other goes aside."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return _never_equal(f"an index that cannot be read ({exc.errno})")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return _never_equal("an index that is not a file")
        digest = _hash_fd(fd, _MAX_HASHED_INDEX)
    finally:
        os.close(fd)
    return f"an index that cannot be parsed:{digest}" if digest else _never_equal("an index too large to compare")


def take(worktree: str, layout: GitLayout, home: str = "") -> GitSnapshot:
    """Walk every git directory of the worktree's repository (see the module);
    ``home`` is where ``~/`` in an include path leads."""
    walk = _Walk(worktree, home)
    by_file: list[str] = []
    external: dict[str, str] = {}
    if layout.kind == "repository":
        by_file.append(".git")
        walk.gitdir(".git", "")
        walk.run()
        top = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.stat(".git", dir_fd=top, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                # A .git the session turned into a gitfile or a symlink:
                # where it leads is the session's choice.
                walk.pointer(".git", "", top, st)
                walk.run()
        except FileNotFoundError:
            pass
        finally:
            os.close(top)
        try:
            fd = walk.open(".git/worktrees")
        except OSError as exc:
            walk.gitdirs[".git/worktrees"] = {"": _never_equal(f"unsearchable {exc.errno}")}
            fd = None
        if fd is not None:
            try:
                listing = _open_subdir(fd, ".", os.O_RDONLY)
                names = sorted(os.listdir(listing)) if listing is not None else []
                if listing is not None:
                    os.close(listing)
            finally:
                os.close(fd)
            for name in names:
                rel = f".git/worktrees/{name}"
                try:
                    entry = walk.open(rel)
                except OSError as exc:
                    walk.gitdirs[rel] = {"": _never_equal(f"unsearchable {exc.errno}")}
                    continue
                if entry is None:
                    continue
                try:
                    walk.gitdirs[rel] = fingerprint(entry, walk.budget)
                finally:
                    os.close(entry)
                by_file.append(rel)
    elif layout.kind == "linked":
        try:
            top = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            top = None
        if top is not None:
            try:
                external[os.path.join(worktree, ".git")] = digest_at(top, ".git") or "absent"
            finally:
                os.close(top)
        for gitdir in layout.gitdirs:  # outside the worktree; held by Landlock, its redirects by the plan
            try:
                fd = os.open(gitdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                for name, digest in fingerprint(fd, walk.budget).items():
                    external[os.path.join(gitdir, name)] = digest
            finally:
                os.close(fd)
        # What the repository's configuration (its common directory's, this
        # worktree's own) reads or runs inside this worktree.
        for gitdir in layout.gitdirs + layout.readable[:1]:
            try:
                fd = os.open(gitdir, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                includes, hooks_paths = config_targets(fd)
            finally:
                os.close(fd)
            walk.config_targets(gitdir, "", includes, hooks_paths)
    return GitSnapshot(gitdirs=walk.gitdirs, by_file=by_file, pointers=walk.pointers, indexes=walk.indexes,
                       external=external, complete=walk.complete, included=walk.included)


def gitdir_paths(worktree: str, snap: GitSnapshot) -> list[str]:
    """The git directories of a walk (absolute), those it could look into,
    not the repository's ``.git`` itself nor the other worktrees' entries."""
    return [os.path.join(worktree, rel) for rel, found in snap.gitdirs.items()
            if rel not in snap.by_file and "" not in found]


def changes(before: GitSnapshot, now: GitSnapshot) -> list[str]:
    """What to move aside, worktree-relative, outermost first, none inside another."""
    found: list[str] = []
    for rel, now_fp in now.gitdirs.items():
        old = before.gitdirs.get(rel)
        if rel in now.by_file and "" not in now_fp:
            if old is None and rel != ".git":
                # A linked worktree the session added: its redirects are
                # checked by redirects.quarantine_new_redirects (a commondir
                # leading back to this .git is what `git worktree add` writes).
                continue
            found += [f"{rel}/{name}" for name, digest in now_fp.items()
                      if (old or {}).get(name) != digest and digest != "directory"]
        elif old != now_fp:
            found.append(rel)
    found += [rel for rel, digest in now.pointers.items() if before.pointers.get(rel) != digest]
    found += [rel for rel, why in now.indexes.items() if before.indexes.get(rel) != why]
    found += [rel for rel, digest in now.included.items()
              if before.included.get(rel) != digest and digest not in ("absent", "directory", "hooks directory")]
    result: list[str] = []
    for rel in sorted(set(found), key=lambda r: (r.count("/"), r)):
        if not any(is_within(rel, done) for done in result):
            result.append(rel)
    return result


def quarantine(worktree: str, before: GitSnapshot, now: GitSnapshot) -> tuple[list[str], list[str]]:
    """Move aside what ``changes`` lists; returns the new names (absolute) and
    what could not be moved, with why. A walk that stopped short (more git
    directories than it looks at) is itself a failure."""
    moved: list[str] = []
    failed: list[str] = []
    todo = changes(before, now)
    if not now.complete:
        # More than the walk looks at (a session can make that many cheaply):
        # what was not looked at is not handed to the user's git either. With
        # .git/modules and the index aside, git knows no submodule.
        failed.append(f"{worktree}: more git directories than dispatchd checks ({MAX_GITDIRS}); "
                      ".git/modules and .git/index moved aside")
        if ".git" in now.by_file:
            todo = [".git/index", ".git/modules"] + [r for r in todo if not is_within(r, ".git/modules")]
    for rel in todo:
        try:
            done = fs.move_below_aside(worktree, rel)  # None: gone since the walk
        except OSError as exc:
            failed.append(f"{os.path.join(worktree, rel)}: {exc.strerror}")
            continue
        if done is not None:
            moved.append(done)
    for path, digest in now.external.items():
        old = before.external.get(path)
        # New or changed: a redirect redirects.quarantine_new_redirects
        # moved already is absent from ``now``; rebase state, a hook, a config.
        if old != digest and digest not in ("absent", "directory"):
            try:
                moved.append(fs.move_aside(path))
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror}")
    return moved, failed
