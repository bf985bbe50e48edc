"""Remove the temporary files of writes that never finished (worker side).

``atomic_write`` writes ``.NAME.dispatchd-XXXXXXXX.tmp`` beside its target and
renames it over the target. A tool server killed between the two leaves the
temporary file (up to the file size cap) in the worktree, where ``git status``
and ``list_files`` show it. The next session that writes the worktree removes
such files when it is granted the worktree's write lock: only one session
writes a worktree at a time, so no other session's write is in flight, and
this process's own writes in flight are skipped (their names are registered
before the files exist).

Guarantees:
- only names matching ``atomic.TEMP_NAME`` exactly, and only regular files:
  never a user's file of another name, never a directory or a symlink's target;
- the walk is by descriptor (``os.fwalk``) and follows no symlink, and every
  unlink is relative to the directory descriptor it was found in: swapping a
  directory for a symlink mid-walk sends nothing outside the worktree;
- ``.git`` directories are not walked (tools do not write there), nor other
  file systems mounted inside the worktree;
- it runs in the background and never fails a call; it is confined like
  everything in the tool server (Landlock holds it to the worktree).
"""

from __future__ import annotations

import os
import stat

from dispatchd.tools.atomic import TEMP_NAME, in_flight


def sweep_temp_files(root: str) -> list[str]:
    """Remove leftover temporary files under ``root``; returns their paths."""
    removed: list[str] = []
    try:
        root_dev = os.stat(root, follow_symlinks=False).st_dev
    except OSError:
        return removed
    for dirpath, dirnames, filenames, dirfd in os.fwalk(os.fsencode(root), follow_symlinks=False):
        keep = []
        for d in dirnames:
            if d == b".git":
                continue
            try:
                if os.stat(d, dir_fd=dirfd, follow_symlinks=False).st_dev != root_dev:
                    continue
            except OSError:
                continue
            keep.append(d)
        dirnames[:] = keep
        for name in filenames:
            if not TEMP_NAME.match(name):
                continue
            try:
                if name in in_flight():
                    continue
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    continue
                os.unlink(name, dir_fd=dirfd)
                removed.append(os.fsdecode(os.path.join(dirpath, name)))
            except OSError:
                continue
    return removed
