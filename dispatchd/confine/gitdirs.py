"""Git metadata that the user's own git runs, protected while git keeps working.

What a session writes under ``.git`` is read later by the user's git, outside
any sandbox: ``.git/config`` (``core.hooksPath``, ``core.fsmonitor``, filters,
aliases) and ``.git/hooks/*`` run commands, ``.git/commondir`` and a linked
worktree's ``.git`` pointer file choose which of those are read. This module
finds, for one worktree, what must stay read-only and what git must be able
to write, and the planner turns that into mounts and Landlock rules:

- a plain repository (``WORKTREE/.git/``): ``config``, ``hooks``, and each
  submodule's ``modules/*/config`` and ``modules/*/hooks`` are bound read-only
  over themselves in the session's mount namespace; the rest of ``.git``
  (objects, refs, index, lock files) stays writable, so add, commit and
  checkout -b work;
- a linked worktree (``WORKTREE/.git`` is a file naming ``COMMON/worktrees/N``):
  the pointer file and ``N``'s own ``commondir`` and ``gitdir`` are read-only;
  ``COMMON`` is readable, and only ``COMMON/objects``, ``COMMON/refs``,
  ``COMMON/logs`` and ``COMMON/worktrees/N`` are writable. A pointer is
  believed only if git itself would: ``N/gitdir`` must name this worktree's
  ``.git`` back, and ``COMMON`` must belong to the user;
- a file that did not exist and would redirect git (``.git/commondir``) cannot
  be stopped from being created in a writable directory by any mount; the
  daemon checks for it once the session's processes are gone and moves it
  aside (``quarantine_new_redirects``).

Only in full mode (a mount namespace). Without one, Landlock cannot carve a
read-only hole in a writable tree: the session's ``leaves_open`` says so.

The daemon reads the ``.git`` pointer file here (``O_NOFOLLOW``, at most 4 KiB,
a regular file only): the one file inside a worktree it opens, and it treats
the content as hostile.
"""

from __future__ import annotations

import os
import stat
import time

import msgspec

REDIRECTS = ("commondir",)  # files whose mere appearance changes which config git reads


class GitLayout(msgspec.Struct, frozen=True):
    kind: str  # "none", "repository", "linked", "refused"
    read_only: list[str] = []  # bound read-only over themselves (must exist)
    readable: list[str] = []  # outside the worktree: Landlock read-only
    writable: list[str] = []  # outside the worktree: Landlock read-write, bound writable
    note: str = ""


def _read_small(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _existing(paths: list[str]) -> list[str]:
    return [p for p in paths if os.path.lexists(p) and not os.path.islink(p)]


def inspect_git(worktree: str, *, uid: int) -> GitLayout:
    dotgit = os.path.join(worktree, ".git")
    try:
        st = os.lstat(dotgit)
    except FileNotFoundError:
        return GitLayout("none")
    if stat.S_ISDIR(st.st_mode):
        protect = [os.path.join(dotgit, "config"), os.path.join(dotgit, "hooks")]
        modules = os.path.join(dotgit, "modules")
        if os.path.isdir(modules) and not os.path.islink(modules):
            for name in sorted(os.listdir(modules)):
                protect += [os.path.join(modules, name, "config"), os.path.join(modules, name, "hooks")]
        return GitLayout("repository", read_only=_existing(protect))
    if not stat.S_ISREG(st.st_mode):
        return GitLayout("refused", note=".git is neither a directory nor a file")
    text = _read_small(dotgit) or ""
    if not text.startswith("gitdir: "):
        return GitLayout("refused", read_only=[dotgit], note=".git file does not name a gitdir")
    gitdir = os.path.realpath(os.path.join(worktree, text[len("gitdir: "):].strip()))
    back = (_read_small(os.path.join(gitdir, "gitdir")) or "").strip()
    if not back or os.path.realpath(back) != os.path.realpath(dotgit):
        return GitLayout("refused", read_only=[dotgit],
                         note=f"{gitdir} does not point back at this worktree; not granted")
    common_rel = (_read_small(os.path.join(gitdir, "commondir")) or "").strip()
    common = os.path.realpath(os.path.join(gitdir, common_rel)) if common_rel else ""
    if not common or os.path.dirname(gitdir) != os.path.join(common, "worktrees"):
        return GitLayout("refused", read_only=[dotgit], note=f"{gitdir} is not a worktrees/ entry of its common dir")
    try:
        if os.stat(common).st_uid != uid:
            return GitLayout("refused", read_only=[dotgit], note=f"{common} belongs to another user; not granted")
    except OSError:
        return GitLayout("refused", read_only=[dotgit], note=f"{common} cannot be inspected")
    writable = [gitdir] + [os.path.join(common, d) for d in ("objects", "refs", "logs") if os.path.isdir(os.path.join(common, d))]
    read_only = _existing([dotgit, os.path.join(gitdir, "commondir"), os.path.join(gitdir, "gitdir")])
    return GitLayout("linked", read_only=read_only, readable=[common], writable=writable)


def redirects_present(worktree: str) -> list[str]:
    """Which redirecting files exist now in a repository's ``.git``."""
    dotgit = os.path.join(worktree, ".git")
    if not os.path.isdir(dotgit) or os.path.islink(dotgit):
        return []
    return [name for name in REDIRECTS if os.path.lexists(os.path.join(dotgit, name))]


def quarantine_new_redirects(worktree: str, before: list[str]) -> list[str]:
    """Move aside redirecting files a session created; call only once every
    process of the session is gone (nothing can race the rename then)."""
    moved = []
    for name in redirects_present(worktree):
        if name in before:
            continue
        src = os.path.join(worktree, ".git", name)
        dst = f"{src}.quarantined-by-dispatchd-{int(time.time())}"
        try:
            os.rename(src, dst)
            moved.append(dst)
        except OSError:
            continue
    return moved
