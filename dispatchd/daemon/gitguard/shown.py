"""What the last end clears out of the user's git's way before and beside
putting the history back (``history.restore``): each step on its own, so
that one that fails (reported) never keeps the next from running.

``clear``, first:
- a directory the restore reads or writes in that is not one (``objects``,
  ``objects/info``, ``objects/info/commit-graphs``, ``objects/pack``, ``refs``, ``refs/heads``,
  ``refs/tags``, ``logs``, which a linked worktree's session is granted; a fan-out directory ``objects/ab`` in ``after``, among the
  changed ones) is moved aside, and a directory takes its place when
  needed: a symlinked fan-out or pack directory showed every kept name
  present (nothing put back) while git read the session's files through it;
- those directories and the git directory itself, made read-only or
  unsearchable by the session, are given their owner's rights back (the
  user's, so the daemon's), and left so: a ``chmod 555 refs`` kept a
  branch from being written back, and everything after it from running.

``after`` (once the changed object directories are known): a fan-out
directory made unsearchable lent back; the FIFOs and
the like where git reads (``hangs``), the replacement refs
(``replacerefs``), ``shallow`` and the alternates (``viewfiles``; the object
indexes it checks once the objects are put back: ``history.restore``), each in a step of its own: an error in one is reported as
a failure of the check and the others still run.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from dispatchd.daemon.gitguard import fs, hangs, replacerefs, viewfiles

# ``logs`` too: a linked worktree's session is granted it writable, and a
# symlink there led the grant to the whole common directory.
_DIRS = ("objects", "objects/info", "objects/info/commit-graphs", "objects/pack", "refs", "refs/heads", "refs/tags",
         "logs")

Step = tuple[list[tuple[str, str]], list[str]]


def clear(common: str) -> Step:
    """Move aside what stands for a directory, and lend the directories
    (see the module). A failure here stops the restore (its writes would go
    through what could not be moved)."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    fs.lend_path(common)
    for rel in _DIRS:
        path = os.path.join(common, rel)
        if not _aside_unless_dir(path, done, failed):
            fs.lend_path(path)
    return done, failed


def _aside_unless_dir(path: str, done: list[tuple[str, str]], failed: list[str]) -> bool:
    """``path`` moved aside when something other than a directory is there;
    whether it was (or tried to be)."""
    if not os.path.lexists(path) or fs.is_dir(path):
        return False
    try:
        done.append((path, f"not a directory (git reads through a symlink); moved aside to {fs.move_aside(path)}"))
    except OSError as exc:
        failed.append(f"{path}: not a directory, and cannot be moved aside ({exc.strerror})")
    return True


def after(common: str, object_dirs: set[str], replaces: dict[str, str] | None, replaces_packed: list[str],
          views: dict[str, str | None] | None) -> Step:
    """The steps of the module's ``after``, each on its own."""
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    # A fan-out directory replaced by a symlink: its ctime's look (history._stamps,
    # directories only) misses it, so it is among the changed ones.
    for d in sorted(object_dirs):
        # And one made unsearchable (``chmod 000``: its ctime changed) is given its
        # owner's rights back: the looks for replaced and rewritten files go in.
        if not _aside_unless_dir(os.path.join(common, "objects", d), done, failed):
            fs.lend_path(os.path.join(common, "objects", d))
    steps: list[tuple[str, Callable[[], Step]]] = [("hangs", lambda: hangs.sweep(common, object_dirs))]
    if replaces is not None:  # what git would show and check out in place of the user's objects
        steps.append(("replacement refs", lambda: replacerefs.restore(common, replaces, replaces_packed)))
    if views is not None:  # shallow, alternates: which history and objects git shows
        steps.append(("shallow and alternates", lambda: viewfiles.restore(common, views)))
    for what, step in steps:
        try:
            did, not_done = step()
        except Exception as exc:  # noqa: BLE001 - reported: the check fails, the next step runs
            did, not_done = [], [f"{common}: the check of {what} failed: {type(exc).__name__}: {exc}"]
        done += did
        failed += not_done
    return done, failed
