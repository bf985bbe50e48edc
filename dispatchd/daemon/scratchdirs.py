"""Scratch directories kept for the next session: emptied, checked, renamed.

A session's scratch directory (``STATE/sessions/ID``, its ``tmp`` and
``home``) used to be made with three ``mkdir`` at each open and removed at
each end. On ext4 without a journal (the root file system of some cloud
VMs, this project's development machine among them) the inode allocator
skips every inode freed in the last ``dirty_expire_centisecs`` (30 s) when
it looks for a free one (``recently_deleted``), so back-to-back sessions
made each new inode dearer than the last: 0.06 ms a ``mkdir`` idle, 0.8 ms
after a few thousand sessions (docs/performance.md, "Scratch directories
kept"). A directory emptied at a session's end and renamed for the next
costs no inode, and frees none.

Guarantees:
- a directory is kept only when its session's processes are known gone
  (``processes_gone``), it was emptied whole (``treewalk.remove_tree_at``
  below it, any depth, within its budget), and what is left is exactly what
  a new one is: ``tmp`` and ``home``, directories owned by the daemon's
  user, mode 0700, empty, with no extended attribute (a default ACL or a
  ``user.*`` attribute a session set would reach the next session);
  anything else, and it is removed as before;
- a kept directory stays locked by this daemon (``leftovers.ScratchLocks``)
  under an id of its own, unknown to any session, so a start of another
  daemon leaves it alone, and the next start after this daemon's death
  removes it, as any scratch directory whose lock is free;
- it is given to the next session by two renames, its lock first: a start
  of another daemon that finds the directory without its lock meanwhile
  removes it (it is empty), and the session's open then makes its own;
- at most ``KEEP`` are kept: the pool's sandboxes are made one at a time.
"""

from __future__ import annotations

import os
import stat

from dispatchd import treewalk

KEEP = 4
_PARTS = ("home", "tmp")


def empty_for_reuse(scratch: str, uid: int) -> bool:
    """Empty ``scratch``'s ``tmp`` and ``home`` (whatever a session left
    there) and say whether it is now as a new one (see the module). Never
    raises; False leaves it for removal."""
    try:
        top = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if sorted(os.listdir(top)) != list(_PARTS):
            return False
        for part in _PARTS:
            if not _empty_part(top, part, uid):
                return False
        return True
    except OSError:
        return False
    finally:
        os.close(top)


def _empty_part(top: int, part: str, uid: int) -> bool:
    fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=top)
    try:
        st = os.fstat(fd)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or stat.S_IMODE(st.st_mode) != 0o700:
            return False
        if os.listxattr(fd):
            return False
        budget = treewalk.Budget()
        for name in os.listdir(fd):
            treewalk.remove_tree_at(fd, name, budget)
        return not budget.skipped and not os.listdir(fd)
    finally:
        os.close(fd)
