"""Files a session created that would redirect the user's git, moved aside
once the session's processes are gone.

``commondir`` (always) and ``config.worktree`` (with
extensions.worktreeConfig), appearing in a git directory, change which
configuration git reads. No mount can stop one from being created in a
writable directory, so the daemon lists them at open (``redirects_present``)
and, once every process of the session is gone, moves aside each that is new
(``quarantine_new_redirects``), in every git directory of the layout and in
the entries of a repository's linked worktrees: there a ``commondir``
belongs, but only one that leads back to this ``.git``. A ``.git`` a session
turned into a symlink is itself a redirect. This runs in both modes.

The daemon acts on these by name (``fs.move_aside``): only below a root
whose every directory on the way is a real one (``lstat``), never through a
symlink.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from dispatchd.confine.plan import GitLayout
from dispatchd.daemon.gitguard.fs import is_dir, move_aside, read_small, scanned
from dispatchd.inside import is_within

# Files whose mere appearance in a git directory changes which configuration
# git reads: ``commondir`` always, ``config.worktree`` where the repository
# has extensions.worktreeConfig.
REDIRECTS = ("commondir", "config.worktree")


def _plain_path_below(root: str, path: str) -> bool:
    """``root`` and every directory from it down to ``path``'s parent are real
    directories, not symlinks: acting on ``path`` by name stays below ``root``."""
    if not is_dir(root) or not is_within(path, root):
        return False
    parent = os.path.dirname(path)
    while parent != root and len(parent) > len(root):
        if not is_dir(parent):
            return False
        parent = os.path.dirname(parent)
    return True


def _leads_back(entry: str, dotgit: str) -> bool:
    """A linked worktree's ``commondir`` that names this ``.git`` (git writes
    ``../..``). Anything unreadable or odd (a NUL byte, say) does not."""
    text = read_small(os.path.join(entry, "commondir"))
    try:
        return text is not None and os.path.realpath(os.path.join(entry, text.strip())) == os.path.realpath(dotgit)
    except (ValueError, OSError, RecursionError):  # the last: a chain of a thousand symlinks (realpath recurses)
        return False


def redirects_present(layout: GitLayout, root: str = "") -> list[str]:
    """Which redirecting files exist now in the layout's git directories, and,
    in a repository, in its linked worktrees' entries: there a ``commondir``
    belongs, but only one that leads back to this ``.git``, so a session that
    adds a worktree cannot aim it elsewhere. A ``.git`` that a session turned
    into a symlink (degraded mode) is itself a redirect. Nothing reached
    through a symlink is listed: the daemon acts on these by name.

    ``root`` is the worktree (a repository's git directories lie below it);
    a linked worktree's own git directory is its own root."""
    found: list[str] = []
    if layout.kind == "repository" and layout.gitdirs and os.path.islink(layout.gitdirs[0]):
        return [layout.gitdirs[0]]
    for gitdir in layout.gitdirs:
        top = root if layout.kind == "repository" and root else gitdir
        if not _plain_path_below(top, gitdir) or not is_dir(gitdir):
            continue
        found += [os.path.join(gitdir, n) for n in REDIRECTS if os.path.lexists(os.path.join(gitdir, n))]
    if layout.kind != "repository" or not layout.gitdirs or not is_dir(layout.gitdirs[0]):
        return found
    dotgit = layout.gitdirs[0]
    worktrees = os.path.join(dotgit, "worktrees")
    if not is_dir(worktrees):
        return found
    try:
        entries = scanned(worktrees)
    except OSError:
        return found
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        worktree_config = os.path.join(entry.path, "config.worktree")
        if os.path.lexists(worktree_config):
            found.append(worktree_config)
        commondir = os.path.join(entry.path, "commondir")
        if os.path.lexists(commondir) and not _leads_back(entry.path, dotgit):
            found.append(commondir)
    return found


def quarantine_new_redirects(layout: GitLayout, before: list[str], root: str = "",
                             skip: Callable[[str], bool] = lambda path: False,
                             unmoved: set[str] | None = None) -> tuple[list[str], list[str]]:
    """Move aside redirecting files a session created; call only once every
    process of the session is gone (nothing can race the rename then).
    Returns what was moved, and what could not be (with why). ``skip``: paths
    an earlier part of the domain judges against its own baseline;
    ``unmoved``: gets the paths that could not be moved (the later steps of
    the check pass them over: each is said once)."""
    moved, failed = [], []
    for src in redirects_present(layout, root):
        if src in before or skip(src):
            continue
        try:
            moved.append(move_aside(src))
        except OSError as exc:
            failed.append(f"{src}: {exc.strerror}")
            if unmoved is not None:
                unmoved.add(src)
    return moved, failed
