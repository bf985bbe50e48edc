"""A session's scratch directory kept for the next session: its ``tmp`` and
``home`` removed, the directory that held them and its lock handed on.

A session's scratch directory (``STATE/sessions/ID``, its ``tmp`` and
``home``) was made with three ``mkdir`` and a lock file at each open, and
all four removed at its end. On ext4 without a journal (the root file
system of some cloud VMs, this project's development machine among them)
the inode allocator skips every inode freed in the last
``dirty_expire_centisecs`` (30 s) when it looks for a free one
(``recently_deleted``), so back-to-back sessions made each new inode dearer
than the last: 0.06 ms a ``mkdir`` idle, 0.8 ms after a few thousand
sessions (docs/performance.md, "Scratch directories kept"). The directory
and its lock, kept and renamed for the next session, cost no inode.

Only those two are kept, never ``tmp`` and ``home`` themselves: a session
can hand a descriptor of its ``/tmp`` to another session running beside it
(a Unix socket in a worktree both can write), which keeps it after the
first one ends, and Landlock checks no listing, ``stat`` or ``fchmod``
through a descriptor already open. A kept ``tmp`` would show that holder
the next session's files. The directory above them is bound nowhere: no
session ever holds it.

Guarantees:
- a directory is kept only once its session's processes are known gone
  (``Session.processes_gone``), its ``tmp`` and ``home`` were removed whole
  (``treewalk.remove_tree_at``, any depth, within its budget) and it is
  then an empty directory of the daemon's user; anything else, and it is
  removed as before. The next session gets a new ``tmp`` and ``home``;
- a kept directory stays locked by this daemon (``leftovers.ScratchLocks``)
  under an id of its own, unknown to any session, so a start of another
  daemon leaves it alone, and the next start after this daemon's death
  removes it, as any scratch directory whose lock is free;
- every name it has is backed by its held lock: handed on, its lock file
  gets the new name first by a hard link (the same locked file under both
  names), then the directory is renamed, then the old lock name goes;
- at most ``KEEP`` are kept: the pool's sandboxes are made one at a time.
"""

from __future__ import annotations

import os
import stat

from dispatchd import treewalk

KEEP = 4
PARTS = ("home", "tmp")  # what a session's scratch directory holds (pooling._make_scratch)


def clear_for_reuse(scratch: str, uid: int) -> bool:
    """Remove ``scratch``'s ``tmp`` and ``home`` (whatever a session left
    there) and say whether it is now an empty directory of ``uid``'s (see the
    module). Never raises; False leaves it for removal."""
    try:
        top = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(top)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or sorted(os.listdir(top)) != list(PARTS):
            return False
        budget = treewalk.Budget()
        for part in PARTS:
            treewalk.remove_tree_at(top, part, budget)
        return not budget.skipped and not os.listdir(top)
    except OSError:
        return False
    finally:
        os.close(top)
