"""What would hang the user's git after a session, taken out at the end.

Git opens the files of its directory with a blocking ``open(2)``: a FIFO a
session left where git reads a file waits for a writer that never comes,
and every later git command of the user's hangs there (seen: ``git log``
with a FIFO at ``packed-refs``, ``shallow`` or ``objects/info/alternates``;
the daemon's own reads never block: ``fs.open_regular``). So at the last
end (``history.restore``) every entry that is not a regular file, a
directory or a symlink (a FIFO, a socket, a device) where git reads is
moved out of the way:

- in the common git directory: its top level, and everything below
  ``refs``, ``logs``, ``info``, ``objects/info``, ``objects/pack`` and each
  ``worktrees/<name>`` (a linked worktree's ``HEAD``, ``index``...), and the
  object directories the restore looks at again (those changed since the
  baseline);
- moved to ``<git directory>/hang-<path>.quarantined-by-dispatchd-…`` at
  its top level, never beside: renamed within ``refs`` or ``logs`` it
  would still be a ref git opens.

The walk goes by ``lstat`` and ``scandir``, never through a symlink, at most
``_MAX_ENTRIES`` entries (past them, the rest is not looked at, and the
report says so). A symlink is left: git does not follow one for an object
or a pack, and one to a FIFO elsewhere is a session's ordinary file
(``redirects``, ``snapshots`` and the history's own checks deal with those
git follows). Nothing is deleted.
"""

from __future__ import annotations

import os

from dispatchd.daemon.gitguard import fs

_BELOW = ("refs", "logs", "info", "objects/info", "objects/pack", "worktrees")
_MAX_ENTRIES = 100_000


def sweep(common: str, object_dirs: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Move aside what would hang the user's git (see the module): returns
    ``(path, what was done)`` and what could not be done."""
    found: list[str] = []
    left = [_MAX_ENTRIES]
    _scan(common, found, left, deep=False)
    for rel in _BELOW + tuple(f"objects/{d}" for d in sorted(object_dirs)):
        top = os.path.join(common, rel)
        if fs.is_dir(top):
            _scan(top, found, left, deep=True)
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    for path in found:
        rel = os.path.relpath(path, common).replace(os.sep, "-")
        dst = os.path.join(common, fs.aside_name(f"hang-{rel}"))
        try:
            os.rename(path, dst)
            done.append((path, f"a FIFO, socket or device where git reads a file (it would hang the user's git); "
                               f"moved aside to {dst}"))
        except OSError as exc:
            failed.append(f"{path}: a FIFO, socket or device where git reads, cannot be moved aside ({exc.strerror})")
    if left[0] <= 0:
        failed.append(f"{common}: more than {_MAX_ENTRIES} entries; the rest was not looked at for FIFOs")
    return done, failed


def _scan(top: str, found: list[str], left: list[int], *, deep: bool) -> None:
    pending = [top]
    while pending and left[0] > 0:
        path = pending.pop()
        try:
            entries = fs.scanned(path)
        except OSError:
            continue  # unsearchable: git cannot open what is below either
        for entry in entries:
            left[0] -= 1
            if left[0] <= 0:
                return
            try:  # the directory entry's type where the file system gives it: no stat
                if entry.is_dir(follow_symlinks=False):
                    if deep:
                        pending.append(entry.path)
                    continue
                if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                    continue
            except OSError:
                continue
            found.append(entry.path)
