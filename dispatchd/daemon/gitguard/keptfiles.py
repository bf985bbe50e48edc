"""The user's own small git files, kept by content at the baseline and
written back where a session changed or deleted them.

``snapshots.quarantine`` moves aside what a session changed in a repository's
git directory, and that alone left the user without it: a ``.git/config`` a
session rewrote (degraded mode, where nothing holds it read-only) took the
user's remotes, identity and every local setting aside with it, until they
renamed the file back; a hook a session rewrote or deleted was simply gone,
and the user's next commit ran no check of theirs.

- ``read``, at a part's baseline (of a part joined while sessions of its
  domain run, only the files none of them could write are kept:
  ``parts.keep_outside``), keeps the bytes and mode of each regular file
  git reads for configuration or commands in the repository's own git
  directories (``.git`` and ``.git/worktrees/N``, or a linked worktree's
  own git directory): ``digests.CONFIG_FILES``, ``REVIEW_FILES`` and every
  hook, and the regular files the configuration runs or reads from the
  worktree (``snapshots``' ``included``: each entry of a ``core.hooksPath``
  there, in ``.git`` or beside the code, and each include's target; they
  come back only while the worktree is a directory); and, from the tree
  walk (``read_tree``), those of every repository the worktree holds (a
  nested clone, which ``runnables`` judges), within ``MAX_FILE``
  each and ``MAX_TOTAL`` in all (past them:
  moved aside as before, not put back). The look then records the digest
  of the bytes kept (``digest_of``): one the user's git rewrote between the
  look and the read is kept as read.
- ``put_back``, at each end, after ``snapshots.quarantine`` (which leaves
  these names where they are: ``left_in_place``): each kept file whose
  digest differs now, or which is gone, is written back whole or not at
  all, under git's own lock, as git writes it (``gitlock.replace``): the
  name never stops naming a whole file, a ``git config`` of the user's
  running beside the end is never overwritten nor overwrites the put-back,
  and what stood there (the session's, or the user's own change) is kept
  under an aside name by a hard link: never deleted. A lock held past
  ``gitlock.WAIT_S`` (the user's git, one that stopped, or a session's
  plant) is never written around: what stands there is made unreadable
  and the check fails, saying so (``gitlock.left_held``). The directory is
  reached by descriptor from the worktree (or the linked worktree's git
  directory), one component at a time, no symlink followed: a symlink or a
  file a session put in the way is moved aside and the directory made
  again, so nothing is ever written outside.
- Not put back: the heads of a merge, cherry-pick or revert in progress
  that a session removed (``git commit``, ``--continue`` or ``--abort``
  remove them: the session finished or ended the user's operation); and
  anything of a git directory that is gone as a whole, or is no git
  directory any more (no ``HEAD``): nothing is made where another directory
  now stands at the worktree's path.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable

import msgspec

from dispatchd.daemon.gitguard import fs, gitlock, noroom
from dispatchd.daemon.gitguard.digests import CONFIG_FILES, REVIEW_FILES, file_digest

MAX_FILE = 256 * 1024  # one file kept (a config, a hook)
MAX_TOTAL = 1024 * 1024  # all of one baseline's: the record is written at every open
_NAMES = frozenset(CONFIG_FILES + REVIEW_FILES)
_HEADS = frozenset(("MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD"))
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Kept(msgspec.Struct, frozen=True):
    """One file as the baseline found it: ``rel`` below ``base`` (the
    worktree when "", else a linked worktree's git directory)."""

    base: str
    rel: str
    mode: int
    data: str  # latin-1: every byte kept
    gitdir: str = ""  # the snapshot's key of its git directory ("": ``base`` itself)
    name: str = ""  # its name in that git directory's fingerprint
    # Where the look records its digest: "" the git directory's fingerprint
    # (``gitdir``, ``name``) or ``external``; "included" a file the
    # repository's configuration runs or reads from the worktree (an entry
    # of a ``core.hooksPath`` there, an include's target), ``rel`` its key in
    # the snapshot's ``included``; "tree" a file of a repository found in
    # the worktree by ``runnables`` (a nested clone), ``rel`` its key in the
    # tree's entries, ``gitdir`` that repository's git directory.
    source: str = ""


def kept_name(name: str) -> bool:
    """A name of a git directory's (``config``, ``hooks/pre-commit``) whose bytes are kept."""
    return name in _NAMES or (name.startswith("hooks/") and name.count("/") == 1)


def keepable(leaf: str) -> bool:
    """Not a name git never runs nor reads (a sample hook), nor one an end
    moved aside, nor a lock: what a session planted and an end moved aside
    beside the hooks was kept at the next baseline, and could be made to
    cost the next end a lock's wait each."""
    return not leaf.endswith((".sample", ".lock")) and fs.QUARANTINED not in leaf


def read(worktree: str, gitdirs: dict[str, dict[str, str]], by_file: list[str],
         external: dict[str, str], linked: list[str], included: dict[str, str] | None = None) -> list[Kept]:
    """What of ``by_file``'s git directories (``gitdirs``' keys, worktree
    relative), of the ``linked`` git directories (``external``'s paths
    below them) and of the files in the worktree the configuration runs or
    reads (``included``: each entry of a ``core.hooksPath`` there, each
    include's target) to keep."""
    wanted: list[Kept] = []  # data empty: read below
    for gitdir in by_file:
        for name, digest in gitdirs.get(gitdir, {}).items():
            if kept_name(name) and digest.startswith("file:"):
                wanted.append(Kept(base="", rel=f"{gitdir}/{name}", mode=0, data="", gitdir=gitdir, name=name))
    for base in linked:
        for path, digest in external.items():
            name = os.path.relpath(path, base)
            if os.path.dirname(path) in (base, os.path.join(base, "hooks"), os.path.join(base, "info")) \
                    and kept_name(name) and digest.startswith("file:"):
                wanted.append(Kept(base=base, rel=name, mode=0, data="", name=name))
    for rel, digest in (included or {}).items():
        if digest.startswith("file:") and keepable(os.path.basename(rel)):
            wanted.append(Kept(base="", rel=rel, mode=0, data="", source="included"))
    return _with_bytes(worktree, wanted)


def read_tree(root: str, entries: dict[str, str], targets: dict[str, str] | None = None) -> list[Kept]:
    """What to keep of the repositories a tree walk found in the worktree
    (``runnables``' ``entries``: a git directory's key holds ``gitdir``, its
    files follow below it): their config, hooks (no ``*.sample``: git runs
    none) and review files, as of the repository's own ``.git``; and the
    files their configuration runs or reads in the worktree (``targets``:
    each -> its repository's git directory, ``parts.nested_targets``)."""
    return _with_bytes(root, _tree_wanted(entries, targets or {}))


def _tree_wanted(entries: dict[str, str], targets: dict[str, str]) -> list[Kept]:
    """``read_tree``'s files, their bytes not read."""
    gitdirs = {rel for rel, digest in entries.items() if digest == "gitdir"}
    wanted: list[Kept] = []
    for rel, digest in entries.items():
        if not digest.startswith("file:"):
            continue
        parent = os.path.dirname(rel)
        gitdir = parent if parent in gitdirs else os.path.dirname(parent)
        if gitdir not in gitdirs:
            continue
        name = rel[len(gitdir) + 1:] if gitdir else rel
        if kept_name(name) and keepable(os.path.basename(name)):
            wanted.append(Kept(base="", rel=rel, mode=0, data="", gitdir=gitdir, name=name, source="tree"))
    for rel, gitdir in targets.items():
        if entries.get(rel, "").startswith("file:") and keepable(os.path.basename(rel)):
            wanted.append(Kept(base="", rel=rel, mode=0, data="", gitdir=gitdir, source="tree"))
    return wanted


def _with_bytes(worktree: str, wanted: list[Kept]) -> list[Kept]:
    """``wanted`` with their bytes and modes as read now, within the bounds."""
    kept: list[Kept] = []
    left = MAX_TOTAL
    for want in wanted:
        got = _read(want.base or worktree, want.rel)
        if got is None:
            continue  # gone, or no regular file, since the look
        mode, data = got
        if len(data) > left:
            continue
        left -= len(data)
        kept.append(msgspec.structs.replace(want, mode=mode, data=data.decode("latin-1")))
    return kept


def digest_of(k: Kept) -> str:
    """The digest of the bytes and mode kept, as a look records them: a
    file the user's git rewrote between the look and the read (a ``git
    config`` of theirs as a session opens) is kept as read, and the look
    takes this digest in place of its own (``snapshots.take``): not kept, it
    was renamed aside at the end with nothing put back, and the user's next
    ``git config`` made a config of its one key."""
    return _digest(k.mode, k.data.encode("latin-1"))


def _digest(mode: int, data: bytes) -> str:
    return file_digest(mode, hashlib.sha256(data).hexdigest())


def dir_below(top: str, parent: str) -> int | None:
    """A descriptor of ``top/parent`` reached with no symlink on the way
    (``fs.path_below``), or None when it cannot be."""
    try:
        base = os.open(top, _DIR)
    except OSError:
        return None
    try:
        return fs.path_below(base, parent) if parent else os.dup(base)
    except OSError:
        return None
    finally:
        os.close(base)


def _read(top: str, rel: str) -> tuple[int, bytes] | None:
    parent, _, leaf = rel.rpartition("/")
    fd = dir_below(top, parent)
    if fd is None:
        return None
    try:
        got = _read_at(fd, leaf)
    finally:
        os.close(fd)
    return (stat.S_IMODE(got[0].st_mode), got[1]) if got is not None else None


def _read_at(dir_fd: int, leaf: str) -> tuple[os.stat_result, bytes] | None:
    """The regular file ``leaf`` of ``dir_fd`` (no symlink followed), its
    ``fstat`` and bytes, within ``MAX_FILE``; None otherwise."""
    try:
        opened = fs.open_regular(leaf, dir_fd)
    except OSError:
        return None
    if opened is None:
        return None
    file_fd, st = opened
    try:
        return (st, fs.read_all(file_fd, MAX_FILE + 1)) if st.st_size <= MAX_FILE else None
    except OSError:
        return None
    finally:
        os.close(file_fd)


def _there(worktree: str, k: Kept, seen: dict[str, bool]) -> bool:
    """Whether what ``k`` is put back in is still there: its git directory
    (a directory with a ``HEAD``); for a file the configuration names in the
    worktree, the worktree itself, a directory (not a symlink to one), and,
    for one inside ``.git``, that git directory. One in the worktree (a
    nested repository's, a ``.git/myhooks``) is reached from the worktree
    with no symlink followed: a session that swapped a directory on the way
    for a link to another repository had a git directory of config and hooks
    alone made at its name."""
    if k.base:
        where = k.base
    elif k.source == "included":
        where = os.path.join(worktree, ".git") if k.rel.startswith(".git/") else worktree
    else:
        where = os.path.join(worktree, k.gitdir)
    if where not in seen:
        if k.base:
            seen[where] = _is_gitdir(where)
        elif where == worktree:
            seen[where] = _is_dir(where)
        else:
            seen[where] = _is_gitdir_below(worktree, os.path.relpath(where, worktree))
    return seen[where]


def _is_gitdir_below(worktree: str, rel: str) -> bool:
    """``rel`` below the worktree, reached with no symlink, is a git directory (holds a ``HEAD``)."""
    fd = dir_below(worktree, rel)
    if fd is None:
        return False
    try:
        os.stat("HEAD", dir_fd=fd, follow_symlinks=False)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _due(worktree: str, kept: list[Kept], gitdirs: dict[str, dict[str, str]], external: dict[str, str],
         skip: Callable[[str], bool], included: dict[str, str], tree: dict[str, str]) -> list[tuple[Kept, str | None]]:
    """Each of ``kept`` to write back, with its digest now (None: gone):
    changed or gone, its git directory still there, not ``skip``'s."""
    due: list[tuple[Kept, str | None]] = []
    seen: dict[str, bool] = {}
    for k in kept:
        if not _there(worktree, k, seen):
            continue  # the git directory itself is gone (or another directory is at the worktree's path)
        path = os.path.join(k.base or worktree, k.rel)
        if skip(path):
            continue
        if k.source:
            now = (included if k.source == "included" else tree).get(k.rel)
        else:
            now = gitdirs.get(k.gitdir, {}).get(k.name) if not k.base else external.get(path)
        if now == _digest(k.mode, k.data.encode("latin-1")):
            continue
        if now is None and k.name in _HEADS:
            continue  # removed: the operation was finished or aborted
        due.append((k, now))
    return due


def left_in_place(worktree: str, kept: list[Kept], gitdirs: dict[str, dict[str, str]],
                  external: dict[str, str], skip: Callable[[str], bool] = lambda path: False,
                  included: dict[str, str] | None = None, tree: dict[str, str] | None = None) -> set[str]:
    """The paths (absolute) ``put_back`` replaces under git's lock, the
    version there kept aside by it: ``snapshots.quarantine`` leaves them where
    they are (a rename aside left the name absent until the put-back)."""
    return {os.path.join(k.base or worktree, k.rel)
            for k, _ in _due(worktree, kept, gitdirs, external, skip, included or {}, tree or {})}


def put_back(worktree: str, kept: list[Kept], gitdirs: dict[str, dict[str, str]],
             external: dict[str, str], skip: Callable[[str], bool] = lambda path: False,
             included: dict[str, str] | None = None, tree: dict[str, str] | None = None,
             ) -> tuple[list[tuple[str, str]], list[str]]:
    """Write back each of ``kept`` that the look now (``gitdirs``,
    ``external``, ``included``: a snapshot's; ``tree``: a tree walk's
    entries; each taken before the quarantine)
    found changed or gone, but those ``skip`` says an earlier part judges;
    returns what was put back or kept aside, with why, and what could not be."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    due = _due(worktree, kept, gitdirs, external, skip, included or {}, tree or {})
    seen: dict[str, bool] = {}
    _sweep(worktree, [k for k in kept if _there(worktree, k, seen) and not skip(os.path.join(k.base or worktree, k.rel))])
    # One wait in all for the locks beside files a session could write: a
    # lock planted beside each of thousands of kept files was a second each.
    deadline = time.monotonic() + gitlock.WAIT_S
    for k, now in due:
        path = os.path.join(k.base or worktree, k.rel)
        left = k.source in ("tree", "included")
        try:
            aside = write_below(k.base or worktree, k.rel, k.data.encode("latin-1"), k.mode, move_left=left,
                                wait_s=max(0.0, deadline - time.monotonic()) if left else None)
        except Left as left:
            failed.append(f"{path}: changed, yours not put back: {left}")
            continue
        except OSError as exc:
            failed.append(f"{path}: changed by a session, yours cannot be put back ({exc.strerror})")
            continue
        if aside is None:
            continue  # the same bytes again by the time the lock was taken
        if aside:
            done.append((aside, "git configuration, hooks or state changed or new"))
        what = "deleted" if now is None else "changed"
        done.append((path, f"yours, as it was before the session {what} it, put back"))
    return done, failed


def sweep(worktree: str, kept: list[Kept]) -> None:
    """What a killed daemon's put-back left beside ``kept``, removed before
    the end's look (``_sweep``): its lock and temporary, seen first, were
    taken for a session's new hooks and moved aside, and said as its."""
    seen: dict[str, bool] = {}
    _sweep(worktree, [k for k in kept if _there(worktree, k, seen)])


def _sweep(worktree: str, due: list[Kept]) -> None:
    """What a killed daemon's put-back left beside the kept files
    (``gitlock.sweep``): its lock would stand in the way of the put-back,
    and its temporary name, a second name of a file put back, would be
    taken for a hard link a session made (``hardlinks.detach``)."""
    leaves: dict[tuple[str, str], set[str]] = {}
    for k in due:
        parent, _, leaf = k.rel.rpartition("/")
        leaves.setdefault((k.base or worktree, parent), set()).add(leaf)
    for (top, parent), names in leaves.items():
        fd = dir_below(top, parent)
        if fd is None:
            continue
        try:
            listed = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            continue
        finally:
            os.close(fd)
        try:
            gitlock.sweep(listed, os.path.join(top, parent), names)
        finally:
            os.close(listed)


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_gitdir(path: str) -> bool:
    """A directory (not a symlink to one) with a ``HEAD``: a git directory
    still there to put a file back in."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode) and os.path.lexists(os.path.join(path, "HEAD"))
    except OSError:
        return False


class Left(Exception):
    """A lock held past ``gitlock.WAIT_S``: what stands there was left (see ``gitlock.left_held``), said."""


def write_below(top: str, rel: str, data: bytes, mode: int | None = None, *, move_left: bool = False,
                wait_s: float | None = None) -> str | None:
    """``rel`` below ``top`` holding ``data`` (``mode``: its permission
    bits; None: 0644 less the umask), under git's lock
    (``gitlock.replace``), its directory reached from ``top`` one component
    at a time, no symlink followed (one in the way moved aside, a missing
    directory made); returns where what stood at the name is kept ("" when
    nothing stood there), or None when it held ``data`` already. No room
    for a step: the ballast freed and tried again, then what stands there
    made unreadable (``noroom``). ``Left`` where git's lock stays held;
    with ``move_left`` it is moved aside instead (``gitlock.replace``; after
    ``wait_s``, None: ``gitlock.WAIT_S``)."""
    parent, _, leaf = rel.rpartition("/")
    fd = parent_made(top, parent)
    try:
        got: list[str | None] = []

        def attempt() -> str:
            got[:] = [gitlock.replace(fd, leaf, data, mode, move_left=move_left, wait_s=wait_s)]
            return ""
        try:
            noroom.moved(attempt, lambda: os.fstat(fd).st_dev, lambda: noroom.disarm_at(fd, leaf))
        except gitlock.LockHeld:  # what stands there disarmed in the directory reached, never by path again
            raise Left(gitlock.left_held(os.path.join(top, rel), fd)) from None
        aside = got[0]
        return os.path.join(top, parent, aside) if aside else aside
    finally:
        os.close(fd)


def parent_made(top: str, parent: str) -> int:
    """A descriptor of ``top/parent`` (``/``-separated, "" for ``top``),
    reached one component at a time as ``subdir`` reaches each."""
    fd = os.open(top, _DIR)
    try:
        for part in parent.split("/") if parent else []:
            nxt = subdir(fd, part)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def subdir(fd: int, name: str) -> int:
    """The directory ``name`` in ``fd``, opened without following a symlink;
    made when absent; a symlink or anything else there moved aside first."""
    try:
        return os.open(name, _DIR, dir_fd=fd)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise
        if exc.errno != errno.ENOENT:
            fs.move_aside_at(fd, name)
    try:
        os.mkdir(name, 0o755, dir_fd=fd)
    except PermissionError:
        with fs.lent(fd):
            os.mkdir(name, 0o755, dir_fd=fd)
    return os.open(name, _DIR, dir_fd=fd)
