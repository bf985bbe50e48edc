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

Git follows a symlink there too (a pack index, the commit-graph, a loose
object, a ref): a symlink whose target is a FIFO, a socket or a device goes
the same way (``stat``: a FIFO's does not block), and below ``refs``,
``logs``, ``objects`` and ``worktrees``, where git makes none, every symlink
that does not lead to a regular file (one to a directory would lead git to
what it holds). At the top level a symlink to a directory is the user's to
have (a shared ``hooks``).

The walk goes by ``scandir`` (the entry's type from the directory) without
entering a symlink, at most ``_MAX_ENTRIES`` entries in each area (past
them, the rest of that area is not looked at, and the report says so: junk
at the top level cannot hide a FIFO in ``refs``). Nothing is deleted.
"""

from __future__ import annotations

import os
import stat

from dispatchd.daemon.gitguard import fs

_BELOW = ("refs", "logs", "info", "objects/info", "objects/pack", "worktrees")
_MAX_ENTRIES = 100_000


def sweep(common: str, object_dirs: set[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """Move aside what would hang the user's git (see the module): returns
    ``(path, what was done)`` and what could not be done."""
    found: list[str] = []
    done: list[tuple[str, str]] = []
    failed: list[str] = []
    for rel in ("",) + _BELOW + tuple(f"objects/{d}" for d in sorted(object_dirs)):
        top = os.path.join(common, rel) if rel else common
        if rel and not fs.is_dir(top):
            continue
        left = [_MAX_ENTRIES]
        _scan(top, found, left, deep=bool(rel))
        if left[0] <= 0:
            failed.append(f"{top}: more than {_MAX_ENTRIES} entries; the rest was not looked at for FIFOs")
    for path in found:
        rel = os.path.relpath(path, common).replace(os.sep, "-")
        dst = os.path.join(common, fs.aside_name(f"hang-{rel}"))
        what = _what(path)
        try:
            os.rename(path, dst)
            done.append((path, f"{what} where git reads a file (it would hang the user's git, or lead it "
                               f"elsewhere); moved aside to {dst}"))
        except OSError as exc:
            failed.append(f"{path}: {what} where git reads, cannot be moved aside ({exc.strerror})")
    return done, failed


def _scan(top: str, found: list[str], left: list[int], *, deep: bool) -> None:
    pending = [top]
    while pending and left[0] > 0:
        path = pending.pop()
        try:
            entries = fs.scanned(path)
        except PermissionError:
            fs.lend_path(path)  # a session's chmod 311: git reaches a name in it all the same
            try:
                entries = fs.scanned(path)
            except OSError:
                continue
        except OSError:
            continue
        for entry in entries:
            left[0] -= 1
            if left[0] <= 0:
                return
            try:  # the directory entry's type where the file system gives it: no stat
                if entry.is_dir(follow_symlinks=False):
                    if deep:
                        pending.append(entry.path)
                    continue
                if entry.is_file(follow_symlinks=False):
                    continue
                if entry.is_symlink() and _harmless_link(entry.path, deep):
                    continue
            except OSError:
                continue
            found.append(entry.path)


def _what(path: str) -> str:
    """What the report calls the entry found at ``path``."""
    try:
        if not os.path.islink(path):
            return "a FIFO, socket or device"
        mode = os.stat(path).st_mode
    except OSError:
        return "a FIFO, socket or device"
    return "a symlink to a directory" if stat.S_ISDIR(mode) else "a symlink to a FIFO, socket or device"


def _harmless_link(path: str, deep: bool) -> bool:
    """Whether git following the symlink ``path`` finds nothing to hang on:
    a regular file, nothing (dangling, a loop), or at the top level a
    directory."""
    try:
        mode = os.stat(path).st_mode  # follows it: a FIFO's stat does not wait
    except OSError:
        return True
    return stat.S_ISREG(mode) or (not deep and stat.S_ISDIR(mode))
