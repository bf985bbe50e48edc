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
time with ``O_NOFOLLOW`` (``gitfs.open_dir_below``), every file read with a
bound; an index is opened by its path, ``O_NOFOLLOW`` on the file itself
(``gitfs.index_gitlinks``). A symlink is recorded, never followed (except to
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
from dispatchd.daemon import gitfs
from dispatchd.inside import is_within

# What git reads, in a git directory, that names or runs a command or
# redirects where configuration comes from (hooks: each entry).
CONFIG_FILES = ("config", "config.worktree", "commondir", "info/attributes")
_MAX_READ = 16 * 1024 * 1024  # one file of configuration or one hook
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


def _never_equal(why: str) -> str:
    return f"{why}:{secrets.token_hex(8)}"


def _hash_fd(fd: int, limit: int) -> str | None:
    h = hashlib.sha256()
    total = 0
    while chunk := os.read(fd, 1 << 20):
        total += len(chunk)
        if total > limit:
            return None
        h.update(chunk)
    return h.hexdigest()


def digest_at(dir_fd: int, name: str) -> str | None:
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
        digest = _hash_fd(fd, _MAX_READ)
    except OSError as exc:
        return _never_equal(f"unreadable {exc.errno}")
    finally:
        os.close(fd)
    # The mode counts: a hook made executable runs where it did not.
    return f"file:{stat.S_IMODE(st.st_mode):o}:{digest}" if digest else _never_equal("too large")


def _open_subdir(dir_fd: int, name: str, flags: int = os.O_PATH) -> int | None:
    try:
        return os.open(name, flags | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            return None
        raise


def fingerprint(dir_fd: int) -> dict[str, str]:
    """What git reads from one git directory for configuration or commands."""
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
            digest = digest_at(fd, leaf)
        finally:
            if fd != dir_fd:
                os.close(fd)
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
            # git runs a hook by its exact name only: the samples git init
            # copies (pre-commit.sample...) never run, and cost the most to read.
            for name in (n for n in names if not n.endswith(".sample")):
                digest = digest_at(hooks_fd, name)
                if digest is not None:
                    found[f"hooks/{name}"] = digest
        finally:
            os.close(hooks_fd)
    elif hooks is not None:
        found["hooks"] = hooks
    return found


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


class _Walk:
    def __init__(self, worktree: str) -> None:
        self.worktree = worktree.rstrip("/") or "/"
        self.gitdirs: dict[str, dict[str, str]] = {}
        self.pointers: dict[str, str] = {}
        self.indexes: dict[str, str] = {}
        self.indexed: set[str] = set()
        self.visits = 0
        self.complete = True

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
        return gitfs.open_dir_below(self.worktree, rel)

    def gitdir(self, rel: str, worktree: str | None) -> None:
        """Record the git directory at ``rel`` and the ones below it; with
        ``worktree`` (the directory its index's paths are relative to), the
        submodules its index records too."""
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
                self.gitdirs[rel] = fingerprint(fd)
            finally:
                os.close(fd)
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
            try:
                fd = self.open(rel)
                if fd is None:
                    continue
                try:
                    listing = _open_subdir(fd, ".", os.O_RDONLY)
                    names = sorted(os.listdir(listing)) if listing is not None else []
                    if listing is not None:
                        os.close(listing)
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
        links = gitfs.index_gitlinks(path)
        if links is None:
            self.indexes[index_rel] = _index_content(path)
            return
        for link in sorted(links):
            if not self._budget():
                return
            if not gitfs.safe_link(link):
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
                if exc.errno in gitfs.ABSENT:
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


def take(worktree: str, layout: GitLayout) -> GitSnapshot:
    """Walk every git directory of the worktree's repository (see the module)."""
    walk = _Walk(worktree)
    by_file: list[str] = []
    external: dict[str, str] = {}
    if layout.kind == "repository":
        by_file.append(".git")
        walk.gitdir(".git", "")
        top = os.open(worktree, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.stat(".git", dir_fd=top, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                # A .git the session turned into a gitfile or a symlink:
                # where it leads is the session's choice.
                walk.pointer(".git", "", top, st)
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
                    walk.gitdirs[rel] = fingerprint(entry)
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
                for name, digest in fingerprint(fd).items():
                    external[os.path.join(gitdir, name)] = digest
            finally:
                os.close(fd)
    return GitSnapshot(gitdirs=walk.gitdirs, by_file=by_file, pointers=walk.pointers, indexes=walk.indexes,
                       external=external, complete=walk.complete)


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
                # checked by gitredirects.quarantine_new_redirects (a commondir
                # leading back to this .git is what `git worktree add` writes).
                continue
            found += [f"{rel}/{name}" for name, digest in now_fp.items()
                      if (old or {}).get(name) != digest and digest != "directory"]
        elif old != now_fp:
            found.append(rel)
    found += [rel for rel, digest in now.pointers.items() if before.pointers.get(rel) != digest]
    found += [rel for rel, why in now.indexes.items() if before.indexes.get(rel) != why]
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
    walk = _Walk(worktree)
    for rel in todo:
        parent, _, name = rel.rpartition("/")
        try:
            fd = walk.open(parent)
        except OSError as exc:
            failed.append(f"{os.path.join(worktree, rel)}: {exc.strerror}")
            continue
        if fd is None:
            continue  # gone since the walk: nothing there for git to read
        try:
            moved.append(os.path.join(worktree, parent, gitfs.move_aside_at(fd, name)))
        except FileNotFoundError:
            pass
        except OSError as exc:
            failed.append(f"{os.path.join(worktree, rel)}: {exc.strerror}")
        finally:
            os.close(fd)
    for path, digest in now.external.items():
        old = before.external.get(path)
        # A file new there is a redirect: gitredirects.quarantine_new_redirects moves it.
        if old is not None and old != digest and digest != "absent":
            try:
                moved.append(gitfs.move_aside(path))
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror}")
    return moved, failed
