"""The temporary files of atomic writes: their one name pattern, and the sweep
that removes the ones writes cut short left behind (daemon and worker side).

``tools/atomic.py`` writes ``.NAME.dispatchd-XXXXXXXX.tmp`` (``temp_name``)
beside its target and renames it over the target. A tool server killed
between the two leaves the temporary file (up to the file size cap) in the
worktree, where ``git status`` and ``list_files`` show it. The next session
that writes the worktree removes such files when it is granted the
worktree's write lock (unless the grant says the daemon knows none is left:
``daemon/writelock.py``), and the daemon does once a writer's processes are
gone: only one session writes a worktree at a time, so no other session's
write is in flight, and the caller's own writes in flight are skipped (their
names are registered before the files exist, ``in_flight``).

Guarantees:
- only names matching ``TEMP_NAME`` exactly, and only regular files:
  never a user's file of another name, never a directory or a symlink's target;
- the walk is by descriptor (``treewalk.walk``: iterative, bounded in entries
  and depth, never raising) and follows no symlink, and every
  unlink is relative to the directory descriptor it was found in: swapping a
  directory for a symlink mid-walk sends nothing outside the worktree;
- ``.git`` directories are not walked (tools do not write there), nor other
  file systems mounted inside the worktree;
- it never fails its caller; in the tool server it runs in the background,
  confined like everything there (Landlock holds it to the worktree).

No tool code is imported: the daemon uses this module too.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from collections.abc import Callable

from dispatchd import treewalk

__all__ = ["TEMP_NAME", "no_temp_files", "sweep_temp_files", "temp_name"]

# Exactly the names temp_name makes.
TEMP_NAME = re.compile(rb"^\..{1,800}\.dispatchd-[0-9a-f]{8}\.tmp$", re.DOTALL)


_STEM_BYTES = 200  # with the rest (24 bytes), under NAME_MAX (255)


def temp_name(stem: str) -> str:
    """A fresh temporary name for a file named ``stem`` (random: retry on
    EEXIST), the stem cut to ``_STEM_BYTES`` bytes: cut to 200 characters,
    a name of multibyte ones was over NAME_MAX, and every write or restore of
    that file failed (``File name too long``)."""
    raw = os.fsencode(stem)[:_STEM_BYTES]
    return f".{os.fsdecode(raw)}.dispatchd-{secrets.token_hex(4)}.tmp"


def no_temp_files(names: list[bytes]) -> bool:
    """Whether a directory's non-directories hold no temporary file's name."""
    return not any(TEMP_NAME.match(name) for name in names)


def sweep_temp_files(root: str, in_flight: Callable[[], frozenset[bytes]] = frozenset,
                     budget: treewalk.Budget | None = None, listings: treewalk.Listings | None = None,
                     kept: list[str] | None = None) -> list[str]:
    """Remove leftover temporary files under ``root``; returns their paths.

    ``in_flight()`` names the temporary files the caller is writing now
    (asked again for each candidate: a write may start during the sweep).
    ``budget`` bounds the walk (``treewalk``: entries and depth); what it
    skipped is noted there. ``listings`` (``treewalk.Listings(no_temp_files)``,
    kept by the caller from one sweep to the next): a directory with no
    temporary file when it was last listed, and unchanged since, is not
    listed again. ``kept`` gets the paths of regular files of the pattern
    left in place (in flight, or that could not be removed)."""
    removed: list[str] = []
    budget = budget or treewalk.Budget()
    try:
        root_dev = os.stat(root, follow_symlinks=False).st_dev
    except OSError:
        return removed

    def prune(name: bytes, dirfd: int) -> bool:
        if name == b".git":
            return True
        try:
            return os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_dev != root_dev
        except OSError:
            return True

    for dirpath, filenames, dirfd in treewalk.walk(root, budget, prune, listings):
        for name in filenames:
            if not TEMP_NAME.match(name):
                continue
            try:
                if name in in_flight():
                    if kept is not None:
                        kept.append(os.fsdecode(os.path.join(dirpath, name)))
                    continue
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    continue
                os.unlink(name, dir_fd=dirfd)
                removed.append(os.fsdecode(os.path.join(dirpath, name)))
            except OSError as exc:
                if kept is not None and exc.errno != errno.ENOENT:  # gone already: nothing kept
                    kept.append(os.fsdecode(os.path.join(dirpath, name)))
                continue
    return removed
